"""Megatron-LM GPT checkpoints -> a megafp8 checkpoint at iteration 0 (weights only): legacy rank files
(``iter_N/mp_rank_XX[_YYY]/model_optim_rng.pt``, any TP/PP, no virtual pipeline) and Megatron-Core ``torch_dist``
checkpoints (``iter_N/.metadata`` + ``*.distcp``, any TP/PP/DP), Megatron-Core parameter names.

Megatron-Core's TP shards are the same as megafp8's: ``linear_qkv`` rows are whole query groups
(group-interleaved q/k/v, concatenated over TP), ``linear_fc1`` is ``[gate_r; up_r]`` per rank (stride 2),
``linear_proj``/``linear_fc2`` are split along the input, the vocab along rows. Layer indices in a rank file
are local to its pipeline stage (uniform split). Rank files are mmapped through a restricted unpickler
(``safe_unpickler``): tensors load as usual, Megatron's own classes (the enums among the saved flags, RNG and
optimizer state) become inert placeholders, so any Megatron version, or none, reads them and no code from the
file runs. Each global tensor is assembled only when it is written.

``torch_dist`` checkpoints (``megatron_dist_reader``) store global tensors, so the TP/PP/DP they were saved at does
not matter; Megatron-Core keys them differently: layer weights stacked over layers (``decoder.layers.<name>``,
``[num_layers, ...]``) or one key per global layer (``decoder.layers.<i>.<name>``), norms under the Transformer
Engine names even from the local spec, ``linear_fc1`` as the global ``[gate; up]`` (or ``weight_w`` / ``weight_v``
halves), ``_extra_state`` as byte entries (skipped); ``args`` come from ``common.pt`` or the ``common_state`` entry.
"""
from __future__ import annotations

import argparse
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from megafp8.checkpoint.convert_hf import check_target_layout, write_streamed_checkpoint
from megafp8.checkpoint.hf_files import ConversionError
from megafp8.checkpoint.megatron_dist_reader import DistCheckpoint, is_dist_checkpoint, load_pickle_file
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
_QK_LAYERNORM_MAP = {f"self_attention.{x}_layernorm.weight": ((f"self_attention.{x}_layernorm.weight",), None)
                     for x in "qk"}  # --qk-layernorm: [d] gains, the same on every TP rank


def layer_map(config: ModelConfig) -> dict[str, tuple[tuple[str, ...], int | str | None]]:
    """``_LAYER_MAP`` for the layers of ``config`` (with the query/key norms under --qk-layernorm)."""
    return {**_LAYER_MAP, **(_QK_LAYERNORM_MAP if config.qk_layernorm else {})}


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
    state = load_pickle_file(file, str(file))
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


def _config(flags: dict[str, Any], source: str, *, global_keys: bool = False) -> ModelConfig:
    """The model the saved flags describe; ``global_keys``: a torch_dist checkpoint, whose keys do not depend on
    the pipeline layout (virtual stages allowed)."""
    get = flags.get
    required = [("swiglu", True), ("normalization", "RMSNorm"), ("position_embedding_type", "rope"),
                ("add_bias_linear", False), ("add_qkv_bias", False), ("num_experts", None)]
    required += [] if global_keys else [("num_layers_per_virtual_pipeline_stage", None)]
    problems = [f"--{name.replace('_', '-')} {get(name)!r}" for name, ok in required
                if name in flags and get(name) != ok]
    if problems:
        raise ConversionError(f"{source}: the checkpoint's flags {', '.join(problems)} describe a model megafp8's "
                              "Llama does not have (needs --swiglu, RMSNorm, RoPE, no biases, no MoE"
                              + ("" if global_keys else ", no VPP") + ")")
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
                       init_method_std=get("init_method_std", 0.02), kv_channels=_kv_channels(flags),
                       layernorm_zero_centered_gamma=bool(get("apply_layernorm_1p", False)),
                       qk_layernorm=bool(get("qk_layernorm", False)), **_rope_scaling(flags))


def _kv_channels(flags: dict[str, Any]) -> int | None:
    """Megatron-LM saves kv_channels = hidden / heads when none was given; only another head dim is kept."""
    kv, hidden, heads = flags.get("kv_channels"), flags.get("hidden_size"), flags.get("num_attention_heads")
    if not isinstance(kv, int) or isinstance(kv, bool) or (isinstance(heads, int) and kv * heads == hidden):
        return None
    return kv


