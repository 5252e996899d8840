"""megafp8 checkpoint -> Megatron-LM legacy checkpoint (``iter_N/mp_rank_XX[_YYY]/model_optim_rng.pt``) at a chosen TP/PP.

The inverse of ``convert_megatron``: Megatron-Core's local-spec parameter names (``--transformer-impl local``),
its TP cuts (whole query groups of the group-interleaved ``linear_qkv`` per rank, ``[gate_r; up_r]`` for
``linear_fc1``, ``linear_proj``/``linear_fc2`` along the input, the vocab padded to
``--make-vocab-size-divisible-by`` x TP and split along rows), stage-local layer indices over a uniform
pipeline split. Each rank file holds what Megatron-LM's ``load_checkpoint`` reads: ``model`` (its
``_extra_state`` entries None, as Megatron-Core's local linears save them), ``args`` (a plain
``argparse.Namespace`` of the fields its ``load_args_from_checkpoint`` / ``check_checkpoint_args`` read),
``iteration``, ``checkpoint_version`` 3.0; no optimizer or RNG state, so Megatron-LM loads it with
``--finetune`` (or ``--no-load-optim --no-load-rng``). Only tensors, numbers, strings and that Namespace are
pickled: ``torch.load(..., weights_only=True)`` with Megatron-Core's safe globals reads it.
"""
from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

import torch
from torch.distributed.checkpoint.metadata import TensorStorageMetadata
from tqdm import tqdm

from megafp8.checkpoint.convert_hf import _CheckpointReader, _config_from_manifest, check_target_layout
from megafp8.checkpoint.convert_megatron import _TRACKER, layer_map
from megafp8.checkpoint.hf_files import ConversionError, atomic_output_dir
from megafp8.model.config import ModelConfig

CHECKPOINT_VERSION = 3.0
RANK_FILE = "model_optim_rng.pt"
# Megatron-LM hard-codes these Llama-3.1 RoPE scaling values (only the factor is a flag there)
_MEGATRON_ROPE_SCALING = {"rope_scaling_low_freq_factor": 1.0, "rope_scaling_high_freq_factor": 4.0,
                          "rope_scaling_original_max_position_embeddings": 8192}
# Megatron-Core's local-spec linears that save an ``_extra_state`` entry (None without FP8 metadata)
_EXTRA_STATE_LINEARS = ("self_attention.linear_qkv", "self_attention.linear_proj", "mlp.linear_fc1", "mlp.linear_fc2")


