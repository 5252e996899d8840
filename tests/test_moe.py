"""The MoE block against a per-token fp64 loop written here (routing, weights, dropped tokens, the balancing and z
losses by their formulas, gradients), the expert-bias rule, and the flags' one-line errors."""
import math

import pytest
import torch
import torch.nn.functional as F

from fp8_testing import sqnr_db
from megafp8.fp8 import Fp8Recipe, apply_precision_map
from megafp8.model.config import ModelConfig
from megafp8.model.moe import MoELayer, dispatch_order
from megafp8.model.moe_stats import update_expert_biases
from megafp8.parallel.parallel_state import ParallelState
from megafp8.training.arguments import parse_and_check

HIDDEN, FFN, EXPERTS, SEQ, BATCH = 16, 24, 6, 10, 3


def _layer(**options) -> MoELayer:
    config = ModelConfig(hidden_size=HIDDEN, num_experts=EXPERTS, moe_ffn_hidden_size=FFN, **options)
    layer = MoELayer(config, ParallelState().init_process_groups())
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for param in layer.parameters():
            param.copy_(torch.randn(param.shape, generator=generator) * 0.5)
        if layer.router.expert_bias is not None:
            layer.router.expert_bias.copy_(torch.randn(EXPERTS, generator=generator) * 0.3)
    return layer


def _reference(layer: MoELayer, x: torch.Tensor, p: dict[str, torch.Tensor]):
    """The block in fp64, one token at a time: (output [T, h], balancing metric, z metric)."""
    r = layer.router
    k, tokens = r.topk, x.shape[0]
    choices, weights, all_probs, lse = [], [], [], []
    for t in range(tokens):
        logits = p["router.weight"] @ x[t]
        lse.append(torch.logsumexp(logits, 0))
        if r.score_function == "softmax":
            probs = torch.softmax(logits, 0)
            if r.pre_softmax:
                chosen = torch.topk(probs, k).indices
                w = probs[chosen]
            else:
                chosen = torch.topk(logits, k).indices
                w = torch.softmax(logits[chosen], 0)
            all_probs.append(probs)
        else:
            scores = torch.sigmoid(logits)
            bias = r.expert_bias.double() if r.expert_bias is not None else 0
            chosen = torch.topk(scores + bias, k).indices
            w = scores[chosen]
            w = w / w.sum() if k > 1 else w
            all_probs.append(scores / scores.sum())
        if r.scaling_factor is not None:
            w = w * r.scaling_factor
        choices.append(chosen.tolist())
        weights.append(w)
    kept = {(t, j) for t in range(tokens) for j in range(k)}
    capacity = layer.capacity(tokens)
    if capacity is not None:
        for e in range(EXPERTS):
            mine = [(t, j) for t in range(tokens) for j in range(k) if choices[t][j] == e]
            if layer.drop_policy == "probs":  # highest weight first, earlier choices first among equals
                mine.sort(key=lambda tj: -float(weights[tj[0]][tj[1]].detach()))
            kept -= set(mine[capacity:])
    out = []
    for t in range(tokens):
        y = torch.zeros(HIDDEN, dtype=torch.float64)
        for j, e in enumerate(choices[t]):
            if (t, j) in kept:
                gate, up = (p[f"experts.local_experts.{e}.linear_fc1.weight"] @ x[t]).chunk(2)
                y = y + weights[t][j] * (p[f"experts.local_experts.{e}.linear_fc2.weight"] @ (F.silu(gate) * up))
        if layer.shared_experts is not None:
            gate, up = (p["shared_experts.linear_fc1.weight"] @ x[t]).chunk(2)
            y = y + p["shared_experts.linear_fc2.weight"] @ (F.silu(gate) * up)
        out.append(y)
    probs = torch.stack(all_probs)  # [T, E]
    picked = torch.zeros(tokens, EXPERTS, dtype=torch.float64)
    for t in range(tokens):
        picked[t, choices[t]] = 1
    if r.load_balancing_type == "seq_aux_loss":  # token t = position * batch + sample
        per_seq = [EXPERTS * ((picked[b::BATCH].sum(0) / (k * SEQ)) * probs[b::BATCH].mean(0)).sum()
                   for b in range(BATCH)]
        balance = torch.stack(per_seq).mean()
    else:
        balance = EXPERTS * ((picked.sum(0) / (k * tokens)) * probs.mean(0)).sum()
    return torch.stack(out), balance, torch.stack(lse).square().mean()