def _rope_scaling(flags: dict[str, Any]) -> dict[str, Any]:
    """Megatron-LM's --use-rope-scaling / --rope-scaling-factor; its other Llama-3 values are hard-coded there
    (low 1, high 4, original 8192: ModelConfig's defaults)."""
    if not flags.get("use_rope_scaling"):
        return {}
    return {"use_rope_scaling": True, "rope_scaling_factor": float(flags.get("rope_scaling_factor", 8.0))}


def megatron_to_megafp8(load_dir: str | Path, save_dir: str | Path, *, iteration: int | None = None,
                        target_tp: int = 1, target_pp: int = 1, progress: bool = True) -> ModelConfig:
    """Convert a Megatron-LM checkpoint (legacy rank files at any TP/PP, or ``torch_dist`` saved at any TP/PP/DP,
    told apart by the iteration directory's contents) into a megafp8 checkpoint at iteration 0.

    The vocab is the checkpoint's ``--vocab-size`` when saved, else its padded vocab (extra rows kept)."""
    load_dir = Path(load_dir)
    path = _iteration_dir(load_dir, iteration)
    ranks = {}
    for entry in sorted(path.iterdir()):
        match = _RANK_DIR.match(entry.name)
        if match:
            ranks[(int(match[1]), int(match[2] or 0))] = entry / "model_optim_rng.pt"
    if not ranks:
        if is_dist_checkpoint(path):
            return _dist_to_megafp8(DistCheckpoint(path), Path(save_dir), target_tp, target_pp, progress)
        raise ConversionError(f"--load-dir {load_dir}: {path} has no mp_rank_XX[_YYY] directories and no "
                              ".metadata (neither a legacy nor a torch_dist Megatron checkpoint)")
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
        for ours, (theirs, dim) in layer_map(config).items():
            names = tuple(f"decoder.layers.{local}.{n}" for n in theirs)
            shape = tuple(_global_shape(config, ours))
            tensors[f"layers.{g}.{ours}"] = (shape, lambda p=p, names=names, dim=dim: assemble(p, names, dim))
    tensors["final_layernorm.weight"] = ((h,), lambda: assemble(pp - 1, ("decoder.final_layernorm.weight",), None))
    if not config.tie_embeddings:
        tensors["output_layer.weight"] = ((v, h), vocab_rows(pp - 1, "output_layer.weight"))
    _check_no_unknown(states, ranks, config)
    _write(path, Path(save_dir), config, tensors, progress, shapes_known=False)
    return config


_Plan = dict[str, tuple[tuple[int, ...], Callable[[], torch.Tensor]]]  # megafp8 name -> (global shape, build)


def _write(path: Path, save_dir: Path, config: ModelConfig, tensors: _Plan, progress: bool, *,
           shapes_known: bool) -> None:
    """Write the planned tensors, each checked against the shape the flags imply; unless ``shapes_known`` (from
    metadata), every tensor is built once first, so nothing is written for a mismatched checkpoint."""
    def checked(name: str, shape: tuple[int, ...], build: Callable[[], torch.Tensor]) -> Callable[[], torch.Tensor]:
        def run() -> torch.Tensor:
            tensor = build()
            if tuple(tensor.shape) != shape:
                raise ConversionError(f"{path}: {name} assembles to shape {list(tensor.shape)}, the checkpoint's "
                                      f"flags imply {list(shape)}")
            return tensor
        return run

    if not shapes_known:
        for name, (shape, build) in tensors.items():
            checked(name, shape, build)()
    write_streamed_checkpoint(save_dir, config, {n: (s, checked(n, s, b)) for n, (s, b) in tensors.items()},
                              "megatron -> megafp8", progress)


def _global_shape(config: ModelConfig, suffix: str) -> list[int]:
    h, d = config.hidden_size, config.head_dim
    return {"input_layernorm.weight": [h], "pre_mlp_layernorm.weight": [h],
            "self_attention.q_layernorm.weight": [d], "self_attention.k_layernorm.weight": [d],
            "self_attention.linear_qkv.weight": [(config.num_attention_heads + 2 * config.num_query_groups) * d, h],
            "self_attention.linear_proj.weight": [h, config.num_attention_heads * d],
            "mlp.linear_fc1.weight": [2 * config.ffn_hidden_size, h],
            "mlp.linear_fc2.weight": [h, config.ffn_hidden_size]}[suffix]


def _check_no_unknown(states: dict, ranks: dict, config: ModelConfig) -> None:
    known = {"embedding.word_embeddings.weight", "decoder.final_layernorm.weight", "output_layer.weight"}
    suffixes = {n for names, _ in layer_map(config).values() for n in names}
    for key, state in states.items():
        unknown = [n for n in state["model"] if not n.endswith("_extra_state") and n not in known
                   and not ((m := _LAYER.match(n)) and m[2] in suffixes)]
        if unknown:
            raise ConversionError(f"{ranks[key]}: tensors megafp8's Llama does not have: {unknown[:5]}")


