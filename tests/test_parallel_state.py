"""ParallelState: Megatron rank order, group membership, layout validation, and real groups over gloo."""
import pytest
import torch
import torch.distributed as dist

from distributed_testing import run_distributed
from megafp8.parallel.collectives import all_reduce
from megafp8.parallel.parallel_state import LayoutError, ParallelState, group_ranks, layout_errors, rank_coordinates


def test_coordinates_tp2_dp4_pp2_table():
    """World 16 = TP2 x DP4 x PP2, TP innermost then DP then PP; table written out by hand."""
    table = {  # rank: (tp, dp, pp)
        0: (0, 0, 0), 1: (1, 0, 0), 2: (0, 1, 0), 3: (1, 1, 0), 4: (0, 2, 0), 5: (1, 2, 0), 6: (0, 3, 0),
        7: (1, 3, 0), 8: (0, 0, 1), 9: (1, 0, 1), 10: (0, 1, 1), 11: (1, 1, 1), 12: (0, 2, 1), 13: (1, 2, 1),
        14: (0, 3, 1), 15: (1, 3, 1),
    }
    for rank, (tp, dp, pp) in table.items():
        c = rank_coordinates(rank, tp=2, dp=4, pp=2)
        assert (c.tp, c.dp, c.pp) == (tp, dp, pp), rank
    groups = group_ranks(tp=2, dp=4, pp=2)
    assert groups["tp"] == [[0, 1], [2, 3], [4, 5], [6, 7], [8, 9], [10, 11], [12, 13], [14, 15]]
    assert groups["dp"] == [[0, 2, 4, 6], [1, 3, 5, 7], [8, 10, 12, 14], [9, 11, 13, 15]]
    assert groups["pp"] == [[0, 8], [1, 9], [2, 10], [3, 11], [4, 12], [5, 13], [6, 14], [7, 15]]
    assert groups["amax"] == [list(range(8)), list(range(8, 16))]
    assert groups["embedding"] == groups["pp"]


def test_groups_match_megatron_docstring_example():
    """Megatron's parallel_state docstring: 16 GPUs, TP2 PP4 (so DP2)."""
    groups = group_ranks(tp=2, dp=2, pp=4)
    assert groups["tp"] == [[0, 1], [2, 3], [4, 5], [6, 7], [8, 9], [10, 11], [12, 13], [14, 15]]
    assert groups["dp"] == [[0, 2], [1, 3], [4, 6], [5, 7], [8, 10], [9, 11], [12, 14], [13, 15]]
    assert groups["pp"] == [[0, 4, 8, 12], [1, 5, 9, 13], [2, 6, 10, 14], [3, 7, 11, 15]]
    assert groups["embedding"] == [[0, 12], [1, 13], [2, 14], [3, 15]]


def test_every_rank_in_exactly_one_group_of_each_kind():
    for kind, groups in group_ranks(tp=4, dp=3, pp=2).items():
        members = sorted(r for g in groups for r in g)
        assert members == list(range(24)), kind


def test_single_process_state_needs_no_process_group():
    ps = ParallelState().init_process_groups()
    assert (ps.tp_group.size, ps.dp_group.size, ps.pp_group.size) == (1, 1, 1)
    assert ps.tp_group.group is None and ps.is_pipeline_first_stage and ps.is_pipeline_last_stage


_BASE_MODEL = dict(num_layers=4, hidden_size=64, ffn_hidden_size=128, num_attention_heads=8, num_query_groups=4,
                   seq_length=16)


