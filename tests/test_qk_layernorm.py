"""--qk-layernorm (issue 32): an RMSNorm on each query and key head before RoPE, checked against transformers' Qwen3
(logits and gradients, in fp64), the PP=1 model from scratch under TP=2 + SP and PP=2, and as users reach it: the
training entry, its checkpoint in transformers, and the converters (HF Qwen3 and Megatron-LM, both ways); frozen
gains (--freeze-qk-layernorm) get no gradient and no optimizer state."""
from __future__ import annotations

import dataclasses
import os
import subprocess
import sys

import pytest
import torch
import torch.distributed.checkpoint as dcp

from convert_testing import TOLERANCE, checkpoint_tensors, convert, rel_err
from data_fixtures import REPO_ROOT
from distributed_testing import run_distributed
from megafp8.checkpoint import load_checkpoint
from megafp8.checkpoint.args_check import ArgsMismatchError
from megafp8.checkpoint.convert_hf import training_args
from megafp8.model import GPTModel, ModelConfig
from megafp8.model.hf_mapping import hf_llama_config_kwargs, model_config_from_hf, to_hf_state_dict
from megafp8.parallel.parallel_state import ParallelState
from megafp8.training.megatron_flags import LLAMA_FLAGS
from pipeline_testing import Case, run_case

transformers = pytest.importorskip("transformers")


def _config(**fields) -> ModelConfig:
    base = dict(num_layers=2, hidden_size=64, ffn_hidden_size=96, num_attention_heads=4, num_query_groups=2,
                kv_channels=24, seq_length=16, max_position_embeddings=32, vocab_size=100,
                make_vocab_size_divisible_by=16, rope_theta=500000.0, norm_eps=1e-6, seed=5, qk_layernorm=True)
    return ModelConfig(**{**base, **fields})


def _ids(config: ModelConfig, batch: int = 2) -> torch.Tensor:
    return torch.randint(0, config.vocab_size, (batch, config.seq_length), generator=torch.Generator().manual_seed(3))


def _random_gains(model: torch.nn.Module) -> None:
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "layernorm" in name:
                param.uniform_(0.5, 1.5, generator=torch.Generator().manual_seed(hash(name) % 2**31))


def _qwen3(config: ModelConfig, state: dict[str, torch.Tensor]):
    hf_config = transformers.Qwen3Config(**hf_llama_config_kwargs(config), attn_implementation="eager")
    hf = transformers.Qwen3ForCausalLM(hf_config).eval()
    hf.load_state_dict(to_hf_state_dict(state, config), strict=True)  # q_norm / k_norm included, nothing left over
    return hf


def test_qk_layernorm_gives_transformers_qwen3_logits_and_gradients_in_fp64():
    config = _config()
    model = GPTModel(config, ParallelState().init_process_groups())
    attention = model.layers["0"].self_attention
    assert attention.q_layernorm.weight.shape == attention.k_layernorm.weight.shape == (24,)
    _random_gains(model)
    hf = _qwen3(config, model.state_dict()).double()  # the fp64 reference: transformers' own Qwen3 code
    assert model_config_from_hf(hf.config, seq_length=config.seq_length).qk_layernorm
    ids = _ids(config)
    ours = model(ids)[..., : config.vocab_size]
    theirs = hf(ids).logits
    assert rel_err(ours.double(), theirs) <= TOLERANCE
    for logits in (ours, theirs):
        torch.nn.functional.cross_entropy(logits.reshape(-1, config.vocab_size), ids.reshape(-1)).backward()
    for i in range(config.num_layers):
        for ours_name, hf_name in (("q_layernorm", "q_norm"), ("k_layernorm", "k_norm")):
            grad = getattr(model.layers[str(i)].self_attention, ours_name).weight.grad
            expected = getattr(hf.model.layers[i].self_attn, hf_name).weight.grad
            assert rel_err(grad.double(), expected) <= 1e-4, (i, ours_name)
    qkv_grad = attention.linear_qkv.weight.grad  # the gradient reaches q and k through the norm
    expected = torch.cat([hf.model.layers[0].self_attn.q_proj.weight.grad, hf.model.layers[0].self_attn.k_proj.weight.grad])
    assert rel_err(qkv_grad.reshape(2, 4, 24, 64)[:, :3].reshape(-1, 64).double(),
                   _group_major(expected, config)) <= 1e-4


