"""GPTModel in FP8 sharded over TP=2 / TP=4 (with and without sequence parallelism) against the TP=1 FP8 run,
and the bytes the FP8 sequence-parallel all-gather puts on the wire.

"Synchronized scales": the TP=1 reference takes one delayed-scaling step (amax histories filled), then
every TP rank loads its state dict, scales included, so both runs quantize with the same scales. The
FP8 bytes are then the same up to fp32 summation order in the inputs they quantize, and loss and
gradients must agree to 1e-3 relative (loss) and 40 dB SQNR (gradients): a wrong scale sync or a
gather of the wrong bytes gives errors of order 1 (< 10 dB). After the compared step, each side runs
its own scale update: the TP side's amax all-reduce over the TP group must reproduce the TP=1 scales
(max is exact, so they are compared for equality).
"""
import pytest
import torch

from distributed_testing import run_distributed
from fp8_testing import sqnr_db
from megafp8.fp8 import Fp8Recipe
from megafp8.model import GPTModel, ModelConfig
from megafp8.parallel import collectives as C
from megafp8.parallel.fp8_sequence_parallel import fp8_scaling_manager
from megafp8.parallel.parallel_state import ParallelState
from megafp8.parallel.sharding import gather_tensor_model_parallel, shard_state_dict
from megafp8.parallel.tensor_parallel import allreduce_sequence_parallel_grads

BATCH = 2
RECIPE = Fp8Recipe.delayed(amax_history_len=4)


def _config(activation="swiglu") -> ModelConfig:
    return ModelConfig(num_layers=2, hidden_size=64, ffn_hidden_size=128, num_attention_heads=8, num_query_groups=4,
                       seq_length=16, vocab_size=100, make_vocab_size_divisible_by=8, activation=activation)


def _batch(cfg, seed):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, cfg.vocab_size, (BATCH, cfg.seq_length), generator=g)
    return ids, torch.randint(0, cfg.vocab_size, (BATCH, cfg.seq_length), generator=g)


def _assert_grads_match(model, reference, ps, cfg, floor_db: float, case: str) -> None:
    """Gather every sharded grad to its TP=1 shape (vocab padding cut) and compare by SQNR."""
    ref_params = dict(reference.named_parameters())
    for name, param in model.named_parameters():
        full_grad = gather_tensor_model_parallel(param.grad, param, ps.tp_group)
        ref_grad = ref_params[name].grad
        if getattr(param, "padded_vocab", False):
            full_grad, ref_grad = full_grad[: cfg.vocab_size], ref_grad[: cfg.vocab_size]
        assert sqnr_db(full_grad, ref_grad) >= floor_db, (case, name, sqnr_db(full_grad, ref_grad))


def _fp8_equivalence_body(rank: int, world_size: int) -> None:
    n = world_size
    for sp, activation in ((False, "swiglu"), (True, "smooth_swiglu")):
        cfg = _config(activation)
        case = f"TP={n} sequence_parallel={sp} activation={activation}"
        torch.manual_seed(0)
        ps1 = ParallelState().init_process_groups()
        reference = GPTModel(cfg, ps1, fp8_recipe=RECIPE)
        ref_manager = fp8_scaling_manager(reference, ps1)
        ids, labels = _batch(cfg, 1)
        reference(ids, labels).mean().backward()  # step 1: fill the amax histories
        ref_manager.update()
        reference.zero_grad()

        ps = ParallelState(world_size=n, tensor_model_parallel_size=n, sequence_parallel=sp).init_process_groups()
        model = GPTModel(cfg, ps, fp8_recipe=RECIPE)
        model.load_state_dict(shard_state_dict(reference.state_dict(), model, n, ps.tp_group.rank))

        ids, labels = _batch(cfg, 2)  # step 2, compared
        ref_loss = reference(ids, labels)
        ref_loss.mean().backward()
        loss = model(ids, labels)
        loss.mean().backward()
        allreduce_sequence_parallel_grads(model, ps)
        rel = ((loss - ref_loss).abs().max() / ref_loss.abs().max()).item()
        assert rel <= 1e-3, (case, rel)

        _assert_grads_match(model, reference, ps, cfg, 40.0, case)

        ps.comm.reset()
        fp8_scaling_manager(model, ps).update()
        ref_manager.update()
        assert ps.comm["amax_reduce"] > 0 or n == 1, "the amax reduction must go over the TP group"
        ref_states = dict(reference.named_buffers())
        for name, buf in model.named_buffers():
            if name.endswith(".scale"):
                assert torch.equal(buf, ref_states[name]), (case, name, buf, ref_states[name])


