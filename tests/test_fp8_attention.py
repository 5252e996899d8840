"""FP8 dot-product attention (--fp8-dot-product-attention): the twin vs an fp64 softmax attention (SQNR bounds per
format, causal, GQA, odd lengths), tiling that moves no byte, context parallelism (ring and all-gather over FP8 K/V
bytes) vs one rank, the bytes it moves and keeps, the layer following its QKV projection's precision, and the
training entry under TP2 x CP2 against the same run with high-precision attention."""
from __future__ import annotations

import json
import math
import os
import subprocess
import sys

import pytest
import torch
import torch.distributed as dist

from data_fixtures import REPO_ROOT, write_synthetic_dataset
from attention_testing import attention_inputs, reference_attention
from distributed_testing import run_distributed
from megafp8.fp8.dot_product_attention import (Fp8AttentionFormats, Fp8Blocks, cast_per_tensor,
                                               fp8_dot_product_attention)
from megafp8.fp8.recipe import Fp8Recipe
from megafp8.model import GPTModel, ModelConfig
from megafp8.parallel.collectives import CommCounters
from megafp8.parallel.context_parallel import context_parallel_attention, split_for_context_parallel
from megafp8.parallel.parallel_state import ParallelState
from megafp8.training.arguments import parse_and_check
from megafp8.training.megatron_flags import LLAMA_FLAGS
from megafp8_kernels import element_format, fp8_attention_reference

HYBRID = Fp8AttentionFormats()  # E4M3 forward, E5M2 dO and dS
E4M3 = Fp8AttentionFormats(backward=torch.float8_e4m3fn)
# SQNR floors in dB (output, then dq, dk, dv): measured 25.8-27.3 / 18.8-19.5 / 19.3-20.1 / 23.3-23.9 (hybrid) and
# 25.8-27.3 / 22.6-23.0 / 23.2-23.6 / 26.1-27.0 (e4m3) over the cases below; about 2 dB of margin. E4M3 carries 3 mantissa bits (~31 dB per cast), E5M2 2.
FLOORS = {"hybrid": (24.0, 17.0, 17.0, 21.0), "e4m3": (24.0, 20.5, 21.0, 24.0)}


def _exact(q, k, v, dout, scale=None):
    full = [t.clone().requires_grad_() for t in (q, k, v)]
    out = reference_attention(*full, scale=scale)
    out.backward(dout)
    return [out.detach(), *(t.grad for t in full)]


def sqnr_db(actual: torch.Tensor, expected: torch.Tensor) -> float:
    return 10 * math.log10(float((expected ** 2).sum() / ((actual.double() - expected) ** 2).sum()))


def _fp8(q, k, v, dout, formats, scale=None):
    mine = [t.float().requires_grad_() for t in (q, k, v)]
    out = fp8_dot_product_attention(*mine, formats, scale=scale)
    out.backward(dout.float())
    return [out.detach(), *(t.grad for t in mine)]


@pytest.mark.parametrize("formats, floors", [(HYBRID, FLOORS["hybrid"]), (E4M3, FLOORS["e4m3"])],
                         ids=["hybrid", "e4m3"])
@pytest.mark.parametrize("heads, groups, s, scale", [(4, 2, 77, None), (2, 2, 33, None), (4, 1, 64, 0.3)],
                         ids=["gqa-odd", "mha-odd", "mqa-softmax-scale"])
def test_fp8_attention_is_within_its_sqnr_floor_of_fp64_attention(formats, floors, heads, groups, s, scale):
    q, k, v, dout = attention_inputs(2, heads, groups, s, 16, seed=s)
    got, want = _fp8(q, k, v, dout, formats, scale), _exact(q, k, v, dout, scale)
    assert got[0].dtype == torch.float32 and got[3].shape == k.shape
    for name, a, e, floor in zip(("out", "dq", "dk", "dv"), got, want, floors):
        assert sqnr_db(a, e) >= floor, (name, sqnr_db(a, e), floor)


def test_query_tiles_change_only_fp32_rounding(monkeypatch):
    """P is normalised by the exact lse and dS's tiles are aligned to the query tiles: the twin's row tiling (its
    memory bound) changes no FP8 rounding rule, only how the fp32 matmuls are blocked (last-bit differences, which
    may flip a rare cast: far below FP8's own error)."""
    q, k, v, dout = attention_inputs(1, 4, 2, 300, 16, seed=1)
    whole = _fp8(q, k, v, dout, HYBRID)
    monkeypatch.setattr(fp8_attention_reference, "Q_TILE_ROWS", 128)
    tiled = _fp8(q, k, v, dout, HYBRID)
    for a, b in zip(whole, tiled):
        assert sqnr_db(a, b.double()) > 70


