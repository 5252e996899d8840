"""Atomic contention in per-step reductions, counted: every scatter-style reduction of an optimizer step under
--fp8-param-gather sends at most one source per 128 elements to any scaling group (a tensorwise weight's
publication used to send every element to one address: ~1e9 contended atomics per step at 1B parameters), and
the sequence-parallel transposed FP8 copy takes its group amaxes by reductions, with no scatter at all; both
bit-equal to the element-wise scatter they replace (NaN included)."""
import math
from types import SimpleNamespace

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from optim_testing import build, make_ddp, tiny_config, train_step
from megafp8.fp8 import Fp8Recipe
from megafp8.optim import DistributedOptimizer
from megafp8.parallel.fp8_sequence_parallel import fp8_scaling_manager
from megafp8.parallel.parallel_state import ParallelState

SCATTERS = {torch.ops.aten.scatter_reduce_.two, torch.ops.aten.scatter_reduce.two, torch.ops.aten.scatter_add_.default,
            torch.ops.aten.scatter_add.default, torch.ops.aten.index_reduce_.default, torch.ops.aten.index_add_.default,
            torch.ops.aten.index_reduce.default, torch.ops.aten.index_add.default}


class _Scatters(TorchDispatchMode):
    """Every scatter-style reduction: (target size, sources per target address)."""

    def __init__(self):
        super().__init__()
        self.calls = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func in SCATTERS:
            target, index = args[0], args[2]
            if target.dim() == 2:  # along dim 1: address (row, index)
                index = index + torch.arange(index.shape[0], device=index.device)[:, None] * target.shape[1]
            self.calls.append((target.numel(), torch.bincount(index.flatten(), minlength=target.numel())))
        return func(*args, **(kwargs or {}))


RECIPES = {"delayed": lambda: Fp8Recipe.delayed(amax_history_len=4), "tensorwise": Fp8Recipe.tensorwise,
           "rowwise": Fp8Recipe.rowwise, "blockwise": Fp8Recipe.blockwise}


@pytest.mark.parametrize("recipe", RECIPES)
def test_fp8_param_gather_step_sends_one_source_per_128_elements_per_group(recipe):
    ps = ParallelState().init_process_groups()
    cfg = tiny_config(hidden_size=128, ffn_hidden_size=512, num_attention_heads=4, vocab_size=256)
    model = build(cfg, ps, fp8_recipe=RECIPES[recipe]())
    ddp = make_ddp(model, ps, use_distributed_optimizer=True, fp8_param_gather=True)
    opt = DistributedOptimizer(ddp, weight_decay=0.1, clip_grad=1.0)
    manager = fp8_scaling_manager(model, ps)
    for step in range(2):  # delayed states warm up
        train_step(ddp, opt, cfg, step, 1e-3, before_step=manager.update)
    scatters, step = _Scatters(), opt.step

    def counted(lr):
        with scatters:
            return step(lr)

    opt.step = counted
    train_step(ddp, opt, cfg, 2, 1e-3, before_step=manager.update)
    pub = opt._fp8_publication
    master_scale = torch.cat([opt.master_scale, opt.master_scale.new_ones(1)])
    elements = sum(torch.bincount(pub._decode(slab, master_scale)[1].flatten(), minlength=pub.num_slots + 1)
                   for slab in pub.slabs)
    largest_group = int(elements[:pub.num_slots].max())
    publication = [sources for size, sources in scatters.calls if size > pub.num_slots + 1]
    assert publication, "the publication's amax scatter was not seen"
    for sources in publication:  # per scaling group: at most one source per 128 of its elements
        assert torch.all(sources[:pub.num_slots] <= torch.ceil(elements[:pub.num_slots] / 128)), recipe
        assert int(sources[pub.num_slots + 1:].max()) <= 1  # scratch addresses: one element each
    for size, sources in scatters.calls:  # and no reduction of the step has a hotter address than that
        assert int(sources.max()) <= max(1, largest_group // 128), (recipe, size, int(sources.max()))


def _scatter_reference(x2d, granularity, rank, size):
    """The element-wise scatter that _local_transposed_shard used before (kept here as the oracle)."""
    rows, cols = x2d.shape
    if granularity == "rowwise":
        group = torch.zeros(rows, dtype=torch.long)
        amax = torch.zeros(cols, 1)
    else:
        group = torch.arange(rank * rows, (rank + 1) * rows) // 128
        amax = torch.zeros(cols, math.ceil(rows * size / 128))
    xt = x2d.t().float()
    return amax.scatter_reduce_(1, group.expand(cols, rows), xt.abs(), "amax")


@pytest.mark.parametrize("granularity", ["rowwise", "blockwise"])
@pytest.mark.parametrize("rows, rank, size", [(256, 1, 2), (96, 1, 2), (96, 2, 4), (200, 0, 2), (40, 3, 4)])
def test_sequence_parallel_transposed_copy_amax_without_scatter(granularity, rows, rank, size):
    from megafp8.fp8 import linear_function

    torch.manual_seed(rows + rank)
    x2d = torch.randn(rows, 64) * torch.rand(1, 64) * 100
    x2d[rows // 3, 5] = float("nan")
    seen = {}
    comm = SimpleNamespace(rank=rank, size=size, sync_amax=lambda amax: seen.setdefault("amax", amax.clone()))
    recipe = (Fp8Recipe.rowwise() if granularity == "rowwise" else Fp8Recipe.blockwise())
    local = SimpleNamespace(granularity=recipe.granularity("input"))
    scatters = _Scatters()
    with scatters:
        recipe.quantizer("input").transposed_sequence_shard(x2d, local, comm)
    assert scatters.calls == []
    expected = _scatter_reference(x2d, granularity, rank, size)
    assert torch.equal(seen["amax"].isnan(), expected.isnan())
    assert torch.equal(seen["amax"].nan_to_num(), expected.nan_to_num())
