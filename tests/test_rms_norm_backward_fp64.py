"""RMSNorm's written-out backward (module, fused FP8 prologue, TP/SP weight grad) against fp64 autograd of the plain
formula: its error is at most autograd's own low-precision error."""
import pytest
import torch

from distributed_testing import run_distributed
from megafp8.fp8.prologue import RMSNormPrologue, rms_norm
from megafp8.model.norm import RMSNorm
from megafp8.parallel.parallel_state import ParallelState
from megafp8.parallel.tensor_parallel import allreduce_sequence_parallel_grads

EPS = 1e-5
DTYPES = [(torch.float32, torch.float32), (torch.bfloat16, torch.float32), (torch.bfloat16, torch.bfloat16),
          (torch.float16, torch.float16)]


def _plain(x, weight):
    """The formula as autograd sees it (transformers' LlamaRMSNorm); in fp64 for fp64 inputs."""
    xf = x if x.dtype == torch.float64 else x.float()
    return weight * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + EPS)).to(x.dtype)


def _inputs(act_dtype, weight_dtype, tokens=64, hidden=256):
    g = torch.Generator().manual_seed(0)
    x = (torch.randn(tokens, hidden, generator=g) * 3).to(act_dtype)
    weight = (1 + 0.1 * torch.randn(hidden, generator=g)).to(weight_dtype)
    grad = torch.randn(tokens, hidden, generator=g).to(act_dtype)
    return x, weight, grad


def _grads(fn, x, weight, grad):
    x, weight = x.detach().requires_grad_(), weight.detach().requires_grad_()
    fn(x, weight).backward(grad)
    return x.grad, weight.grad


def _rel(got, ref):
    """Relative RMS error: stable where a max over a few elements is one rounding's luck."""
    return float((got.double() - ref).norm() / ref.norm())


def _fp64(x, weight, grad):
    return _grads(_plain, x.double(), weight.double(), grad.double())


@pytest.mark.parametrize("act_dtype,weight_dtype", DTYPES)
def test_module_backward_at_least_as_accurate_as_autograd(act_dtype, weight_dtype):
    x, weight, grad = _inputs(act_dtype, weight_dtype)
    ref_dx, ref_dw = _fp64(x, weight, grad)
    auto_dx, auto_dw = _grads(_plain, x, weight, grad)
    dx, dw = _grads(lambda a, w: rms_norm(a, w, EPS), x, weight, grad)
    assert dx.dtype == act_dtype and dw.dtype == weight_dtype
    # 2% slack: one rounding more or less in a reduction order; the measured errors are in the commit message.
    assert _rel(dx, ref_dx) <= 1.02 * _rel(auto_dx, ref_dx), (_rel(dx, ref_dx), _rel(auto_dx, ref_dx))
    assert _rel(dw, ref_dw) <= 1.02 * _rel(auto_dw, ref_dw), (_rel(dw, ref_dw), _rel(auto_dw, ref_dw))
    if act_dtype == torch.float32:
        assert _rel(dx, ref_dx) < 1e-6 and _rel(dw, ref_dw) < 1e-6


@pytest.mark.parametrize("act_dtype,weight_dtype", DTYPES)
def test_fused_prologue_backward_is_the_module_backward(act_dtype, weight_dtype):
    """The FP8 linear's fused RMSNorm prologue runs its backward from its own saved rstd: the module's bits."""
    x, weight, grad = _inputs(act_dtype, weight_dtype)
    prologue = RMSNormPrologue(weight, EPS)
    _, (rstd,) = prologue.forward(x, weight)
    dx, dw = prologue.backward(grad, (True, True), x, weight, rstd)
    module_dx, module_dw = _grads(lambda a, w: rms_norm(a, w, EPS), x, weight, grad)
    assert torch.equal(dx, module_dx) and torch.equal(dw, module_dw)


def _sequence_parallel_body(rank, world_size):
    """Each TP rank normalizes its sequence chunk; the weight grad summed over TP is within fp32 rounding of the
    fp64 grad of the whole sequence, as accurate as the single-process one."""
    ps = ParallelState(world_size=world_size, tensor_model_parallel_size=world_size,
                       sequence_parallel=True).init_process_groups()
    x, weight, grad = _inputs(torch.float32, torch.float32)
    norm = RMSNorm(weight.numel(), EPS, sequence_parallel=True)
    norm.weight.data.copy_(weight)
    chunk = x.shape[0] // world_size
    rows = slice(rank * chunk, (rank + 1) * chunk)
    norm(x[rows]).backward(grad[rows])
    allreduce_sequence_parallel_grads(norm, ps)
    _, ref_dw = _fp64(x, weight, grad)
    _, single_dw = _grads(lambda a, w: rms_norm(a, w, EPS), x, weight, grad)
    assert _rel(norm.weight.grad, ref_dw) < 1e-6, _rel(norm.weight.grad, ref_dw)
    assert _rel(norm.weight.grad, ref_dw) <= 2 * _rel(single_dw, ref_dw) + 1e-8


@pytest.mark.distributed
def test_sequence_parallel_weight_grad_matches_fp64():
    run_distributed(_sequence_parallel_body, world_size=2, timeout_s=300)