def test_probabilities_use_the_fixed_scale_and_saturate_never():
    """P = 1 (a row attending to one key) lands on E4M3's 448 exactly: the first query of a causal attention sees
    only itself, so its output is exactly V8's first row dequantized."""
    q, k, v, _ = attention_inputs(1, 2, 2, 8, 16, seed=2)
    out = fp8_dot_product_attention(q.float(), k.float(), v.float(), HYBRID)
    v8, v_inv = cast_per_tensor(v.float(), torch.float8_e4m3fn, False)
    p_scale = fp8_attention_reference.P_SCALE
    assert p_scale == 448.0
    torch.testing.assert_close(out[:, :, 0], (v8[:, :, 0].float() * p_scale) * (v_inv / p_scale), rtol=0, atol=0)


@pytest.mark.parametrize("b, heads, groups, s, d, causal", [(1, 4, 2, 77, 32, True), (2, 2, 2, 64, 16, False),
                                                        (1, 2, 1, 130, 64, True)])
def test_triton_forward_matches_the_twin(b, heads, groups, s, d, causal):
    """The Triton kernel (Triton's interpreter on CPU) against the twin: the same lse up to fp32 rounding and the same
    output bits but where an exp an ulp apart flips a P cast."""
    from megafp8_kernels.fp8_attention_triton import fp8_attention_forward_triton

    q, k, v, _ = attention_inputs(b, heads, groups, s, d, seed=d)
    operands = [cast_per_tensor(t.float(), torch.float8_e4m3fn, False) for t in (q, k, v)]
    (q8, q_inv), (k8, k_inv), (v8, v_inv) = operands
    twin = fp8_attention_reference.fp8_attention_forward(q8, k8, v8, q_inv, k_inv, v_inv, causal, d ** -0.5)
    kernel = fp8_attention_forward_triton(q8, k8, v8, q_inv, k_inv, v_inv, causal, d ** -0.5)
    torch.testing.assert_close(kernel[1], twin[1], rtol=0, atol=2e-6)
    assert sqnr_db(kernel[0], twin[0].double()) > 60
    assert (kernel[0] == twin[0]).float().mean() > 0.99


@pytest.mark.parametrize("b, heads, groups, s, d, causal, ds_dtype, pow2", [
    (1, 4, 2, 77, 32, True, torch.float8_e5m2, False), (2, 2, 2, 64, 16, False, torch.float8_e4m3fn, True),
    (1, 2, 1, 130, 64, True, torch.float8_e5m2, False)])
def test_triton_backward_matches_the_twin(b, heads, groups, s, d, causal, ds_dtype, pow2):
    """The two backward kernels (dK/dV per key block, dQ per query block; the interpreter on CPU) against the twin:
    the same P and dS casts (dS's 64 x 64 tile scales included), so only the fp32 sums' order differs."""
    from megafp8_kernels.fp8_attention_triton import fp8_attention_backward_triton

    q, k, v, dout = attention_inputs(b, heads, groups, s, d, seed=d + 1)
    (q8, q_inv), (k8, k_inv), (v8, v_inv) = (cast_per_tensor(t.float(), torch.float8_e4m3fn, False) for t in (q, k, v))
    do8, do_inv = cast_per_tensor(dout.float(), torch.float8_e5m2, False)
    out, lse = fp8_attention_reference.fp8_attention_forward(q8, k8, v8, q_inv, k_inv, v_inv, causal, d ** -0.5)
    delta = (dout.float() * out).sum(-1)
    args = (do8, q8, k8, v8, do_inv, q_inv, k_inv, v_inv, lse, delta, causal, d ** -0.5, element_format(ds_dtype),
            pow2)
    twin, kernel = fp8_attention_reference.fp8_attention_backward(*args), fp8_attention_backward_triton(*args)
    for name, a, e in zip(("dq", "dk", "dv"), kernel, twin):
        assert a.shape == e.shape and sqnr_db(a, e.double()) > 100, (name, sqnr_db(a, e.double()))


