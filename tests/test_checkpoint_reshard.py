"""Checkpoints reshard on load: saved at one TP/PP/DP layout, loaded at another by torch.distributed.checkpoint.

Three checkpoints are written by one 4-process gloo job:
- P: an fp32 GPTModel (tied embeddings) at TP=2 x PP=2, its weights cut from a TP=1 reference model
  (same seed on every rank); the reference's logits are the oracle. Loaded at TP=1 (1 process) and TP=4
  (4 processes): logits equal the reference's within fp32 summation-order noise (<= 1e-6 relative to
  max |logit|); a wrong chunk offset gives errors of order 1.
- F: an FP8 (delayed scaling) model at TP=2 x DP=2 with known amax histories / scales, plus ZeRO-style
  moments (each DP rank owns a flat range of each TP shard, value 2 * weight + 1). Loaded at TP=4 and
  TP=1: every buffer is bit-identical, and every rank's new range of every moment equals 2 * its
  loaded weight + 1 (vocab-padding rows are not in the checkpoint and keep the template's NaN).
- O: an optimizer-like 1-D flat state owned in uneven ranges (one empty) at DP=4, loaded at DP=2 as
  the exact re-slice, plus a python leaf.
"""

import math
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp

from distributed_testing import run_distributed
from megafp8.checkpoint import flat_sharded_state, load_checkpoint, param_flat_range_state, save_checkpoint
from megafp8.fp8 import Fp8Recipe
from megafp8.model import GPTModel, ModelConfig
from megafp8.parallel import collectives as C
from megafp8.parallel.parallel_state import ParallelState
from megafp8.parallel.sharding import shard_state_dict

BATCH = 2
FLAT_NUMEL = 37
DP4_BOUNDS = [0, 10, 19, 19, 37]  # rank 2 owns nothing


def _config(tie: bool) -> ModelConfig:
    return ModelConfig(num_layers=2, hidden_size=64, ffn_hidden_size=96, num_attention_heads=8, num_query_groups=4,
                       seq_length=16, vocab_size=100, make_vocab_size_divisible_by=8, tie_embeddings=tie)


def _ids(cfg: ModelConfig) -> torch.Tensor:
    return torch.randint(0, cfg.vocab_size, (BATCH, cfg.seq_length), generator=torch.Generator().manual_seed(1))


def _rel_err(actual: torch.Tensor, expected: torch.Tensor) -> float:
    return ((actual - expected).abs().max() / expected.abs().max()).item()


def _known_scaling_values(name: str, like: torch.Tensor) -> torch.Tensor:
    """Distinct, name-derived values for an FP8 scaling buffer (what a trained run would have)."""
    seed = sum(map(ord, name))
    return torch.rand(like.shape, generator=torch.Generator().manual_seed(seed)) * 100


def _dp_range(numel: int, dp_rank: int, dp_size: int) -> tuple[int, int]:
    bounds = [round(numel * i / dp_size) for i in range(dp_size + 1)]
    return bounds[dp_rank], bounds[dp_rank + 1]


def _moments(model: GPTModel, ps: ParallelState, fill: float | None) -> tuple[dict, dict]:
    """ZeRO-style state: this DP rank's flat range of each parameter's TP shard (2 * w + 1, or ``fill``)."""
    state, local = {}, {}
    for name, p in model.named_parameters():
        start, end = _dp_range(p.numel(), ps.coords.dp, ps.dp_size)
        values = 2 * p.detach().reshape(-1)[start:end] + 1 if fill is None else torch.full((end - start,), fill)
        local[name] = (values, start)
        state[name] = {"exp_avg": param_flat_range_state(values, start, p, ps.coords.tp, ps.tp_size,
                                                         model.config.vocab_size)}
    return {"params": state, "step": 7 if fill is None else 0}, local


def _fp8_model(ps: ParallelState) -> GPTModel:
    return GPTModel(_config(tie=False), ps, fp8_recipe=Fp8Recipe(scaling="delayed", amax_history_len=8))


