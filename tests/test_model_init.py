"""Layout-invariant initialization: a model built from scratch (no state dict loaded) under TP=2 / TP=4
and as pipeline stages equals the TP=1 model, its TP shards differ, and the model-parallel RNG gives
per-TP-rank streams inside a fork and identical ones outside.

The reference is the single-process TP=1 model with the same seed. Parameters must match bit for bit
(the same generator draws the same full tensor; slicing is exact); gradients after one forward/backward
match to the fp32 summation-order bound of tests/test_model_tp_equivalence.py.
"""
import pytest
import torch

from distributed_testing import run_distributed
from megafp8.model import GPTModel, ModelConfig
from megafp8.parallel import collectives as C
from megafp8.parallel.parallel_state import ParallelState
from megafp8.parallel.random import (
    ModelParallelRNG, initialize_parameters, model_parallel_seed, parameter_generator, parameter_seed,
)
from megafp8.parallel.sharding import gather_tensor_model_parallel, is_tensor_model_parallel
from megafp8.parallel.tensor_parallel import (
    ColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding, allreduce_sequence_parallel_grads,
    init_method_normal,
)

BATCH = 2
TOLERANCE = 1e-5


def _config(tie: bool, seed: int = 7) -> ModelConfig:
    # vocab 100 pads to 104 at TP=1 and to 128 at TP=4: the padding rows differ between layouts.
    return ModelConfig(num_layers=2, hidden_size=32, ffn_hidden_size=48, num_attention_heads=4, num_query_groups=4,
                       seq_length=8, vocab_size=100, make_vocab_size_divisible_by=8, tie_embeddings=tie, seed=seed)


def _rel_err(actual: torch.Tensor, expected: torch.Tensor) -> float:
    return ((actual - expected).abs().max() / expected.abs().max()).item()


def _full(local: torch.Tensor, param: torch.Tensor, tp, vocab_size: int) -> torch.Tensor:
    """The full tensor from every rank's shard, vocab padding cut off (after checking it is zero)."""
    full = gather_tensor_model_parallel(local.detach(), param, tp)
    if getattr(param, "padded_vocab", False):
        assert torch.all(full[vocab_size:] == 0), "vocab padding rows must be zero"
        full = full[:vocab_size]
    return full


def _assert_shards_differ(param: torch.Tensor, tp) -> None:
    if tp.size == 1 or not is_tensor_model_parallel(param):
        return
    shards = C.all_gather(param.detach().unsqueeze(0).contiguous(), tp, "tp_allgather", dim=0)
    for i in range(tp.size):
        for j in range(i):
            assert not torch.equal(shards[i], shards[j]), f"TP shards {i} and {j} are identical"


def _init_body(rank: int, world_size: int) -> None:
    n = world_size
    g = torch.Generator().manual_seed(1)
    for sp, tie in ((False, False), (True, True)):
        cfg = _config(tie)
        ids = torch.randint(0, cfg.vocab_size, (BATCH, cfg.seq_length), generator=g)
        labels = torch.randint(0, cfg.vocab_size, (BATCH, cfg.seq_length), generator=g)
        loss_weights = torch.rand(BATCH, cfg.seq_length, generator=g)
        torch.manual_seed(100 + rank)  # the global RNG must play no part in the model's values
        reference = GPTModel(cfg, ParallelState().init_process_groups())
        ps = ParallelState(world_size=n, tensor_model_parallel_size=n, sequence_parallel=sp).init_process_groups()
        tp = ps.tp_group
        model = GPTModel(cfg, ps)  # built from scratch: nothing loaded
        case = f"TP={n} sequence_parallel={sp} tie_embeddings={tie}"

        ref_params = dict(reference.named_parameters())
        assert [name for name, _ in model.named_parameters()] == list(ref_params), case
        for name, param in model.named_parameters():
            expected = _full(ref_params[name], ref_params[name], reference.tp, cfg.vocab_size)
            assert torch.equal(_full(param, param, tp, cfg.vocab_size), expected), (case, name)
            _assert_shards_differ(param, tp)

        (reference(ids, labels) * loss_weights).sum().backward()
        (model(ids, labels) * loss_weights).sum().backward()
        allreduce_sequence_parallel_grads(model, ps)
        for name, param in model.named_parameters():
            ref_grad = ref_params[name].grad
            if getattr(param, "padded_vocab", False):
                ref_grad = ref_grad[: cfg.vocab_size]
            full_grad = _full(param.grad, param, tp, cfg.vocab_size)
            assert _rel_err(full_grad, ref_grad) <= TOLERANCE, (case, name, _rel_err(full_grad, ref_grad))
            if is_tensor_model_parallel(param):
                _assert_shards_differ(param.grad, tp)

        # Pipeline stages (built in this process): layers keep their global index and their values, and
        # the last stage's copy of a tied embedding equals the first stage's embedding.
        first = GPTModel(cfg, ps, post_process=False, layer_numbers=[0])
        last = GPTModel(cfg, ps, pre_process=False, layer_numbers=[1])
        stage_params = {**dict(first.named_parameters()), **dict(last.named_parameters())}
        model_params = dict(model.named_parameters())
        for name, param in stage_params.items():
            source = model_params["embedding.weight"] if tie and name == "output_layer.weight" else model_params[name]
            assert torch.equal(param, source), (case, "pipeline stage", name)