OPTIONS = {
    "softmax-top2": dict(),
    "softmax-pre-top1": dict(moe_router_topk=1, moe_router_pre_softmax=True),
    "sigmoid-bias-top3": dict(moe_router_topk=3, moe_router_score_function="sigmoid",
                              moe_router_enable_expert_bias=True),
    "sigmoid-bias-scaled": dict(moe_router_topk=2, moe_router_score_function="sigmoid",
                                moe_router_enable_expert_bias=True, moe_router_topk_scaling_factor=2.5),
    "seq-aux": dict(moe_router_load_balancing_type="seq_aux_loss", moe_aux_loss_coeff=0.1),
    "capacity-probs": dict(moe_expert_capacity_factor=0.6),
    "capacity-position": dict(moe_expert_capacity_factor=0.6, moe_token_drop_policy="position"),
    "capacity-padded-shared": dict(moe_expert_capacity_factor=0.8, moe_pad_expert_input_to_capacity=True,
                                   moe_shared_expert_intermediate_size=8),
    # --moe-grouped-gemm: the experts as two grouped GEMMs (torch._grouped_mm, fp32 on CPU) instead of the loop
    "grouped-gemm": dict(moe_grouped_gemm=True),
    "grouped-gemm-capacity-padded": dict(moe_grouped_gemm=True, moe_expert_capacity_factor=0.8,
                                         moe_pad_expert_input_to_capacity=True),
}


@pytest.mark.parametrize("options", OPTIONS.values(), ids=OPTIONS.keys())
def test_moe_block_matches_a_per_token_fp64_loop(options):
    options = {"moe_aux_loss_coeff": 0.05, "moe_z_loss_coeff": 0.01, **options}
    layer = _layer(**options)
    x = torch.randn(SEQ, BATCH, HIDDEN, generator=torch.Generator().manual_seed(1), requires_grad=True)
    out = layer(x)
    probe = torch.randn(out.shape, generator=torch.Generator().manual_seed(2))
    (out * probe).sum().backward()  # the aux and z losses come in through the block's output (scale 1)

    params = {name: p.detach().double().requires_grad_() for name, p in layer.named_parameters()}
    x64 = x.detach().double().reshape(-1, HIDDEN).requires_grad_()
    want, balance, z = _reference(layer, x64, params)
    objective = (want * probe.double().reshape(-1, HIDDEN)).sum() + options["moe_z_loss_coeff"] * z
    if layer.router.load_balancing_type != "none":
        objective = objective + options["moe_aux_loss_coeff"] * balance
    objective.backward()

    def close(actual, expected, what):
        if expected is None:  # an expert no token chose: no gradient in the loop, zeros in the block
            expected = torch.zeros_like(actual, dtype=torch.float64)
        assert (actual.double() - expected).abs().max() <= 1e-5 * expected.abs().max(), what

    assert layer._runs_grouped(x.detach()) == options.get("moe_grouped_gemm", False)  # not the loop in disguise
    close(out.detach().reshape(-1, HIDDEN), want.detach(), "output")
    close(layer.stats["aux_metric"], balance.detach(), "balancing loss")
    close(layer.stats["z_metric"], z.detach(), "z loss")
    close(x.grad.reshape(-1, HIDDEN), x64.grad, "input gradient")
    for name, param in layer.named_parameters():
        close(param.grad, params[name].grad, name)
    if layer.capacity(SEQ * BATCH) is not None:  # the capacity really dropped choices
        order, counts = dispatch_order(*layer.router.choose(F.linear(x.detach().reshape(-1, HIDDEN),
                                                                     layer.router.weight)), EXPERTS,
                                       layer.capacity(SEQ * BATCH), layer.drop_policy)
        assert counts.max() <= layer.capacity(SEQ * BATCH) and len(order) < SEQ * BATCH * layer.topk


def test_dispatch_keeps_token_order_within_each_expert():
    experts = torch.tensor([[2, 0], [0, 1], [2, 1], [0, 2]])
    order, counts = dispatch_order(experts, torch.rand(4, 2), 3, None)
    assert counts.tolist() == [3, 2, 3]
    assert order.tolist() == [1, 2, 6, 3, 5, 0, 4, 7]  # expert 0: tokens 0, 1, 3; expert 1: 1, 2; expert 2: 0, 2, 3


@pytest.mark.parametrize("grouped", [False, True], ids=["loop", "grouped-gemm"])
def test_an_expert_without_tokens_still_gets_a_zero_gradient(grouped):
    layer = _layer(moe_router_topk=1, moe_grouped_gemm=grouped)
    with torch.no_grad():
        layer.router.weight.zero_()
        layer.router.weight[3] = 1.0  # every token picks expert 3 (for positive inputs)
    layer(torch.rand(SEQ, BATCH, HIDDEN)).sum().backward()
    grads = [e.linear_fc1.weight.grad for e in layer.experts.local_experts.values()]
    assert all(g is not None for g in grads)
    assert grads[3].abs().sum() > 0 and all(g.abs().sum() == 0 for i, g in enumerate(grads) if i != 3)