@pytest.mark.parametrize("layout, model, flag", [
    (dict(world_size=6, tp=4, pp=1), {}, "--tensor-model-parallel-size"),
    (dict(world_size=8, tp=2, pp=3), {}, "--pipeline-model-parallel-size"),
    (dict(world_size=4, tp=4, pp=1), dict(num_attention_heads=6, num_query_groups=2, hidden_size=48),
     "--num-attention-heads (6) must be divisible by --tensor-model-parallel-size (4)"),
    (dict(world_size=4, tp=4, pp=1), dict(num_query_groups=2), "--num-query-groups (2)"),
    (dict(world_size=1, tp=1, pp=1), dict(num_query_groups=3), "--num-attention-heads (8) must be divisible by --num-query-groups"),
    (dict(world_size=1, tp=1, pp=1), dict(hidden_size=60), "--hidden-size (60) must be divisible by --num-attention-heads"),
    (dict(world_size=2, tp=2, pp=1), dict(ffn_hidden_size=99), "--ffn-hidden-size (99)"),
    (dict(world_size=4, tp=1, pp=4), dict(num_layers=6), "--num-layers (6) must be divisible by --pipeline-model-parallel-size"),
    (dict(world_size=2, tp=1, pp=2, vpp_layers=3), {}, "--num-layers-per-virtual-pipeline-stage (3)"),
    (dict(world_size=1, tp=1, pp=1, vpp_layers=1), {}, "--num-layers-per-virtual-pipeline-stage needs"),
    (dict(world_size=4, tp=4, pp=1, sequence_parallel=True), dict(seq_length=18), "--seq-length (18)"),
    (dict(world_size=8, tp=2, pp=1), dict(global_batch_size=12, micro_batch_size=2), "--global-batch-size (12)"),
    (dict(world_size=1, tp=1, pp=1), dict(micro_batch_size=0), "--micro-batch-size must be >= 1"),
    (dict(world_size=1, tp=1, pp=1), dict(hidden_size=24, num_attention_heads=8, num_query_groups=8), "head dim"),
])
def test_layout_errors_name_the_flag(layout, model, flag):
    errors = layout_errors(**layout, **{**_BASE_MODEL, **model})
    assert any(flag in e for e in errors), errors


def test_valid_layout_has_no_errors():
    assert layout_errors(world_size=16, tp=2, pp=2, vpp_layers=1, sequence_parallel=True, global_batch_size=32,
                         micro_batch_size=2, **_BASE_MODEL) == []


def test_parallel_state_message_prints_every_factor():
    with pytest.raises(LayoutError) as err:
        ParallelState(world_size=6, tensor_model_parallel_size=4)
    msg = str(err.value)
    assert "--tensor-model-parallel-size" in msg and "world size 6" in msg and "--pipeline-model-parallel-size 1" in msg


def _groups_body(rank: int, world_size: int) -> None:
    ps = ParallelState(world_size=4, tensor_model_parallel_size=2, pipeline_model_parallel_size=2).init_process_groups()
    expected = group_ranks(tp=2, dp=1, pp=2)
    for kind, handle in (("tp", ps.tp_group), ("pp", ps.pp_group), ("amax", ps.amax_group),
                         ("embedding", ps.embedding_group)):
        mine = next(g for g in expected[kind] if rank in g)
        assert list(handle.ranks) == mine and handle.ranks[handle.rank] == rank
        # The group really connects exactly these ranks: summing the rank ids proves it.
        total = all_reduce(torch.tensor([float(rank)]), handle, "tp_allreduce")
        assert total.item() == sum(mine), (kind, total.item(), mine)
    assert ps.dp_group.size == 1 and ps.dp_group.group is None
    assert ps.is_pipeline_first_stage == (rank < 2)
    assert dist.get_backend() == "gloo"


@pytest.mark.distributed
def test_process_groups_connect_the_right_ranks():
    run_distributed(_groups_body, world_size=4)