@pytest.mark.distributed
@pytest.mark.parametrize("tp", [2, 4])
def test_from_scratch_tp_model_equals_tp1_slices(tp):
    run_distributed(_init_body, world_size=tp)


def _layers_body(rank: int, world_size: int) -> None:
    """Standalone layers (no GPTModel): the full tensor comes from the default generator, then is sliced."""
    n = world_size
    ps = ParallelState(world_size=n, tensor_model_parallel_size=n).init_process_groups()
    ps1 = ParallelState().init_process_groups()
    tp = ps.tp_group
    for build in (lambda s: ColumnParallelLinear(8, 12, s, partition_stride=2),
                  lambda s: RowParallelLinear(12, 8, s),
                  lambda s: VocabParallelEmbedding(16, 8, s)):
        torch.manual_seed(3)
        full = build(ps1).weight
        torch.manual_seed(3)
        local = build(ps).weight
        assert torch.equal(gather_tensor_model_parallel(local.detach(), local, tp), full.detach())
        _assert_shards_differ(local, tp)


@pytest.mark.distributed
def test_standalone_layers_draw_full_then_slice():
    run_distributed(_layers_body, world_size=2)


def test_seed_and_name_select_the_stream():
    a = torch.empty(64, 8)
    init = init_method_normal(1.0)
    draws = {}
    for seed, name in ((7, "layers.0.mlp.linear_fc1.weight"), (7, "layers.1.mlp.linear_fc1.weight"),
                       (8, "layers.0.mlp.linear_fc1.weight")):
        draws[seed, name] = init(a.clone(), parameter_generator(seed, name)).clone()
    same = init(a.clone(), parameter_generator(7, "layers.0.mlp.linear_fc1.weight"))
    assert torch.equal(same, draws[7, "layers.0.mlp.linear_fc1.weight"])
    values = list(draws.values())
    assert not torch.equal(values[0], values[1]), "same seed, different name must give different tensors"
    assert not torch.equal(values[0], values[2]), "different seed, same name must give different tensors"
    assert parameter_seed(7, "x") == parameter_seed(7, "x") < 2 ** 63


def test_same_seed_same_model_different_seed_different_model():
    ps = ParallelState().init_process_groups()
    a, b, c = (GPTModel(_config(False, seed), ps) for seed in (7, 7, 8))
    for (name, pa), pb, pc in zip(a.named_parameters(), b.parameters(), c.parameters()):
        assert torch.equal(pa, pb), name
        if hasattr(pa, "init_method"):
            assert not torch.equal(pa, pc), name
    # Re-initializing in place reproduces the constructor's values, one tensor at a time.
    with torch.no_grad():
        for p in b.parameters():
            p.zero_()
    names = initialize_parameters(b, 7, 0, 1, vocab_size=100)
    assert "embedding.weight" in names and "layers.1.self_attention.linear_qkv.weight" in names
    for (name, pa), pb in zip(a.named_parameters(), b.parameters()):
        if name in names:
            assert torch.equal(pa, pb), name
        else:  # norms are not random: their init is the constructor's ones
            assert "layernorm" in name and torch.all(pa == 1), name


def _rng_body(rank: int, world_size: int) -> None:
    """TP=2 x DP=2: forked draws differ across TP ranks, agree across DP replicas; default draws agree."""
    ps = ParallelState(world_size=world_size, tensor_model_parallel_size=2).init_process_groups()
    rng = model_parallel_seed(11, ps.tp_group.rank, ps.coords.pp)
    with rng.fork():
        forked = torch.rand(16)
    default = torch.rand(16)
    everything = C.all_gather(torch.stack([forked, default]).unsqueeze(0), ps.dp_group, "dp_grad_reduce")
    assert torch.equal(everything[0], everything[-1]), "DP replicas must draw the same numbers"
    tp_view = C.all_gather(torch.stack([forked, default]).unsqueeze(0), ps.tp_group, "tp_allgather")
    assert not torch.equal(tp_view[0, 0], tp_view[1, 0]), "forked streams must differ across TP ranks"
    assert torch.equal(tp_view[0, 1], tp_view[1, 1]), "default streams must agree across TP ranks"


@pytest.mark.distributed
def test_model_parallel_rng_streams():
    run_distributed(_rng_body, world_size=4)


def test_model_parallel_rng_fork_and_checkpoint():
    rng = model_parallel_seed(5, tp_rank=0)
    torch.manual_seed(5)
    expected_default = torch.rand(4)
    rng = model_parallel_seed(5, tp_rank=0)
    with rng.fork():
        torch.rand(3)  # a forked region consumes nothing from the default stream
    assert torch.equal(torch.rand(4), expected_default)

    saved = rng.state_dict()
    with rng.fork():
        forked_next = torch.rand(4)
    default_next = torch.rand(4)
    restored = ModelParallelRNG()
    restored.load_state_dict(saved)
    with restored.fork():
        assert torch.equal(torch.rand(4), forked_next)
    assert torch.equal(torch.rand(4), default_next)
    with pytest.raises(KeyError, match="no state"):
        with ModelParallelRNG().fork():
            pass