def _group_major(q_then_k: torch.Tensor, config: ModelConfig) -> torch.Tensor:
    """HF's [q heads; k heads] rows in the fused QKV's per-group order (q heads of group g, then k head g)."""
    d, groups = config.head_dim, config.num_query_groups
    r = config.num_attention_heads // groups
    q, k = q_then_k.split([config.num_attention_heads * d, groups * d])
    return torch.cat([q.reshape(groups, r, d, -1), k.reshape(groups, 1, d, -1)], dim=1).reshape(-1, q.shape[-1])


def _pipeline_body(rank: int, world_size: int) -> None:
    # From scratch (layout-invariant init, nothing loaded): losses and every gradient, the norms' TP sums included,
    # against the single-process model over two SGD steps.
    run_case(Case(pp=2, tp=2, sp=True, model=(("qk_layernorm", True),)), world_size)


def test_qk_layernorm_tp2_sp_pp2_from_scratch_equals_the_single_process_model():
    run_distributed(_pipeline_body, world_size=4)


def test_training_entry_with_qk_layernorm_exports_to_transformers_qwen3(tmp_path):
    """A 2-process TP + SP run with --qk-layernorm; its checkpoint in transformers' Qwen3 and through Megatron-LM's
    format and back; a resume without the flag is refused."""
    flags = [*LLAMA_FLAGS, "--qk-layernorm", "--kv-channels", "24", "--num-layers", "2", "--hidden-size", "64",
             "--num-attention-heads", "4", "--group-query-attention", "--num-query-groups", "2",
             "--ffn-hidden-size", "96", "--seq-length", "32", "--max-position-embeddings", "32",
             "--micro-batch-size", "2", "--global-batch-size", "4", "--lr", "1e-2", "--train-iters", "3",
             "--mock-data", "--tokenizer-type", "NullTokenizer", "--vocab-size", "200",
             "--tensor-model-parallel-size", "2", "--sequence-parallel", "--save", str(tmp_path / "run"),
             "--save-interval", "3", "--log-interval", "1", "--eval-iters", "0"]
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
               "-m", "megafp8.pretrain", *flags]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    result = subprocess.run(command, cwd=REPO_ROOT, capture_output=True, text=True, timeout=600, env=env)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-3000:]
    weights = checkpoint_tensors(tmp_path / "run")
    gains = weights["model.layers.1.self_attention.k_layernorm.weight"]
    assert gains.shape == (24,) and not torch.equal(gains, torch.ones(24))  # trained
    result = convert("--load-format", "megafp8", "--save-format", "hf", "--load-dir", tmp_path / "run",
                     "--save-dir", tmp_path / "hf", "--save-dtype", "fp32")
    assert result.returncode == 0, result.stderr
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf", attn_implementation="eager").eval()
    assert type(hf).__name__ == "Qwen3ForCausalLM"
    assert torch.equal(hf.model.layers[1].self_attn.k_norm.weight, gains)
    config = _config(vocab_size=hf.config.vocab_size, seq_length=32, rope_theta=10000.0, norm_eps=1e-5,
                     make_vocab_size_divisible_by=128, tie_embeddings=True)
    model = GPTModel(config, ParallelState().init_process_groups()).eval()
    load_checkpoint(tmp_path / "run", model=model, parallel_state=ParallelState(), args=training_args(config),
                    finetune=True)
    ids = _ids(config)
    with torch.no_grad():
        assert rel_err(model(ids)[..., : config.vocab_size], hf(ids).logits) <= TOLERANCE
    # HF Qwen3 -> megafp8 -> HF gives every tensor back bit for bit.
    assert convert("--load-format", "hf", "--save-format", "megafp8", "--load-dir", tmp_path / "hf",
                   "--save-dir", tmp_path / "from_hf").returncode == 0
    assert convert("--load-format", "megafp8", "--save-format", "hf", "--load-dir", tmp_path / "from_hf",
                   "--save-dir", tmp_path / "hf_back", "--save-dtype", "fp32").returncode == 0
    back = transformers.Qwen3ForCausalLM.from_pretrained(tmp_path / "hf_back").state_dict()
    original = hf.state_dict()
    assert sorted(back) == sorted(original) and all(torch.equal(back[k], original[k]) for k in original)
    # megafp8 -> Megatron-LM (TP=2: the gains copied on both ranks, q_layernorm / k_layernorm) -> megafp8.
    result = convert("--load-format", "megafp8", "--save-format", "megatron", "--load-dir", tmp_path / "run",
                     "--save-dir", tmp_path / "megatron", "--target-tensor-parallel-size", "2")
    assert result.returncode == 0, result.stderr
    rank0 = torch.load(tmp_path / "megatron" / "iter_0000003" / "mp_rank_00" / "model_optim_rng.pt",
                       weights_only=False)
    assert rank0["args"].qk_layernorm and torch.equal(
        rank0["model"]["decoder.layers.1.self_attention.k_layernorm.weight"], gains)
    result = convert("--load-format", "megatron", "--save-format", "megafp8", "--load-dir", tmp_path / "megatron",
                     "--save-dir", tmp_path / "from_megatron")
    assert result.returncode == 0, result.stderr
    again = checkpoint_tensors(tmp_path / "from_megatron")
    assert sorted(again) == sorted(weights) and all(torch.equal(again[k], weights[k]) for k in weights)
    # The same weights without the flag: refused by name, even as --finetune.
    plain = GPTModel(dataclasses.replace(config, qk_layernorm=False), ParallelState().init_process_groups())
    with pytest.raises(ArgsMismatchError, match="--qk-layernorm: checkpoint True, now False"):
        load_checkpoint(tmp_path / "run", model=plain, parallel_state=ParallelState(),
                        args=training_args(plain.config), finetune=True)


