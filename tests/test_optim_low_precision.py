"""Low-precision optimizer state: the codecs' round-trip error bounds, and a small LM trained 300 steps with
FP8 moments + FP16 master weights against the fp32 run and against a real peer, torchao's AdamWFp8."""
from unittest import mock

import pytest
import torch

from optim_testing import build, make_ddp, tiny_config
from megafp8.optim import DistributedOptimizer
from megafp8.optim.state_codec import Fp8ExpandCodec, PlainCodec, fp8_round_trip_bound
from megafp8.parallel.parallel_state import ParallelState


def _adam_like_state(numel: int, seed: int = 0) -> torch.Tensor:
    """Groups of very different magnitude and spread, like Adam moments: some span 30 binades, some are
    nearly constant, some are all zero, some have isolated zeros."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(numel, generator=g) * torch.exp2(torch.randint(-40, 5, (numel // 128, 1), generator=g).float()).repeat(1, 128).view(-1)
    wide = torch.exp2(torch.rand(numel, generator=g) * 30 - 30)  # 30 binades inside one group
    x[: numel // 4] *= wide[: numel // 4]
    x[numel // 4: numel // 4 + 128] = 0.0
    x[numel // 2: numel // 2 + 128] = 3.0 + 1e-3 * torch.randn(128, generator=g)
    x[::97] = 0.0
    return x


@pytest.mark.parametrize("signed", [True, False])
def test_fp8_codec_round_trip_within_stated_bound(signed):
    x = _adam_like_state(128 * 64)
    x = x if signed else x.abs()
    codec = Fp8ExpandCodec(x.numel())
    codec.encode(0, x.numel(), x)
    decoded = codec.decode(0, x.numel())
    zero = x == 0
    assert torch.equal(decoded[zero], x[zero])
    bound = fp8_round_trip_bound(codec.k.float()).repeat_interleave(128)
    rel = ((decoded - x).abs() / x.abs())[~zero]
    assert torch.all(rel <= bound[~zero] * 1.001 + 1e-6), float((rel / bound[~zero]).max())
    assert torch.equal(torch.sign(decoded), torch.sign(x))
    # The bound is tight where the expansion cannot help: a group spanning 30 binades has k < 1.
    assert codec.k.min() < 1 and codec.k.max() == 16.0
    assert float(rel.max()) < 0.5
    # Why the expansion: one plain scale per group (torchao-style) flushes the group's small values to zero.
    groups = x.view(-1, 128)
    scale = 448.0 / groups.abs().amax(dim=1, keepdim=True).clamp(min=1e-30)
    plain = ((groups * scale).to(torch.float8_e4m3fn).float() / scale).view(-1)
    assert float(((plain - x).abs() / x.abs())[~zero].max()) == 1.0


def test_fp8_codec_chunks_are_independent():
    """Encoding chunk by chunk (the step's way) stores exactly what one whole-shard encode stores."""
    x = _adam_like_state(128 * 16, seed=1)
    whole, chunked = Fp8ExpandCodec(x.numel()), Fp8ExpandCodec(x.numel())
    whole.encode(0, x.numel(), x)
    for start in range(0, x.numel(), 384):
        chunked.encode(start, min(start + 384, x.numel()), x[start:start + 384])
    for key, value in whole.tensors().items():
        assert torch.equal(value.view(torch.uint8) if key == "codes" else value,
                           chunked.tensors()[key].view(torch.uint8) if key == "codes" else chunked.tensors()[key])
    with pytest.raises(ValueError, match="group boundary"):
        whole.encode(64, 128, x[64:128])


def test_bf16_codec_round_trip():
    x = _adam_like_state(128 * 8)
    codec = PlainCodec(x.numel(), dtype=torch.bfloat16)
    codec.encode(0, x.numel(), x)
    nonzero = x != 0
    rel = ((codec.decode(0, x.numel()) - x).abs() / x.abs())[nonzero]
    assert float(rel.max()) <= 2.0 ** -8


# ---- a small LM, 300 steps --------------------------------------------------------------------------
LM = dict(num_layers=1, hidden_size=64, ffn_hidden_size=128, seq_length=16, vocab_size=128)
STEPS, LR, EVAL_EVERY = 300, 3e-3, 25


def _noisy_bigram_batch(cfg, seed: int, n: int = 8):
    """Next token = (5 t + 3) mod V with probability 0.7, else uniform: learnable, with an entropy floor."""
    g = torch.Generator().manual_seed(seed)
    vocab = cfg.vocab_size
    seq = torch.empty(n, cfg.seq_length + 1, dtype=torch.long)
    seq[:, 0] = torch.randint(0, vocab, (n,), generator=g)
    for t in range(cfg.seq_length):
        follow = torch.rand(n, generator=g) < 0.7
        seq[:, t + 1] = torch.where(follow, (5 * seq[:, t] + 3) % vocab, torch.randint(0, vocab, (n,), generator=g))
    return seq[:, :-1], seq[:, 1:]


def _train(kind) -> list[float]:
    """Held-out loss every EVAL_EVERY steps. kind: (master, state) dtypes of ours, or "torchao"."""
    cfg = tiny_config(**LM)
    model = build(cfg, ParallelState().init_process_groups())
    if kind == "torchao":
        from torchao.optim import AdamWFp8
        opt = AdamWFp8(model.parameters(), lr=LR, weight_decay=0.0)
    else:
        opt = DistributedOptimizer(make_ddp(model, ParallelState().init_process_groups()),
                                   master_weight_dtype=kind[0], optimizer_state_dtype=kind[1])
    eval_ids, eval_labels = _noisy_bigram_batch(cfg, 10 ** 6, 64)
    losses = []
    for step in range(STEPS):
        ids, labels = _noisy_bigram_batch(cfg, step)
        opt.zero_grad()
        model(ids, labels).mean().backward()
        if kind == "torchao":
            # torchao compiles its per-parameter update; run the same function eagerly (no compiler on CI).
            with mock.patch.object(torch, "compile", lambda fn, **kw: fn):
                opt.step()
        else:
            assert not opt.step(LR).skipped
        if step % EVAL_EVERY == EVAL_EVERY - 1:
            with torch.no_grad():
                losses.append(float(model(eval_ids, eval_labels).mean()))
    return losses


def test_fp8_states_fp16_master_track_fp32_and_torchao():
    fp32 = torch.tensor(_train(("fp32", "fp32")))
    ours = torch.tensor(_train(("fp16", "fp8")))
    peer = torch.tensor(_train("torchao"))
    assert fp32[-1] < 0.75 * fp32[0]  # it learned something
    ours_dev, peer_dev = (ours - fp32).abs() / fp32, (peer - fp32).abs() / fp32
    assert ours_dev[-1] <= 0.01  # the criterion: final loss within 1% of the fp32-state run
    assert ours_dev.max() <= 0.01  # ...and the whole trajectory (measured: about 0.1%)
    # torchao's E4M3 moments (one scale per 128-block, no range expansion, fp32 for tensors < 4096
    # elements) reach the same final loss (measured 0.1%) but wander up to ~7% early on, when v spans many
    # binades; documented tolerance: final within 1%, trajectory within 10%.
    assert peer_dev[-1] <= 0.01 and peer_dev.max() <= 0.10
    assert (ours - peer).abs().max() / peer[-1] <= 0.10


def test_fp16_master_rescales_when_weights_grow():
    """One step at lr=1 grows the weights 16-50x: each tensor's power-of-two scale must follow (an fp16 code at
    the old scale would overflow to inf) by an exact rescale. Both runs start from fp16-representable weights,
    so their first update is the same and the fp16 master equals the fp32 one up to fp16 rounding."""
    cfg = tiny_config()
    runs = {}
    for master in ("fp32", "fp16"):
        ps = ParallelState().init_process_groups()
        model = build(cfg, ps)
        for p in model.parameters():
            p.data = p.data.half().float()
        ddp = make_ddp(model, ps)
        opt = DistributedOptimizer(ddp, master_weight_dtype=master)
        initial_scale = opt.master_scale.clone()
        ids, labels = _noisy_bigram_batch(cfg, 0)
        ddp(ids, labels).mean().backward()
        assert not opt.step(1.0).skipped
        runs[master] = {n: p.detach().clone() for n, p in ddp.module.named_parameters()}
        if master == "fp16":
            assert (opt.master_scale <= initial_scale / 16).any()  # moved down by 2^4 and more
    for name, value in runs["fp16"].items():
        ref = runs["fp32"][name]
        assert torch.isfinite(value).all()
        assert float((value - ref).abs().max() / ref.abs().max()) <= 2.0 ** -10, name