def padded_vocab_size(vocab_size: int, divisible_by: int, tp: int) -> int:
    """Megatron-LM's ``_vocab_size_with_padding``: up to a multiple of ``divisible_by`` x TP."""
    multiple = divisible_by * tp
    return -(-vocab_size // multiple) * multiple


def rank_dir_name(tp_rank: int, pp_rank: int, pp: int) -> str:
    """``mp_rank_XX`` at PP=1, ``mp_rank_XX_YYY`` with pipeline stages (Megatron-LM's get_checkpoint_name)."""
    return f"mp_rank_{tp_rank:02d}" + (f"_{pp_rank:03d}" if pp > 1 else "")


def megatron_args(config: ModelConfig, saved: dict[str, Any], *, tp: int, pp: int, padded_vocab: int,
                  divisible_by: int, iteration: int) -> argparse.Namespace:
    """The ``args`` Megatron-LM saves with a checkpoint, for this model: every model field its
    ``load_args_from_checkpoint`` copies (``--use-checkpoint-args``) and ``check_checkpoint_args`` compares, in
    Megatron-LM's names and conventions; the run's tokenizer and FP8 flags when the manifest holds them."""
    args = dict(
        num_layers=config.num_layers, hidden_size=config.hidden_size, ffn_hidden_size=config.ffn_hidden_size,
        num_attention_heads=config.num_attention_heads, num_query_groups=config.num_query_groups,
        group_query_attention=config.num_query_groups != config.num_attention_heads, kv_channels=config.head_dim,
        seq_length=saved.get("seq_length") or config.max_position_embeddings,
        max_position_embeddings=config.max_position_embeddings, position_embedding_type="rope",
        add_position_embedding=False, use_rotary_position_embeddings=True, rotary_base=_int_if_whole(config.rope_theta),
        rotary_percent=1.0, rotary_interleaved=False, rotary_seq_len_interpolation_factor=None,
        use_rope_scaling=config.use_rope_scaling, rope_scaling_factor=config.rope_scaling_factor,
        normalization="RMSNorm", norm_epsilon=config.norm_eps, apply_layernorm_1p=config.layernorm_zero_centered_gamma, swiglu=True,
        squared_relu=False, untie_embeddings_and_output_weights=not config.tie_embeddings, add_bias_linear=False,
        add_qkv_bias=False, qk_layernorm=config.qk_layernorm,
        apply_query_key_layer_scaling=False, attention_dropout=0.0, hidden_dropout=0.0,
        init_method_std=config.init_method_std, num_experts=None, spec=None, transformer_impl="local",
        vocab_size=config.vocab_size, padded_vocab_size=padded_vocab, make_vocab_size_divisible_by=divisible_by,
        tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp, virtual_pipeline_model_parallel_size=None,
        num_layers_per_virtual_pipeline_stage=None, expert_model_parallel_size=1, ckpt_format="torch",
        iteration=iteration, consumed_train_samples=0, skipped_train_samples=0, consumed_valid_samples=0,
        params_dtype=torch.float32)
    # Megatron-LM's names for megafp8's same flags (strings and numbers only: nothing else is pickled)
    for name in ("tokenizer_type", "tokenizer_model", "fp8_recipe", "fp8_margin", "fp8_amax_history_len",
                 "fp8_amax_compute_algo", "seed", "bf16"):
        if isinstance(saved.get(name), (str, int, float, bool)):
            args[name] = saved[name]
    if isinstance(saved.get("fp8_format"), str):
        args["fp8"] = saved["fp8_format"]  # Megatron-LM's --fp8-format stores into args.fp8
    return argparse.Namespace(**args)


def _int_if_whole(value: float) -> int | float:
    """Megatron-LM's --rotary-base is an int flag: 500000.0 is stored as 500000."""
    return int(value) if float(value).is_integer() else value


def _check_exportable(config: ModelConfig, path: Path) -> None:
    if config.num_experts is not None:  # the manifest's MoE flags (convert_hf._config_from_manifest reads them)
        raise ConversionError(f"{path}: --num-experts {config.num_experts}: the Megatron-LM export writes dense "
                              "models only (export a MoE model with --save-format hf)")
    if config.use_rope_scaling:
        differ = [f"--{k.replace('_', '-')} {getattr(config, k)}" for k, v in _MEGATRON_ROPE_SCALING.items()
                  if getattr(config, k) != v]
        if differ:
            raise ConversionError(f"{path}: {', '.join(differ)}: Megatron-LM's --use-rope-scaling fixes these at "
                                  f"{_MEGATRON_ROPE_SCALING} (only --rope-scaling-factor is a flag there)")


def megafp8_to_megatron(load_dir: str | Path, save_dir: str | Path, *, target_tp: int = 1, target_pp: int = 1,
                        make_vocab_size_divisible_by: int | None = None, iteration: int | None = None,
                        progress: bool = True) -> argparse.Namespace:
    """Write a megafp8 checkpoint (any layout) as a Megatron-LM legacy checkpoint at ``target_tp`` x ``target_pp``
    (fp32 weights, the checkpoint's iteration); returns the ``args`` saved in every rank file.

    The vocab is padded (zero rows) to ``make_vocab_size_divisible_by`` x TP, by default the run's
    ``--make-vocab-size-divisible-by`` from the manifest, else Megatron-LM's default 128. One rank file is built
    at a time; each global tensor is read once per TP rank, so memory is about one rank's shard plus one tensor."""
    reader = _CheckpointReader(Path(load_dir), iteration)
    embedding = reader.metadata.get("model.embedding.weight")
    if not isinstance(embedding, TensorStorageMetadata):
        raise ConversionError(f"{reader.path}: tensor 'embedding.weight' is missing from the checkpoint")
    saved = reader.manifest.get("args", {})
    config = _config_from_manifest(saved, embedding.size[0], reader.path)
    _check_exportable(config, reader.path)
    check_target_layout(config, target_tp, target_pp)
    divisible_by = make_vocab_size_divisible_by
    if divisible_by is None:
        divisible_by = saved.get("make_vocab_size_divisible_by") or 128
    if not isinstance(divisible_by, int) or divisible_by < 1:
        raise ConversionError(f"--make-vocab-size-divisible-by must be a positive integer, got {divisible_by!r}")
    tp, pp = target_tp, target_pp
    padded = padded_vocab_size(config.vocab_size, divisible_by, tp)
    step = int(reader.manifest.get("iteration", 0))
    args = megatron_args(config, saved, tp=tp, pp=pp, padded_vocab=padded, divisible_by=divisible_by, iteration=step)
    per_stage = config.num_layers // pp

    def read(name: str) -> torch.Tensor:
        tensor = reader.read([name])[name].to(torch.float32)
        if name in ("embedding.weight", "output_layer.weight"):  # zero padding rows, as megafp8 keeps them
            tensor = torch.cat([tensor, tensor.new_zeros(padded - tensor.shape[0], tensor.shape[1])])
        return tensor

    def shard(tensor: torch.Tensor, how: int | str | None, rank: int) -> torch.Tensor:
        if how is None:
            return tensor.clone()
        if how == "gate_up":  # [gate; up] -> this rank's [gate_r; up_r]
            gate, up = tensor.chunk(2)
            return torch.cat([gate.chunk(tp)[rank], up.chunk(tp)[rank]])
        return tensor.chunk(tp, dim=how)[rank].clone()  # qkv rows are whole query groups: contiguous per rank

    def stage_plan(p: int) -> dict[str, tuple[str, int | str | None]]:
        """Megatron-Core name -> (megafp8 name, how it is cut over TP) for pipeline stage ``p``."""
        plan: dict[str, tuple[str, int | str | None]] = {}
        if p == 0:
            plan["embedding.word_embeddings.weight"] = ("embedding.weight", 0)
        for local in range(per_stage):
            for ours, (theirs, how) in layer_map(config).items():
                plan[f"decoder.layers.{local}.{theirs[0]}"] = (f"layers.{p * per_stage + local}.{ours}", how)
        if p == pp - 1:
            plan["decoder.final_layernorm.weight"] = ("final_layernorm.weight", None)
            # tied: the last stage of a pipeline keeps its own copy of the embedding (Megatron-Core's
            # embedding group keeps them equal); without stages the output layer has no weight
            if not config.tie_embeddings or pp > 1:
                plan["output_layer.weight"] = ("embedding.weight" if config.tie_embeddings else
                                               "output_layer.weight", 0)
        return plan

    def rank_state(t: int, p: int) -> dict[str, torch.Tensor | None]:
        state: dict[str, torch.Tensor | None] = {}
        for theirs, (ours, how) in stage_plan(p).items():
            state[theirs] = shard(read(ours), how, t)
            module = theirs.rsplit(".", 1)[0]
            if module.endswith(_EXTRA_STATE_LINEARS) or module == "output_layer":
                state[module + "._extra_state"] = None
        if p == pp - 1 and "output_layer._extra_state" not in state:
            state["output_layer._extra_state"] = None
        return state

    save_dir = Path(save_dir)
    ranks = [(t, p) for p in range(pp) for t in range(tp)]
    with atomic_output_dir(save_dir, "--save-dir") as tmp:
        iteration_path = tmp / f"iter_{step:07d}"
        for t, p in tqdm(ranks, desc="megafp8 -> megatron", unit="rank file", disable=not progress):
            rank_path = iteration_path / rank_dir_name(t, p, pp)
            rank_path.mkdir(parents=True)
            torch.save({"args": args, "checkpoint_version": CHECKPOINT_VERSION, "iteration": step,
                        "model": rank_state(t, p), "num_floating_point_operations_so_far": 0},
                       rank_path / RANK_FILE)
        (tmp / _TRACKER).write_text(f"{step}\n")  # after every rank file, as Megatron-LM writes it
    return args


def finetune_flags(args: argparse.Namespace) -> str:
    """The Megatron-LM flags that build the exported model, for ``pretrain_gpt.py --load DIR --finetune ...``."""
    flags = [f"--tensor-model-parallel-size {args.tensor_model_parallel_size}",
             f"--pipeline-model-parallel-size {args.pipeline_model_parallel_size}",
             f"--num-layers {args.num_layers}", f"--hidden-size {args.hidden_size}",
             f"--ffn-hidden-size {args.ffn_hidden_size}", f"--num-attention-heads {args.num_attention_heads}"]
    if args.group_query_attention:
        flags += ["--group-query-attention", f"--num-query-groups {args.num_query_groups}"]
    flags += [f"--seq-length {args.seq_length}", f"--max-position-embeddings {args.max_position_embeddings}",
              "--position-embedding-type rope", f"--rotary-base {args.rotary_base}", "--normalization RMSNorm",
              f"--norm-epsilon {args.norm_epsilon:g}", "--swiglu", "--disable-bias-linear",
              f"--make-vocab-size-divisible-by {args.make_vocab_size_divisible_by}", "--transformer-impl local",
              "--ckpt-format torch"]
    if args.use_rope_scaling:
        flags += ["--use-rope-scaling", f"--rope-scaling-factor {args.rope_scaling_factor:g}"]
    if args.untie_embeddings_and_output_weights:
        flags.append("--untie-embeddings-and-output-weights")
    return " ".join(flags)

