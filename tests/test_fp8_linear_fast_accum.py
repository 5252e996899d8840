"""Fast accumulation in fprop only (TransformerEngine's recipes): every FP8 layer's fprop GEMM asks for it where
the GEMM mode offers it (tensorwise/rowwise), dgrad and wgrad never do, and the recipe can turn it off."""
import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from megafp8.fp8 import Fp8Linear, Fp8Recipe
from megafp8.training.arguments import parse_args
from megafp8.training.megatron_flags import LLAMA_FLAGS


class _GemmCalls(TorchDispatchMode):
    """(output shape, fast_accum) of every megafp8 GEMM launched inside."""

    def __init__(self):
        super().__init__()
        self.calls = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.ops.megafp8.fp8_gemm.default:
            fast = kwargs.get("fast_accum", args[7] if len(args) > 7 else False)
            self.calls.append(((args[0].shape[0], args[1].shape[0]), fast))
        elif func is torch.ops.megafp8.fp8_gemm_into.default:
            self.calls.append((tuple(args[5].shape), False))  # into `out`: always fp32 promotion
        return func(*args, **kwargs)


RECIPES = {"delayed": Fp8Recipe.delayed(amax_history_len=4), "tensorwise": Fp8Recipe.tensorwise(),
           "rowwise": Fp8Recipe.rowwise(), "blockwise": Fp8Recipe.blockwise()}


@pytest.mark.parametrize("fast", [True, False], ids=["default", "off"])
@pytest.mark.parametrize("name", list(RECIPES))
def test_only_fprop_accumulates_fast(name, fast):
    recipe = RECIPES[name] if fast else RECIPES[name].replace(fprop_fast_accum=False)
    tokens, k, n = 48, 64, 80  # distinct sizes: each GEMM is recognised by its output shape
    layer = Fp8Linear(k, n, recipe=recipe)
    x = torch.randn(tokens, k, requires_grad=True)
    with _GemmCalls() as gemms:
        y = layer(x)
        y.backward(torch.randn_like(y))
    by_shape = dict(gemms.calls)
    assert len(gemms.calls) == 3 and set(by_shape) == {(tokens, n), (tokens, k), (n, k)}
    expected_fprop = fast and name != "blockwise"  # blockwise GEMMs promote every 128 of K by construction
    assert by_shape == {(tokens, n): expected_fprop, (tokens, k): False, (n, k): False}


def test_fast_accum_is_a_recipe_field_read_from_the_args():
    args = parse_args([*LLAMA_FLAGS, "--fp8-format", "hybrid", "--data-path", "d", "--tokenizer-model", "t",
                       "--train-iters", "1"])
    assert Fp8Recipe.from_args(args).fprop_fast_accum  # default on, as TransformerEngine
    args.fp8_fprop_fast_accum = False  # the flag the training arguments will offer (--no-fp8-fprop-fast-accum)
    assert not Fp8Recipe.from_args(args).fprop_fast_accum
    assert not Fp8Recipe.tensorwise().fast_accum("dgrad") and not Fp8Recipe.tensorwise().fast_accum("wgrad")


def test_reference_gemm_ignores_fast_accum_on_cpu():
    """On CPU the reference twin is exact fp32 either way: the same output bit for bit (the GPU kernels differ)."""
    torch.manual_seed(0)
    x = torch.randn(32, 256)
    outputs = []
    for fast in (True, False):
        layer = Fp8Linear(256, 64, recipe=Fp8Recipe.tensorwise(fprop_fast_accum=fast))
        torch.manual_seed(1)
        torch.nn.init.normal_(layer.weight)
        outputs.append(layer(x))
    assert torch.equal(outputs[0], outputs[1])
