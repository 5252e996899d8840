"""The run's flags in a checkpoint, and the check that a resumed run does not silently change the math.

Three kinds of flag: shape flags (the weights cannot load under another value, whatever the mode),
math flags (the weights load, but the continued run is not the saved run: an error unless
``--finetune`` or the flag is named in ``--allow-changed-args``), and everything else (parallel layout,
logging, paths, lengths), which may change freely: the checkpoint reshards.
"""
from __future__ import annotations

import argparse
import json
from collections.abc import Collection, Mapping
from typing import Any

from megafp8.checkpoint.errors import CheckpointError

SHAPE_ARGS = ("num_layers", "hidden_size", "ffn_hidden_size", "num_attention_heads", "num_query_groups",
              "kv_channels", "vocab_size", "untie_embeddings_and_output_weights",
              # zero-centred norm gains are stored as w, plain ones as 1 + w: the same bytes mean another model
              "layernorm_zero_centered_gamma", "qk_layernorm", "pre_norm", "post_norm",
              "num_experts", "moe_layer_freq", "moe_ffn_hidden_size", "moe_shared_expert_intermediate_size",
              "moe_router_enable_expert_bias")
MATH_ARGS = ("seq_length", "max_position_embeddings", "norm_epsilon", "rotary_base", "use_rope_scaling",
             "rope_scaling_factor", "rope_scaling_low_freq_factor", "rope_scaling_high_freq_factor",
             "rope_scaling_original_max_position_embeddings", "activation",
             "softmax_scale", "embedding_scale", "freeze_qk_layernorm", "unit_scaling", "residual_tau",
             "bf16", "fp16", "loss_scale", "min_loss_scale", "loss_scale_window", "hysteresis",
             "fp8_format", "fp8_recipe", "fp8_amax_history_len", "fp8_amax_compute_algo", "fp8_margin",
             "fp8_power_of_2_scale", "first_last_layers_bf16", "fp8_param_gather", "fp4_param_gather",
             "fp8_static_grad_scale", "fp8_dot_product_attention",
             "moe_router_topk", "moe_router_score_function", "moe_router_pre_softmax", "moe_router_topk_scaling_factor", "moe_router_load_balancing_type",
             "moe_aux_loss_coeff", "moe_z_loss_coeff", "moe_router_bias_update_rate", "moe_expert_capacity_factor",
             "moe_token_drop_policy",
             "global_batch_size", "lr", "min_lr", "lr_decay_style", "lr_warmup_iters", "lr_warmup_samples",
             "lr_decay_iters", "lr_decay_samples", "weight_decay", "adam_beta1", "adam_beta2", "adam_eps",
             "clip_grad", "master_weight_dtype", "optimizer_state_dtype", "seed", "data_path", "split",
             "tokenizer_type", "attention_dropout", "hidden_dropout", "calculate_per_token_loss", "decoupled_lr",
             "decoupled_min_lr", "lr_warmup_fraction", "mock_data", "vocab_file", "merge_file")


class ArgsMismatchError(CheckpointError):
    """A flag differs from the checkpoint's in a way that changes the model or the math."""


def args_to_dict(args: argparse.Namespace | Mapping[str, Any] | None) -> dict[str, Any]:
    """A JSON-safe copy of the flags (values JSON cannot hold are stored as their repr)."""
    if args is None:
        return {}
    items = vars(args).items() if isinstance(args, argparse.Namespace) else dict(args).items()
    out = {}
    for key, value in items:
        try:
            json.dumps(value)
            out[key] = value
        except (TypeError, ValueError):
            out[key] = repr(value)
    return out


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def check_args(saved: Mapping[str, Any], current: Mapping[str, Any], *, finetune: bool = False,
               allow_changed: Collection[str] = (), checkpoint: str = "the checkpoint") -> None:
    """Raise ``ArgsMismatchError`` listing every flag whose value differs in a way that matters.

    Only flags present in both dicts are compared (an older checkpoint may lack newer flags).
    ``allow_changed``: flag names (``lr`` or ``--lr``) the user explicitly lets differ."""
    allowed = {a.lstrip("-").replace("-", "_") for a in allow_changed}
    current = args_to_dict(current)

    def differs(name: str) -> bool:
        return name in saved and name in current and name not in allowed and saved[name] != current[name]

    shape = [n for n in SHAPE_ARGS if differs(n)]
    math = [] if finetune else [n for n in MATH_ARGS if differs(n)]
    if not shape and not math:
        return
    lines = [f"  {_flag(n)}: checkpoint {saved[n]!r}, now {current[n]!r}" for n in shape + math]
    hint = []
    if shape:
        hint.append("model-shape flags must match the checkpoint (its weights have those shapes)")
    if math:
        hint.append("these flags change the training math: use the checkpoint's values, or --finetune to start "
                    "a new run from its weights, or continue this run with the new values: --allow-changed-args "
                    + " ".join(n.replace("_", "-") for n in math))
    raise ArgsMismatchError(f"flags differ from {checkpoint}:\n" + "\n".join(lines) + "\n" + "; ".join(hint))
