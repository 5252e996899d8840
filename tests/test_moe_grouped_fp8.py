"""--moe-grouped-gemm with FP8 experts (megafp8.fp8.grouped_linear_function): fprop, dgrad and wgrad as grouped FP8
GEMMs must give the loop of FP8 linears' output, gradients and scaling state: to the bit on CPU (the grouped GEMMs'
twins are the loop's GEMMs), within the kernels' SQNR with the Triton kernels (interpreter). Recipes without grouped
kernels keep the loop."""
import pytest
import torch

from torch.utils.checkpoint import checkpoint

from fp8_testing import SavedBytes, attach_main_grads, sqnr_db
from megafp8.fp8 import Fp8Recipe, Fp8ScalingManager, apply_precision_map, enable_fp8_telemetry
from megafp8.fp8 import grouped_linear_function
from megafp8.model.config import ModelConfig
from megafp8.model.moe import MoELayer
from megafp8.parallel.parallel_state import ParallelState

HIDDEN, FFN, EXPERTS = 128, 256, 4
GROUPED = {"tensorwise": dict(scaling="tensorwise", fp8_format="hybrid"),
           "delayed": dict(scaling="delayed", fp8_format="hybrid"),
           "rowwise": dict(scaling="rowwise", fp8_format="e4m3"),
           "blockwise": dict(scaling="blockwise", fp8_format="e4m3")}


def _layer(recipe: Fp8Recipe | None, grouped: bool, device: str = "cpu") -> MoELayer:
    config = ModelConfig(hidden_size=HIDDEN, num_experts=EXPERTS, moe_ffn_hidden_size=FFN, moe_grouped_gemm=grouped)
    layer = MoELayer(config, ParallelState().init_process_groups())
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for param in layer.parameters():
            param.copy_(torch.randn(param.shape, generator=generator) * 0.05)
    apply_precision_map([layer], [recipe])
    return layer.to(device)


def _run(layer: MoELayer, steps: int = 2, seed: int = 1, tokens: int = 40):
    """Two forward/backward passes (the second under the first's delayed scales); output, input grad, weight grads."""
    generator = torch.Generator().manual_seed(seed)
    device = layer.router.weight.device
    for _ in range(steps):
        x = torch.randn(tokens, 2, HIDDEN, generator=generator).to(device).requires_grad_()
        out = layer(x)
        (out * torch.randn(out.shape, generator=generator).to(device)).sum().backward()
        Fp8ScalingManager(layer, None).update()
    grads = [p.grad.clone() for p in layer.experts.parameters()]
    return out.detach(), x.grad, grads


class _CountGroupedGemms:
    """Counts the grouped GEMM calls (fprop and dgrad: ``calls``; wgrad: ``wgrad_calls``)."""

    def __init__(self, monkeypatch):
        self.calls = self.wgrad_calls = 0
        for name, counter in (("grouped_fp8_gemm", "calls"), ("grouped_fp8_wgrad", "wgrad_calls")):
            real = getattr(grouped_linear_function, name)

            def counted(*args, real=real, counter=counter, **kwargs):
                setattr(self, counter, getattr(self, counter) + 1)
                return real(*args, **kwargs)
            monkeypatch.setattr(grouped_linear_function, name, counted)


@pytest.mark.parametrize("name", GROUPED)
def test_grouped_fp8_experts_are_the_loop_to_the_bit_on_cpu(name, monkeypatch):
    recipe = Fp8Recipe(**GROUPED[name])
    loop, grouped = _layer(recipe, False), _layer(recipe, True)
    for layer in (loop, grouped):
        enable_fp8_telemetry(layer)
    counter = _CountGroupedGemms(monkeypatch)
    expected, got = _run(loop), _run(grouped)
    assert (counter.calls, counter.wgrad_calls) == (2 * 2 * 2, 2 * 2)  # steps x (fc1, fc2) x (fprop, dgrad) / wgrad
    assert any(n % 16 for n in grouped.stats["tokens_per_expert"].tolist())  # ragged loads, padded as the loop pads
    for want, have in zip(expected[:2], got[:2]):
        assert torch.equal(want, have)
    assert all(torch.equal(w, h) for w, h in zip(expected[2], got[2]))
    # Each expert's own scaling state and telemetry moved as in the loop (the guard reads them per expert).
    for (name_a, a), (_, b) in zip(loop.named_buffers(), grouped.named_buffers()):
        assert torch.equal(a, b), name_a
    for m_loop, m_grouped in zip(loop.experts.modules(), grouped.experts.modules()):
        for role, stats in getattr(m_loop, "fp8_telemetry", {}).items():
            for key, value in stats.values().items():
                assert torch.equal(value, m_grouped.fp8_telemetry[role].values()[key]), (role, key)


@pytest.mark.parametrize("name", ["blockwise", pytest.param("tensorwise", marks=pytest.mark.slow)])
def test_grouped_fp8_experts_with_the_triton_kernel_follow_the_loop(name, monkeypatch):
    """The grouped Triton kernel (the interpreter on CPU, the GPU in gpu_check.sh) against the loop of the Triton FP8
    GEMM: the same FP8 operands, sums in another order."""
    device = "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cpu":
        monkeypatch.setenv("MEGAFP8_KERNEL_BACKEND", "triton")
    recipe = Fp8Recipe(**GROUPED[name])
    counter = _CountGroupedGemms(monkeypatch)
    tokens = 40 if device == "cuda" else 12  # the interpreter's time grows with the rows' tiles
    expected, got = (_run(_layer(recipe, grouped, device), steps=1, tokens=tokens) for grouped in (False, True))
    assert (counter.calls, counter.wgrad_calls) == (4, 2)  # the grouped kernels ran
    for want, have in zip((*expected[:2], *expected[2]), (*got[:2], *got[2])):
        assert sqnr_db(have.cpu(), want.cpu()) >= 45.0


