"""Hugging Face Llama (Qwen3, Mixtral, Qwen3-MoE) directory <-> megafp8 checkpoint, streamed a tensor at a time.

HF -> megafp8: every megafp8 parameter becomes a lazy ``ShardedChunks`` whose data DCP asks for only while
writing it (q/k/v are read and fused then, gate/up concatenated), so peak memory is about one fused tensor.
The checkpoint is layout-free (global shapes, real vocab), so the TP/PP of the run that loads it is free.
megafp8 -> HF: the checkpoint is read one layer at a time with DCP (resharded from whatever layout saved it),
running no code from its files (``safe_dcp``).
"""
from __future__ import annotations

import dataclasses
import functools
import json
import re
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.distributed.checkpoint.metadata import TensorStorageMetadata
from tqdm import tqdm

from megafp8.checkpoint.microscaled_export import EXPORTS as MICROSCALED_EXPORTS
from megafp8.checkpoint.atomic import MANIFEST_FILE, iteration_dir, read_tracker
from megafp8.checkpoint.fp8_export import (BLOCK, RECIPE_KEY, fp8_linear_names, quantization_config,
                                           quantize_blockwise, read_guard_switched, training_recipe)
from megafp8.checkpoint.hf_files import (ConversionError, HfTensors, ShardedSafetensorsWriter, atomic_output_dir,
                                         model_config_from_hf_dict, read_hf_config)
from megafp8.checkpoint.manifest import check_file, read_manifest
from megafp8.checkpoint.safe_dcp import read_metadata
from megafp8.checkpoint.save_load import read_entries, save_checkpoint
from megafp8.checkpoint.sharded_tensor import ShardedChunks
from megafp8.model.config import ModelConfig
from megafp8.model.hf_mapping import (NORM_WEIGHTS, fuse_qkv, hf_config_fields, hf_norm_gain, layer_renames,
                                      mlp_sources, norm_weight_from_hf, split_qkv)
from megafp8.model.hf_moe_mapping import (moe_export_problems, moe_fields_from_manifest, moe_mlp_hf_shapes,
                                          moe_training_args)
from megafp8.model.rotary import Llama3RopeScaling
from megafp8.parallel.parallel_state import ParallelState
from megafp8.training.megatron_flags import LLAMA_FLAGS

SAVE_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
_IGNORED_HF_SUFFIXES = ("rotary_emb.inv_freq",)  # a buffer old transformers versions saved


class _LazyChunks(ShardedChunks):
    """One whole tensor whose values are produced only when DCP writes it (a meta tensor stands in before)."""

    def __init__(self, shape: tuple[int, ...], produce: Callable[[], torch.Tensor]) -> None:
        super().__init__(shape, [((0,) * len(shape), torch.empty(shape, dtype=torch.float32, device="meta"))])
        self.produce = produce

    def __get_tensor_shard__(self, index: Any) -> torch.Tensor:
        return self.produce()


def _hf_layer_shapes(config: ModelConfig, i: int) -> dict[str, tuple[int, ...]]:
    h, ffn, d = config.hidden_size, config.ffn_hidden_size, config.head_dim
    p = f"model.layers.{i}."
    return {p + "input_layernorm.weight": (h,), p + "post_attention_layernorm.weight": (h,),
            p + "self_attn.q_proj.weight": (config.num_attention_heads * d, h),
            p + "self_attn.k_proj.weight": (config.num_query_groups * d, h),
            p + "self_attn.v_proj.weight": (config.num_query_groups * d, h),
            p + "self_attn.o_proj.weight": (h, config.num_attention_heads * d),
            **(moe_mlp_hf_shapes(config, i) if config.is_moe_layer(i) else
               {p + "mlp.gate_proj.weight": (ffn, h), p + "mlp.up_proj.weight": (ffn, h),
                p + "mlp.down_proj.weight": (h, ffn)}),
            **({p + f"self_attn.{x}_norm.weight": (d,) for x in "qk"} if config.qk_layernorm else {})}


