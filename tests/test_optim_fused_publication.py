"""--fp8-param-gather's fused publication (megafp8.optim.fused_fp8_publication: an amax launch and a cast launch per
publish) against its torch twin (megafp8.optim.fp8_publication's slab path). Piece by piece: the cast gives
cast_to_fp8's bits for E4M3 and E5M2 side by side on the hard values (every grid value, ties, subnormals, past the
range, inf, NaN, -0); the group amaxes equal a scatter MAX over each element's scaling group (element_groups) for
rowwise, blockwise and tensorwise weights of awkward shapes and a fragment starting mid-weight, with one atomic source
per run of equal slots in a 128-group (exactly one per 128 elements for weights whose rows are multiples of 128).
Whole: an optimizer on the fused step publishes the twin's fp8_data bytes, scale_inv and observed amaxes bit for bit
for every weight recipe (delayed cold and warm, tensorwise, rowwise, blockwise), both master presets, weights in E4M3
and E5M2 at once, and at DP=2 (gloo); one warm step's aten ops (the interpreter's own copies around each launch left
out: a GPU launch dispatches none) are equal at two widths and at 2 vs 4 layers but for the DDP's 4 view ops per FP8
weight, and the publication is 2 launches. Under TRITON_INTERPRET=1 on CPU (tests/conftest.py)."""
from __future__ import annotations

import contextlib
import os
from dataclasses import dataclass

import pytest
import torch

from distributed_testing import run_distributed
from optim_testing import build, make_ddp, tiny_config, train_step
from test_optim_fp8_param_gather import RECIPES
from test_optim_fused_step import KERNEL_DEVICE, PRESETS, bits, interpreted
from megafp8.fp8 import Fp8Recipe
from megafp8.optim import DistributedOptimizer, fused_fp8_publication
from megafp8.optim.fp8_param_cast import cast_to_fp8, element_groups, group_divisors, num_scale_groups
from megafp8.optim.state_codec import GROUP
from megafp8.parallel.fp8_sequence_parallel import fp8_scaling_manager
from megafp8.parallel.parallel_state import ParallelState
from megafp8_kernels import Granularity

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2


@dataclass(frozen=True)
class _E5M2Weights(Fp8Recipe):
    """No preset quantizes weights to E5M2; this one does, so a model holds weights of both formats."""

    def dtype(self, role: str) -> torch.dtype:
        return E5M2 if role == "weight" else super().dtype(role)


