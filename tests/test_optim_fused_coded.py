"""The coded presets' fused step (megafp8.optim.fused_adamw_coded) piece by piece and at DP=2: its E4M3 and fp16
roundings equal torch's casts and the twin's stochastic rounding on the hard values (every E4M3 tie and boundary,
zeros, fp16's range ends and subnormals, flat indices past 2^32), its fp64 log2/exp2 equal the torch versions bit for
bit and are accurate to ~1e-11, the fp16 master's publication writes the slab decode's bits in fp32, bf16 and fp16,
and the optimizer's fused step equals its twin bit for bit with two learning rates and at DP=2 (gloo). Under TRITON_INTERPRET=1 on CPU (tests/conftest.py); the pieces also run on a GPU."""
import math
import os

import numpy as np
import pytest
import torch
import triton
import triton.language as tl

from distributed_testing import run_distributed
from optim_testing import build, make_ddp, tiny_config, train_step
from test_optim_fused_step import KERNEL_DEVICE, PRESETS, assert_same_bits, bits, interpreted
from megafp8.optim import DistributedOptimizer, reproducible_math, reproducible_math_triton
from megafp8.optim.fused_adamw_coded import publish_fp16_master_triton
from megafp8.optim.fused_adamw_coded_triton import _counter_uniform, _e4m3_bits, _stochastic_round_to_fp16
from megafp8.optim.state_codec import GROUP
from megafp8.optim.stochastic_rounding import counter_uniform_at, stochastic_round_to_fp16
from megafp8.parallel.parallel_state import ParallelState


@triton.jit
def _e4m3_kernel(y_ptr, out_ptr, n, BLOCK: tl.constexpr):
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    tl.store(out_ptr + i, _e4m3_bits(tl.load(y_ptr + i, mask=i < n, other=0.0)), mask=i < n)


@triton.jit
def _rounding_kernel(x_ptr, key_ptr, index_ptr, uniform_ptr, out_ptr, n, BLOCK: tl.constexpr):
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    inside = i < n
    uniform = _counter_uniform(tl.load(key_ptr + i, mask=inside, other=0), tl.load(index_ptr + i, mask=inside, other=0))
    tl.store(uniform_ptr + i, uniform, mask=inside)
    tl.store(out_ptr + i, _stochastic_round_to_fp16(tl.load(x_ptr + i, mask=inside, other=0.0), uniform), mask=inside)


@triton.jit
def _log_exp_kernel(x_ptr, t_ptr, log_ptr, exp_ptr, consts_ptr, n, BLOCK: tl.constexpr):
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    inside = i < n
    log = reproducible_math_triton.log2_fp64(tl.load(x_ptr + i, mask=inside, other=1.0), consts_ptr)
    tl.store(log_ptr + i, log, mask=inside)
    exp = reproducible_math_triton.exp2_fp64(tl.load(t_ptr + i, mask=inside, other=0.0), consts_ptr)
    tl.store(exp_ptr + i, exp, mask=inside)


def _launch(kernel, n, *args):
    """On KERNEL_DEVICE, as the optimizer launches: without FMA contraction (the twins round every product)."""
    block = 1024 if KERNEL_DEVICE == "cuda" else 1 << 14
    kernel[(triton.cdiv(n, block),)](*[a.to(KERNEL_DEVICE) if isinstance(a, torch.Tensor) else a for a in args], n,
                                     BLOCK=block, enable_fp_fusion=False)


def test_e4m3_rounding_equals_torchs_cast():
    """Every E4M3 value, the midpoints between neighbours (ties to even) and the fp32 values either side of them,
    subnormals included, both signs: the kernel's integer rounding is torch's fp32 -> float8_e4m3fn cast."""
    grid = torch.arange(127, dtype=torch.uint8).view(torch.float8_e4m3fn).float()  # 0 .. 448
    midpoints = (grid[:-1] + grid[1:]) / 2
    points = torch.cat([grid, midpoints])
    around = torch.cat([points, torch.nextafter(points, points + 1), torch.nextafter(points, points - 1)])
    y = torch.cat([around, -around, torch.rand(1 << 16, generator=torch.Generator().manual_seed(0)) * 896 - 448])
    y = y.clamp(-448, 448)
    out = torch.empty(y.numel(), dtype=torch.uint8, device=KERNEL_DEVICE)
    _launch(_e4m3_kernel, y.numel(), y, out)
    expected = y.to(torch.float8_e4m3fn).view(torch.uint8)
    assert torch.equal(out.cpu(), expected), y[out.cpu() != expected][:8]


