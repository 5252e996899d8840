"""Megatron-LM legacy GPT checkpoints (``iter_N/mp_rank_XX[_YYY]/model_optim_rng.pt``, Megatron-Core
parameter names, any TP/PP, no virtual pipeline) -> a megafp8 checkpoint at iteration 0 (weights only).

Megatron-Core's TP shards are the same as megafp8's: ``linear_qkv`` rows are whole query groups
(group-interleaved q/k/v, concatenated over TP), ``linear_fc1`` is ``[gate_r; up_r]`` per rank (stride 2),
``linear_proj``/``linear_fc2`` are split along the input, the vocab along rows. Layer indices in a rank file
are local to its pipeline stage (uniform split). Rank files are mmapped through a restricted unpickler
(``safe_unpickler``): tensors load as usual, Megatron's own classes (the enums among the saved flags, RNG and
optimizer state) become inert placeholders, so any Megatron version, or none, reads them and no code from the
file runs. Each global tensor is assembled only when it is written.
"""
from __future__ import annotations

import argparse
import re
import zipfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from megafp8.checkpoint import safe_unpickler
from megafp8.checkpoint.convert_hf import check_target_layout, write_streamed_checkpoint
from megafp8.checkpoint.hf_files import ConversionError
from megafp8.checkpoint.safe_unpickler import Placeholder
from megafp8.model.config import ModelConfig

_RANK_DIR = re.compile(r"^mp_rank_(\d{2})(?:_(\d{3}))?$")
_LAYER = re.compile(r"^decoder\.layers\.(\d+)\.(.+)$")
# megafp8 suffix -> (Megatron-Core suffixes (local spec, Transformer Engine spec), TP concat dim or None)
_LAYER_MAP = {
    "input_layernorm.weight": (("input_layernorm.weight", "self_attention.linear_qkv.layer_norm_weight"), None),
    "self_attention.linear_qkv.weight": (("self_attention.linear_qkv.weight",), 0),
    "self_attention.linear_proj.weight": (("self_attention.linear_proj.weight",), 1),
    "pre_mlp_layernorm.weight": (("pre_mlp_layernorm.weight", "mlp.linear_fc1.layer_norm_weight"), None),
    "mlp.linear_fc1.weight": (("mlp.linear_fc1.weight",), "gate_up"),
    "mlp.linear_fc2.weight": (("mlp.linear_fc2.weight",), 1),
}


_TRACKER = "latest_checkpointed_iteration.txt"
# the saved flags a ModelConfig cannot do without (the vocab: vocab_size, else padded_vocab_size)
_REQUIRED_FLAGS = ("num_layers", "hidden_size", "ffn_hidden_size", "num_attention_heads", "seq_length")


def _iteration_dir(load_dir: Path, iteration: int | None) -> Path:
    if not load_dir.is_dir():
        raise ConversionError(f"--load-dir {load_dir} " + ("is not a directory" if load_dir.exists() else
                                                          "does not exist"))
    if iteration is not None:
        path = load_dir / f"iter_{iteration:07d}"
        if not path.is_dir():
            raise ConversionError(f"--load-iteration {iteration}: {path} does not exist")
        return path
    tracker = load_dir / _TRACKER
    if not tracker.exists():
        raise ConversionError(f"--load-dir {load_dir} has no {_TRACKER}: not a Megatron-LM checkpoint directory "
                              "(or pass --load-iteration)")
    text = tracker.read_text().strip()
    if text != "release" and not text.isdigit():
        raise ConversionError(f"{tracker} is corrupt: expected an iteration number or 'release', found {text[:40]!r}")
    path = load_dir / ("release" if text == "release" else f"iter_{int(text):07d}")
    if not path.is_dir():
        raise ConversionError(f"{tracker} names {text}, but {path} does not exist (pass --load-iteration)")
    return path


def _load_rank_file(file: Path) -> dict[str, Any]:
    """One rank's state dict, through the restricted unpickler; a file that is not one names itself."""
    try:
        state = safe_unpickler.load(file)
    except OSError as e:
        raise ConversionError(f"cannot read {file}: {e}") from None
    except Exception as e:  # noqa: BLE001 - whatever the unpickler met, the file is the cause
        if not zipfile.is_zipfile(file):  # every torch.save since torch 1.6 writes a zip; its directory is last
            raise ConversionError(f"{file} is truncated or not a PyTorch checkpoint "
                                  f"({type(e).__name__}: {e})") from None
        raise ConversionError(f"{file} is a PyTorch checkpoint that cannot be read "
                              f"({type(e).__name__}: {e})") from None
    if not isinstance(state, dict) or "model" not in state and "model0" not in state:
        raise ConversionError(f"{file} holds no 'model' state dict: not a Megatron-LM rank file")
    return state