# ---- torch_dist (Megatron-Core distributed checkpoints) -------------------------------------------------

# entries of a torch_dist checkpoint that hold no weights (optimizer, RNG, bookkeeping, TE's FP8 metadata)
_NOT_WEIGHTS = re.compile(r"^(?:chained_\d+\.)?optimizer\.|^(?:rng_state|rerun_state_machine_state|common_state)(?:/|$)"
                          r"|_extra_state(?:/|$)")


def _dist_to_megafp8(checkpoint: DistCheckpoint, save_dir: Path, target_tp: int, target_pp: int,
                     progress: bool) -> ModelConfig:
    """A torch_dist iteration directory -> megafp8: global tensors by key, shapes checked from the metadata."""
    common = checkpoint.common_state()
    source = str(checkpoint.path / "common.pt") if (checkpoint.path / "common.pt").exists() else \
        f"{checkpoint.metadata_file} ('common_state' entry)"
    config = _config(_saved_flags(common, source), source, global_keys=True)
    check_target_layout(config, target_tp, target_pp)
    h, v, n = config.hidden_size, config.vocab_size, config.num_layers
    used: set[str] = set()

    def read(key: str, shape: tuple[int, ...], layer: int | None = None) -> Callable[[], torch.Tensor]:
        if checkpoint.shape(key) != shape:
            raise ConversionError(f"{checkpoint.metadata_file}: {key!r} has shape {list(checkpoint.shape(key))}, "
                                  f"the checkpoint's flags imply {list(shape)}")
        used.add(key)
        return lambda: checkpoint.read(key, layer)

    def vocab_rows(key: str) -> Callable[[], torch.Tensor]:
        if key not in checkpoint.tensors:
            raise ConversionError(f"{checkpoint.metadata_file}: tensor {key!r} is missing")
        padded = checkpoint.shape(key)[0]  # Megatron pads the vocab; the extra rows are dropped
        build = read(key, (max(padded, v), h))
        return lambda: build()[:v]

    def layer_weight(g: int, names: tuple[str, ...], shape: tuple[int, ...]) -> Callable[[], torch.Tensor] | None:
        for name in names:
            if f"decoder.layers.{g}.{name}" in checkpoint.tensors:  # one key per layer (non-homogeneous layers)
                return read(f"decoder.layers.{g}.{name}", shape)
            if f"decoder.layers.{name}" in checkpoint.tensors:  # stacked over layers: [num_layers, ...]
                return read(f"decoder.layers.{name}", (n, *shape), g)
        return None

    tensors: _Plan = {"embedding.weight": ((v, h), vocab_rows("embedding.word_embeddings.weight"))}
    for g in range(n):
        for ours, (theirs, _) in layer_map(config).items():
            shape = tuple(_global_shape(config, ours))
            build = layer_weight(g, theirs, shape)
            if build is None and ours == "mlp.linear_fc1.weight":  # gate and up saved apart (singleton shards)
                gate, up = (layer_weight(g, (f"mlp.linear_fc1.weight_{half}",), (shape[0] // 2, h)) for half in "wv")
                build = (lambda gate=gate, up=up: torch.cat([gate(), up()])) if gate and up else None
            if build is None:
                raise ConversionError(f"{checkpoint.metadata_file}: tensor 'decoder.layers.{theirs[0]}' (layer {g}, "
                                      "stacked or per layer) is missing")
            tensors[f"layers.{g}.{ours}"] = (shape, build)
    if "decoder.final_layernorm.weight" not in checkpoint.tensors:
        raise ConversionError(f"{checkpoint.metadata_file}: tensor 'decoder.final_layernorm.weight' is missing")
    tensors["final_layernorm.weight"] = ((h,), read("decoder.final_layernorm.weight", (h,)))
    if not config.tie_embeddings:
        tensors["output_layer.weight"] = ((v, h), vocab_rows("output_layer.weight"))
    used.add("output_layer.weight")  # a tied model's copy of the embedding, if saved, is not needed
    unknown = [k for k in [*checkpoint.tensors, *checkpoint.objects] if k not in used and not _NOT_WEIGHTS.search(k)]
    if unknown:
        raise ConversionError(f"{checkpoint.metadata_file}: entries megafp8's Llama does not have: {unknown[:5]}")
    checkpoint.check_storage(sorted(used & set(checkpoint.tensors)))
    _write(checkpoint.path, save_dir, config, tensors, progress, shapes_known=True)
    return config
