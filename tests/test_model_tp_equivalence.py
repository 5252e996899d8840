"""GPTModel sharded over TP=2 / TP=4 (with and without sequence parallelism) equals the TP=1 model in fp32.

Every rank builds the same TP=1 reference (same seed), cuts its state dict into this rank's shards with
``shard_state_dict`` and runs the same batch. Sharded logits are all-gathered along the vocab, sharded
grads are all-gathered along their partition dim (``gather_tensor_model_parallel``, stride-aware); the
vocab padding, which differs between TP sizes, is cut off before comparing. Error metric:
``max|a - b| / max|b|`` per tensor (elementwise relative error is meaningless near zero). The 1e-5
bound leaves room only for fp32 summation-order differences (~1e-7 observed); a wrong shard, a
missing reduction or a dropped SP grad all-reduce gives errors of order 1.
"""
import pytest
import torch

from distributed_testing import run_distributed
from megafp8.model import GPTModel, ModelConfig
from megafp8.parallel import collectives as C
from megafp8.parallel.parallel_state import ParallelState
from megafp8.parallel.sharding import gather_tensor_model_parallel, shard_state_dict
from megafp8.parallel.tensor_parallel import allreduce_sequence_parallel_grads

BATCH = 2
TOLERANCE = 1e-5


def _config(tie: bool) -> ModelConfig:
    # 8 heads / 4 groups so TP=4 still holds whole groups (1 group, 2 query heads per rank); GQA r = 2.
    return ModelConfig(num_layers=2, hidden_size=64, ffn_hidden_size=96, num_attention_heads=8, num_query_groups=4,
                       seq_length=16, vocab_size=100, make_vocab_size_divisible_by=8, tie_embeddings=tie)


def _rel_err(actual: torch.Tensor, expected: torch.Tensor) -> float:
    return ((actual - expected).abs().max() / expected.abs().max()).item()


def expected_tp_bytes(cfg: ModelConfig, tp: int, sp: bool) -> dict[str, int]:
    """Bytes one rank sends in one forward+backward with labels, by the convention in collectives.py.

    Per layer two TP regions (attention, MLP) plus one at each end (embedding, output head) = 2L + 1
    entries and 2L + 1 exits; each costs one collective forward and its dual backward.
    """
    regions = 2 * cfg.num_layers + 1
    act_bytes = cfg.seq_length * BATCH * cfg.hidden_size * 4
    tokens = cfg.seq_length * BATCH
    # CE: all-reduce of the per-token max, then one of (target logit, sum exp) stacked
    ce = 2 * tokens * 4 * (tp - 1) // tp + 2 * (2 * tokens * 4) * (tp - 1) // tp
    if sp:
        # Each entry (a column-parallel layer) also re-gathers its saved input shard in backward for wgrad.
        per_gather = act_bytes // tp * (tp - 1)
        return {"tp_sp_allgather": 3 * regions * per_gather, "tp_reduce_scatter": 2 * regions * per_gather,
                "tp_allreduce": ce}
    return {"tp_sp_allgather": 0, "tp_reduce_scatter": 0,
            "tp_allreduce": 2 * regions * (2 * act_bytes * (tp - 1) // tp) + ce}


def _equivalence_body(rank: int, world_size: int) -> None:
    n = world_size
    for sp, tie in ((False, False), (True, True), (True, False), (False, True)):
        cfg = _config(tie)
        torch.manual_seed(0)
        reference = GPTModel(cfg, ParallelState().init_process_groups())
        g = torch.Generator().manual_seed(1)
        ids = torch.randint(0, cfg.vocab_size, (BATCH, cfg.seq_length), generator=g)
        labels = torch.randint(0, cfg.vocab_size, (BATCH, cfg.seq_length), generator=g)
        loss_weights = torch.rand(BATCH, cfg.seq_length, generator=g)  # uneven weights exercise every token's grad
        ref_logits = reference(ids)[..., : cfg.vocab_size]
        ref_loss = reference(ids, labels)
        (ref_loss * loss_weights).sum().backward()

        ps = ParallelState(world_size=n, tensor_model_parallel_size=n, sequence_parallel=sp).init_process_groups()
        tp = ps.tp_group
        model = GPTModel(cfg, ps)
        model.load_state_dict(shard_state_dict(reference.state_dict(), model, n, tp.rank))
        case = f"TP={n} sequence_parallel={sp} tie_embeddings={tie}"

        logits = C.all_gather(model(ids), tp, "tp_allgather", dim=-1)[..., : cfg.vocab_size]
        assert _rel_err(logits, ref_logits) <= TOLERANCE, (case, _rel_err(logits, ref_logits))

        ps.comm.reset()
        loss = model(ids, labels)
        assert _rel_err(loss, ref_loss) <= TOLERANCE, case
        (loss * loss_weights).sum().backward()
        counted = ps.comm.snapshot_and_reset()
        expected = expected_tp_bytes(cfg, n, sp)
        assert {k: counted[k] for k in expected} == expected, (case, counted, expected)

        allreduce_sequence_parallel_grads(model, ps)
        if sp:  # norm weights: 2 per layer + final norm, one coalesced all-reduce
            norm_bytes = (2 * cfg.num_layers + 1) * cfg.hidden_size * 4
            assert ps.comm["tp_allreduce"] == 2 * norm_bytes * (n - 1) // n, case

        ref_params = dict(reference.named_parameters())
        names = [name for name, _ in model.named_parameters()]
        assert names == list(ref_params), case
        for name, param in model.named_parameters():
            full_grad = gather_tensor_model_parallel(param.grad, param, tp)
            ref_grad = ref_params[name].grad
            if getattr(param, "padded_vocab", False):
                full_grad, ref_grad = full_grad[: cfg.vocab_size], ref_grad[: cfg.vocab_size]
            assert _rel_err(full_grad, ref_grad) <= TOLERANCE, (case, name, _rel_err(full_grad, ref_grad))


@pytest.mark.distributed
@pytest.mark.parametrize("tp", [2, 4])
def test_tensor_parallel_matches_tp1_fp32(tp):
    """A failure names the case and the parameter: a wrong shard layout shows up in that weight's grad,
    a missing SP grad reduction in the norm weights, a wrong dual mapping in the embedding grad."""
    run_distributed(_equivalence_body, world_size=tp)
