"""The model's part of a checkpoint: every parameter and persistent buffer under a layout-free name and
global shape, so any TP/PP/DP layout of the same model saves and loads the same entries.

Names are the module's own (``layers.{i}`` carries the global layer index, so pipeline stages and
virtual chunks never collide). Tensor-parallel parameters become ``ShardedChunks`` via their
``partition_dim``/``partition_stride``/``padded_vocab`` tags; everything else (norms, FP8 amax
histories and scales, which the amax reduction keeps identical on every rank) is replicated and DCP
writes it once. The last pipeline stage's copy of a tied embedding (``shared_embedding``) is saved as
``embedding.weight``: it equals the first stage's after the embedding-group sync, and a PP=1 model
(which has no ``output_layer.weight`` when tied) loads it from there.
"""
from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch
from torch import nn

from megafp8.checkpoint.sharded_tensor import ShardedChunks, tensor_parallel_state
from megafp8.parallel.parallel_state import ParallelState

TIED_EMBEDDING = "embedding.weight"


def _vocab_size(model: nn.Module) -> int | None:
    config = getattr(model, "config", None)
    return getattr(config, "vocab_size", None)


def checkpoint_key(name: str, param: torch.Tensor | None) -> str:
    """The layout-free checkpoint name of parameter ``name`` (optimizer state keyed by parameter should
    use it too, so the last stage's tied output weight and the PP=1 embedding share one entry)."""
    return TIED_EMBEDDING if param is not None and getattr(param, "shared_embedding", False) else name


def model_checkpoint_state(models: nn.Module | Sequence[nn.Module], parallel_state: ParallelState, *,
                           params_only: bool = False,
                           overrides: Mapping[str, ShardedChunks] | None = None) -> dict[str, torch.Tensor | ShardedChunks]:
    """``{name: tensor or ShardedChunks}`` for every model chunk this rank holds; the values are views of
    the live parameters and buffers, so DCP saves from them and loads into them in place.

    ``params_only``: parameters without buffers (``--finetune`` starts FP8 scaling state afresh, and a
    converted Hugging Face checkpoint has none). ``overrides``: the chunks to save/load for parameters
    (by their own name) whose values do not live in the parameter, e.g. FP8 layers' weights under
    --fp8-param-gather, which the ZeRO owners hold as master weights."""
    chunks = [models] if isinstance(models, nn.Module) else list(models)
    tp_rank, tp_size = parallel_state.coords.tp, parallel_state.tp_size
    group_coords = parallel_state.group_coordinates()  # (index, size) per named group: how placements shard
    state: dict[str, torch.Tensor | ShardedChunks] = {}
    owners: dict[str, torch.Tensor] = {}
    for model in chunks:
        params = dict(model.named_parameters())
        vocab_size = _vocab_size(model)
        for name, tensor in model.state_dict(keep_vars=True).items():
            param = params.get(name)
            if params_only and param is None:
                continue
            key = checkpoint_key(name, param)
            if key in state:
                if owners[key] is tensor:  # V schedules: the two end chunks share one embedding Parameter
                    continue
                raise ValueError(f"model state: two model chunks both hold {key!r}")
            owners[key] = tensor
            local = tensor.detach()
            if overrides is not None and name in overrides:
                state[key] = overrides[name]
                continue
            if param is not None:
                local = tensor_parallel_state(local, param, tp_rank, tp_size, vocab_size,
                                              group_coords=group_coords)
            state[key] = local
    return state


@torch.no_grad()
def zero_vocab_padding_(models: nn.Module | Sequence[nn.Module], parallel_state: ParallelState) -> None:
    """Zero the rows past the real vocab of vocab-padded parameters (they are not in the checkpoint;
    zero is what layout-invariant initialization gives them, so a loaded model equals a fresh one)."""
    chunks = [models] if isinstance(models, nn.Module) else list(models)
    for model in chunks:
        vocab_size = _vocab_size(model)
        if vocab_size is None:
            continue
        for param in model.parameters():
            if not getattr(param, "padded_vocab", False):
                continue
            dim, rows = param.partition_dim, param.shape[param.partition_dim]
            start = parallel_state.coords.tp * rows
            keep = min(max(vocab_size - start, 0), rows)
            if keep < rows:
                param.narrow(dim, keep, rows - keep).zero_()
