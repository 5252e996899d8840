"""torch.compile: the kernels are custom ops with fake implementations (opcheck), and a transformer block
compiles with fullgraph=True (no graph break) on the aot_eager backend, in fp32 and with FP8 recipes,
giving the eager outputs and gradients.

aot_eager runs dynamo and AOTAutograd (the whole tracing stack that a graph break or a missing fake
implementation would trip) and then executes the traced ATen graph eagerly, so compiled and eager runs
do the same arithmetic: outputs and grads must agree to fp32 round-off (op order may differ slightly).
"""
import pytest
import torch
from torch.library import opcheck

import megafp8_kernels as K
from megafp8.fp8 import Fp8Recipe, fp8_autocast
from megafp8.model.config import ModelConfig
from megafp8.model.model import GPTModel
from megafp8.parallel.parallel_state import ParallelState

# opcheck's schema test compares inputs before/after with allclose, which has no FP8 kernel: the GEMM
# ops (FP8 inputs) run the other three checks; their mutation contract is tested directly below.
GEMM_CHECKS = ("test_autograd_registration", "test_faketensor", "test_aot_dispatch_dynamic")


# The interpreted Triton op's opcheck for tensorwise by default, for every granularity with -m slow (CI time).
@pytest.mark.parametrize("gran, backend", [
    pytest.param(g, b, id=f"{g.value}-{b}", marks=[pytest.mark.slow] if b and g != K.Granularity.TENSORWISE else [])
    for b in ("", "triton") for g in K.Granularity])
def test_quantize_op_passes_opcheck(gran, backend):
    """Fake outputs match the real ones in shape, dtype and strides (1x128 scales K-block-major)."""
    x = torch.randn(130, 260, generator=torch.Generator().manual_seed(0))
    for transpose in (False, True):
        opcheck(torch.ops.megafp8.quantize.default, (x, torch.float8_e4m3fn, gran.value, False, None, transpose, backend))
    if gran is K.Granularity.TENSORWISE:
        opcheck(torch.ops.megafp8.quantize.default, (x, torch.float8_e5m2, gran.value, True, torch.tensor(3.0), True, backend))


@pytest.mark.parametrize("mode", list(K.GemmScaleMode), ids=lambda m: m.value)
def test_gemm_ops_pass_opcheck_and_mutate_only_out(mode):
    g = torch.Generator().manual_seed(1)
    gran_a, gran_b = mode.operand_granularities
    qa = K.quantize(torch.randn(130, 260, generator=g), torch.float8_e4m3fn, gran_a)
    qb = K.quantize(torch.randn(96, 260, generator=g), torch.float8_e4m3fn, gran_b)
    operands = (qa.data, qb.data, qa.scale_inv, qb.scale_inv)
    before = [t.clone() for t in operands]
    opcheck(torch.ops.megafp8.fp8_gemm.default, (*operands, torch.bfloat16, torch.randn(96, generator=g), ""),
            test_utils=GEMM_CHECKS)
    out = torch.randn(130, 96, generator=g)
    opcheck(torch.ops.megafp8.fp8_gemm_into.default, (*operands, None, out, True, ""), test_utils=GEMM_CHECKS)
    start = out.clone()
    torch.ops.megafp8.fp8_gemm_into(*operands, None, out, True, "")
    torch.testing.assert_close(out, start + K.fp8_gemm(*operands), rtol=1e-6, atol=1e-5)
    for t, saved in zip(operands, before):
        assert torch.equal(t.view(torch.uint8) if t.element_size() == 1 else t, saved.view(torch.uint8)
                           if saved.element_size() == 1 else saved), "an input was modified"


# ---- a transformer block under torch.compile(fullgraph=True) ----

def _block_and_inputs(seed: int):
    torch.manual_seed(seed)
    cfg = ModelConfig(num_layers=1, hidden_size=128, ffn_hidden_size=256, num_attention_heads=4, num_query_groups=2,
                      seq_length=16)
    model = GPTModel(cfg, ParallelState().init_process_groups())
    x = torch.randn(16, 2, 128, generator=torch.Generator().manual_seed(seed))
    return model.layers["0"], model.rotary(16), x


def _run(block, rotary, x, recipe, fn=None):
    """Forward + backward of `block` (or its compiled `fn`) under fp8_autocast(recipe); returns output and grads."""
    block.zero_grad(set_to_none=True)
    x = x.clone().requires_grad_(True)
    with fp8_autocast(enabled=recipe is not None, recipe=recipe):
        y = (fn if fn is not None else block)(x, rotary)
    y.backward(torch.cos(torch.arange(y.numel(), dtype=y.dtype)).view_as(y))
    return y.detach(), x.grad, {n: p.grad.clone() for n, p in block.named_parameters()}


def _assert_same_results(eager, compiled, rtol, atol):
    (y0, dx0, g0), (y1, dx1, g1) = eager, compiled
    torch.testing.assert_close(y1, y0, rtol=rtol, atol=atol)
    torch.testing.assert_close(dx1, dx0, rtol=rtol, atol=atol)
    assert g0.keys() == g1.keys()
    for name in g0:
        torch.testing.assert_close(g1[name], g0[name], rtol=rtol, atol=atol, msg=name)