# ---- the kernels on hand-built tables ------------------------------------------------------------------------
def _storage(weights, dtypes):
    """Storage tables for fragments of weights, as the optimizer lays them out: ``weights`` is a list of (shape,
    granularity, first flat index owned, FP8 dtype); each fragment starts on a group boundary, padding zero.
    Returns the kernels' arguments and, per element, its slot (the twin's element_groups) and master value."""
    g = torch.Generator().manual_seed(0)
    frag_of_group, index_offset, rows, slot_base = [], [], [], 0
    values, slots = [], []
    for k, (shape, gran, lo, dtype) in enumerate(weights):
        numel = shape[0] * shape[1] - lo
        groups = -(-numel // GROUP)
        storage_lo = len(frag_of_group) * GROUP
        frag_of_group += [k] * groups
        index_offset += [lo - storage_lo] * groups
        divisors = group_divisors(shape, gran)
        rows.append([slot_base, shape[1], *divisors, shape[0] * shape[1], dtypes.index(dtype)])
        flat = torch.arange(lo, lo + groups * GROUP)
        slot = element_groups(flat.clone(), shape[1], *divisors) + slot_base
        slots.append(torch.where(flat < shape[0] * shape[1], slot, -1))
        magnitude = torch.exp2(torch.randint(-12, 6, (numel,), generator=g).float())  # every slot its own amax
        values.append(torch.cat([torch.randn(numel, generator=g) * magnitude, torch.zeros(groups * GROUP - numel)]))
        slot_base += num_scale_groups(shape, gran)
    slots = torch.cat(slots)
    slots[slots < 0] = slot_base  # padding: the dummy slot
    rows.append([slot_base, 1, 1, 1, 1, 0, 0])
    tables = dict(master=torch.cat(values), master_scale=torch.ones(len(weights)),
                  frag_of_group=torch.tensor(frag_of_group), index_offset=torch.tensor(index_offset),
                  groups=torch.arange(len(frag_of_group)), frag_table=torch.tensor(rows), dummy_slot=slot_base)
    return {k: v.to(KERNEL_DEVICE) if isinstance(v, torch.Tensor) else v for k, v in tables.items()}, slots


def test_cast_equals_cast_to_fp8_in_both_formats():
    """Every E4M3 and E5M2 grid value, the midpoints between neighbours and the floats either side, values past
    each range, inf, NaN and -0, under scales 1 and 2^-3 + an ulp, in an E4M3 weight beside an E5M2 one."""
    hard = []
    for dtype in (E4M3, E5M2):
        grid = torch.arange(256, dtype=torch.uint8).view(dtype).float()
        grid = grid[grid.isfinite()].unique()
        points = torch.cat([grid, (grid[:-1] + grid[1:]) / 2])
        hard.append(torch.cat([points, torch.nextafter(points, points + 1), torch.nextafter(points, points - 1)]))
    extra = torch.tensor([70000.0, -1e9, 3.4e38, float("inf"), -float("inf"), float("nan"), -0.0, 1e-30])
    values = torch.cat([*hard, extra])
    values = torch.cat([values, torch.zeros(-values.numel() % GROUP)])  # whole groups: no padding lanes
    n = values.numel()  # each of the two weights (one row each) holds them all
    weights = [((1, n), Granularity.TENSORWISE, 0, E4M3), ((1, n), Granularity.TENSORWISE, 0, E5M2)]
    dtypes = [E4M3, E5M2]
    tables, _slots = _storage(weights, dtypes)
    tables["master"] = torch.cat([values, values]).to(KERNEL_DEVICE)
    scale = torch.tensor([1.0, torch.nextafter(torch.tensor(0.125), torch.tensor(1.0)).item(), 1.0])
    out = torch.full((2 * n,), 0xAA, dtype=torch.uint8, device=KERNEL_DEVICE)
    groups = n // GROUP
    fused_fp8_publication.cast_triton(
        **tables, scale=scale.to(KERNEL_DEVICE), dest_buffer=torch.zeros(2 * groups, dtype=torch.int64,
                                                                          device=KERNEL_DEVICE),
        dest_offset=torch.arange(2 * groups, device=KERNEL_DEVICE) * GROUP,
        buffer_address=torch.tensor([out.data_ptr()], device=KERNEL_DEVICE),
        formats=fused_fp8_publication.format_ids(dtypes))
    for k, dtype in enumerate(dtypes):
        expected = cast_to_fp8(values.clone(), scale[k], dtype)
        got = out[k * n:(k + 1) * n].cpu()
        assert torch.equal(got, expected), (dtype, values[got != expected][:8])


SHAPES = [((256, 128), Granularity.ROWWISE, 0), ((130, 130), Granularity.BLOCK_128X128, 0),
          ((300, 160), Granularity.BLOCK_128X128, 4000), ((7, 3), Granularity.ROWWISE, 0),
          ((200, 256), Granularity.TENSORWISE, 300), ((256, 384), Granularity.BLOCK_128X128, 0)]


@pytest.mark.parametrize("fp16_master", [False, True], ids=["fp32-master", "fp16-master"])
def test_group_amax_equals_a_scatter_max_with_one_source_per_run(fp16_master):
    tables, slots = _storage([(*w, E4M3) for w in SHAPES], [E4M3])
    values = tables["master"].cpu()
    if fp16_master:  # codes = value * 2^k per fragment; the kernel divides them back
        scale = torch.exp2(torch.arange(len(SHAPES)).float() + 8)
        codes = (values.view(-1, GROUP) * scale[tables["frag_of_group"].cpu()][:, None]).half()
        values = (codes.float() / scale[tables["frag_of_group"].cpu()][:, None]).view(-1)
        tables["master"], tables["master_scale"] = codes.view(-1).to(KERNEL_DEVICE), scale.to(KERNEL_DEVICE)
    num_slots = tables["dummy_slot"] + 1
    amax = torch.zeros(num_slots, device=KERNEL_DEVICE)
    sources = torch.zeros(num_slots, dtype=torch.int32, device=KERNEL_DEVICE)
    fused_fp8_publication.group_amax_triton(**tables, amax=amax, sources=sources)
    expected = torch.zeros(num_slots).scatter_reduce_(0, slots, values.abs(), "amax")
    assert torch.equal(amax.cpu(), expected)
    # One source per run of equal slots in each 128-group.
    per_group = slots.view(-1, GROUP)
    heads = torch.ones_like(per_group, dtype=torch.bool)
    heads[:, 1:] = per_group[:, 1:] != per_group[:, :-1]
    runs = torch.zeros(num_slots, dtype=torch.int32).index_add_(0, per_group[heads], torch.ones(int(heads.sum()),
                                                                                                dtype=torch.int32))
    assert torch.equal(sources.cpu(), runs)
    elements = torch.bincount(slots, minlength=num_slots)
    first = 0
    for shape, gran, lo in SHAPES:  # rows of 128 multiples: exactly one source per 128 elements
        n = num_scale_groups(shape, gran)
        if shape[1] % GROUP == 0 and lo % GROUP == 0:
            assert torch.equal(sources[first:first + n].cpu().long() * GROUP, elements[first:first + n]), shape
        first += n


# ---- the optimizer: fused publication vs the twin ------------------------------------------------------------
def _published(ddp) -> list[torch.Tensor]:
    """What a publication writes: every FP8 bucket's bytes, every weight's scale_inv, the delayed states' pending
    amaxes and scales."""
    out = [b.fp8_data.clone() for b in ddp.buckets if b.fp8]
    for info in ddp.fp8_params.values():
        out.append(info.scale_inv.clone())
        q = info.module.fp8_weight_quantization(info.recipe)
        if q.state is not None:
            out += [q.state.pending_amax.clone(), q.state.scale.clone()]
    return out


def _cold(ddp) -> list[bool]:
    return [info.module.fp8_weight_quantization(info.recipe).scale is None for info in ddp.fp8_params.values()]


def _publications(fused: bool, scaling: str, preset: str, ps, mixed_formats: bool = False, steps: int = 2):
    """What each publish of a short run wrote (the optimizer's first, cold for delayed states, then one per step)."""
    cfg = tiny_config(num_layers=2, hidden_size=160, ffn_hidden_size=200, num_attention_heads=4)
    model = build(cfg, ps, fp8_recipe=RECIPES[scaling])
    if mixed_formats:
        for m in [m for m in model.modules() if hasattr(m, "fp8_weight_quantization")][::2]:
            m.recipe = _E5M2Weights(**{**RECIPES[scaling].__dict__, "fp8_format": "e4m3"})
    ddp = make_ddp(model, ps, use_distributed_optimizer=True, fp8_param_gather=True, bucket_size=700)
    master, states = PRESETS[preset]
    opt = DistributedOptimizer(ddp, weight_decay=0.1, clip_grad=1.0, fused_step=fused, master_weight_dtype=master,
                               optimizer_state_dtype=states)
    assert (opt._fp8_publication.fused is not None) == fused
    assert len(opt._fp8_publication.dtypes) == (2 if mixed_formats else 1)
    written, cold = [_published(ddp)], [_cold(ddp)]
    manager = fp8_scaling_manager(model, ps)
    for step in range(steps):
        assert not train_step(ddp, opt, cfg, step, 1e-2, before_step=manager.update)[0].skipped
        written.append(_published(ddp))
        cold.append(_cold(ddp))
    return written, cold


def _assert_same(scaling, preset, ps, mixed_formats=False):
    (twin, cold), (fused, fused_cold) = (_publications(f, scaling, preset, ps, mixed_formats) for f in (False, True))
    assert cold == fused_cold
    if scaling == "delayed":  # the first publish casts under cold states' current scaling, the last under warm ones
        assert all(cold[0]) and not any(cold[-1])
    for k, (a, b) in enumerate(zip(twin, fused)):
        assert len(a) == len(b)
        for i, (x, y) in enumerate(zip(a, b)):
            assert torch.equal(bits(x), bits(y)), (scaling, preset, k, i, int((bits(x) != bits(y)).sum()))


@interpreted
@pytest.mark.parametrize("preset", ["fp32", "compressed"])
@pytest.mark.parametrize("scaling", list(RECIPES))
def test_fused_publication_equals_the_twin(scaling, preset):
    _assert_same(scaling, preset, ParallelState().init_process_groups())


@interpreted
@pytest.mark.parametrize("scaling", ["tensorwise", "blockwise"])
def test_fused_publication_with_e4m3_and_e5m2_weights(scaling):
    _assert_same(scaling, "compressed", ParallelState().init_process_groups(), mixed_formats=True)


def _dp2_body(rank, world_size):
    ps = ParallelState(world_size=world_size).init_process_groups()
    for scaling, preset in (("delayed", "compressed"), ("rowwise", "fp32"), ("blockwise", "compressed")):
        _assert_same(scaling, preset, ps)


@interpreted
@pytest.mark.distributed
@pytest.mark.slow  # CI time (the 30-minute budget): the one-process twin tests above run by default
def test_fused_publication_equals_the_twin_at_dp2():
    """DP=2 shards cut rows and 128x128 blocks, so both ranks' amaxes of a group meet in the DP all-reduce."""
    assert os.environ.get("TRITON_INTERPRET") == "1"  # the spawned ranks inherit it
    run_distributed(_dp2_body, world_size=2, timeout_s=600)


# ---- the cost of a warm step ---------------------------------------------------------------------------------
@contextlib.contextmanager
def _launches_counted_apart():
    """Counts Triton launches and leaves their interpreter's own aten ops (copying each argument to the host and
    back) out of any op counter: a GPU launch dispatches no aten op."""
    from torch.utils._python_dispatch import _disable_current_modes
    from triton.runtime import interpreter

    launches = {"all": 0, "publication": 0}
    run, launchers = interpreter.GridExecutor.__call__, {}

    def uncounted(self, *args, **kwargs):
        launches["all"] += 1
        with _disable_current_modes():
            return run(self, *args, **kwargs)

    for name in ("group_amax_triton", "cast_triton"):
        launchers[name] = getattr(fused_fp8_publication, name)

        def counted(*args, _launcher=launchers[name], **kwargs):
            launches["publication"] += 1
            return _launcher(*args, **kwargs)

        setattr(fused_fp8_publication, name, counted)
    interpreter.GridExecutor.__call__ = uncounted
    try:
        yield launches
    finally:
        interpreter.GridExecutor.__call__ = run
        for name, launcher in launchers.items():
            setattr(fused_fp8_publication, name, launcher)


@interpreted
@pytest.mark.parametrize("scaling", ["delayed", pytest.param("tensorwise", marks=pytest.mark.slow)])
@pytest.mark.parametrize("preset", [pytest.param("fp32", marks=pytest.mark.slow), "compressed"])  # compressed: more ops
def test_fused_step_ops_do_not_grow_with_width_or_layers(monkeypatch, scaling, preset):
    from test_optim_op_count import _fp8_step_ops

    monkeypatch.setenv("MEGAFP8_FUSED_OPTIMIZER", "1")
    runs = {}
    for hidden, layers in ((64, 2), (256, 2), (64, 4)):
        with _launches_counted_apart() as launches:
            ops, handing_ops, _names, weights = _fp8_step_ops(hidden, layers, scaling, *PRESETS[preset])
        runs[hidden, layers] = (ops, launches["publication"])
        assert handing_ops == 4 * weights
    assert len(set(runs.values())) == 1, runs
    # 2 launches per publish (amax, cast); _fp8_step_ops publishes once at the start and once per step (3 steps)
    assert runs[64, 2][1] == 2 * 4, runs