@pytest.mark.distributed
@pytest.mark.parametrize("tp", [2, 4])
def test_fp8_tensor_parallel_matches_tp1_fp8(tp):
    run_distributed(_fp8_equivalence_body, world_size=tp)


# ---- bytes on the wire ----

def _sp_allgather_bytes(rank: int, world_size: int, results_file: str) -> None:
    """Counts tp_sp_allgather bytes of the transformer blocks' forward+backward, FP8 vs BF16.

    Only the blocks (not the output head): the head's gather is high precision by design, in both runs.
    """
    import json

    n = world_size
    cfg = _config()
    cfg.params_dtype = torch.bfloat16
    counts = {}
    for name, recipe in (("bf16", None), ("fp8", Fp8Recipe.delayed(amax_history_len=1))):
        torch.manual_seed(0)
        ps = ParallelState(world_size=n, tensor_model_parallel_size=n, sequence_parallel=True).init_process_groups()
        model = GPTModel(cfg, ps, fp8_recipe=recipe)
        x = torch.randn(cfg.seq_length // n, BATCH, cfg.hidden_size, dtype=torch.bfloat16, requires_grad=True)
        rotary = model.rotary(cfg.seq_length)
        ps.comm.reset()
        out = x
        for layer in model.layers.values():
            out = layer(out, rotary)
        out.float().square().sum().backward()
        counts[name] = ps.comm.snapshot()["tp_sp_allgather"]
    if rank == 0:
        with open(results_file, "w") as f:
            json.dump(counts, f)


@pytest.mark.distributed
def test_fp8_sequence_parallel_allgather_bytes(tmp_path):
    """FP8 SP all-gather: 1 byte per element (the tensorwise scale is already identical on every rank,
    so it does not travel) vs 2 bytes per element in BF16, and exactly the analytic count. Per block four gathers of a [s/TP, b, hidden] shard: forward, the
    inputs of the two column-parallel layers (QKV, FC1); backward, the output gradients of the two
    row-parallel layers (proj, FC2), which dgrad and wgrad consume in FP8 (E5M2) anyway."""
    import json

    n = 2
    results = tmp_path / "bytes.json"
    run_distributed(_sp_allgather_bytes, world_size=n, args=(str(results),))
    counts = json.loads(results.read_text())
    cfg = _config()
    local_elems = cfg.seq_length // n * BATCH * cfg.hidden_size
    gathers = 4 * cfg.num_layers
    assert counts["bf16"] == gathers * local_elems * 2 * (n - 1)
    assert counts["fp8"] == gathers * local_elems * 1 * (n - 1)
    assert counts["fp8"] <= 0.52 * counts["bf16"], counts


def _current_scaling_body(rank: int, world_size: int) -> None:
    """Current-scaling recipes under TP=2 + SP: their scales are computed per shard (a row-parallel
    weight shard has its own rowwise/blockwise scales), so the match is to FP8 accuracy, not exact.
    This exercises the gathered per-row/per-block scales and the re-quantized transposed copies."""
    n = world_size
    cfg = _config()
    for recipe in (Fp8Recipe.tensorwise(), Fp8Recipe.rowwise(), Fp8Recipe.blockwise()):
        torch.manual_seed(0)
        reference = GPTModel(cfg, ParallelState().init_process_groups(), fp8_recipe=recipe)
        ps = ParallelState(world_size=n, tensor_model_parallel_size=n, sequence_parallel=True).init_process_groups()
        model = GPTModel(cfg, ps, fp8_recipe=recipe)
        model.load_state_dict(shard_state_dict(reference.state_dict(), model, n, ps.tp_group.rank))
        ids, labels = _batch(cfg, 3)
        ref_loss, loss = reference(ids, labels), model(ids, labels)
        ref_loss.mean().backward()
        loss.mean().backward()
        allreduce_sequence_parallel_grads(model, ps)
        assert sqnr_db(loss, ref_loss) >= 30.0, (recipe.scaling, sqnr_db(loss, ref_loss))
        _assert_grads_match(model, reference, ps, cfg, 15.0, recipe.scaling)


@pytest.mark.distributed
def test_current_scaling_recipes_under_sequence_parallel():
    run_distributed(_current_scaling_body, world_size=2)
