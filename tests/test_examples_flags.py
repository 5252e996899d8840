"""The GPU example scripts are valid bash and their flags pass the training entry's validation at the world
size they launch (flags, layout, batch sizes), without training: `torchrun` is replaced by a stub on PATH
that records its command line."""
import os
import shlex
import subprocess

import pytest

from data_fixtures import REPO_ROOT
from megafp8.model.moe_options import moe_layer_pattern
from megafp8.training.arguments import parse_args
from megafp8.training.model_setup import model_config_from_args, parallel_state_from_args

EXAMPLES = os.path.join(REPO_ROOT, "examples")
LLAMA3_VOCAB = 128256  # Meta-Llama-3-8B's tokenizer


def _launch(script: str, tmp_path, **env: str) -> list[str]:
    """The torchrun command line the script runs (the stub writes it; nothing trains)."""
    stub_dir, record = tmp_path / "bin", tmp_path / "torchrun_args"
    stub_dir.mkdir(exist_ok=True)
    (stub_dir / "torchrun").write_text(f'#!/usr/bin/env bash\nprintf "%s\\0" "$@" > {shlex.quote(str(record))}\n')
    (stub_dir / "torchrun").chmod(0o755)
    result = subprocess.run(["bash", os.path.join(EXAMPLES, script)], capture_output=True, text=True, timeout=60,
                            env={**os.environ, "PATH": f"{stub_dir}:{os.environ['PATH']}",
                                 "RUN_DIR": str(tmp_path / "run"), **env})
    assert result.returncode == 0, result.stderr
    return record.read_text().split("\0")[:-1]


def _entry_flags(command: list[str]) -> tuple[list[str], int]:
    """(the flags after `-m megafp8.pretrain`, the world size torchrun's options imply)."""
    module = command.index("-m")
    assert command[module + 1] == "megafp8.pretrain"
    launcher = command[:module]
    nnodes = 1 if "--standalone" in launcher else int(launcher[launcher.index("--nnodes") + 1])
    return command[module + 2:], nnodes * int(launcher[launcher.index("--nproc-per-node") + 1])


def _validated(flags: list[str], world_size: int, vocab_size: int):
    """parse_args plus the layout/model check megafp8.pretrain does before any process-group work."""
    args = parse_args(flags, world_size)
    parallel_state_from_args(args).validate_model(model_config_from_args(args, vocab_size),
                                                  global_batch_size=args.global_batch_size,
                                                  micro_batch_size=args.micro_batch_size)
    return args


@pytest.mark.parametrize("script", ["pretrain_llama3_8b_fp8.sh", "pretrain_llama3_8b_32k_cp.sh", "pretrain_single_gpu.sh",
                                    "quickstart.sh", "fp8_parity.sh", "pretrain_moe_qwen3_30b_a3b.sh",
                                    "pretrain_moe_deepseek_v3_recipe.sh"])
def test_example_is_valid_bash(script):
    assert subprocess.run(["bash", "-n", os.path.join(EXAMPLES, script)]).returncode == 0


@pytest.mark.parametrize("nnodes", [1, 2, 4, 16])
def test_llama3_8b_template_flags_are_accepted(tmp_path, nnodes):
    command = _launch("pretrain_llama3_8b_fp8.sh", tmp_path, NNODES=str(nnodes), NODE_RANK="1", MASTER="node0")
    launcher = command[:command.index("-m")]
    assert launcher[launcher.index("--rdzv-backend") + 1] == "c10d"
    assert launcher[launcher.index("--rdzv-endpoint") + 1] == "node0:29500"
    assert launcher[launcher.index("--node-rank") + 1] == "1"
    flags, world_size = _entry_flags(command)
    assert world_size == 8 * nnodes
    args = _validated(flags, world_size, LLAMA3_VOCAB)
    # Meta-Llama-3-8B's config.json: the shapes the template must reproduce.
    assert (args.num_layers, args.hidden_size, args.ffn_hidden_size, args.num_attention_heads,
            args.num_query_groups, args.seq_length, args.rotary_base, args.norm_epsilon) == (
        32, 4096, 14336, 32, 8, 8192, 500000.0, 1e-5)
    assert args.untie_embeddings_and_output_weights and args.tokenizer_type == "HuggingFaceTokenizer"
    assert args.group_query_attention and args.attention_dropout == args.hidden_dropout == 0  # the Llama block
    assert (args.tensor_model_parallel_size, args.pipeline_model_parallel_size, args.data_parallel_size) == (4, 2, nnodes)
    assert args.sequence_parallel and args.bf16 and args.fp8_format == "hybrid" and args.fp8_recipe == "delayed"
    assert args.use_distributed_optimizer and args.fp8_param_gather
    assert args.overlap_grad_reduce and args.overlap_param_gather
    assert args.save == args.load == str(tmp_path / "run" / "checkpoints") and args.log_dir and args.tensorboard_dir