def test_fp16_stochastic_rounding_equals_the_twin():
    """The kernel's counter-based uniforms and fp16 stochastic rounding (nextafter on the bits) give the twin's bits:
    zeros of both signs, fp16's largest values and beyond, subnormals, values on and between the fp16 grid, inf and
    NaN, with keys and flat indices up to 2^40."""
    g = torch.Generator().manual_seed(0)
    special = torch.tensor([0.0, -0.0, 65504.0, -65504.0, 65519.0, 70000.0, -1e9, 2.0 ** -24, -(2.0 ** -24), 2.0 ** -25,
                            3 * 2.0 ** -26, 1e-30, 1.0, -1.0, 1.0 + 2.0 ** -12, -(1.0 + 2.0 ** -12), math.inf,
                            -math.inf, math.nan])
    binades = torch.randint(-26, 17, (1 << 16,), generator=g)
    x = torch.cat([special.repeat(64), torch.randn(1 << 16, generator=g) * torch.exp2(binades.float())])
    key = torch.randint(0, 1 << 32, (x.numel(),), generator=g)
    index = torch.randint(0, 1 << 40, (x.numel(),), generator=g)
    uniform = torch.empty(x.numel(), device=KERNEL_DEVICE)
    out = torch.empty(x.numel(), dtype=torch.float16, device=KERNEL_DEVICE)
    _launch(_rounding_kernel, x.numel(), x, key, index, uniform, out)
    twin_uniform = counter_uniform_at(key, index)
    assert torch.equal(bits(uniform.cpu()), bits(twin_uniform))
    twin = stochastic_round_to_fp16(x, twin_uniform)
    nan = twin.isnan()
    assert torch.equal(out.cpu().isnan(), nan)  # a NaN's payload is the device's own
    assert torch.equal(bits(out.cpu())[~nan], bits(twin)[~nan])
    assert 0.2 < float((twin.float() > x).float()[~nan & (x.abs() < 1)].mean()) < 0.8  # rounding goes both ways


def test_reproducible_log2_exp2():
    """Triton's log2/exp2 (interpreted, or compiled without FMA contraction) are the torch versions' bits, and both
    are within 2e-11 of numpy's fp64 log2/exp2 (relative, or absolute for log2 near 0)."""
    g = torch.Generator().manual_seed(0)
    x = torch.exp2(torch.rand(1 << 16, generator=g, dtype=torch.float64) * 560 - 280)
    t = torch.rand(1 << 16, generator=g, dtype=torch.float64) * 2045 - 1022
    x[:4], t[:4] = torch.tensor([1.0, 2.0, 0.5, 448.0]), torch.tensor([0.0, -1.0, -1022.0, 1023.0])
    log, exp = (torch.empty(1 << 16, dtype=torch.float64, device=KERNEL_DEVICE) for _ in range(2))
    _launch(_log_exp_kernel, x.numel(), x, t, log, exp, reproducible_math.constants(KERNEL_DEVICE))
    assert torch.equal(bits(log.cpu()), bits(reproducible_math.log2_(x.clone())))
    assert torch.equal(bits(exp.cpu()), bits(reproducible_math.exp2_(t.clone())))
    assert torch.equal(exp[:4].cpu(), torch.tensor([1.0, 0.5, 2.0 ** -1022, 2.0 ** 1023], dtype=torch.float64))
    assert torch.equal(log[:3].cpu(), torch.tensor([0.0, 1.0, -1.0], dtype=torch.float64))  # exact on powers of two
    exact_log, exact_exp = torch.from_numpy(np.log2(x.numpy())), torch.from_numpy(np.exp2(t.numpy()))
    assert float(((log.cpu() - exact_log).abs() / exact_log.abs().clamp(min=1)).max()) < 2e-11
    assert float(((exp.cpu() - exact_exp).abs() / exact_exp).max()) < 2e-11


