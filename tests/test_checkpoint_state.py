"""What a checkpoint carries besides weights, and how shards map to global coordinates.

- Chunk mapping: for every TP size, stride and vocab padding, the chunks ``tensor_parallel_state`` and
  ``param_flat_range_state`` produce for all ranks tile the full (unpadded) tensor exactly once with the
  values ``shard_tensor`` (the layers' own sharding rule) puts there.
- RNG (python, numpy, torch, the model-parallel tracker) and extra state round-trip bit-exactly, per
  rank, in a 2-process PP=2 job; the FP8 saturation guard's switches saved per pipeline stage are merged
  when the checkpoint is loaded at PP=1; RNG states are not restored across a layout change (and say so).
"""
import random

import numpy as np
import pytest
import torch

from distributed_testing import run_distributed
from megafp8.checkpoint import (ShardedChunks, capture_rng_state, load_checkpoint, param_flat_range_state,
                                restore_rng_state, save_checkpoint, tensor_parallel_state)
from megafp8.fp8 import SaturationGuard
from megafp8.model import GPTModel, ModelConfig
from megafp8.parallel.parallel_state import ParallelState
from megafp8.parallel.random import model_parallel_seed
from megafp8.parallel.sharding import resize_vocab_dim, set_tensor_model_parallel_attributes, shard_tensor


def _tiled(chunk_lists: list[ShardedChunks], shape: tuple[int, ...]) -> tuple[torch.Tensor, torch.Tensor]:
    """Place every chunk at its offsets; return (values, how many chunks covered each element)."""
    values, cover = torch.zeros(shape), torch.zeros(shape, dtype=torch.int64)
    for sc in chunk_lists:
        assert tuple(sc.global_shape) == shape
        for offsets, tensor in sc.chunks:
            index = tuple(slice(o, o + s) for o, s in zip(offsets, tensor.shape))
            values[index] = tensor
            cover[index] += 1
    return values, cover


@pytest.mark.parametrize("tp,dim,stride,padded", [(2, 0, 1, False), (4, 0, 2, False), (2, 1, 1, False),
                                                  (3, 0, 1, True), (4, 0, 1, True), (2, 1, 2, False)])