def test_expert_bias_moves_each_expert_towards_the_mean_load():
    layer = _layer(moe_router_score_function="sigmoid", moe_router_enable_expert_bias=True,
                   moe_router_bias_update_rate=0.01)
    layer(torch.randn(SEQ, BATCH, HIDDEN))
    load = layer.step_tokens_per_expert.clone()
    before = layer.router.expert_bias.clone()
    assert load.sum() == SEQ * BATCH * layer.topk

    class NoGroup:  # one rank: nothing to sum over
        size = 1

    update_expert_biases([layer], NoGroup())
    assert torch.equal(layer.router.expert_bias, before + 0.01 * torch.sign(load.mean() - load))
    assert layer.step_tokens_per_expert.sum() == 0  # the next step counts afresh
    skipped = layer.router.expert_bias.clone()
    layer(torch.randn(SEQ, BATCH, HIDDEN))
    update_expert_biases([layer], NoGroup(), applied=torch.tensor(False))
    assert torch.equal(layer.router.expert_bias, skipped)  # a skipped step leaves the biases


@pytest.mark.parametrize("flags, messages", [
    (["--moe-router-topk", "4", "--moe-aux-loss-coeff", "0.1"],
     ["--moe-router-topk, --moe-aux-loss-coeff without --num-experts"]),
    (["--num-experts", "4", "--moe-router-topk", "5", "--moe-expert-capacity-factor", "0",
      "--moe-router-enable-expert-bias", "--moe-pad-expert-input-to-capacity"],
     ["--moe-router-topk (5) must be between 1 and --num-experts (4)", "--moe-expert-capacity-factor must be positive",
      "--moe-router-enable-expert-bias needs --moe-router-score-function sigmoid"]),
    (["--num-experts", "4", "--moe-layer-freq", "1,0,1"], ["one 0/1 per layer, 2 in all"]),
    (["--num-experts", "4", "--moe-pad-expert-input-to-capacity"],
     ["--moe-pad-expert-input-to-capacity needs --moe-expert-capacity-factor"]),
    (["--num-experts", "4", "--enable-cuda-graph"], ["--num-experts with --enable-cuda-graph: not supported yet"]),
    (["--expert-model-parallel-size", "2"], ["--expert-model-parallel-size without --num-experts"]),
    (["--num-experts", "6", "--expert-model-parallel-size", "4", "--expert-tensor-parallel-size", "2",
      "--moe-ffn-hidden-size", "33"],
     ["--num-experts (6) must be divisible by --expert-model-parallel-size (4)",
      "--moe-ffn-hidden-size (33) must be divisible by --expert-tensor-parallel-size (2)",
      "--expert-model-parallel-size > 1 needs --use-distributed-optimizer",
      "--expert-tensor-parallel-size > 1 needs --use-distributed-optimizer",
      "--expert-tensor-parallel-size (2) x --expert-model-parallel-size (4) = 8 does not divide the ranks of a "
      "pipeline stage (TP x CP x DP = 4)"]),
    (["--num-experts", "4", "--expert-tensor-parallel-size", "2", "--activation", "xielu", "--moe-grouped-gemm"],
     ["--expert-tensor-parallel-size > 1 with --activation xielu: not built",
      "--moe-grouped-gemm with --expert-tensor-parallel-size > 1 or --activation xielu: not built"]),
    (["--num-experts", "4", "--expert-tensor-parallel-size", "2", "--fp4-format", "e2m1", "--fp4-until-grad-noise",
      "--fp4-switch-gemms", "fprop"],
     ["--fp4-until-grad-noise with --expert-model-parallel-size or --expert-tensor-parallel-size > 1",
      "--fp4-switch-gemms fprop with --expert-tensor-parallel-size > 1"]),
    (["--num-experts", "4", "--expert-model-parallel-size", "2", "--fp4-format", "e2m1", "--fp4-until-grad-noise"],
     ["--fp4-until-grad-noise with --expert-model-parallel-size or --expert-tensor-parallel-size > 1"]),
])
def test_moe_flag_problems_are_reported_together_one_line_each(flags, messages):
    _, errors, _ = parse_and_check(["--num-layers", "2", *flags], world_size=4)
    for message in messages:
        assert sum(message in e for e in errors) == 1, (message, errors)