def test_context_parallel_sits_between_tp_and_dp():
    """World 16 = TP2 x CP2 x DP2 x PP2, Megatron's order tp-cp-dp-pp; dp_group is DP x CP (grads, ZeRO)."""
    for rank in range(16):
        c = rank_coordinates(rank, tp=2, dp=2, pp=2, cp=2)
        assert (c.tp, c.cp, c.dp, c.pp) == (rank % 2, rank // 2 % 2, rank // 4 % 2, rank // 8), rank
    groups = group_ranks(tp=2, dp=2, pp=2, cp=2)
    assert groups["tp"] == [[0, 1], [2, 3], [4, 5], [6, 7], [8, 9], [10, 11], [12, 13], [14, 15]]
    assert groups["cp"] == [[0, 2], [1, 3], [4, 6], [5, 7], [8, 10], [9, 11], [12, 14], [13, 15]]
    assert groups["dp"] == [[0, 2, 4, 6], [1, 3, 5, 7], [8, 10, 12, 14], [9, 11, 13, 15]]
    assert groups["pp"] == [[r, r + 8] for r in range(8)]
    assert groups["amax"] == [list(range(8)), list(range(8, 16))]
    ps = ParallelState(world_size=16, tensor_model_parallel_size=2, pipeline_model_parallel_size=2,
                       context_parallel_size=2)
    assert (ps.dp_size, ps.cp_size) == (2, 2) and "--context-parallel-size 2" in ps.describe()


@pytest.mark.parametrize("layout, model, message", [
    (dict(world_size=6, tp=2, cp=2, pp=1), {}, "--context-parallel-size (2) x --pipeline-model-parallel-size (1) = 4 "
                                               "does not divide the world size (6)"),
    (dict(world_size=4, tp=1, cp=4, pp=1), dict(seq_length=12), "--seq-length (12) must be divisible by "
                                                                "2 x --context-parallel-size (8)"),
    (dict(world_size=8, tp=2, cp=2, pp=2, sequence_parallel=True), dict(seq_length=12),
     "--seq-length (12) must be divisible by 2 x --context-parallel-size x --tensor-model-parallel-size "
     "(with --sequence-parallel) (8)"),
    (dict(world_size=8, tp=2, cp=2, pp=1), dict(global_batch_size=3, micro_batch_size=1),
     "data-parallel size (2 = world / (TP x CP 2 x PP))"),
    (dict(world_size=2, tp=1, cp=0, pp=1), {}, "--context-parallel-size must be >= 1, got 0"),
])
def test_context_parallel_layout_errors_name_the_flag(layout, model, message):
    errors = layout_errors(**layout, **model)
    assert any(message in e for e in errors), errors


def test_context_parallel_layout_error_before_any_process_group():
    from megafp8.training.arguments import ArgumentError, parse_args
    from megafp8.training.megatron_flags import LLAMA_FLAGS
    flags = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "36",
             "--micro-batch-size", "1", "--train-iters", "1", "--lr", "1e-3", "--data-path", "x",
             "--tokenizer-type", "NullTokenizer", "--vocab-size", "100", "--context-parallel-size", "4", *LLAMA_FLAGS]
    with pytest.raises(ArgumentError, match=r"--seq-length \(36\) must be divisible by 2 x --context-parallel-size \(8\)"):
        parse_args(flags, 4)
    assert parse_args([*flags[:7], "32", *flags[8:]], 8).data_parallel_size == 2


def test_nccl_process_group_is_bound_to_the_local_gpu(monkeypatch):
    """Under NCCL the group is created with device_id = cuda:LOCAL_RANK (eager communicator, barriers that need not
    guess the device); checked on CPU by recording what init_process_group receives."""
    from megafp8.parallel import parallel_state

    calls = {}
    monkeypatch.setenv("LOCAL_RANK", "3")
    monkeypatch.setattr(dist, "is_initialized", lambda: False)
    monkeypatch.setattr(torch.cuda, "set_device", lambda device: calls.setdefault("set_device", device))
    monkeypatch.setattr(dist, "init_process_group", lambda **kwargs: calls.setdefault("init", kwargs))
    parallel_state.initialize_distributed(backend="nccl", timeout_minutes=5)
    assert calls["set_device"] == 3
    assert calls["init"]["device_id"] == torch.device("cuda", 3) and calls["init"]["backend"] == "nccl"
    calls.clear()
    parallel_state.initialize_distributed(backend="gloo")
    assert "device_id" not in calls["init"] and "set_device" not in calls