def _save_body(rank: int, world_size: int, root: str) -> None:
    # P: TP=2 x PP=2 from a TP=1 reference
    cfg = _config(tie=True)
    torch.manual_seed(0)
    reference = GPTModel(cfg, ParallelState().init_process_groups())
    full = reference.state_dict()
    if rank == 0:
        torch.save(reference(_ids(cfg))[..., : cfg.vocab_size].detach(), f"{root}/reference_logits.pt")
    ps = ParallelState(world_size=4, tensor_model_parallel_size=2, pipeline_model_parallel_size=2).init_process_groups()
    first, last = ps.is_pipeline_first_stage, ps.is_pipeline_last_stage
    stage = GPTModel(cfg, ps, pre_process=first, post_process=last, layer_numbers=[ps.coords.pp])
    if not first:  # the last stage's own copy of the tied embedding
        full["output_layer.weight"] = full["embedding.weight"]
    stage_keys = stage.state_dict().keys()
    stage.load_state_dict(shard_state_dict({k: v for k, v in full.items() if k in stage_keys}, stage, 2, ps.coords.tp))
    save_checkpoint(f"{root}/P", 3, model=stage, parallel_state=ps, args={"num_layers": 2})

    # F: FP8 model at TP=2 x DP=2 with known scaling state and ZeRO moments
    ps = ParallelState(world_size=4, tensor_model_parallel_size=2).init_process_groups()
    model = _fp8_model(ps)
    for name, buf in model.state_dict().items():
        if "fp8_scaling" in name:
            buf.copy_(_known_scaling_values(name, buf))
    optimizer_state, _ = _moments(model, ps, fill=None)
    save_checkpoint(f"{root}/F", 5, model=model, parallel_state=ps, optimizer_state=optimizer_state)

    # O: flat 1-D state in uneven ranges at DP=4
    ps = ParallelState(world_size=4).init_process_groups()
    model = GPTModel(_config(tie=True), ps)
    start, end = DP4_BOUNDS[rank], DP4_BOUNDS[rank + 1]
    flat = {"exp_avg": (torch.arange(start, end, dtype=torch.float32) * 1.5, start, FLAT_NUMEL),
            "exp_avg_sq": (torch.arange(start, end, dtype=torch.float64) ** 2, start, FLAT_NUMEL)}
    save_checkpoint(f"{root}/O", 1, model=model, parallel_state=ps,
                    optimizer_state={"flat": flat_sharded_state(flat), "step": 11})


def _check_logits(root: str, tp: int) -> None:
    cfg = _config(tie=True)
    ps = ParallelState(world_size=tp, tensor_model_parallel_size=tp).init_process_groups()
    torch.manual_seed(123)  # a different random init: every weight must come from the checkpoint
    model = GPTModel(cfg, ps)
    loaded = load_checkpoint(f"{root}/P", model=model, parallel_state=ps, args={"num_layers": 2})
    assert loaded.iteration == 3
    logits = model(_ids(cfg))
    if tp > 1:
        logits = C.all_gather(logits, ps.tp_group, "tp_allgather", dim=-1)
    reference = torch.load(f"{root}/reference_logits.pt")
    assert _rel_err(logits[..., : cfg.vocab_size], reference) <= 1e-6, (tp, _rel_err(logits[..., : cfg.vocab_size], reference))
    weight = model.embedding.weight
    rows = torch.arange(weight.shape[0]) + ps.coords.tp * weight.shape[0]
    assert torch.all(weight[rows >= cfg.vocab_size] == 0)  # padding rows: not in the checkpoint, zeroed on load


def _check_fp8_and_moments(root: str, tp: int) -> None:
    ps = ParallelState(world_size=tp, tensor_model_parallel_size=tp).init_process_groups()
    model = _fp8_model(ps)
    template, local = _moments(model, ps, fill=float("nan"))
    loaded = load_checkpoint(f"{root}/F", model=model, parallel_state=ps, optimizer_state=template)
    assert loaded.optimizer_loaded and template["step"] == 7
    checked = 0
    for name, buf in model.state_dict().items():
        if "fp8_scaling" in name:
            assert torch.equal(buf, _known_scaling_values(name, buf)), name
            checked += 1
    assert checked == 2 * 3 * 4 * 2  # layers x linears x roles x (history, scale)
    vocab = model.config.vocab_size
    for name, p in model.named_parameters():
        values, start = local[name]
        expected = 2 * p.detach().reshape(-1)[start:start + values.numel()] + 1
        if getattr(p, "padded_vocab", False):  # rows past the real vocab are not saved: the template's NaN stays
            row = torch.arange(start, start + values.numel()) // p.shape[1] + ps.coords.tp * p.shape[0]
            expected = torch.where(row < vocab, expected, torch.nan)
        assert torch.equal(values.isnan(), expected.isnan()) and torch.equal(values.nan_to_num(), expected.nan_to_num()), name


