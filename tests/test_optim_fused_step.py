"""The fused optimizer step (Triton kernels, a fixed number of launches per bucket shard: megafp8.optim.fused_adamw for
fp32 master + fp32 moments, megafp8.optim.fused_adamw_coded for every other preset) against its torch twin (the slab
path, megafp8.optim.storage_update): the kernels equal their twins bit for bit on plain tensors (with and without
clipping and decay, a skipped step keeping every value), for every preset; the optimizer's Triton path equals the
twin's master weights, moments, scales, published weights and grad norms bit for bit over several steps (DP=1 and
several buckets, a non-finite step skipped on both, a step large enough to move the fp16 scales); and one step's aten
ops and kernel launches (2 per bucket shard, 3 with an fp16 master: its publication) are the same at two widths (16x
the parameters), with no host read. Under TRITON_INTERPRET=1
(tests/conftest.py) on CPU; test_kernels_equal_their_twins also on a GPU (tools/bench/gpu_check.sh's tests step)."""
import os

import pytest
import torch

from optim_testing import build, make_ddp, tiny_config, train_step
from test_optim_op_count import counted_warm_step
from megafp8.optim import DistributedOptimizer, fused_adamw, fused_adamw_coded
from megafp8.optim.state_codec import GROUP, PlainCodec, make_state_codec
from megafp8.optim.stochastic_rounding import rounding_keys
from megafp8.optim.storage_update import Fp16Master, adamw_update
from megafp8.parallel.parallel_state import ParallelState

# The optimizer-level tests build CPU models: they run where Triton interprets (tests/conftest.py on CPU machines).
interpreted = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1",
                                 reason="CPU storage: the Triton kernels run here only under TRITON_INTERPRET=1")
# The kernels themselves run on a GPU too, against the CPU twin's bits (tools/bench/gpu_check.sh's tests step).
KERNEL_DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
# --master-weight-dtype x --optimizer-state-dtype: every combination has a fused kernel.
PRESETS = {"fp32": ("fp32", "fp32"), "compressed": ("fp16", "fp8"), "fp16-bf16": ("fp16", "bf16"),
           "fp16-fp32": ("fp16", "fp32"), "fp32-fp8": ("fp32", "fp8"), "fp32-bf16": ("fp32", "bf16")}


def bits(t: torch.Tensor) -> torch.Tensor:
    """The stored bits (torch.equal on values calls -0.0 and 0.0 equal and cannot compare float8)."""
    return t.view({1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()])


def _plain_states(n, seed):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(n, generator=g), torch.randn(n, generator=g) * 1e-2, torch.rand(n, generator=g) * 1e-4]


def _kernel_cases():
    every = [(clip, finite, dtype) for clip in (None, 0.37) for finite in (True, False)
             for dtype in (torch.float32, torch.bfloat16)]
    for preset in PRESETS:  # every case for the two documented presets, two each for the others (interpreter time)
        cases = every if preset in ("fp32", "compressed") else [every[0], every[-1]]
        for clip, finite, dtype in cases:
            yield pytest.param(preset, clip, finite, dtype, id=f"{preset}-{'clip' if clip else 'noclip'}-"
                               f"{'update' if finite else 'skipped'}-{str(dtype).removeprefix('torch.')}")


@pytest.mark.parametrize("preset, clip, finite, grad_dtype", list(_kernel_cases()))
def test_kernels_equal_their_twins(preset, clip, finite, grad_dtype):
    if preset == "fp32":
        _fp32_kernels_equal_their_twins(clip, finite, grad_dtype)
    else:
        _coded_kernel_equals_its_twin(*PRESETS[preset], clip, finite, grad_dtype)


def _fp32_kernels_equal_their_twins(clip, finite, grad_dtype):
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