@pytest.mark.parametrize("nnodes", [2, 4])
def test_long_context_template_flags_are_accepted(tmp_path, nnodes):
    """32k tokens per sequence at TP4 x CP2 x PP2 (16 GPUs per replica): DP = NNODES / 2, CP's chunks fit."""
    flags, world_size = _entry_flags(_launch("pretrain_llama3_8b_32k_cp.sh", tmp_path, NNODES=str(nnodes)))
    assert world_size == 8 * nnodes
    args = _validated(flags, world_size, LLAMA3_VOCAB)
    assert (args.num_layers, args.hidden_size, args.num_query_groups, args.seq_length) == (32, 4096, 8, 32768)
    assert args.use_rope_scaling and args.rope_scaling_factor == 8
    assert (args.tensor_model_parallel_size, args.context_parallel_size, args.pipeline_model_parallel_size,
            args.data_parallel_size) == (4, 2, 2, nnodes // 2)
    assert args.cp_comm_type == "p2p" and args.sequence_parallel and args.recompute_granularity == "selective"
    assert args.fp8_format == "hybrid" and args.use_distributed_optimizer and args.fp8_param_gather
    assert args.global_batch_size * args.seq_length == 128 * 32768  # 4M tokens per iteration


@pytest.mark.parametrize("nnodes", [2, 4])
def test_moe_template_flags_are_accepted(tmp_path, nnodes):
    """Qwen3-30B-A3B's shapes (its config.json) at PP2 x TP2 + SP x DP, the experts over EP 8 of each stage."""
    flags, world_size = _entry_flags(_launch("pretrain_moe_qwen3_30b_a3b.sh", tmp_path, NNODES=str(nnodes)))
    assert world_size == 8 * nnodes
    args = _validated(flags, world_size, 151936)
    assert (args.num_layers, args.hidden_size, args.num_attention_heads, args.num_query_groups, args.kv_channels,
            args.num_experts, args.moe_ffn_hidden_size, args.moe_router_topk) == (48, 2048, 32, 4, 128, 128, 768, 8)
    assert args.qk_layernorm and args.moe_router_score_function == "softmax" and not args.moe_router_pre_softmax
    assert (args.pipeline_model_parallel_size, args.tensor_model_parallel_size, args.data_parallel_size,
            args.expert_model_parallel_size) == (2, 2, 2 * nnodes, 8)
    assert args.fp8_recipe == "blockwise" and args.fp8_power_of_2_scale and args.use_distributed_optimizer


@pytest.mark.parametrize("nnodes", [2, 4])
def test_deepseek_v3_recipe_template_flags_are_accepted(tmp_path, nnodes):
    """DeepSeek-V3's router, balancing and shared experts, the first layer dense, TP2 + SP x DP, EP 8."""
    flags, world_size = _entry_flags(_launch("pretrain_moe_deepseek_v3_recipe.sh", tmp_path, NNODES=str(nnodes)))
    assert world_size == 8 * nnodes
    args = _validated(flags, world_size, 129280)
    assert (args.num_layers, args.num_experts, args.moe_router_topk, args.moe_ffn_hidden_size,
            args.moe_shared_expert_intermediate_size) == (27, 64, 6, 1408, 2816)
    assert [bool(x) for x in moe_layer_pattern(args.num_layers, args.moe_layer_freq)] == [False] + [True] * 26
    assert (args.moe_router_score_function, args.moe_router_enable_expert_bias, args.moe_router_topk_scaling_factor,
            args.moe_router_load_balancing_type) == ("sigmoid", True, 2.5, "seq_aux_loss")
    assert (args.tensor_model_parallel_size, args.data_parallel_size, args.expert_model_parallel_size) == (
        2, 4 * nnodes, 8)
    assert args.fp8_recipe == "blockwise" and args.non_persistent_ckpt_type == "local"


def test_single_gpu_script_flags_are_accepted(tmp_path):
    flags, world_size = _entry_flags(_launch("pretrain_single_gpu.sh", tmp_path))
    assert world_size == 1
    args = _validated(flags, world_size, 4000)
    assert (args.num_layers, args.hidden_size, args.seq_length, args.data_parallel_size) == (16, 2048, 2048, 1)
    assert args.fp8_format == "hybrid" and args.bf16 and args.num_micro_batches == 16
    # ~1B parameters: untied embedding/head of the 4000-piece (padded 4096) vocabulary + 16 GQA layers.
    h, f, kv = args.hidden_size, args.ffn_hidden_size, args.hidden_size // args.num_attention_heads * args.num_query_groups
    params = 2 * 4096 * h + 16 * (h * (h + 2 * kv) + h * h + 3 * h * f + 2 * h) + h
    assert 0.9e9 < params < 1.3e9


@pytest.mark.parametrize("script", ["pretrain_single_gpu.sh", "pretrain_llama3_8b_fp8.sh",
                                    "pretrain_llama3_8b_32k_cp.sh", "pretrain_moe_qwen3_30b_a3b.sh",
                                    "pretrain_moe_deepseek_v3_recipe.sh"])
def test_gpu_example_install_line_brings_the_packages_its_flags_need(script, tmp_path):
    """The install line in the script's header names the extras whose packages its flags import (a tokenizer,
    TensorBoard): following it, the run does not stop at the optional-package check."""
    import re

    from setup_extras import extras_packages

    header = open(os.path.join(EXAMPLES, script)).read().split("set -euo pipefail")[0]
    extras = re.search(r'pip install -e "\.\[([a-z,]+)\]"', header).group(1).split(",")
    installed = {package for extra in extras for package in extras_packages()[extra]}
    flags, _ = _entry_flags(_launch(script, tmp_path))
    needed = set()
    if "--tensorboard-dir" in flags:
        needed.add("tensorboard")
    tokenizer_type = flags[flags.index("--tokenizer-type") + 1]
    needed.add({"SentencePieceTokenizer": "sentencepiece", "HuggingFaceTokenizer": "tokenizers"}[tokenizer_type])
    assert needed <= installed, (script, needed - installed)