def test_chunks_tile_the_full_tensor(tp, dim, stride, padded):
    vocab = 10
    full_shape = [vocab if padded else 8 * tp, 6] if dim == 0 else [5, 8 * tp]
    full = torch.randn(full_shape)
    padded_full = resize_vocab_dim(full, -(-vocab // tp) * tp, 0) if padded else full
    shards = [shard_tensor(padded_full, tp, r, dim, stride) for r in range(tp)]
    whole, ranges = [], []
    for rank, shard in enumerate(shards):
        param = torch.nn.Parameter(shard.clone())
        set_tensor_model_parallel_attributes(param, dim, stride, padded_vocab=padded)
        whole.append(tensor_parallel_state(shard, param, rank, tp, vocab if padded else None))
        flat = shard.reshape(-1)
        cuts = [0, flat.numel() // 3 + 1, flat.numel() // 3 + 1, flat.numel() - 2, flat.numel()]  # uneven, one empty
        ranges += [param_flat_range_state(flat[a:b], a, param, rank, tp, vocab if padded else None)
                   for a, b in zip(cuts, cuts[1:])]
    for chunk_lists in (whole, ranges):
        values, cover = _tiled(chunk_lists, tuple(full.shape))
        assert torch.equal(cover, torch.ones_like(cover)) and torch.equal(values, full)


def test_replicated_tensor_is_not_chunked():
    param = torch.nn.Parameter(torch.ones(4))
    local = param.detach()
    assert tensor_parallel_state(local, param, 1, 2) is local  # DCP dedups it across ranks: saved once


def _draws(tracker) -> list:
    with tracker.fork():
        forked = torch.rand(3).tolist()
    return [random.random(), float(np.random.rand()), torch.rand(3).tolist(), forked]


def test_rng_round_trip_bit_exact():
    tracker = model_parallel_seed(7, tp_rank=1)
    random.seed(3)
    np.random.seed(4)
    state = capture_rng_state(tracker)
    expected = _draws(tracker)
    _draws(tracker)  # advance every generator further
    restore_rng_state(state, tracker)
    assert _draws(tracker) == expected


def _config() -> ModelConfig:
    return ModelConfig(num_layers=2, hidden_size=32, ffn_hidden_size=64, num_attention_heads=4, num_query_groups=2,
                       seq_length=8, vocab_size=50, make_vocab_size_divisible_by=8)


def _pp2_body(rank: int, world_size: int, root: str) -> None:
    ps = ParallelState(world_size=2, pipeline_model_parallel_size=2).init_process_groups()
    model = GPTModel(_config(), ps, pre_process=rank == 0, post_process=rank == 1, layer_numbers=[rank])
    tracker = model_parallel_seed(100 + rank, tp_rank=0, pp_rank=rank)
    random.seed(rank)
    np.random.seed(10 + rank)
    guard = SaturationGuard()
    guard.strikes = {f"layers.{rank}.mlp.linear_fc1": 2}
    guard.switched = {f"layers.{rank}.self_attention.linear_qkv"}
    extra = {"scheduler": {"num_steps": 40, "lr": 1.5e-4}, "skipped": 2, "tensor": torch.arange(5.0)}
    save_checkpoint(root, 9, model=model, parallel_state=ps, extra=extra, rng_tracker=tracker,
                    saturation_guard=guard, consumed_samples=72)
    expected = _draws(tracker)
    _draws(tracker)
    new_guard = SaturationGuard()
    loaded = load_checkpoint(root, model=model, parallel_state=ps, rng_tracker=tracker, saturation_guard=new_guard)
    assert loaded.rng_restored and loaded.consumed_samples == 72 and loaded.iteration == 9
    assert _draws(tracker) == expected  # this rank's own streams, bit-exact
    assert loaded.extra["scheduler"] == extra["scheduler"] and torch.equal(loaded.extra["tensor"], extra["tensor"])
    assert new_guard.switched == {f"layers.{rank}.self_attention.linear_qkv"}
    assert new_guard.strikes == {"layers.0.mlp.linear_fc1": 2, "layers.1.mlp.linear_fc1": 2}


@pytest.mark.distributed
def test_rng_extra_and_guard_across_pipeline_stages(tmp_path):
    run_distributed(_pp2_body, world_size=2, args=(str(tmp_path),))
    ps = ParallelState().init_process_groups()
    model = GPTModel(_config(), ps)
    guard = SaturationGuard()
    before = torch.get_rng_state()
    loaded = load_checkpoint(tmp_path, model=model, parallel_state=ps, saturation_guard=guard)
    assert not loaded.rng_restored and "RNG states not restored" in loaded.messages[0]
    assert torch.equal(torch.get_rng_state(), before)
    assert guard.switched == {"layers.0.self_attention.linear_qkv", "layers.1.self_attention.linear_qkv"}
    assert model.layers["0"].self_attention.linear_qkv.guard_high_precision
    assert model.layers["1"].self_attention.linear_qkv.guard_high_precision
    assert loaded.extra["skipped"] == 2


def test_model_chunks_list_loads_into_one_model(tmp_path):
    """A rank's list of pipeline chunks (global layer names) saves as one model; PP=1 loads it whole."""
    ps = ParallelState().init_process_groups()
    cfg = ModelConfig(**{**vars(_config()), "tie_embeddings": False})
    torch.manual_seed(0)
    chunks = [GPTModel(cfg, ps, post_process=False, layer_numbers=[0]),
              GPTModel(cfg, ps, pre_process=False, layer_numbers=[1])]
    save_checkpoint(tmp_path, 1, model=chunks, parallel_state=ps)
    whole = GPTModel(cfg, ps)
    load_checkpoint(tmp_path, model=whole, parallel_state=ps)
    merged = {**chunks[0].state_dict(), **chunks[1].state_dict()}
    assert merged.keys() == whole.state_dict().keys()
    assert all(torch.equal(v, merged[k]) for k, v in whole.state_dict().items())
