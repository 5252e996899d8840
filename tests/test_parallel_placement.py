"""Placements and mesh views: every parameter kind of a real model (TP=1, and TP=2 over gloo) gets the placement its
tags imply, grad-norm counting by placement equals the old TP-rank-0 rule, the expert view's groups are the dense
ones at EP=1 (and share their communicators), and a toy placement split over DP counts everywhere and saves sharded."""
import pytest
import torch
from torch import nn

from distributed_testing import run_distributed
from optim_testing import build, make_ddp, tiny_config
from megafp8.checkpoint.sharded_tensor import ShardedChunks, param_flat_range_state, tensor_parallel_state
from megafp8.optim.storage_layout import StorageLayout, _counts_in_grad_norm
from megafp8.optim.storage_slabs import STEP_SLAB
from megafp8.parallel.collectives import all_reduce
from megafp8.parallel.parallel_state import (CHECKPOINT_GLOO, LayoutError, ParallelState, expert_group_ranks,
                                             group_ranks)
from megafp8.parallel.placement import Placement, placement_of


def _expected(name: str, sequence_parallel: bool, tied_copy: bool = False) -> Placement:
    """Each kind of parameter of the GPT model, written out by hand."""
    if name.endswith("layernorm.weight"):
        return Placement(replica_group="tp", grad_sum_group="tp" if sequence_parallel else None)
    kinds = {"embedding.weight": Placement("tp", 0, padded_vocab=True),
             "output_layer.weight": Placement("tp", 0, padded_vocab=True, tied_copy=tied_copy),
             "linear_qkv.weight": Placement("tp", 0), "linear_proj.weight": Placement("tp", 1),
             "linear_fc1.weight": Placement("tp", 0, shard_stride=2), "linear_fc2.weight": Placement("tp", 1)}
    return next(placement for suffix, placement in kinds.items() if name.endswith(suffix))


def _old_rule(param: nn.Parameter, tp_rank: int) -> bool:
    """storage_layout's rule before placements: tied copies never, TP-replicated parameters on TP rank 0 only."""
    return not getattr(param, "shared_embedding", False) and (getattr(param, "tensor_model_parallel", False)
                                                               or tp_rank == 0)


@pytest.mark.parametrize("sequence_parallel", [False, True])
def test_every_parameter_kind_tp1(sequence_parallel):
    ps = ParallelState(sequence_parallel=sequence_parallel).init_process_groups()
    model = build(tiny_config(), ps)
    names = [name for name, _ in model.named_parameters()]
    assert any(n.endswith("linear_fc1.weight") for n in names) and any(n.endswith("layernorm.weight") for n in names)
    for name, param in model.named_parameters():
        assert placement_of(param) == _expected(name, sequence_parallel), name
    make_ddp(model, ps)  # attaches them
    assert all(param.placement == _expected(name, sequence_parallel) for name, param in model.named_parameters())


def test_tied_copy_is_never_counted():
    ps = ParallelState().init_process_groups()
    head = build(tiny_config(tie_embeddings=True), ps, pre_process=False)
    copy = head.output_layer.weight
    assert placement_of(copy) == _expected("output_layer.weight", False, tied_copy=True)
    assert not _counts_in_grad_norm(copy, lambda name: 0)


@pytest.mark.parametrize("tp_rank", [0, 1, 3])
def test_grad_norm_counting_by_placement_equals_the_old_rule(tp_rank):
    ps = ParallelState().init_process_groups()
    model = build(tiny_config(tie_embeddings=True), ps, pre_process=False)
    for name, param in model.named_parameters():
        assert _counts_in_grad_norm(param, {"tp": tp_rank}.__getitem__) == _old_rule(param, tp_rank), name


@pytest.mark.parametrize("tp,cp,dp,pp", [(1, 1, 1, 1), (2, 1, 4, 2), (2, 2, 2, 2), (4, 1, 3, 2), (1, 2, 3, 1)])
def test_expert_view_groups_are_the_dense_groups_at_ep1(tp, cp, dp, pp):
    ps = ParallelState(world_size=tp * cp * dp * pp, tensor_model_parallel_size=tp, context_parallel_size=cp,
                       pipeline_model_parallel_size=pp)
    assert (ps.ep_size, ps.etp_size, ps.edp_size) == (1, tp, cp * dp)
    dense = group_ranks(tp=tp, dp=dp, pp=pp, cp=cp)
    expert = expert_group_ranks(ps.etp_size, ps.ep_size, ps.edp_size, pp)
    assert expert["etp"] == dense["tp"] and expert["edp"] == dense["dp"] and expert["expert_amax"] == dense["amax"]
    assert expert["ep"] == [[r] for r in range(ps.world_size)]
    assert ps.group_ranks().keys() >= {"tp", "cp", "dp", "pp", "amax", "embedding", "etp", "ep", "edp", "expert_amax"}


def test_expert_view_with_ep2_by_hand():
    """World 8 = TP2 x DP4; ETP1 x EP2 x EDP4: expert ranks etp-ep-edp, EP innermost here."""
    ps = ParallelState(world_size=8, tensor_model_parallel_size=2, expert_model_parallel_size=2,
                       expert_tensor_parallel_size=1)
    groups = ps.group_ranks()
    assert groups["ep"] == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert groups["edp"] == [[0, 2, 4, 6], [1, 3, 5, 7]] and groups["etp"] == [[r] for r in range(8)]
    assert groups["expert_amax"] == groups["edp"] and "--expert-model-parallel-size 2" in ps.describe()
    assert ps.group_coordinates()["edp"] == (0, 4) and ps.group_coordinates()["world"] == (0, 8)