def test_reproducible_sqrt_is_ieees_correctly_rounded_root():
    """The grad norm's square root: math.sqrt's (IEEE, correctly rounded) bits over 30 decades and the grad norm that
    differed between machines, where torch's CPU sqrt may be one last bit off; 0, inf and NaN pass through."""
    g = torch.Generator().manual_seed(0)
    x = torch.exp2(torch.rand(1 << 16, generator=g, dtype=torch.float64) * 200 - 100)
    x[:2] = torch.tensor([float.fromhex("0x1.033833bfa9f64p+3"), 2.0], dtype=torch.float64)
    want = torch.tensor([math.sqrt(v) for v in x.tolist()], dtype=torch.float64)
    assert torch.equal(bits(reproducible_math.sqrt(x)), bits(want))
    assert reproducible_math.sqrt(x[0]).item().hex() == "0x1.6c4ee0c57b289p+1"
    special = reproducible_math.sqrt(torch.tensor([0.0, math.inf, math.nan], dtype=torch.float64))
    assert special[0] == 0 and special[1] == math.inf and math.isnan(special[2])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_fp16_master_publication_equals_the_slab_decode(dtype):
    """The fp16 master's publication kernel writes what the slab path's decode (codes / scale) and copy_ write, in
    the model's dtype (rounded to nearest even)."""
    g = torch.Generator().manual_seed(0)
    groups = 40
    codes = (torch.randn(groups * GROUP, generator=g) * 3000).to(torch.float16)
    scale = torch.exp2(torch.randint(-4, 16, (groups + 3,), generator=g).float())
    expected = torch.empty(groups * GROUP, dtype=dtype)
    expected.copy_((codes.float().view(groups, GROUP) / scale[3:, None]).view(-1))
    out = torch.full((groups * GROUP,), 7.0, dtype=dtype, device=KERNEL_DEVICE)
    publish_fp16_master_triton(codes.to(KERNEL_DEVICE), scale.to(KERNEL_DEVICE), 3, out)
    assert torch.equal(bits(out.cpu()), bits(expected))


@interpreted
def test_fused_step_with_two_learning_rates_equals_the_twin():
    """--decoupled-lr: the fused step launches once per same-LR run of each shard (the embedding and the output layer
    at their own LR); the twin takes per-group constants. The compressed preset, bit for bit."""
    runs = []
    for fused in (False, True):
        ps = ParallelState().init_process_groups()
        cfg = tiny_config()
        ddp = make_ddp(build(cfg, ps), ps, use_distributed_optimizer=True, bucket_size=2000)
        opt = DistributedOptimizer(ddp, weight_decay=0.1, clip_grad=1.0, fused_step=fused, master_weight_dtype="fp16",
                                   optimizer_state_dtype="fp8",
                                   decoupled_lr_params=("embedding.weight", "output_layer.weight"))
        assert opt._decoupled_launches is not None and len(opt._decoupled_launches) > len(opt._shards)
        norms = []
        for step in range(3):
            result, _ = train_step(ddp, _TwoLrs(opt, 8.0), cfg, step, 1e-2)
            norms.append(result.grad_norm_tensor.clone())
        ddp.finish_param_sync()
        runs.append((opt, ddp, norms))
    assert_same_bits(*runs[0], *runs[1])


class _TwoLrs:
    """The optimizer with ``step(lr)`` taking ``decoupled_lr = ratio * lr`` (train_step passes one LR)."""

    def __init__(self, opt, ratio):
        self.opt, self.ratio = opt, ratio

    def zero_grad(self):
        self.opt.zero_grad()

    def step(self, lr):
        return self.opt.step(lr, decoupled_lr=self.ratio * lr)


def _dp2_body(rank, world_size, preset):
    """Each rank runs the twin and the fused step on the same model and batches, a skipped step and clipping
    included; the DP=2 shards (uneven: buckets cut through parameters) must agree bit for bit."""
    master, states = PRESETS[preset]
    runs = []
    for fused in (False, True):
        ps = ParallelState(world_size=world_size).init_process_groups()
        cfg = tiny_config()
        ddp = make_ddp(build(cfg, ps), ps, use_distributed_optimizer=True, bucket_size=3000)
        opt = DistributedOptimizer(ddp, weight_decay=0.1, clip_grad=0.05, fused_step=fused,
                                   master_weight_dtype=master, optimizer_state_dtype=states)
        norms = []
        for step in range(4):
            def poison():
                ddp.buckets[0].grad_data[3] = float("nan")
            result, _ = train_step(ddp, opt, cfg, step, 1e-2, before_step=poison if step == 2 else None)
            assert result.skipped == (step == 2)
            norms.append(result.grad_norm_tensor.clone())
        ddp.finish_param_sync()
        runs.append((opt, ddp, norms))
    assert len(runs[1][0]._shards) >= 2
    assert_same_bits(*runs[0], *runs[1])


@interpreted
@pytest.mark.distributed
def test_fused_step_equals_the_twin_at_dp2():
    assert os.environ.get("TRITON_INTERPRET") == "1"  # the spawned ranks inherit it
    run_distributed(_dp2_body, world_size=2, args=("compressed",), timeout_s=600)