def test_block_compiles_fullgraph_fp32():
    block, rotary, x = _block_and_inputs(0)
    eager = _run(block, rotary, x, None)
    torch._dynamo.reset()
    compiled = torch.compile(block, backend="aot_eager", fullgraph=True)
    _assert_same_results(eager, _run(block, rotary, x, None, compiled), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("recipe", [Fp8Recipe.tensorwise(), Fp8Recipe.delayed(amax_history_len=4), Fp8Recipe.blockwise()],
                         ids=["tensorwise", "delayed", "blockwise"])
def test_block_compiles_fullgraph_fp8(recipe):
    """The FP8 block (quantize + FP8 GEMM custom ops inside the FP8 autograd op) traces as one graph.

    Delayed scaling: a first eager step allocates the amax histories and leaves them warm; the compiled
    and eager runs then start from identical states, and the amaxes each run observes must match too."""
    block, rotary, x = _block_and_inputs(1)
    _run(block, rotary, x, recipe)  # allocate scaling states (and warm the delayed histories) eagerly
    states = {n: b.clone() for n, b in block.named_buffers()}
    eager = _run(block, rotary, x, recipe)
    after_eager = {n: b.clone() for n, b in block.named_buffers()}
    for name, b in block.named_buffers():
        b.copy_(states[name])
    torch._dynamo.reset()
    compiled = torch.compile(block, backend="aot_eager", fullgraph=True)
    with fp8_autocast(recipe=recipe):
        _assert_same_results(eager, _run(block, rotary, x, recipe, compiled), rtol=1e-5, atol=1e-6)
    for name, b in block.named_buffers():
        torch.testing.assert_close(b, after_eager[name], rtol=0, atol=0, msg=name)


def test_whole_model_with_loss_compiles_fullgraph_delayed_fp8():
    """Embedding, two FP8 blocks (per-layer recipes from the model's precision map), output head and
    vocab-parallel cross-entropy (TP=1): one graph, the eager loss and grads."""
    torch.manual_seed(2)
    cfg = ModelConfig(num_layers=2, hidden_size=128, ffn_hidden_size=256, num_attention_heads=4, seq_length=16)
    model = GPTModel(cfg, ParallelState().init_process_groups(), fp8_recipe=Fp8Recipe.delayed(amax_history_len=4))
    g = torch.Generator().manual_seed(3)
    ids, labels = torch.randint(0, 100, (2, 16), generator=g), torch.randint(0, 100, (2, 16), generator=g)

    def step(fn):
        model.zero_grad(set_to_none=True)
        loss = fn(ids, labels).mean()
        loss.backward()
        return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}

    step(model)  # allocate and warm the delayed-scaling states
    states = {n: b.clone() for n, b in model.named_buffers()}
    loss0, grads0 = step(model)
    for name, b in model.named_buffers():
        b.copy_(states[name])
    torch._dynamo.reset()
    loss1, grads1 = step(torch.compile(model, backend="aot_eager", fullgraph=True))
    torch.testing.assert_close(loss1, loss0, rtol=1e-5, atol=1e-6)
    with fp8_autocast(enabled=False):  # the same model in fp32 gives another loss: FP8 really ran
        assert not torch.allclose(model(ids, labels).mean().detach(), loss0, rtol=1e-6, atol=0)
    for name in grads0:
        torch.testing.assert_close(grads1[name], grads0[name], rtol=1e-5, atol=1e-6, msg=name)


def test_compiled_layers_record_the_kurtosis_monitors_moments():
    """--compile with --log-fp8-telemetry: each compiled FP8 linear writes its input's moments into the slot it
    owns (megafp8.fp8.kurtosis.add_moments_slot), and the kurtosis and RMS equal the eager layers'."""
    from megafp8.fp8.kurtosis import collect_kurtosis, enable_kurtosis
    from megafp8.model.compile import compile_layers

    cfg = ModelConfig(num_layers=2, hidden_size=64, ffn_hidden_size=128, num_attention_heads=4, seq_length=16)
    ids = torch.randint(0, 100, (2, 16), generator=torch.Generator().manual_seed(4))
    values = []
    for compiled in (False, True):
        model = GPTModel(cfg, ParallelState().init_process_groups(), fp8_recipe=Fp8Recipe.tensorwise())
        if compiled:
            torch._dynamo.reset()
            assert compile_layers([model], backend="aot_eager", fullgraph=True) == 2
        enable_kurtosis(model, True)
        model(ids)
        values.append(collect_kurtosis(model))
        fc2 = model.layers["0"].mlp.linear_fc2
        assert (fc2.input_moments is fc2.__dict__.get("input_moments_slot")) == compiled  # the graph wrote it
        enable_kurtosis(model, False)
    assert len(values[1]) == 2 * 2 * 4  # kurtosis and RMS of every FP8 linear of both layers
    for key, eager in values[0].items():
        assert abs(values[1][key] - eager) <= 1e-9 * abs(eager), (key, values[1][key], eager)
