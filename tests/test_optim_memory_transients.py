"""The distributed optimizer's start-up encode and a checkpoint's state collection hold temporaries of one chunk on the
optimizer's device, whatever the model size (a model with 16x the parameters has the same peak), and give the bits the
whole-fragment formulas give.

A failure of the peak tests points at a whole-shard or whole-fragment copy (``_init_master`` converting every owned
parameter to fp32 at once, ``state_dict``/``owned_master_weights`` cloning on the device before the host copy); a
failure of the bit tests at the chunked encode or the host copies changing what a run stores or a checkpoint saves.
Peaks are counted by tools/bench/bench_optimizer_memory.py's LiveBytes on the CPU (the optimizer's device here); the
checkpoint collection writes its copies to the meta device, which stands in for the host.
"""
import os
import sys

import pytest
import torch

from data_fixtures import REPO_ROOT
from megafp8.model import GPTModel, ModelConfig
from megafp8.optim import DistributedOptimizer
from megafp8.parallel.data_parallel import DDPConfig, DistributedDataParallel
from megafp8.parallel.parallel_state import ParallelState

sys.path.insert(0, os.path.join(REPO_ROOT, "tools", "bench"))
from bench_optimizer_memory import LiveBytes  # noqa: E402

CHUNK = 1024
PRESETS = {"fp32": dict(master_weight_dtype="fp32", optimizer_state_dtype="fp32"),
           "compressed": dict(master_weight_dtype="fp16", optimizer_state_dtype="fp8")}
# hidden 32 -> 128: the matrices (and so the largest fragments) grow 16x; every fragment spans several chunks
WIDTHS = (32, 128)


def _optimizer(hidden: int, preset: str, ps: ParallelState) -> DistributedOptimizer:
    """bf16 parameters (as under --bf16): their fp32 values are a real copy, as on a GPU."""
    torch.manual_seed(0)
    cfg = ModelConfig(num_layers=2, hidden_size=hidden, ffn_hidden_size=4 * hidden, num_attention_heads=4,
                      seq_length=8, vocab_size=256, params_dtype=torch.bfloat16)
    ddp = DistributedDataParallel(GPTModel(cfg, ps), ps, DDPConfig(use_distributed_optimizer=True))
    return DistributedOptimizer(ddp, chunk_size=CHUNK, **PRESETS[preset])


def _cpu_peak(fn) -> int:
    mode = LiveBytes(device_type="cpu")
    with torch.no_grad(), mode:
        result = fn()
    del result
    return mode.peak


@pytest.fixture(scope="module")
def ps():
    return ParallelState().init_process_groups()


@pytest.fixture(scope="module", params=list(PRESETS))
def optimizers(request, ps):
    return request.param, [_optimizer(hidden, request.param, ps) for hidden in WIDTHS]


def _whole_fragment_values(opt: DistributedOptimizer, frag) -> torch.Tensor:
    """The fragment's fp32 values as the old start-up encode took them: the whole fragment at once."""
    return frag.bucket.param_data[frag.bucket_lo:frag.bucket_lo + frag.numel].float()


def test_start_up_encode_holds_one_chunk(optimizers):
    preset, (small, large) = optimizers
    assert max(f.numel for f in large.fragments) >= 16 * max(f.numel for f in small.fragments) >= 16 * CHUNK
    peaks = [_cpu_peak(opt._init_master) for opt in (small, large)]
    # fp32: one chunk's fp32 values; fp16: those and their scaled product (plus a few 0-dim amaxes and scales)
    chunks = 1 if preset == "fp32" else 2
    assert peaks[0] == peaks[1] <= chunks * CHUNK * 4 + 256, peaks


def test_start_up_encode_bits_equal_the_whole_fragment_formula(optimizers):
    """Reference: each fragment's whole fp32 values; fp16: the scale 2^(10 - floor(log2 amax)) of the tensor's amax,
    codes = round-to-nearest fp16 of values * scale (one DP rank: the agreed amax is the local one)."""
    preset, (_small, opt) = optimizers
    opt._init_master()
    for frag in opt.fragments:
        values = _whole_fragment_values(opt, frag)
        codes = opt.master.values[frag.storage_lo:frag.storage_lo + frag.numel]
        if preset == "fp32":
            assert torch.equal(codes, values)
            continue
        amax = values.abs().amax()
        scale = torch.exp2(10 - torch.floor(torch.log2(amax))) if amax > 0 else torch.ones(())
        assert torch.equal(opt.master_scale[frag.index], scale)
        assert torch.equal(codes.view(torch.int16), (values * scale).to(torch.float16).view(torch.int16))


def test_reload_from_host_values_equals_the_start_up_encode(optimizers, ps):
    """``reload_master_weights`` from fp32 values on the host (a checkpoint's owned ranges) takes them chunk by chunk
    onto the optimizer's device: the same codes and scales as encoding the parameters themselves."""
    preset, (_small, opt) = optimizers
    opt._init_master()
    expected = opt.master.values.clone(), opt.master_scale.clone()
    opt._init_master({f.name: _whole_fragment_values(opt, f).to("cpu") for f in opt.fragments})
    assert torch.equal(opt.master.values, expected[0]) and torch.equal(opt.master_scale, expected[1])


def test_checkpoint_collection_adds_nothing_on_the_device_but_a_decode_chunk(optimizers):
    preset, (small, large) = optimizers
    for opt in (small, large):
        assert _cpu_peak(lambda: opt.state_dict(device="meta")) == 0
    # The fp32 master is its own decode (copied straight out); fp16 codes / scale decode one chunk at a time.
    peaks = [_cpu_peak(lambda: opt.owned_master_weights(device="meta")) for opt in (small, large)]
    assert peaks[0] == peaks[1] == (0 if preset == "fp32" else 2 * CHUNK * 4), peaks


def test_checkpoint_collection_copies_the_live_bits_to_the_host(optimizers):
    """Reference: the old collection, whole slices of the live storage cloned (and decoded whole for the master)."""
    preset, (_small, opt) = optimizers
    opt.exp_avg.encode(0, opt.master.numel, torch.linspace(-1, 1, opt.master.numel))  # moments worth comparing
    state = opt.state_dict()
    for frag in opt.fragments:
        entry = state["fragments"][frag.name]
        assert (entry["start"], entry["end"]) == (frag.param_lo, frag.param_hi)
        assert torch.equal(entry["master_scale"], opt.master_scale[frag.index])
        for prefix in ("master", "exp_avg", "exp_avg_sq"):
            codec = getattr(opt, prefix)
            for key, t in codec.tensors().items():
                per_group = t.numel() != codec.numel
                lo, hi = ((frag.storage_lo // 128, -(-(frag.storage_lo + frag.numel) // 128)) if per_group
                          else (frag.storage_lo, frag.storage_lo + frag.numel))
                saved = entry[f"{prefix}.{key}"]
                assert saved.device.type == "cpu" and saved.is_contiguous() and saved.dtype == t.dtype
                assert torch.equal(saved.view(torch.uint8), t[lo:hi].view(torch.uint8))
    for name, (param, start, values) in opt.owned_master_weights().items():
        frag = next(f for f in opt.fragments if f.name == name)
        whole = opt.master.values[frag.storage_lo:frag.storage_lo + frag.numel].float()
        if preset == "compressed":
            whole = whole / opt.master_scale[frag.index]
        assert (param, start) == (frag.param, frag.param_lo) and torch.equal(values, whole)