def hf_shapes(config: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Every tensor a HF Llama checkpoint of ``config`` holds, with its shape."""
    shapes = {"model.embed_tokens.weight": (config.vocab_size, config.hidden_size),
              "model.norm.weight": (config.hidden_size,)}
    if not config.tie_embeddings:
        shapes["lm_head.weight"] = (config.vocab_size, config.hidden_size)
    for i in range(config.num_layers):
        shapes.update(_hf_layer_shapes(config, i))
    return shapes


def _megafp8_sources(config: ModelConfig) -> dict[str, list[str]]:
    """megafp8 parameter name -> the HF tensors it is built from (in fusion order)."""
    sources = {"embedding.weight": ["model.embed_tokens.weight"], "final_layernorm.weight": ["model.norm.weight"]}
    if not config.tie_embeddings:
        sources["output_layer.weight"] = ["lm_head.weight"]
    for i in range(config.num_layers):
        ours, theirs = f"layers.{i}.", f"model.layers.{i}."
        for src, dst in layer_renames(config).items():
            sources[ours + src] = [theirs + dst]
        sources[ours + "self_attention.linear_qkv.weight"] = [theirs + f"self_attn.{x}_proj.weight" for x in "qkv"]
        sources.update({ours + src: [theirs + p for p in parts] for src, parts in mlp_sources(config, i).items()})
    return sources


def training_args(config: ModelConfig) -> dict[str, Any]:
    """The flags the training entry needs to build this model (saved in the manifest, checked on --load)."""
    return {"num_layers": config.num_layers, "hidden_size": config.hidden_size,
            "ffn_hidden_size": config.ffn_hidden_size, "num_attention_heads": config.num_attention_heads,
            "num_query_groups": config.num_query_groups, "max_position_embeddings": config.max_position_embeddings,
            "norm_epsilon": config.norm_eps, "rotary_base": config.rope_theta, "activation": "swiglu",
            "untie_embeddings_and_output_weights": not config.tie_embeddings, "init_method_std": config.init_method_std,
            # always saved: a run resumed with --apply-layernorm-1p from plain gains would scale by 1 + g
            "layernorm_zero_centered_gamma": config.layernorm_zero_centered_gamma, "qk_layernorm": config.qk_layernorm,
            **({"kv_channels": config.kv_channels} if config.kv_channels is not None else {}),
            **rope_scaling_args(config), **moe_training_args(config)}


def rope_scaling_args(config: ModelConfig) -> dict[str, Any]:
    """Llama-3.1 RoPE scaling as training flags (Megatron-LM's --use-rope-scaling, --rope-scaling-factor and
    megafp8's three others); nothing for unscaled RoPE, so those checkpoints and flag lines stay as before."""
    if not config.use_rope_scaling:
        return {}
    return {"use_rope_scaling": True, **{f"rope_scaling_{field}": getattr(config, f"rope_scaling_{field}")
                                         for field in Llama3RopeScaling.FIELDS}}


_FLAG_NAMES = {"layernorm_zero_centered_gamma": "--apply-layernorm-1p"}  # dests named otherwise on the CLI


def training_flags(config: ModelConfig) -> str:
    """The same as command-line flags for ``megafp8.pretrain`` (vocab: from the tokenizer): the Llama block,
    then the sizes (--group-query-attention makes Megatron's parser read --num-query-groups)."""
    flags = [" ".join(LLAMA_FLAGS), "--group-query-attention"]
    for key, value in training_args(config).items():
        flag = _FLAG_NAMES.get(key, f"--{key.replace('_', '-')}")
        if isinstance(value, bool):
            flags += [flag] if value else []
        else:
            flags.append(f"{flag} {value}")
    return " ".join(flags)


def check_target_layout(config: ModelConfig, tp: int, pp: int) -> None:
    """The layout the user means to train at must divide the model (the checkpoint itself is layout-free)."""
    checks = [("--target-tensor-parallel-size", tp, "num_attention_heads", config.num_attention_heads),
              ("--target-tensor-parallel-size", tp, "num_key_value_heads", config.num_query_groups),
              ("--target-tensor-parallel-size", tp, "intermediate_size", config.ffn_hidden_size),
              ("--target-pipeline-parallel-size", pp, "num_hidden_layers", config.num_layers)]
    for flag, size, field, value in checks:
        if size < 1 or value % size:
            raise ConversionError(f"{flag} {size} does not divide {field} ({value})")


def _skeleton(names: list[str]) -> nn.Module:
    """A module tree with meta parameters under ``names``: what save_checkpoint walks to name the entries."""
    root = nn.Module()
    for name in names:
        *path, leaf = name.split(".")
        module = root
        for part in path:
            if not hasattr(module, part):
                module.add_module(part, nn.Module())
            module = getattr(module, part)
        module.register_parameter(leaf, nn.Parameter(torch.empty(0, device="meta"), requires_grad=False))
    return root


def hf_to_megafp8(load_dir: str | Path, save_dir: str | Path, *, target_tp: int = 1, target_pp: int = 1,
                  zero_centered_gamma: bool = False, progress: bool = True) -> ModelConfig:
    """Convert a HF Llama directory into a megafp8 checkpoint at iteration 0 (weights only, fp32).
    ``zero_centered_gamma`` (--apply-layernorm-1p): store each RMSNorm gain g as g - 1, for runs with that flag."""
    load_dir, save_dir = Path(load_dir), Path(save_dir)
    config = model_config_from_hf_dict(read_hf_config(load_dir), str(load_dir / "config.json"))
    config = dataclasses.replace(config, layernorm_zero_centered_gamma=zero_centered_gamma)
    check_target_layout(config, target_tp, target_pp)
    hf = HfTensors(load_dir)
    _check_layer_count(config.num_layers, hf.location, r"model\.layers\.(\d+)\.", load_dir / "config.json",
                       "num_hidden_layers", "its safetensors files hold")
    expected = hf_shapes(config)
    for name, shape in expected.items():  # headers only: every problem is found before anything is written
        if hf.shape(name) != shape:
            raise ConversionError(f"{load_dir}: tensor {name!r} has shape {list(hf.shape(name))}, config.json "
                                  f"implies {list(shape)}")
    ignored = {"lm_head.weight"} if config.tie_embeddings else set()
    unexpected = [n for n in hf.location if n not in expected and n not in ignored
                  and not n.endswith(_IGNORED_HF_SUFFIXES)]
    if unexpected:
        raise ConversionError(f"{load_dir}: unexpected tensors {unexpected[:5]} (an architecture feature "
                              "megafp8's Llama does not have)")
    def build(name: str, sources: list[str]) -> torch.Tensor:
        parts = [hf.get(s, name).float() for s in sources]
        if name.endswith("linear_qkv.weight"):
            return fuse_qkv(*parts, config)
        if name.endswith("layernorm.weight"):  # g - 1 is exact for gains in [0.5, 2] (Sterbenz): 1 + w gives g back
            return norm_weight_from_hf(parts[0], config)
        return torch.cat(parts) if len(parts) > 1 else parts[0]

    tensors = {name: ((sum(expected[s][0] for s in sources),) + expected[sources[0]][1:],
                      functools.partial(build, name, sources))
               for name, sources in _megafp8_sources(config).items()}
    write_streamed_checkpoint(save_dir, config, tensors, "hf -> megafp8", progress)
    return config


def write_streamed_checkpoint(save_dir: Path, config: ModelConfig,
                              tensors: dict[str, tuple[tuple[int, ...], Callable[[], torch.Tensor]]],
                              description: str, progress: bool) -> None:
    """A megafp8 checkpoint at iteration 0 whose parameters ``{name: (global shape, build)}`` are built one at
    a time while DCP writes them, committed atomically under ``save_dir``."""
    bar = tqdm(total=len(tensors), desc=description, unit="tensor", disable=not progress)
    written: list[torch.Tensor] = []  # the tensor DCP wrote last

    def producer(build: Callable[[], torch.Tensor]) -> Callable[[], torch.Tensor]:
        def produce() -> torch.Tensor:
            # DCP keeps a reference to every tensor it wrote until its file closes (the whole model);
            # with per_thread_copy_ahead=0 it writes each before asking for the next, so the previous
            # one's memory can be released here (on a private copy: the source may be shared or mmapped).
            while written:
                written.pop().untyped_storage().resize_(0)
            tensor = build().to(torch.float32, copy=True).contiguous()
            written.append(tensor)
            bar.update(1)
            return tensor
        return produce

    overrides = {name: _LazyChunks(shape, producer(build)) for name, (shape, build) in tensors.items()}
    with atomic_output_dir(save_dir, "--save-dir") as tmp:
        save_checkpoint(tmp, 0, model=_skeleton(list(overrides)), parallel_state=ParallelState(),
                        args=training_args(config), model_overrides=overrides,
                        writer_options={"thread_count": 1, "per_thread_copy_ahead": 0})
    bar.close()


# ---- megafp8 -> HF ---------------------------------------------------------------------------------

def _check_layer_count(declared: int, names, pattern: str, source: Path, field: str, holder: str) -> None:
    """The layer count a config or manifest declares, against the layers the tensors hold, before anything is sized
    from it (a num_hidden_layers of 10^9 in a 700-byte config.json allocated gigabytes)."""
    present = {int(m.group(1)) for name in names if (m := re.match(pattern, name))}
    if declared != len(present):
        raise ConversionError(f"{source}: {field} {declared}, but {holder} {len(present)} layers")


def _checkpoint_path(load_dir: Path, iteration: int | None) -> Path:
    if iteration is None:
        iteration = read_tracker(load_dir)
        if iteration is None:
            raise ConversionError(f"--load-dir {load_dir} has no latest_checkpointed_iteration.txt: not a megafp8 "
                                  "checkpoint directory (or pass --load-iteration)")
    return iteration_dir(load_dir, iteration)


# The FOG block's options (flag, saved key, the value every exported format assumes).
_BLOCK_OPTIONS = (("--no-pre-norm", "pre_norm", True), ("--post-norm", "post_norm", False),
                  ("--softmax-scale", "softmax_scale", None), ("--embedding-scale", "embedding_scale", 1.0),
                  ("--unit-scaling", "unit_scaling", False), ("--residual-tau", "residual_tau", None))


def _config_from_manifest(args: dict[str, Any], vocab_size: int, path: Path) -> ModelConfig:
    needed = ["num_layers", "hidden_size", "ffn_hidden_size", "num_attention_heads", "num_query_groups",
              "max_position_embeddings", "norm_epsilon", "rotary_base", "untie_embeddings_and_output_weights"]
    missing = [k for k in needed if k not in args]
    if missing:
        raise ConversionError(f"{path}: the manifest's flags lack {missing}; cannot describe the model")
    if args.get("activation", "swiglu") not in ("swiglu", "smooth_swiglu"):  # Smooth-SwiGLU's scales cancel
        raise ConversionError(f"{path}: --activation {args['activation']} has no HF Llama equivalent")
    inexpressible = [flag for flag, key, default in _BLOCK_OPTIONS if args.get(key, default) != default]
    if inexpressible:
        raise ConversionError(f"{path}: the run trained with {', '.join(inexpressible)}: a block that HF's Llama, "
                              "Qwen3 and Megatron-LM's GPT cannot express (exported, it would give other logits)")
    return ModelConfig(num_layers=args["num_layers"], hidden_size=args["hidden_size"],
                       ffn_hidden_size=args["ffn_hidden_size"], num_attention_heads=args["num_attention_heads"],
                       num_query_groups=args["num_query_groups"], vocab_size=vocab_size,
                       seq_length=min(args.get("seq_length") or 1, args["max_position_embeddings"]),
                       max_position_embeddings=args["max_position_embeddings"], norm_eps=args["norm_epsilon"],
                       rope_theta=args["rotary_base"], tie_embeddings=not args["untie_embeddings_and_output_weights"],
                       init_method_std=args.get("init_method_std", 0.02), kv_channels=args.get("kv_channels"),
                       layernorm_zero_centered_gamma=bool(args.get("layernorm_zero_centered_gamma", False)),
                       qk_layernorm=bool(args.get("qk_layernorm", False)),
                       **_rope_scaling_from_manifest(args, path), **moe_fields_from_manifest(args))


def _rope_scaling_from_manifest(args: dict[str, Any], path: Path) -> dict[str, Any]:
    """The ModelConfig's RoPE scaling fields from saved flags (a checkpoint from before them: unscaled)."""
    if not args.get("use_rope_scaling"):
        return {}
    names = [f"rope_scaling_{field}" for field in Llama3RopeScaling.FIELDS]
    missing = [name for name in names if name not in args]
    if missing:
        raise ConversionError(f"{path}: the manifest says --use-rope-scaling but lacks {missing}")
    return {"use_rope_scaling": True, **{name: args[name] for name in names}}


def _check_moe_exportable(config: ModelConfig, save_format: str, path: Path) -> None:
    """A MoE model goes to its HF family (Mixtral, Qwen3-MoE) in high precision only: the quantized layouts name
    the dense layers' linears (and the saturation guard's layers), not the experts'."""
    problems = moe_export_problems(config)
    if config.num_experts is not None and save_format != "hf":
        problems.append(f"--num-experts with --save-format {save_format} (the quantized exports cover dense models "
                        "only yet: export with --save-format hf)")
    if problems:
        raise ConversionError(f"{path}: cannot export to HF: {'; '.join(problems)}")


class _CheckpointReader:
    """Full (global) tensors of one committed megafp8 checkpoint, read by name with DCP (resharded from
    whatever layout wrote it)."""

    def __init__(self, load_dir: Path, iteration: int | None) -> None:
        self.path = _checkpoint_path(load_dir, iteration)
        self.manifest = read_manifest(self.path)
        problems = [p for name, entry in sorted(self.manifest["files"].items())
                    if (p := check_file(self.path, name, entry, hash_contents=True))]
        if problems:
            raise ConversionError("checkpoint is damaged:\n  " + "\n  ".join(problems))
        self.index = read_metadata(self.path)  # the restricted unpickler: nothing from the file runs
        self.metadata = self.index.state_dict_metadata

    def read(self, names: list[str]) -> dict[str, torch.Tensor]:
        state = {}
        for name in names:
            meta = self.metadata.get(f"model.{name}")
            if not isinstance(meta, TensorStorageMetadata):
                raise ConversionError(f"{self.path}: tensor {name!r} is missing from the checkpoint")
            state[name] = torch.empty(tuple(meta.size), dtype=meta.properties.dtype)
        read_entries({"model": state}, self.path)
        return state


def _hf_order(config: ModelConfig) -> list[str]:
    """The order ``_hf_tensors`` yields (the streaming writer plans its files from it)."""
    names = ["model.embed_tokens.weight"]
    for i in range(config.num_layers):
        p = f"model.layers.{i}."
        names += [p + f"self_attn.{x}_proj.weight" for x in "qkv"]
        names += [p + dst for dst in layer_renames(config).values()]
        names += [p + part for parts in mlp_sources(config, i).values() for part in parts]
    return names + ["model.norm.weight"] + ([] if config.tie_embeddings else ["lm_head.weight"])


def _hf_tensors(reader: _CheckpointReader, config: ModelConfig) -> Iterator[tuple[str, torch.Tensor]]:
    """(HF name, tensor) in ``_hf_order``, one megafp8 tensor in memory at a time."""
    def one(name: str) -> torch.Tensor:
        return reader.read([name])[name]

    yield "model.embed_tokens.weight", one("embedding.weight")
    for i in range(config.num_layers):
        ours, theirs = f"layers.{i}.", f"model.layers.{i}."
        q, k, v = split_qkv(one(ours + "self_attention.linear_qkv.weight"), config)
        yield from ((theirs + f"self_attn.{x}_proj.weight", t) for x, t in zip("qkv", (q, k, v)))
        del q, k, v
        for src, dst in layer_renames(config).items():
            yield theirs + dst, hf_norm_gain(one(ours + src), config) if src in NORM_WEIGHTS else one(ours + src)
        for src, parts in mlp_sources(config, i).items():  # [gate; up] splits in two halves
            yield from ((theirs + dst, part) for dst, part in zip(parts, one(ours + src).chunk(len(parts))))
    yield "model.norm.weight", hf_norm_gain(one("final_layernorm.weight"), config)
    if not config.tie_embeddings:
        yield "lm_head.weight", one("output_layer.weight")


def megafp8_to_hf(load_dir: str | Path, save_dir: str | Path, *, save_format: str = "hf", save_dtype: str = "bf16",
                  max_shard_bytes: int = 5 * 2**30, iteration: int | None = None,
                  progress: bool = True) -> ModelConfig:
    """Convert a megafp8 checkpoint (any TP/PP/DP layout) into a HF Llama directory: ``save_format`` "hf"
    (``save_dtype`` bf16|fp32), "hf-fp8" (128x128 block E4M3 linear weights, everything else bf16), "hf-nvfp4" or
    "hf-mxfp8" (the blocks' linear weights in NVFP4 / MXFP8, compressed-tensors layouts: microscaled_export.py;
    everything else bf16)."""
    if save_dtype not in SAVE_DTYPES:
        raise ConversionError(f"--save-dtype must be one of {', '.join(SAVE_DTYPES)}, got {save_dtype!r}")
    reader = _CheckpointReader(Path(load_dir), iteration)
    embedding = reader.metadata.get("model.embedding.weight")
    if not isinstance(embedding, TensorStorageMetadata):
        raise ConversionError(f"{reader.path}: tensor 'embedding.weight' is missing from the checkpoint")
    config = _config_from_manifest(reader.manifest.get("args", {}), embedding.size[0], reader.path)
    _check_layer_count(config.num_layers, reader.metadata, r"model\.layers\.(\d+)\.", reader.path / MANIFEST_FILE,
                       "num_layers", "the checkpoint holds")
    _check_moe_exportable(config, save_format, reader.path)
    dtype = SAVE_DTYPES["bf16" if save_format == "hf-fp8" or save_format in MICROSCALED_EXPORTS else save_dtype]
    expected = hf_shapes(config)
    hf_config = {**hf_config_fields(config), "torch_dtype": str(dtype).removeprefix("torch.")}
    fp8, microscaled = save_format == "hf-fp8", MICROSCALED_EXPORTS.get(save_format)
    low_precision = fp8 or microscaled is not None
    switched = read_guard_switched(reader.path, reader.index) if low_precision else []  # kept in bf16, as trained
    saved_args = reader.manifest.get("args", {})
    fp8_modules = fp8_linear_names(config.num_layers, saved_args, switched) if low_precision else set()
    if low_precision:
        config_of = microscaled.quantization_config if microscaled is not None else quantization_config
        hf_config["quantization_config"] = config_of(config.num_layers, saved_args, switched)
        hf_config[RECIPE_KEY] = training_recipe(reader.manifest)
    plan = []
    for name in _hf_order(config):
        shape = expected[name]
        if name.removesuffix(".weight") in fp8_modules and microscaled is not None:
            plan += microscaled.planned_tensors(name, shape)
        elif name.removesuffix(".weight") in fp8_modules:
            plan += [(name, shape, torch.float8_e4m3fn),
                     (name + "_scale_inv", (-(-shape[0] // BLOCK), -(-shape[1] // BLOCK)), torch.float32)]
        else:
            plan.append((name, shape, dtype))
    with atomic_output_dir(Path(save_dir), "--save-dir") as tmp:
        writer = ShardedSafetensorsWriter(tmp, plan, max_shard_bytes)
        for name, tensor in tqdm(_hf_tensors(reader, config), total=len(expected), desc=f"megafp8 -> {save_format}",
                                 unit="tensor", disable=not progress):
            if tuple(tensor.shape) != expected[name]:
                raise ConversionError(f"{reader.path}: {name} has shape {list(tensor.shape)}, the saved flags "
                                      f"imply {list(expected[name])}")
            if name.removesuffix(".weight") in fp8_modules and microscaled is not None:
                for (part, _, _), value in zip(microscaled.planned_tensors(name, expected[name]),
                                               microscaled.quantize(tensor)):
                    writer.add(part, value)
            elif name.removesuffix(".weight") in fp8_modules:
                weight, scale_inv = quantize_blockwise(tensor)
                writer.add(name, weight)
                writer.add(name + "_scale_inv", scale_inv)
            else:
                writer.add(name, tensor.to(dtype))
        writer.finish()
        (tmp / "config.json").write_text(json.dumps(hf_config, indent=2, sort_keys=True) + "\n")
    return config