def test_tensor_parallel_moe_needs_sequence_parallelism():
    _, errors, _ = parse_and_check(["--num-experts", "4", "--tensor-model-parallel-size", "2"], world_size=2)
    assert any("needs --sequence-parallel" in e for e in errors), errors


def test_capacity_is_megatrons_rounding_up():
    layer = _layer(moe_expert_capacity_factor=1.25)
    assert layer.capacity(30) == math.ceil(30 * 2 / EXPERTS * 1.25)
    assert _layer().capacity(30) is None


RECIPES = {"delayed": (dict(scaling="delayed", fp8_format="hybrid"), 22, 20, 18),
           "blockwise": (dict(scaling="blockwise", fp8_format="e4m3"), 22, 20, 18),
           "mxfp8": (dict(scaling="mxfp8", fp8_format="hybrid"), 22, 20, 18),
           "nvfp4": (dict(scaling="nvfp4"), 10, 9, 8.5)}


@pytest.mark.parametrize("recipe, out_db, dx_db, dw_db", RECIPES.values(), ids=RECIPES.keys())
def test_experts_in_fp8_and_fp4_stay_within_their_sqnr_floors_of_high_precision(recipe, out_db, dx_db, dw_db):
    """Every expert GEMM (fprop, dgrad, wgrad) runs the recipe; experts get ragged token counts (the wgrad's K), padded
    to 16 with zero rows (NVFP4's Hadamard transform refuses anything else)."""
    def build(fp8_recipe):
        config = ModelConfig(hidden_size=128, num_experts=4, moe_ffn_hidden_size=128)
        layer = MoELayer(config, ParallelState().init_process_groups())
        generator = torch.Generator().manual_seed(0)
        with torch.no_grad():
            for param in layer.parameters():
                param.copy_(torch.randn(param.shape, generator=generator) * 0.05)
        apply_precision_map([layer], [fp8_recipe])
        return layer

    x = torch.randn(64, 2, 128, generator=torch.Generator().manual_seed(1))
    runs = []
    for fp8_recipe in (None, Fp8Recipe(**recipe)):
        layer, xx = build(fp8_recipe), x.clone().requires_grad_()
        out = layer(xx)
        out.square().sum().backward()
        runs.append((out.detach(), xx.grad, layer.experts.local_experts["0"].linear_fc1.weight.grad))
    assert any(n % 16 for n in layer.stats["tokens_per_expert"].tolist())  # ragged loads were padded
    (ref_out, ref_dx, ref_dw), (out, dx, dw) = runs
    assert sqnr_db(out, ref_out) >= out_db and sqnr_db(dx, ref_dx) >= dx_db and sqnr_db(dw, ref_dw) >= dw_db


@pytest.mark.gpu
def test_grouped_gemm_in_bf16_on_cuda_equals_the_loop_of_linears():
    """--moe-grouped-gemm on a GPU: torch._grouped_mm's bf16 kernels (Hopper) with row counts that are not
    multiples of 16 and an expert without rows, forward and both gradients against the loop in fp32."""
    from megafp8.model.grouped_gemm import grouped_gemm_supported, grouped_linear

    device = torch.device("cuda")
    if not grouped_gemm_supported(torch.bfloat16, device):
        pytest.skip("--moe-grouped-gemm runs torch._grouped_mm on Hopper only (compute capability 9.x)")
    generator = torch.Generator().manual_seed(3)
    counts = torch.tensor([5, 0, 37, 16])
    rows = torch.randn(int(counts.sum()), 256, generator=generator).to(device, torch.bfloat16).requires_grad_()
    weights = [torch.randn(512, 256, generator=generator).div(16).to(device, torch.bfloat16).requires_grad_()
               for _ in counts]
    out = grouped_linear(rows, weights, torch.cumsum(counts, 0).to(device, torch.int32))
    probe = torch.randn(out.shape, generator=generator).to(device)
    (out.float() * probe).sum().backward()
    rows32 = rows.detach().float().requires_grad_()
    weights32 = [w.detach().float().requires_grad_() for w in weights]
    want = torch.cat([chunk @ w.t() for chunk, w in zip(rows32.split(counts.tolist()), weights32)])
    (want * probe).sum().backward()
    torch.testing.assert_close(out.float(), want, rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(rows.grad.float(), rows32.grad, rtol=2e-2, atol=2e-2)
    for w, w32 in zip(weights, weights32):
        torch.testing.assert_close(w.grad.float(), w32.grad, rtol=2e-2, atol=5e-2)
