"""From flags to this rank's model description: the ModelConfig and the validated layout (no process groups here)."""
from __future__ import annotations

import argparse

import torch

from megafp8.model import ModelConfig
from megafp8.model.moe_options import MOE_FLAG_DEFAULTS
from megafp8.parallel.parallel_state import ParallelState
from megafp8.training.moe_flags import expert_tensor_parallel_size


def model_config_from_args(args: argparse.Namespace, vocab_size: int) -> ModelConfig:
    """The architecture named by the model flags; `vocab_size` comes from the tokenizer."""
    return ModelConfig(
        num_layers=args.num_layers, hidden_size=args.hidden_size, ffn_hidden_size=args.ffn_hidden_size,
        num_attention_heads=args.num_attention_heads, num_query_groups=args.num_query_groups,
        seq_length=args.seq_length, max_position_embeddings=args.max_position_embeddings, vocab_size=vocab_size,
        make_vocab_size_divisible_by=args.make_vocab_size_divisible_by, norm_eps=args.norm_epsilon,
        rope_theta=args.rotary_base, use_rope_scaling=args.use_rope_scaling,
        rope_scaling_factor=args.rope_scaling_factor, rope_scaling_low_freq_factor=args.rope_scaling_low_freq_factor,
        rope_scaling_high_freq_factor=args.rope_scaling_high_freq_factor,
        rope_scaling_original_max_position_embeddings=args.rope_scaling_original_max_position_embeddings,
        tie_embeddings=not args.untie_embeddings_and_output_weights,
        init_method_std=args.init_method_std, activation=args.activation, seed=args.seed,
        recompute_granularity=args.recompute_granularity, recompute_method=args.recompute_method,
        recompute_num_layers=args.recompute_num_layers, kv_channels=args.kv_channels,
        attention_dropout=args.attention_dropout, hidden_dropout=args.hidden_dropout,
        layernorm_zero_centered_gamma=args.layernorm_zero_centered_gamma, qk_layernorm=args.qk_layernorm,
        freeze_qk_layernorm=args.freeze_qk_layernorm, pre_norm=args.pre_norm, post_norm=args.post_norm,
        softmax_scale=args.softmax_scale, embedding_scale=args.embedding_scale, unit_scaling=args.unit_scaling,
        residual_tau=args.residual_tau, fp8_dot_product_attention=args.fp8_dot_product_attention,
        **{name: getattr(args, name) for name in MOE_FLAG_DEFAULTS}, num_experts=args.num_experts,
        # On CPU a bf16 (or fp16) matmul is ~50x slower than fp32 (DESIGN.md): --bf16 / --fp16 are honoured on GPU
        # only.
        params_dtype=_params_dtype(args))


def _params_dtype(args: argparse.Namespace) -> torch.dtype:
    if not torch.cuda.is_available():
        return torch.float32
    return torch.bfloat16 if args.bf16 else torch.float16 if args.fp16 else torch.float32


def parallel_state_from_args(args: argparse.Namespace) -> ParallelState:
    """The validated layout (no process groups yet)."""
    return ParallelState(world_size=args.world_size, tensor_model_parallel_size=args.tensor_model_parallel_size,
                         pipeline_model_parallel_size=args.pipeline_model_parallel_size,
                         num_layers_per_virtual_pipeline_stage=args.num_layers_per_virtual_pipeline_stage,
                         sequence_parallel=args.sequence_parallel, pipeline_schedule=args.pipeline_schedule,
                         decoder_first_pipeline_num_layers=args.decoder_first_pipeline_num_layers,
                         decoder_last_pipeline_num_layers=args.decoder_last_pipeline_num_layers,
                         context_parallel_size=args.context_parallel_size, cp_comm_type=args.cp_comm_type,
                         expert_model_parallel_size=args.expert_model_parallel_size,
                         expert_tensor_parallel_size=expert_tensor_parallel_size(args))
