"""The fused optimizer step (megafp8.optim.fused_adamw: Triton kernels, a fixed number of launches per bucket shard)
against its torch twin (the slab path): the kernels equal their twins bit for bit on plain tensors (with and
without clipping and decay, a skipped step keeping every value); the optimizer's Triton path equals the twin's
master weights, moments, published weights and grad norms bit for bit over several steps (DP=1 and several
buckets, a non-finite step skipped on both); and one step's aten ops and kernel launches are the same at two
widths (16x the parameters), with no host read. Under TRITON_INTERPRET=1 (tests/conftest.py) on CPU."""
import os

import pytest
import torch

from optim_testing import build, make_ddp, tiny_config, train_step
from test_optim_op_count import counted_warm_step
from megafp8.optim import DistributedOptimizer, fused_adamw
from megafp8.parallel.parallel_state import ParallelState

# The optimizer-level tests build CPU models: they run where Triton interprets (tests/conftest.py on CPU machines).
interpreted = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1",
                                 reason="CPU storage: the Triton kernels run here only under TRITON_INTERPRET=1")
# The kernels themselves run on a GPU too, against the CPU twin's bits (tools/bench/gpu_check.sh's tests step).
KERNEL_DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _plain_states(n, seed):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(n, generator=g), torch.randn(n, generator=g) * 1e-2, torch.rand(n, generator=g) * 1e-4]