def _saved_flags(state: dict[str, Any], source: str) -> dict[str, Any]:
    """The flags Megatron-LM saved with the checkpoint (``args``), by name."""
    args = state.get("args")
    if isinstance(args, argparse.Namespace):
        return vars(args)
    if isinstance(args, Placeholder):  # a Namespace subclass of a Megatron version this loader does not import
        return args.fields()
    if isinstance(args, dict):
        return args
    raise ConversionError(f"{source} has no saved 'args' (the flags Megatron-LM stores with every checkpoint): "
                          "cannot describe the model")


def _config(flags: dict[str, Any], source: str) -> ModelConfig:
    get = flags.get
    problems = [f"--{name.replace('_', '-')} {get(name)!r}" for name, ok in (
        ("swiglu", True), ("normalization", "RMSNorm"), ("position_embedding_type", "rope"), ("add_bias_linear", False),
        ("add_qkv_bias", False), ("num_layers_per_virtual_pipeline_stage", None), ("num_experts", None))
        if name in flags and get(name) != ok]
    if problems:
        raise ConversionError(f"{source}: the checkpoint's flags {', '.join(problems)} describe a model megafp8's "
                              "Llama does not have (needs --swiglu, RMSNorm, RoPE, no biases, no MoE, no VPP)")
    vocab = get("vocab_size") or get("padded_vocab_size")
    missing = [name for name in _REQUIRED_FLAGS if not isinstance(get(name), int)]
    missing += [] if isinstance(vocab, int) else ["vocab_size (or padded_vocab_size)"]
    if missing:
        raise ConversionError(f"{source}: the saved args lack {', '.join(missing)} (or hold no integer there): "
                              "cannot describe the model")
    return ModelConfig(num_layers=get("num_layers"), hidden_size=get("hidden_size"),
                       ffn_hidden_size=get("ffn_hidden_size"), num_attention_heads=get("num_attention_heads"),
                       num_query_groups=get("num_query_groups") if get("group_query_attention") else None,
                       vocab_size=vocab, seq_length=get("seq_length"),
                       max_position_embeddings=get("max_position_embeddings") or get("seq_length"),
                       norm_eps=get("norm_epsilon", 1e-5), rope_theta=get("rotary_base", 10000),
                       tie_embeddings=not get("untie_embeddings_and_output_weights", False),
                       init_method_std=get("init_method_std", 0.02))