@pytest.mark.gpu
@pytest.mark.parametrize("d, causal", [(64, True), (128, False)])
def test_triton_forward_on_cuda_matches_the_twin(d, causal):
    """On the GPU (hardware fp8 casts and wgmma): the kernels against the CPU twin at a training-like block."""
    from megafp8_kernels.fp8_attention_triton import fp8_attention_backward_triton, fp8_attention_forward_triton

    q, k, v, dout = attention_inputs(2, 8, 2, 512, d, seed=d)
    (q8, q_inv), (k8, k_inv), (v8, v_inv) = (cast_per_tensor(t.float(), torch.float8_e4m3fn, False) for t in (q, k, v))
    twin = fp8_attention_reference.fp8_attention_forward(q8, k8, v8, q_inv, k_inv, v_inv, causal, d ** -0.5)
    kernel = fp8_attention_forward_triton(*(t.cuda() for t in (q8, k8, v8, q_inv, k_inv, v_inv)), causal, d ** -0.5)
    torch.testing.assert_close(kernel[1].cpu(), twin[1], rtol=0, atol=1e-5)
    assert sqnr_db(kernel[0].cpu(), twin[0].double()) > 50
    do8, do_inv = cast_per_tensor(dout.float(), torch.float8_e5m2, False)
    delta = (dout.float() * twin[0]).sum(-1)
    args = (do8, q8, k8, v8, do_inv, q_inv, k_inv, v_inv, twin[1], delta)
    expected = fp8_attention_reference.fp8_attention_backward(*args, causal, d ** -0.5,
                                                               element_format(torch.float8_e5m2))
    got = fp8_attention_backward_triton(*(t.cuda() for t in args), causal, d ** -0.5,
                                        element_format(torch.float8_e5m2))
    for a, e in zip(got, expected):
        assert sqnr_db(a.cpu(), e.double()) > 50


def test_the_gpu_path_runs_the_triton_forward(monkeypatch):
    """What a GPU takes (MEGAFP8_KERNEL_BACKEND=triton, here in the interpreter): fp8_dot_product_attention forward
    and backward through the kernels, within fp32 rounding of the twin's run."""
    q, k, v, dout = attention_inputs(1, 4, 2, 40, 16, seed=3)
    twin = _fp8(q, k, v, dout, HYBRID)
    monkeypatch.setenv("MEGAFP8_KERNEL_BACKEND", "triton")
    kernel = _fp8(q, k, v, dout, HYBRID)
    for a, b in zip(kernel, twin):
        assert sqnr_db(a, b.double()) > 60


# ---- context parallelism ------------------------------------------------------------------------------------------