def test_frozen_qk_gains_get_no_gradient_and_no_optimizer_state(tmp_path):
    """--freeze-qk-layernorm (FOG) at TP=2 + SP with the distributed optimizer: the gains stay 1, have no optimizer
    entries, and every other weight trains."""
    flags = [*LLAMA_FLAGS, "--qk-layernorm", "--freeze-qk-layernorm", "--num-layers", "2", "--hidden-size", "64",
             "--num-attention-heads", "4", "--seq-length", "32", "--micro-batch-size", "2", "--global-batch-size", "4",
             "--lr", "1e-2", "--train-iters", "2", "--mock-data", "--tokenizer-type", "NullTokenizer",
             "--vocab-size", "200", "--tensor-model-parallel-size", "2", "--sequence-parallel",
             "--use-distributed-optimizer", "--save", str(tmp_path / "run"), "--save-interval", "2", "--eval-iters", "0"]
    result = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
                             "-m", "megafp8.pretrain", *flags], cwd=REPO_ROOT, capture_output=True, text=True,
                            timeout=600, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-3000:]
    weights = checkpoint_tensors(tmp_path / "run")
    frozen = [k for k in weights if "q_layernorm" in k or "k_layernorm" in k]
    assert len(frozen) == 4 and all(torch.equal(weights[k], torch.ones(16)) for k in frozen)
    assert not torch.equal(weights["model.layers.0.input_layernorm.weight"], torch.ones(64))  # the others train
    metadata = dcp.FileSystemReader(str(tmp_path / "run" / "iter_0000002")).read_metadata().state_dict_metadata
    optimizer = [k for k in metadata if k.startswith("optimizer.params.")]
    assert optimizer and not any("q_layernorm" in k or "k_layernorm" in k for k in optimizer)
    model = GPTModel(_config(freeze_qk_layernorm=True), ParallelState().init_process_groups())
    model(_ids(model.config), labels=_ids(model.config)).mean().backward()
    assert model.layers["0"].self_attention.q_layernorm.weight.grad is None