@pytest.mark.parametrize("scaling", ["mxfp8", "nvfp4"])
def test_recipes_without_a_grouped_kernel_keep_the_loop(scaling, monkeypatch):
    counter = _CountGroupedGemms(monkeypatch)
    layer = _layer(Fp8Recipe(scaling=scaling), True)
    _run(layer, steps=1)
    assert counter.calls == counter.wgrad_calls == 0
    assert layer._grouped_fp8_recipe() is None


def test_smooth_swiglu_and_a_guard_switched_expert_keep_the_loop():
    recipe = Fp8Recipe(**GROUPED["blockwise"])
    layer = _layer(recipe, True)
    experts = list(layer.experts.local_experts.values())
    assert layer._grouped_fp8_recipe() == recipe
    experts[2].linear_fc2.guard_high_precision = True  # the guard switched one expert's fc2 alone
    assert layer._grouped_fp8_recipe() is None
    experts[2].linear_fc2.guard_high_precision = False
    layer.activation = "smooth_swiglu"
    assert layer._grouped_fp8_recipe() is None


def _main_grad_run(layer: MoELayer, recompute: bool = False, freeze: str | None = None) -> list[torch.Tensor]:
    """One step with fp32 main_grads (the ZeRO grad buffer's contract), optionally recomputed (torch.utils.checkpoint,
    as --recompute-granularity full runs it) or with expert ``freeze``'s fc1 frozen; each expert parameter's
    main_grad, its .grad kept None."""
    attach_main_grads(layer, torch.float32)
    if freeze is not None:
        layer.experts.local_experts[freeze].linear_fc1.weight.requires_grad_(False)
    generator = torch.Generator().manual_seed(3)
    x = torch.randn(40, 2, HIDDEN, generator=generator, requires_grad=True)
    out = checkpoint(layer, x, use_reentrant=False) if recompute else layer(x)
    (out * torch.randn(out.shape, generator=generator)).sum().backward()
    assert all(p.grad is None for p in layer.experts.parameters())
    return [p.main_grad.clone() for p in layer.experts.parameters()]


@pytest.mark.parametrize("name", ["delayed", "blockwise"])
def test_main_grads_under_recompute_and_frozen_experts_are_the_loops(name, monkeypatch):
    """The weight gradients land in the fp32 main_grad (not in .grad, rounded to the parameter's dtype first) under
    recomputation too, where the op's saved copy of a weight is not the leaf; a frozen expert's main_grad stays 0;
    a no-grad forward gives the loop's output and moves no scaling state."""
    recipe = Fp8Recipe(**GROUPED[name])
    counter = _CountGroupedGemms(monkeypatch)
    plain = _main_grad_run(_layer(recipe, False))
    for grouped in (False, True):
        assert all(torch.equal(a, b) for a, b in zip(_main_grad_run(_layer(recipe, grouped), recompute=True), plain))
    assert counter.wgrad_calls == 2
    frozen = [_layer(recipe, grouped) for grouped in (False, True)]
    loop_grads, grouped_grads = (_main_grad_run(layer, freeze="1") for layer in frozen)
    assert all(torch.equal(a, b) for a, b in zip(loop_grads, grouped_grads))
    assert not frozen[1].experts.local_experts["1"].linear_fc1.weight.main_grad.any()
    x = torch.randn(30, 2, HIDDEN, generator=torch.Generator().manual_seed(4))
    layers = [_layer(recipe, grouped).eval() for grouped in (False, True)]
    with torch.no_grad():
        outputs = [layer(x) for layer in layers]
    assert torch.equal(*outputs)
    states = [b for _, b in layers[1].named_buffers()]
    assert all(torch.equal(a, b) for a, b in zip(states, [b for _, b in _layer(recipe, True).named_buffers()]))


def test_the_unfused_swiglu_saves_no_more_than_the_loops_fused_cast():
    recipe = Fp8Recipe(**GROUPED["blockwise"])
    x = torch.randn(40, 2, HIDDEN, generator=torch.Generator().manual_seed(5), requires_grad=True)
    saved = []
    for grouped in (False, True):
        layer = _layer(recipe, grouped)
        with SavedBytes(layer.parameters()) as counted:
            layer(x)
        saved.append(counted.nbytes)
    assert saved[1] <= saved[0], saved


def test_a_module_hook_the_grouped_path_cannot_run_keeps_the_loop(monkeypatch):
    """A forward hook on an expert linear (the re-run's non-finite finder puts one on every module) is called: the
    layer runs the loop, which calls the modules; hooks that read no input (ZeRO's gather) keep the grouped path."""
    counter = _CountGroupedGemms(monkeypatch)
    layer = _layer(Fp8Recipe(**GROUPED["blockwise"]), True)
    seen = []
    handle = layer.experts.local_experts["2"].linear_fc2.register_forward_hook(lambda m, args, out: seen.append(out))
    _run(layer, steps=1)
    assert counter.calls == 0 and len(seen) == 1
    handle.remove()

    def gather(module, args):
        seen.append(module)
    gather.reads_no_input = True
    layer.experts.local_experts["2"].linear_fc2.register_forward_pre_hook(gather)
    _run(layer, steps=1)
    assert counter.calls == 4 and seen[-1] is layer.experts.local_experts["2"].linear_fc2