def _cp_body(rank: int, world_size: int) -> None:
    group, b, heads, groups, d = dist.group.WORLD, 2, 4, 2, 16
    for comm_type, chunk in (("p2p", 5), ("all_gather", 4)):
        seq = 2 * world_size * chunk
        q, k, v, dout = attention_inputs(b, heads, groups, seq, d, seed=chunk)
        want = _exact(q, k, v, dout)
        one_rank = _fp8(q, k, v, dout, HYBRID)
        local = [split_for_context_parallel(t, 2, rank, world_size).float().requires_grad_() for t in (q, k, v)]
        counters, saved = CommCounters(), []

        def pack(t):
            saved.append(t.untyped_storage().nbytes())
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            out = context_parallel_attention(*local, group=group, cp_rank=rank, cp_size=world_size,
                                             comm_type=comm_type, counters=counters, enable_gqa=True,
                                             blocks=Fp8Blocks(HYBRID))
        forward_bytes = counters["cp_kv_p2p"]
        out.backward(split_for_context_parallel(dout, 2, rank, world_size).float())
        got = [out.detach(), *(t.grad for t in local)]
        what = f"{comm_type} CP={world_size} rank {rank}"
        for name, a, e, o, floor in zip(("out", "dq", "dk", "dv"), got, want, one_rank, FLOORS["hybrid"]):
            e, o = (split_for_context_parallel(t, 2, rank, world_size) for t in (e, o))
            # Each rank casts its own Q, K, V (its own scales): CP=N is another FP8 rounding of the same attention,
            # as close to fp64 as one rank's; from one rank's result it differs by two independent roundings (their
            # errors add: about 3 dB below either's own SQNR).
            assert sqnr_db(a, e) >= floor, (what, name, sqnr_db(a, e))
            assert sqnr_db(a, o.double()) >= floor - 4, (what, name, "vs CP=1", sqnr_db(a, o.double()))
        # Forward moves the K/V bytes plus their two fp32 scales: (N - 1) messages, about half of BF16's.
        kv_elems = 2 * b * groups * (seq // world_size) * d
        assert forward_bytes == (world_size - 1) * (kv_elems + 8), what
        assert forward_bytes / ((world_size - 1) * kv_elems * 2) <= 0.52
        # Backward keeps Q8, the K/V message, the output (fp32 here) and lse: FP8 operands, nothing of size s x s.
        q_elems = b * heads * (seq // world_size) * d
        assert sum(saved) == q_elems + 4 + kv_elems + 8 + q_elems * 4 + q_elems // d * 4, (what, saved)


@pytest.mark.distributed
@pytest.mark.parametrize("cp_size", [2, pytest.param(4, marks=pytest.mark.slow)])
def test_fp8_ring_attention_matches_one_rank_within_fp8_bounds(cp_size):
    run_distributed(_cp_body, world_size=cp_size, timeout_s=300)


# ---- the layer -------------------------------------------------------------------------------------------------

def _model(**overrides) -> GPTModel:
    cfg = ModelConfig(num_layers=3, hidden_size=64, ffn_hidden_size=96, num_attention_heads=4, num_query_groups=2,
                      seq_length=16, vocab_size=100, make_vocab_size_divisible_by=8, **overrides)
    return GPTModel(cfg, ParallelState().init_process_groups(), fp8_recipe=Fp8Recipe.tensorwise(), first_last_layers_bf16=1)


def test_attention_runs_fp8_exactly_where_its_qkv_projection_does():
    model = _model(fp8_dot_product_attention=True)
    plain = _model()
    plain.load_state_dict(model.state_dict())
    attention = [layer.self_attention for layer in model.layers.values()]
    assert [a.fp8_blocks() is not None for a in attention] == [False, True, False]  # --first-last-layers-bf16 1
    assert attention[1].fp8_blocks().formats == Fp8AttentionFormats(torch.float8_e4m3fn, torch.float8_e5m2, False)
    ids = torch.randint(0, 100, (2, 16), generator=torch.Generator().manual_seed(0))
    assert not torch.equal(model(ids), plain(ids))
    attention[1].linear_qkv.guard_high_precision = True  # the guard moved the QKV projection: attention follows
    assert attention[1].fp8_blocks() is None
    plain.layers["1"].self_attention.linear_qkv.guard_high_precision = True
    assert torch.equal(model(ids), plain(ids))


def test_delayed_recipe_scales_the_attention_casts_from_their_own_amax_histories():
    """Under a delayed recipe each FP8 attention owns ScalingStates for Q, K, V and dO: cold, a call casts with the
    current scale and observes each tensor's amax; after the step's update the next call casts with the stale scale
    (inputs that grew 4x saturate, as any delayed cast) and observes the new amax. The model builds them in its FP8
    layers only, and its scaling manager finds them."""
    from torch import nn

    from megafp8.fp8.scaling_state import Fp8ScalingManager, ScalingState

    recipe = Fp8Recipe.delayed()
    states = {role: ScalingState(recipe, torch.float8_e5m2 if role == "grad_output" else torch.float8_e4m3fn)
              for role in ("query", "key", "value", "grad_output")}
    manager = Fp8ScalingManager(nn.ModuleDict(states), None)
    q, k, v, dout = (t.float() for t in attention_inputs(1, 4, 2, 24, 16, seed=5))
    for growth in (1.0, 4.0):
        mine = [(t * growth).requires_grad_() for t in (q, k, v)]
        out = fp8_dot_product_attention(*mine, HYBRID, states=states)
        out.backward(dout)
        for role, t in zip(("query", "key", "value", "grad_output"), (*mine, dout)):
            assert states[role].pending_amax == t.detach().abs().amax(), role
        if growth == 4.0:  # the scale is last step's: 448 / amax(q), so 4q saturates
            q8, q_inv = cast_per_tensor(mine[0].detach(), torch.float8_e4m3fn, False, states["query"])
            assert q_inv == 1 / states["query"].scale and q8.float().abs().max() == 448
        manager.update()
    assert all(not s.is_cold for s in states.values())
    model = _model(fp8_dot_product_attention=True)  # --first-last-layers-bf16 1 of 3 layers, tensorwise
    assert not any(hasattr(layer.self_attention, "fp8_scaling") for layer in model.layers.values())
    cfg = model.config
    model = GPTModel(cfg, ParallelState().init_process_groups(), fp8_recipe=Fp8Recipe.delayed(),
                     first_last_layers_bf16=1)
    assert [hasattr(layer.self_attention, "fp8_scaling") for layer in model.layers.values()] == [False, True, False]
    names = [n for n, m in model.named_modules() if isinstance(m, ScalingState) and "self_attention.fp8_scaling" in n]
    assert names == [f"layers.1.self_attention.fp8_scaling.{role}" for role in ("query", "key", "value", "grad_output")]


def test_a_saturating_attention_moves_to_high_precision_with_its_qkv_projection():
    """The attention's casts report to its QKV projection's telemetry (attention_query, ...): when they saturate, the
    saturation guard strikes that layer, moves it to high precision, and the attention goes with it. Here the
    query's delayed scale is made 1000x too large, so only the attention's Q cast saturates."""
    from megafp8.fp8 import SaturationGuard, enable_fp8_telemetry
    from megafp8.fp8.scaling_state import Fp8ScalingManager

    cfg = ModelConfig(num_layers=2, hidden_size=64, ffn_hidden_size=96, num_attention_heads=4, num_query_groups=2,
                      seq_length=16, vocab_size=100, make_vocab_size_divisible_by=8, fp8_dot_product_attention=True)
    model = GPTModel(cfg, ParallelState().init_process_groups(), fp8_recipe=Fp8Recipe.delayed())
    manager, guard = Fp8ScalingManager(model, None), SaturationGuard(patience=1)
    enable_fp8_telemetry(model)
    ids = torch.randint(0, 100, (2, 17), generator=torch.Generator().manual_seed(2))
    attention = model.layers["1"].self_attention
    for step in (1, 2):
        model(ids[:, :-1], ids[:, 1:]).mean().backward()
        if step == 1:
            assert guard.check(model, step) == []  # healthy: nothing saturates
            assert {"attention_query", "attention_key", "attention_value", "attention_grad_output"} <= set(
                attention.linear_qkv.fp8_telemetry)
            manager.update()
            attention.fp8_scaling["query"].scale.mul_(1000)
    messages = guard.check(model, 2)
    assert len(messages) == 1 and "layers.1.self_attention.linear_qkv" in messages[0], messages
    assert attention.linear_qkv.guard_high_precision and attention.fp8_blocks() is None
    assert model.layers["0"].self_attention.fp8_blocks() is not None


def test_selective_recompute_replays_the_same_fp8_attention():
    """--recompute-granularity selective recomputes the core attention in backward: the FP8 casts it replays are
    the forward's (current scales of the same tensors), so the gradients are bit-identical."""
    ids = torch.randint(0, 100, (2, 17), generator=torch.Generator().manual_seed(1))
    grads = []
    for recompute in (None, "selective"):
        model = _model(fp8_dot_product_attention=True, recompute_granularity=recompute)
        model(ids[:, :-1], ids[:, 1:]).mean().backward()
        grads.append({n: p.grad for n, p in model.named_parameters()})
    assert all(torch.equal(grads[0][n], grads[1][n]) for n in grads[0])


@pytest.mark.parametrize("flags, message", [
    (["--fp8-dot-product-attention"], "--fp8-dot-product-attention needs --fp8-format"),
    (["--fp8-format", "hybrid", "--fp8-dot-product-attention", "--attention-dropout", "0.1"],
     "does not drop attention probabilities"),
    (["--fp4-format", "e2m1", "--fp4-recipe", "nvfp4", "--fp8-format", "e4m3", "--fp8-dot-product-attention"], "there is no FP4 attention"),
])
def test_misused_fp8_attention_flag_is_refused_in_one_line(flags, message):
    base = [*LLAMA_FLAGS, "--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length",
            "32", "--micro-batch-size", "2", "--global-batch-size", "4", "--train-iters", "2", "--mock-data",
            "--tokenizer-type", "NullTokenizer", "--vocab-size", "100"]
    _, errors, _ = parse_and_check([*base, *flags])
    assert len(errors) == 1 and message in errors[0], errors


# ---- through the training entry ----------------------------------------------------------------------------------

def _train(data: str, log_dir, *flags: str) -> list[dict]:
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=4",
               "-m", "megafp8.pretrain", *LLAMA_FLAGS, "--tokenizer-type", "NullTokenizer", "--vocab-size", "500",
               "--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "32",
               "--micro-batch-size", "2", "--global-batch-size", "4", "--lr", "1e-3", "--eval-iters", "0",
               "--log-interval", "1", "--distributed-timeout-minutes", "1", "--train-iters", "4",
               "--tensor-model-parallel-size", "2", "--sequence-parallel", "--context-parallel-size", "2",
               "--use-distributed-optimizer", "--fp8-format", "hybrid", "--fp8-recipe", "delayed",
               "--data-path", data, "--log-dir", str(log_dir), *flags]
    result = subprocess.run(command, cwd=REPO_ROOT, capture_output=True, text=True, timeout=300,
                            env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-4000:]
    return [r for r in map(json.loads, (log_dir / "metrics.jsonl").read_text().splitlines()) if "lm_loss" in r]


@pytest.mark.distributed
def test_tp2_cp2_training_with_fp8_attention_tracks_high_precision_attention_and_resumes_bit_exact(tmp_path):
    prefix = str(tmp_path / "synthetic_text_document")
    write_synthetic_dataset(prefix, [50] * 200, vocab_size=500)
    plain = _train(prefix, tmp_path / "plain")
    save = str(tmp_path / "ckpt")
    fp8 = _train(prefix, tmp_path / "fp8", "--fp8-dot-product-attention", "--save", save, "--save-interval", "2")
    assert [r["iteration"] for r in fp8] == [r["iteration"] for r in plain] == [1, 2, 3, 4]
    for a, b in zip(fp8, plain):
        assert math.isfinite(a["lm_loss"]) and abs(a["lm_loss"] - b["lm_loss"]) <= 0.01 * b["lm_loss"], (a, b)
    assert any(a["lm_loss"] != b["lm_loss"] for a, b in zip(fp8, plain))  # the attention did run in FP8
    # Per attention call and rank (N = 2; K/V [2, b=2, 4/TP groups, 32/CP tokens, d=16] = 2048 elements, fp32 on CPU):
    # high precision sends one K/V message forward, one backward and N fp32 dK/dV accumulators; FP8 the same with
    # the K/V messages in bytes plus 8 bytes of scales. Two layers x two micro-batches per step.
    kv = 2 * 2 * 2 * 16 * 16
    calls = 2 * 2
    assert [r["comm_bytes"]["cp_kv_p2p"] for r in plain] == [calls * (2 * kv * 4 + 2 * kv * 4)] * 4
    assert [r["comm_bytes"]["cp_kv_p2p"] for r in fp8] == [calls * (2 * (kv + 8) + 2 * kv * 4)] * 4
    # The attention's delayed-scaling states are checkpointed with the linears': a resume is bit-exact.
    (tmp_path / "ckpt" / "latest_checkpointed_iteration.txt").write_text("2")  # back to iteration 2 (Megatron's way)
    resumed = _train(prefix, tmp_path / "resumed", "--fp8-dot-product-attention", "--load", save)
    assert [r["lm_loss"] for r in resumed] == [r["lm_loss"] for r in fp8[2:]]


@pytest.mark.slow
def test_compiled_layers_run_fp8_attention_eagerly_between_graphs(tmp_path):
    """--compile with FP8 attention: the layer compiles around it (no fullgraph at TP = CP = 1 then) and trains as
    eager does."""
    losses = []
    for flags in ((), ("--compile",)):
        log_dir = tmp_path / f"run{len(losses)}"
        command = [sys.executable, "-m", "megafp8.pretrain", *LLAMA_FLAGS, "--mock-data", "--tokenizer-type",
                   "NullTokenizer", "--vocab-size", "256", "--num-layers", "2", "--hidden-size", "64",
                   "--num-attention-heads", "4", "--seq-length", "32", "--micro-batch-size", "2",
                   "--global-batch-size", "2", "--train-iters", "3", "--log-interval", "1", "--eval-iters", "0",
                   "--fp8-format", "hybrid", "--fp8-dot-product-attention", "--log-dir", str(log_dir), *flags]
        result = subprocess.run(command, cwd=REPO_ROOT, capture_output=True, text=True, timeout=600,
                                env={**os.environ, "OMP_NUM_THREADS": "1"})
        assert result.returncode == 0, result.stderr[-4000:]
        records = map(json.loads, (log_dir / "metrics.jsonl").read_text().splitlines())
        losses.append([r["lm_loss"] for r in records if "lm_loss" in r])
    assert len(losses[1]) == 3
    for compiled, eager in zip(*reversed(losses)):
        assert abs(compiled - eager) <= 1e-5 * eager
