"""TP all-reduce mappings without activation-sized copies: the layers lend their fresh buffers (reuse_input,
reuse_grad) and the all-reduce runs in them; plain calls still copy, and misuse fails loudly, never silently."""
import pytest
import torch

from distributed_testing import run_distributed
from megafp8.parallel import mappings as M
from megafp8.parallel.parallel_state import ParallelState


def _rank_tensor(rank: int, shape: tuple[int, ...]) -> torch.Tensor:
    return torch.randn(shape, generator=torch.Generator().manual_seed(200 + rank))


class _ViewOutput(torch.autograd.Function):
    """Like the FP8 linear op: returns its (fresh) result as a view, which autograd forbids modifying in place."""

    @staticmethod
    def forward(ctx, x):
        return (x * 3.0).view(-1, *x.shape[1:])

    @staticmethod
    def backward(ctx, grad):
        return grad * 3.0


def _body(rank: int, world_size: int) -> None:
    n = world_size
    tp = ParallelState(world_size=n, tensor_model_parallel_size=n).init_process_groups().tp_group
    xs = [_rank_tensor(r, (4, 2, 6)) for r in range(n)]
    gs = [_rank_tensor(10 + r, (4, 2, 6)) for r in range(n)]
    w = _rank_tensor(99, (5, 6))

    # reduce_from, lent buffer: the sum lands in the partial's own storage; grads are unchanged by it.
    for producer in (lambda x: x * 2.0, lambda x: _ViewOutput.apply(x) * (2.0 / 3.0)):
        x = xs[rank].clone().requires_grad_()
        partial = producer(x)
        y = M.reduce_from_tensor_model_parallel_region(partial, tp, reuse_input=True)
        assert y.data_ptr() == partial.data_ptr(), "no copy: the all-reduce ran in the lent buffer"
        torch.testing.assert_close(y, 2.0 * sum(xs))
        y.backward(gs[rank])
        torch.testing.assert_close(x.grad, 2.0 * gs[rank])
    x = xs[rank].clone().requires_grad_()
    y = M.reduce_from_tensor_model_parallel_region(_ViewOutput.apply(x), tp, reuse_input=True)  # view of a Function
    torch.testing.assert_close(y, 3.0 * sum(xs))

    # A lent buffer that its producer saved for backward (exp saves its output): loud error, not wrong grads.
    x = xs[rank].clone().requires_grad_()
    y = M.reduce_from_tensor_model_parallel_region(x.exp(), tp, reuse_input=True)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        y.backward(gs[rank])

    # reduce_from, plain call: the caller's tensor keeps its values.
    partial = xs[rank].clone()
    y = M.reduce_from_tensor_model_parallel_region(partial, tp)
    assert y.data_ptr() != partial.data_ptr() and torch.equal(partial, xs[rank])

    # copy_to with a GEMM consumer, lent gradient: dx = sum over ranks of g_r @ w.
    x = xs[rank].clone().requires_grad_()
    out = torch.nn.functional.linear(M.copy_to_tensor_model_parallel_region(x, tp, reuse_grad=True), w)
    out_grads = [g[..., :5] for g in gs]
    out.backward(out_grads[rank])
    torch.testing.assert_close(x.grad, sum(g @ w for g in out_grads))

    # copy_to, plain call: a gradient the caller still holds (y.backward(g)) is not overwritten.
    x = xs[rank].clone().requires_grad_()
    g = gs[rank].clone()
    M.copy_to_tensor_model_parallel_region(x, tp).backward(g)
    assert torch.equal(g, gs[rank])
    torch.testing.assert_close(x.grad, sum(gs))


@pytest.mark.distributed
def test_allreduce_mappings_reuse_lent_buffers_world2():
    run_distributed(_body, world_size=2)