def _coded_states(master: str, states: str, total: int, seed: int, device="cpu"):
    """fp16 master codes (a power-of-two scale per group, some zeros) or fp32 values, and Adam-like moments: groups
    of very different magnitudes, some spanning 30 binades (FP8 k < 1), some all zero, isolated zeros. Made on the
    CPU, then moved to ``device``."""
    g = torch.Generator().manual_seed(seed)
    groups = total // GROUP
    values = torch.randn(total, generator=g)
    scale = torch.exp2(torch.randint(8, 13, (groups,), generator=g).float())
    master = PlainCodec(total, dtype=torch.float16 if master == "fp16" else torch.float32)
    master.values.copy_(values * scale.repeat_interleave(GROUP) if master.name == "fp16" else values)
    magnitude = torch.exp2(torch.randint(-40, 0, (groups, 1), generator=g).float())
    wide = torch.exp2(torch.rand(groups, GROUP, generator=g) * 30 - 30) * (torch.arange(groups) % 3 == 0)[:, None]
    m = (torch.randn(groups, GROUP, generator=g) * magnitude * torch.where(wide > 0, wide, 1.0)).view(-1)
    m[GROUP:2 * GROUP] = 0.0
    m[::97] = 0.0
    moments = [make_state_codec(states, total) for _ in range(2)]
    moments[0].encode(0, total, m)
    moments[1].encode(0, total, m * m * 10)
    for codec in (master, *moments):
        for name, t in codec.tensors().items():
            setattr(codec, name, t.to(device))
    return [master, *moments], scale