def megatron_to_megafp8(load_dir: str | Path, save_dir: str | Path, *, iteration: int | None = None,
                        target_tp: int = 1, target_pp: int = 1, progress: bool = True) -> ModelConfig:
    """Convert a Megatron-LM legacy checkpoint (any TP/PP) into a megafp8 checkpoint at iteration 0.

    The vocab is the checkpoint's ``--vocab-size`` when saved, else its padded vocab (extra rows kept)."""
    load_dir = Path(load_dir)
    path = _iteration_dir(load_dir, iteration)
    ranks = {}
    for entry in sorted(path.iterdir()):
        match = _RANK_DIR.match(entry.name)
        if match:
            ranks[(int(match[1]), int(match[2] or 0))] = entry / "model_optim_rng.pt"
    if not ranks:
        distributed = any(p.suffix == ".distcp" or p.name == ".metadata" for p in path.iterdir())
        raise ConversionError(f"--load-dir {load_dir}: {path} has no mp_rank_XX[_YYY] directories" + (
            " (it is a torch_dist checkpoint: convert it to the legacy format with Megatron-LM's "
            "tools/checkpoint/convert.py first)" if distributed else ""))
    tp, pp = max(t for t, _ in ranks) + 1, max(p for _, p in ranks) + 1
    missing = [f"mp_rank_{t:02d}" + (f"_{p:03d}" if pp > 1 else "") for t in range(tp) for p in range(pp)
               if (t, p) not in ranks or not ranks[(t, p)].exists()]
    if missing:
        raise ConversionError(f"{path}: rank files missing: {missing}")
    states = {key: _load_rank_file(file) for key, file in ranks.items()}
    if "model0" in states[(0, 0)]:
        raise ConversionError(f"{path}: virtual-pipeline checkpoints (model0, model1, ...) are not supported")
    config = _config(_saved_flags(states[(0, 0)], str(ranks[(0, 0)])), str(ranks[(0, 0)]))
    check_target_layout(config, target_tp, target_pp)
    if config.num_layers % pp:
        raise ConversionError(f"{path}: {config.num_layers} layers do not split evenly over PP={pp} (uneven stages "
                              "are not supported)")
    per_stage = config.num_layers // pp

    def shard(t: int, p: int, names: tuple[str, ...]) -> torch.Tensor:
        model = states[(t, p)]["model"]
        for name in names:
            if name in model:
                return model[name]
        raise ConversionError(f"{ranks[(t, p)]}: tensor {names[0]!r} is missing")

    def assemble(p: int, names: tuple[str, ...], dim: int | str | None) -> torch.Tensor:
        parts = [shard(t, p, names) for t in range(tp)]
        if dim is None:
            return parts[0]
        if dim == "gate_up":
            halves = [part.chunk(2) for part in parts]
            return torch.cat([h[0] for h in halves] + [h[1] for h in halves])
        return torch.cat(parts, dim=dim)

    tensors: dict[str, tuple[tuple[int, ...], Callable[[], torch.Tensor]]] = {}
    h, v = config.hidden_size, config.vocab_size

    def vocab_rows(p: int, name: str) -> Callable[[], torch.Tensor]:
        return lambda: assemble(p, (name,), 0)[:v]

    tensors["embedding.weight"] = ((v, h), vocab_rows(0, "embedding.word_embeddings.weight"))
    for g in range(config.num_layers):
        p, local = divmod(g, per_stage)
        for ours, (theirs, dim) in _LAYER_MAP.items():
            names = tuple(f"decoder.layers.{local}.{n}" for n in theirs)
            shape = tuple(_global_shape(config, ours))
            tensors[f"layers.{g}.{ours}"] = (shape, lambda p=p, names=names, dim=dim: assemble(p, names, dim))
    tensors["final_layernorm.weight"] = ((h,), lambda: assemble(pp - 1, ("decoder.final_layernorm.weight",), None))
    if not config.tie_embeddings:
        tensors["output_layer.weight"] = ((v, h), vocab_rows(pp - 1, "output_layer.weight"))
    _check_no_unknown(states, ranks)

    def checked(name: str, shape: tuple[int, ...], build: Callable[[], torch.Tensor]) -> Callable[[], torch.Tensor]:
        def run() -> torch.Tensor:
            tensor = build()
            if tuple(tensor.shape) != shape:
                raise ConversionError(f"{path}: {name} assembles to shape {list(tensor.shape)}, the checkpoint's "
                                      f"flags imply {list(shape)}")
            return tensor
        return run

    for name, (shape, build) in tensors.items():  # shapes first: nothing is written for a mismatched checkpoint
        checked(name, shape, build)()
    write_streamed_checkpoint(Path(save_dir), config, {n: (s, checked(n, s, b)) for n, (s, b) in tensors.items()},
                              "megatron -> megafp8", progress)
    return config


def _global_shape(config: ModelConfig, suffix: str) -> list[int]:
    h, d = config.hidden_size, config.head_dim
    return {"input_layernorm.weight": [h], "pre_mlp_layernorm.weight": [h],
            "self_attention.linear_qkv.weight": [(config.num_attention_heads + 2 * config.num_query_groups) * d, h],
            "self_attention.linear_proj.weight": [h, config.num_attention_heads * d],
            "mlp.linear_fc1.weight": [2 * config.ffn_hidden_size, h],
            "mlp.linear_fc2.weight": [h, config.ffn_hidden_size]}[suffix]


def _check_no_unknown(states: dict, ranks: dict) -> None:
    known = {"embedding.word_embeddings.weight", "decoder.final_layernorm.weight", "output_layer.weight"}
    suffixes = {n for names, _ in _LAYER_MAP.values() for n in names}
    for key, state in states.items():
        unknown = [n for n in state["model"] if not n.endswith("_extra_state") and n not in known
                   and not ((m := _LAYER.match(n)) and m[2] in suffixes)]
        if unknown:
            raise ConversionError(f"{ranks[key]}: tensors megafp8's Llama does not have: {unknown[:5]}")