@pytest.mark.parametrize("layout, message", [
    (dict(expert_model_parallel_size=3), "--expert-tensor-parallel-size (2) x --expert-model-parallel-size (3) = 6 "
                                         "does not divide the ranks of a pipeline stage (TP x CP x DP = 4)"),
    (dict(expert_model_parallel_size=0), "--expert-model-parallel-size must be >= 1, got 0"),
    (dict(expert_tensor_parallel_size=8), "--expert-tensor-parallel-size (8) x --expert-model-parallel-size (1)"),
])
def test_expert_layout_errors_name_the_flags(layout, message):
    with pytest.raises(LayoutError) as err:
        ParallelState(world_size=4, tensor_model_parallel_size=2, **layout)
    assert message in str(err.value)


def test_named_groups_single_process():
    ps = ParallelState().init_process_groups()
    for name in ("tp", "dp", "amax", "etp", "ep", "edp", "expert_amax", "world", CHECKPOINT_GLOO):
        assert ps.group(name).size == 1 and ps.group(name).group is None, name
    assert ps.group("tp") is ps.tp_group
    with pytest.raises(KeyError, match="no process group named 'nope'"):
        ps.group("nope")


def test_toy_placement_split_over_dp_counts_everywhere_and_saves_sharded():
    rows = 3
    for dp_rank in range(2):
        param = nn.Parameter(torch.arange(6.0).view(rows, 2) + 10 * dp_rank)  # untagged: no TP attributes
        param.placement = Placement(shard_group="dp", shard_dim=0)
        assert _counts_in_grad_norm(param, {"dp": dp_rank, "tp": 1}.__getitem__)
        state = tensor_parallel_state(param.detach(), param, 1, 2, group_coords={"dp": (dp_rank, 2)})
        assert isinstance(state, ShardedChunks) and tuple(state.global_shape) == (2 * rows, 2)
        assert [tuple(offsets) for offsets, _ in state.chunks] == [(rows * dp_rank, 0)]
        flat = param_flat_range_state(param.detach().view(-1)[2:], 2, param, 1, 2, group_coords={"dp": (dp_rank, 2)})
        assert [tuple(offsets) for offsets, _ in flat.chunks] == [(rows * dp_rank + 1, 0)]
        with pytest.raises(ValueError, match="'dp' group"):  # never silently saved whole from one rank
            tensor_parallel_state(param.detach(), param, 0, 1)
    replicated = nn.Parameter(torch.ones(4))
    replicated.placement = Placement(replica_group="dp")
    local = replicated.detach()
    assert tensor_parallel_state(local, replicated, 0, 1) is local  # saved once, deduplicated by DCP
    assert not _counts_in_grad_norm(replicated, {"dp": 1}.__getitem__)


def _tp2_body(rank: int, world_size: int) -> None:
    ps = ParallelState(world_size=2, tensor_model_parallel_size=2, sequence_parallel=True).init_process_groups()
    model = build(tiny_config(), ps)
    for name, param in model.named_parameters():
        assert placement_of(param) == _expected(name, True), name
    ddp = make_ddp(model, ps, use_distributed_optimizer=True)
    assert len(ddp.grad_buffers) == 1 and all(b.group is ps.dp_group for b in ddp.buckets)
    layout = StorageLayout(ddp, weight_decay=0.0, decoupled_lr_params=(), slab_size=STEP_SLAB, device="cpu")
    for frag in layout.fragments:
        counted = layout.group_counted[layout.frag_of_group == frag.index]
        assert bool(counted.all()) == bool(counted.any()) == _old_rule(frag.param, rank), frag.name
    # The expert view shares the dense communicators; the checkpoint gloo group and the world connect both ranks.
    assert ps.group("etp").group is ps.tp_group.group and ps.group("etp").ranks == ps.tp_group.ranks == (0, 1)
    assert ps.group("edp").ranks == ps.dp_group.ranks == (rank,)
    for name in (CHECKPOINT_GLOO, "world", "expert_amax"):
        assert all_reduce(torch.tensor([float(rank + 1)]), ps.group(name), "dp_grad_reduce").item() == 3.0, name
    coords = ps.group_coordinates()
    assert coords["tp"] == (rank, 2) and coords["etp"] == (rank, 2) and coords["dp"] == (0, 1)
    for name, param in model.named_parameters():  # the group coordinates give the TP arguments' chunks
        local = param.detach()
        by_tp = tensor_parallel_state(local, param, rank, 2, 50)
        by_coords = tensor_parallel_state(local, param, 0, 1, 50, group_coords=coords)
        if isinstance(by_tp, ShardedChunks):
            assert [tuple(o) for o, _ in by_tp.chunks] == [tuple(o) for o, _ in by_coords.chunks], name
        else:
            assert by_coords is by_tp is local and not placement_of(param).sharded, name


@pytest.mark.distributed
def test_tp2_placements_counting_and_named_groups():
    run_distributed(_tp2_body, world_size=2)