@pytest.mark.parametrize("clip", [None, 0.37], ids=["noclip", "clip"])
@pytest.mark.parametrize("finite", [True, False], ids=["update", "skipped"])
@pytest.mark.parametrize("grad_dtype", [torch.float32, torch.bfloat16])
def test_kernels_equal_their_twins(clip, finite, grad_dtype):
    n, total = 128 * 700, 128 * 712
    grads = (torch.randn(total, generator=torch.Generator().manual_seed(1)) * 1e-2).to(grad_dtype)
    twin, fused = _plain_states(total, 2), _plain_states(total, 2)
    before = [t.clone() for t in twin]
    decay = torch.rand(total // 128, generator=torch.Generator().manual_seed(3)) > 0.5
    kw = dict(group_decay=decay, clip=None if clip is None else torch.tensor(clip), finite=torch.tensor(finite),
              step_size=torch.tensor(-1e-3 / 0.1), bias_correction2_sqrt=torch.tensor(0.0316),
              decay_factor=1 - 1e-3 * 0.1, beta1=0.9, beta2=0.999, eps=1e-8)
    fused_adamw.adamw_fp32_torch(grads, 256, *twin, 384, n, **kw)
    on = lambda t: t.to(KERNEL_DEVICE) if isinstance(t, torch.Tensor) else t  # noqa: E731
    fused = [on(t) for t in fused]
    fused_adamw.adamw_fp32_triton(on(grads), 256, *fused, 384, n, **{k: on(v) for k, v in kw.items()})
    fused = [t.cpu() for t in fused]
    for a, b, old in zip(twin, fused, before):
        assert torch.equal(a, b)
        assert torch.equal(a, old) != finite
        assert torch.equal(a[:384], old[:384]) and torch.equal(a[384 + n:], old[384 + n:])  # only its range
    squares_twin, squares = (torch.full((800,), -1.0, dtype=torch.float64) for _ in range(2))
    fused_adamw.grad_group_squares_torch(grads, 128, squares_twin, 5, n)
    squares = squares.to(KERNEL_DEVICE)
    fused_adamw.grad_group_squares_triton(on(grads), 128, squares, 5, n)
    squares = squares.cpu()
    assert torch.equal(squares_twin, squares) and (squares[5:705] >= 0).all() and (squares[705:] == -1).all()


def test_twin_lerp_and_addcmul_are_fused_multiply_adds():
    """The kernel's formulas for torch.lerp and addcmul (fma) and sqrt (IEEE) are torch's bits on this CPU."""
    g, m = torch.randn(1 << 16) * 1e-3, torch.randn(1 << 16) * 1e-3
    v = torch.rand(1 << 16) * 1e-6
    fma = lambda a, b, c: (a.double() * b.double() + c.double()).float()  # noqa: E731 (exact product, one rounding but rare double rounding)
    assert torch.equal(torch.lerp(m, g, 0.1), fma(torch.tensor(0.1), g - m, m))
    assert torch.equal((v * 0.999).addcmul_(g, g, value=0.001), fma(torch.tensor(0.001) * g, g, v * 0.999))
    assert torch.equal(fused_adamw.sqrt_rn(v), torch.from_numpy(v.numpy() ** 0.5))


def _run(fused: bool, hidden=32, steps=4, poison_step=2, clip=1.0, weight_decay=0.1, bucket_size=None):
    ps = ParallelState().init_process_groups()
    cfg = tiny_config(hidden_size=hidden, ffn_hidden_size=4 * hidden)
    ddp = make_ddp(build(cfg, ps), ps, use_distributed_optimizer=True, bucket_size=bucket_size)
    opt = DistributedOptimizer(ddp, weight_decay=weight_decay, clip_grad=clip, fused_step=fused)
    assert opt.fused_step == fused
    norms = []
    for step in range(steps):
        def poison():
            ddp.buckets[-1].grad_data[5] = float("inf")
        result, _ = train_step(ddp, opt, cfg, step, 1e-2, before_step=poison if step == poison_step else None)
        assert result.skipped == (step == poison_step)
        norms.append(result.grad_norm_tensor.clone())
    ddp.finish_param_sync()
    return opt, ddp, norms


@interpreted
@pytest.mark.parametrize("clip, weight_decay, bucket_size", [(1.0, 0.1, None), (0.01, 0.0, 3000)],
                         ids=["clip-decay", "tight-clip-buckets"])
def test_fused_step_equals_the_twin(clip, weight_decay, bucket_size):
    (twin, twin_ddp, twin_norms), (fused, fused_ddp, fused_norms) = (
        _run(f, clip=clip, weight_decay=weight_decay, bucket_size=bucket_size) for f in (False, True))
    assert len(fused._shards) == len(twin._shards) >= (2 if bucket_size else 1)
    assert all(torch.equal(a, b) for a, b in zip(twin_norms, fused_norms)), (twin_norms, fused_norms)
    assert fused.step_count == twin.step_count == 3 and fused.skipped_steps == 1
    for a, b in zip(twin.state_tensors(), fused.state_tensors()):
        assert torch.equal(a, b)
    for (name, a), b in zip(twin_ddp.module.state_dict().items(), fused_ddp.module.state_dict().values()):
        assert torch.equal(a, b), name


@interpreted
def test_selection(monkeypatch):
    ps = ParallelState().init_process_groups()
    cfg = tiny_config()
    ddp = make_ddp(build(cfg, ps), ps, use_distributed_optimizer=True)
    monkeypatch.delenv("MEGAFP8_FUSED_OPTIMIZER", raising=False)
    assert not DistributedOptimizer(ddp).fused_step  # CPU storage: the twin
    monkeypatch.setenv("MEGAFP8_FUSED_OPTIMIZER", "1")
    assert DistributedOptimizer(ddp).fused_step
    assert not DistributedOptimizer(ddp, master_weight_dtype="fp16", optimizer_state_dtype="fp8").fused_step
    with pytest.raises(ValueError, match="fp32"):
        DistributedOptimizer(ddp, optimizer_state_dtype="bf16", fused_step=True)


class _Launches:
    """Counts the fused kernels' launches (wrapping the module's launchers)."""

    def __init__(self, monkeypatch):
        self.count = 0
        for name in ("adamw_fp32_triton", "grad_group_squares_triton"):
            launcher = getattr(fused_adamw, name)

            def counted(*args, _launcher=launcher, **kwargs):
                self.count += 1
                return _launcher(*args, **kwargs)

            monkeypatch.setattr(fused_adamw, name, counted)


def fused_step_cost(hidden: int, monkeypatch, poison: bool = False, num_layers: int = 2) -> tuple[int, int, int, int]:
    """(aten ops, host reads, kernel launches) of one warm fused step, and the parameter count."""
    launches = []  # counted from the warm step on
    count, params = counted_warm_step(hidden, poison, num_layers, fused_step=True,
                                      after_warmup=lambda: launches.append(_Launches(monkeypatch)))
    return count.ops, count.host_reads, launches[0].count, params


@interpreted
@pytest.mark.parametrize("poison", [False, True], ids=["update", "skipped"])
def test_fused_step_cost_does_not_grow_with_the_parameter_count(monkeypatch, poison):
    small = fused_step_cost(64, monkeypatch, poison)
    large = fused_step_cost(256, monkeypatch, poison)
    assert large[3] > 10 * small[3]
    assert small[:3] == large[:3], (small, large)
    assert small[1] == 0 and small[2] == 2  # one bucket: two launches


@interpreted
@pytest.mark.slow
def test_fused_step_cost_at_26m_parameters(monkeypatch):
    """2.2M vs 34M parameters on one rank (1 vs 9 slabs for the twin: 82 vs 492 ops): the same ops and launches."""
    small = fused_step_cost(256, monkeypatch)
    large = fused_step_cost(1024, monkeypatch)
    assert small[3] < 2_500_000 and large[3] > 26_000_000
    assert small[:3] == large[:3], (small, large)
