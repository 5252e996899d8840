"""From flags to this rank's model: the ModelConfig, the FP8 recipe and the GPTModel stage (no process groups here)."""
from __future__ import annotations

import argparse

import torch

from megafp8.fp8 import Fp8Recipe
from megafp8.model import GPTModel, ModelConfig
from megafp8.parallel.parallel_state import ParallelState


def model_config_from_args(args: argparse.Namespace, vocab_size: int) -> ModelConfig:
    """The architecture named by the model flags; `vocab_size` comes from the tokenizer."""
    return ModelConfig(
        num_layers=args.num_layers, hidden_size=args.hidden_size, ffn_hidden_size=args.ffn_hidden_size,
        num_attention_heads=args.num_attention_heads, num_query_groups=args.num_query_groups,
        seq_length=args.seq_length, max_position_embeddings=args.max_position_embeddings, vocab_size=vocab_size,
        make_vocab_size_divisible_by=args.make_vocab_size_divisible_by, norm_eps=args.norm_epsilon,
        rope_theta=args.rotary_base, tie_embeddings=not args.untie_embeddings_and_output_weights,
        init_method_std=args.init_method_std, activation=args.activation, seed=args.seed,
        # On CPU a bf16 matmul is ~50x slower than fp32 (DESIGN.md): --bf16 is honoured on GPU only.
        params_dtype=torch.bfloat16 if args.bf16 and torch.cuda.is_available() else torch.float32)


def parallel_state_from_args(args: argparse.Namespace) -> ParallelState:
    """The validated layout (no process groups yet)."""
    return ParallelState(world_size=args.world_size, tensor_model_parallel_size=args.tensor_model_parallel_size,
                         pipeline_model_parallel_size=args.pipeline_model_parallel_size,
                         num_layers_per_virtual_pipeline_stage=args.num_layers_per_virtual_pipeline_stage,
                         sequence_parallel=args.sequence_parallel)


def build_model(args: argparse.Namespace, config: ModelConfig, parallel_state: ParallelState) -> GPTModel:
    """The whole model at PP=1, on this rank's device, with the run's FP8 precision map."""
    device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
    model = GPTModel(config, parallel_state, fp8_recipe=Fp8Recipe.from_args(args),
                     first_last_layers_bf16=args.first_last_layers_bf16)
    return model.to(device)