def _check_flat(root: str) -> None:
    ps = ParallelState(world_size=4, tensor_model_parallel_size=2).init_process_groups()
    start, end = _dp_range(FLAT_NUMEL, ps.coords.dp, ps.dp_size)
    flat = {"exp_avg": (torch.zeros(end - start), start, FLAT_NUMEL),
            "exp_avg_sq": (torch.zeros(end - start, dtype=torch.float64), start, FLAT_NUMEL)}
    template = {"flat": flat_sharded_state(flat), "step": 0}
    load_checkpoint(f"{root}/O", model=GPTModel(_config(tie=True), ps), parallel_state=ps, optimizer_state=template)
    assert torch.equal(flat["exp_avg"][0], torch.arange(start, end, dtype=torch.float32) * 1.5)
    assert torch.equal(flat["exp_avg_sq"][0], torch.arange(start, end, dtype=torch.float64) ** 2)
    assert template["step"] == 11


def _check_pipeline_stages(root: str) -> None:
    """P loaded at TP=1 x PP=2 x DP=2: every stage parameter equals the reference's tensor, the last
    stage's tied output weight included (read from ``embedding.weight``)."""
    cfg = _config(tie=True)
    torch.manual_seed(0)
    full = GPTModel(cfg, ParallelState().init_process_groups()).state_dict()
    ps = ParallelState(world_size=4, pipeline_model_parallel_size=2).init_process_groups()
    first, last = ps.is_pipeline_first_stage, ps.is_pipeline_last_stage
    stage = GPTModel(cfg, ps, pre_process=first, post_process=last, layer_numbers=[ps.coords.pp])
    load_checkpoint(f"{root}/P", model=stage, parallel_state=ps)
    for name, value in stage.state_dict().items():
        expected = full["embedding.weight" if name == "output_layer.weight" else name]
        if name in ("embedding.weight", "output_layer.weight"):  # real vocab rows; padding rows are zero
            value, expected = value[: cfg.vocab_size], expected[: cfg.vocab_size]
        assert torch.equal(value, expected), name
    assert sorted(stage.state_dict()) == sorted(
        [k for k in full if k.startswith(f"layers.{ps.coords.pp}.")] + (["embedding.weight"] if first else [])
        + (["final_layernorm.weight", "output_layer.weight"] if last else []))


def _load_tp4_body(rank: int, world_size: int, root: str) -> None:
    _check_pipeline_stages(root)
    _check_logits(root, tp=4)
    _check_fp8_and_moments(root, tp=4)
    _check_flat(root)


def _check_saved_once(root: str) -> None:
    """F was written by TP=2 x DP=2: every element is stored once (DP replicas deduplicated), replicated
    tensors as one chunk, the fused FC1 weight (stride 2) as 2 blocks x 2 TP ranks, vocab padding not at all."""
    full_metadata = dcp.FileSystemReader(f"{root}/F/iter_0000005").read_metadata()
    metadata = full_metadata.state_dict_metadata
    tensors = {k: v for k, v in metadata.items() if hasattr(v, "chunks")}
    for key, md in tensors.items():
        assert sum(math.prod(c.sizes) for c in md.chunks) == math.prod(md.size), key
    assert len(tensors["model.layers.0.input_layernorm.weight"].chunks) == 1
    assert len(tensors["model.layers.0.mlp.linear_fc1.weight"].chunks) == 4
    assert len(tensors["model.layers.0.mlp.linear_fc1.fp8_scaling.input.amax_history"].chunks) == 1
    assert tensors["model.output_layer.weight"].size == torch.Size([100, 64])  # the real vocab, not 112
    items = full_metadata.storage_data.items()
    data_bytes = sum(p.stat().st_size for p in Path(f"{root}/F/iter_0000005").glob("*.distcp"))
    assert data_bytes == sum(info.length for _, info in items)
    tensor_bytes = sum(math.prod(md.size) * md.properties.dtype.itemsize for md in tensors.values())
    stored = [info.length for index, info in items if index.fqn in tensors]
    # DCP frames each stored item (~1.6 kB); a DP replica writing its copy too would add tensor_bytes again
    assert tensor_bytes <= sum(stored) < tensor_bytes + 2048 * len(stored)


@pytest.mark.distributed
def test_reshard_on_load(tmp_path):
    root = str(tmp_path)
    run_distributed(_save_body, world_size=4, args=(root,), timeout_s=600)
    _check_saved_once(root)
    run_distributed(_load_tp4_body, world_size=4, args=(root,), timeout_s=600)
    # TP=1 in this process: no process group at all
    _check_logits(root, tp=1)
    _check_fp8_and_moments(root, tp=1)