def _coded_kernel_equals_its_twin(master, states, clip, finite, grad_dtype):
    n, total, start, grad_lo = GROUP * 300, GROUP * 312, 3 * GROUP, 256
    grads = (torch.randn(total, generator=torch.Generator().manual_seed(1)) * 1e-2).to(grad_dtype)
    grads[start + 5 * GROUP:start + 6 * GROUP] = 0.0  # a group whose moments decay only
    groups = total // GROUP
    twin, scale = _coded_states(master, states, total, 2)
    fused, _ = _coded_states(master, states, total, 2, KERNEL_DEVICE)
    before = [bits(t).clone() for c in twin for t in c.tensors().values()]
    decay = torch.rand(groups, generator=torch.Generator().manual_seed(3)) > 0.5

    def fp16_tables(device):  # keys of 3 parameters at step 5; flat indices beyond 2^32 for some groups
        if master != "fp16":
            return None
        offsets = torch.where(torch.arange(groups) % 2 == 0, 7 * GROUP, (1 << 33) + 11 * GROUP)
        keys = rounding_keys(7, torch.tensor(5), torch.arange(groups) % 3 + 11)
        group_amax = torch.full((groups,), -1.0, device=device)
        return Fp16Master(scale.to(device), keys.to(device), offsets.to(device), group_amax)

    kw = dict(group_decay=decay, decay_factor=1 - 1e-3 * 0.1, clip=None if clip is None else torch.tensor(clip),
              finite=torch.tensor(finite), step_size=torch.tensor(-1e-3 / 0.1),
              bias_correction2_sqrt=torch.tensor(0.0316), beta1=0.9, beta2=0.999, eps=1e-8)
    twin_tables, fused_tables = fp16_tables("cpu"), fp16_tables(KERNEL_DEVICE)
    adamw_update([grads[grad_lo:grad_lo + n]], start, n, *twin, fp16=twin_tables, **kw)
    on = lambda t: t.to(KERNEL_DEVICE) if isinstance(t, torch.Tensor) else t  # noqa: E731
    fused_adamw_coded.adamw_coded_triton(on(grads), grad_lo, start, n, fused_adamw_coded.coded_storage(*fused),
                                         fp16=fused_tables, **{k: on(v) for k, v in kw.items()})
    after = [(name, bits(t)) for c in twin for name, t in c.tensors().items()]
    for (name, a), b, old in zip(after, (bits(t).cpu() for c in fused for t in c.tensors().values()), before):
        assert torch.equal(a, b), (name, int((a != b).sum()))
        per_group = a.numel() != total
        lo, hi = (start // GROUP, (start + n) // GROUP) if per_group else (start, start + n)
        assert torch.equal(a[:lo], old[:lo]) and torch.equal(a[hi:], old[hi:]), name  # only its range
        assert torch.equal(a[lo:hi], old[lo:hi]) != finite, name  # a skipped step keeps every stored value
    if twin_tables is not None:
        assert torch.equal(twin_tables.group_amax, fused_tables.group_amax.cpu())


def test_twin_lerp_and_addcmul_are_fused_multiply_adds():
    """The kernel's formulas for torch.lerp and addcmul (fma) and sqrt (IEEE) are torch's bits on this CPU."""
    g, m = torch.randn(1 << 16) * 1e-3, torch.randn(1 << 16) * 1e-3
    v = torch.rand(1 << 16) * 1e-6
    fma = lambda a, b, c: (a.double() * b.double() + c.double()).float()  # noqa: E731 (exact product, one rounding but rare double rounding)
    assert torch.equal(torch.lerp(m, g, 0.1), fma(torch.tensor(0.1), g - m, m))
    assert torch.equal((v * 0.999).addcmul_(g, g, value=0.001), fma(torch.tensor(0.001) * g, g, v * 0.999))
    assert torch.equal(fused_adamw.sqrt_rn(v), torch.from_numpy(v.numpy() ** 0.5))


def _run(fused: bool, preset="fp32", hidden=32, steps=4, poison_step=2, clip=1.0, weight_decay=0.1, bucket_size=None,
         lrs=(1e-2,)):
    """``steps`` training steps (the one at ``poison_step`` with an inf grad, skipped), the learning rates cycling
    through ``lrs``; the optimizer (its first master scales in ``opt.scales0``), its DDP and the grad norms."""
    ps = ParallelState().init_process_groups()
    cfg = tiny_config(hidden_size=hidden, ffn_hidden_size=4 * hidden)
    ddp = make_ddp(build(cfg, ps), ps, use_distributed_optimizer=True, bucket_size=bucket_size)
    master, states = PRESETS[preset]
    opt = DistributedOptimizer(ddp, weight_decay=weight_decay, clip_grad=clip, fused_step=fused,
                               master_weight_dtype=master, optimizer_state_dtype=states)
    assert opt.fused_step == fused
    opt.scales0 = opt.master_scale.clone()
    norms = []
    for step in range(steps):
        def poison():
            ddp.buckets[-1].grad_data[5] = float("inf")
        result, _ = train_step(ddp, opt, cfg, step, lrs[step % len(lrs)],
                               before_step=poison if step == poison_step else None)
        assert result.skipped == (step == poison_step)
        norms.append(result.grad_norm_tensor.clone())
    ddp.finish_param_sync()
    return opt, ddp, norms


def assert_same_bits(twin, twin_ddp, twin_norms, fused, fused_ddp, fused_norms):
    """Grad norms, counters, every stored tensor (master, scales, moments) and the published weights, bit for bit."""
    assert len(fused._shards) == len(twin._shards)
    assert all(torch.equal(bits(a), bits(b)) for a, b in zip(twin_norms, fused_norms)), (twin_norms, fused_norms)
    assert (fused.step_count, fused.skipped_steps) == (twin.step_count, twin.skipped_steps)
    for a, b in zip(twin.state_tensors(), fused.state_tensors()):
        assert torch.equal(bits(a), bits(b)), int((bits(a) != bits(b)).sum())
    for (name, a), b in zip(twin_ddp.module.state_dict().items(), fused_ddp.module.state_dict().values()):
        assert torch.equal(bits(a), bits(b)), name


@interpreted
@pytest.mark.parametrize("preset, clip, weight_decay, bucket_size, lrs", [
    ("fp32", 1.0, 0.1, None, (1e-2,)), ("fp32", 0.01, 0.0, 3000, (1e-2,)),
    ("compressed", 1.0, 0.1, None, (1e-2,)), ("compressed", 0.01, 0.0, 3000, (1e-2,)),
    ("compressed", 0.0, 0.1, 3000, (1e-2, 1.0)), ("fp16-bf16", 1.0, 0.1, 3000, (1e-2,)),
    ("fp32-fp8", 1.0, 0.1, 3000, (1e-2,))],
    ids=["fp32-clip-decay", "fp32-tight-clip-buckets", "compressed-clip-decay", "compressed-tight-clip-buckets",
         "compressed-scales-move", "fp16-bf16", "fp32-fp8"])
def test_fused_step_equals_the_twin(preset, clip, weight_decay, bucket_size, lrs):
    (twin, twin_ddp, twin_norms), (fused, fused_ddp, fused_norms) = (
        _run(f, preset, clip=clip, weight_decay=weight_decay, bucket_size=bucket_size, lrs=lrs) for f in (False, True))
    assert len(fused._shards) >= (2 if bucket_size else 1)
    assert fused.step_count == 3 and fused.skipped_steps == 1
    if len(lrs) > 1:  # lr 1 grows every weight: the power-of-two scales must have moved (on both paths alike)
        assert (fused.master_scale != fused.scales0).any()
    assert_same_bits(twin, twin_ddp, twin_norms, fused, fused_ddp, fused_norms)


@interpreted
def test_selection(monkeypatch):
    ps = ParallelState().init_process_groups()
    cfg = tiny_config()
    ddp = make_ddp(build(cfg, ps), ps, use_distributed_optimizer=True)
    monkeypatch.delenv("MEGAFP8_FUSED_OPTIMIZER", raising=False)
    assert not DistributedOptimizer(ddp).fused_step  # CPU storage: the twin
    assert not DistributedOptimizer(ddp, master_weight_dtype="fp16", optimizer_state_dtype="fp8").fused_step
    monkeypatch.setenv("MEGAFP8_FUSED_OPTIMIZER", "1")
    for master, states in PRESETS.values():  # every preset has a kernel
        assert DistributedOptimizer(ddp, master_weight_dtype=master, optimizer_state_dtype=states).fused_step
    monkeypatch.setenv("MEGAFP8_FUSED_OPTIMIZER", "0")
    assert not DistributedOptimizer(ddp, master_weight_dtype="fp16", optimizer_state_dtype="fp8").fused_step
    assert DistributedOptimizer(ddp, optimizer_state_dtype="bf16", fused_step=True).fused_step


class _Launches:
    """Counts the fused kernels' launches (wrapping the modules' launchers)."""

    def __init__(self, monkeypatch):
        self.count = 0
        for module, name in ((fused_adamw, "adamw_fp32_triton"), (fused_adamw, "grad_group_squares_triton"),
                             (fused_adamw_coded, "adamw_coded_triton"),
                             (fused_adamw_coded, "publish_fp16_master_triton")):
            launcher = getattr(module, name)

            def counted(*args, _launcher=launcher, **kwargs):
                self.count += 1
                return _launcher(*args, **kwargs)

            monkeypatch.setattr(module, name, counted)


def fused_step_cost(hidden: int, monkeypatch, poison: bool = False, num_layers: int = 2,
                    preset: str = "fp32") -> tuple[int, int, int, int]:
    """(aten ops, host reads, kernel launches) of one warm fused step, and the parameter count."""
    launches = []  # counted from the warm step on
    master, states = PRESETS[preset]
    count, params = counted_warm_step(hidden, poison, num_layers, fused_step=True, master_weight_dtype=master,
                                      optimizer_state_dtype=states,
                                      after_warmup=lambda: launches.append(_Launches(monkeypatch)))
    return count.ops, count.host_reads, launches[0].count, params


@interpreted
@pytest.mark.parametrize("preset", ["fp32", "compressed"])
@pytest.mark.parametrize("poison", [False, True], ids=["update", "skipped"])
def test_fused_step_cost_does_not_grow_with_the_parameter_count(monkeypatch, poison, preset):
    small = fused_step_cost(64, monkeypatch, poison, preset=preset)
    large = fused_step_cost(256, monkeypatch, poison, preset=preset)
    assert large[3] > 10 * small[3]
    assert small[:3] == large[:3], (small, large)
    # one bucket: two launches (grad squares, update), and the fp16 master's publication
    assert small[1] == 0 and small[2] == (2 if preset == "fp32" else 3)


@interpreted
@pytest.mark.slow
@pytest.mark.parametrize("preset", ["fp32", "compressed"])
def test_fused_step_cost_at_26m_parameters(monkeypatch, preset):
    """2.2M vs 34M parameters on one rank (1 vs 9 slabs for the twin: 82 vs 492 ops with fp32 states, 574 vs 3,404
    compressed): the same ops and launches on the fused path."""
    small = fused_step_cost(256, monkeypatch, preset=preset)
    large = fused_step_cost(1024, monkeypatch, preset=preset)
    assert small[3] < 2_500_000 and large[3] > 26_000_000
    assert small[:3] == large[:3], (small, large)


@interpreted
@pytest.mark.slow
def test_fused_step_cost_above_100m_parameters(monkeypatch):
    """2.2M vs ~101M parameters on one rank (the twin: 1 vs ~25 slabs): the same ops and launches on the fused path."""
    small = fused_step_cost(256, monkeypatch)
    large = fused_step_cost(2048, monkeypatch)
    assert large[3] > 100_000_000
    assert small[:3] == large[:3], (small, large)
