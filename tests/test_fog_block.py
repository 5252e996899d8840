"""The FOG block's options (issue 32): --no-pre-norm, --post-norm (gains from 1/sqrt(L)), --softmax-scale,
--embedding-scale, with --qk-layernorm, and μnit Scaling's: --unit-scaling (N(0, 1) weights, each linear's output
times 1/sqrt(fan_in)) and --residual-tau (sqrt(1 - tau) x + sqrt(tau) F(x)). Checked against a plain fp64
re-implementation of the whole model written here (logits and every gradient), TP=2 + SP x PP=2 built from scratch
against the single-process model, and through the training entry: it trains, its checkpoint refuses a resume without
the options and an export to formats that cannot express the block."""
from __future__ import annotations

import math
import os
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F

from convert_testing import convert
from data_fixtures import REPO_ROOT
from distributed_testing import run_distributed
from megafp8.model import GPTModel, ModelConfig
from megafp8.parallel.parallel_state import ParallelState
from megafp8.training.megatron_flags import LLAMA_FLAGS
from pipeline_testing import Case, run_case

FOG = dict(pre_norm=False, post_norm=True, qk_layernorm=True, softmax_scale=0.3, embedding_scale=2.0)
MUS = dict(pre_norm=False, post_norm=True, unit_scaling=True, residual_tau=0.2)
FOG_XIELU = dict(FOG, activation="xielu")  # FOG's block with its non-gated xIELU MLP


def _config(**fields) -> ModelConfig:
    base = dict(num_layers=2, hidden_size=32, ffn_hidden_size=48, num_attention_heads=4, num_query_groups=2,
                seq_length=8, vocab_size=50, make_vocab_size_divisible_by=2, rope_theta=10000.0, norm_eps=1e-6,
                seed=7)
    return ModelConfig(**{**base, **fields})


def _rms(x, w, eps):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w


def _rope(x, theta):  # x [b, s, heads, d], rotate-half (Llama / HF)
    s, d = x.shape[1], x.shape[-1]
    angles = torch.arange(s, dtype=torch.float64)[:, None] * theta ** (-torch.arange(0, d, 2, dtype=torch.float64) / d)
    cos, sin = torch.cat([angles, angles], -1).cos()[:, None], torch.cat([angles, angles], -1).sin()[:, None]
    return x * cos + torch.cat([-x[..., d // 2:], x[..., : d // 2]], -1) * sin


def _reference_logits(p: dict[str, torch.Tensor], c: ModelConfig, ids: torch.Tensor) -> torch.Tensor:
    """The model the options describe, in fp64, from its parameters (megafp8 names, TP=1)."""
    groups, d = c.num_query_groups, c.head_dim
    r = c.num_attention_heads // groups
    b, s = ids.shape

    def linear(x, weight):  # μnit Scaling: unit weights, the output times 1/sqrt(fan_in)
        return x @ weight.T / (math.sqrt(weight.shape[1]) if c.unit_scaling else 1.0)

    def xielu(x, a_p, a_n, beta=0.5, eps=-1e-6):  # arXiv 2411.13010's xIELU, as transformers' XIELUActivation
        alpha_p, alpha_n = F.softplus(a_p), beta + F.softplus(a_n)
        return torch.where(x > 0, alpha_p * x * x + beta * x, alpha_n * torch.expm1(x.clamp(max=eps)) - alpha_n * x
                           + beta * x)

    def residual_add(x, out):
        if c.residual_tau is None:
            return x + out
        return math.sqrt(1 - c.residual_tau) * x + math.sqrt(c.residual_tau) * out

    x = p["embedding.weight"][ids] * c.embedding_scale
    for i in range(c.num_layers):
        w = lambda name: p[f"layers.{i}.{name}"]  # noqa: E731
        h = _rms(x, w("input_layernorm.weight"), c.norm_eps) if c.pre_norm else x
        qkv = linear(h, w("self_attention.linear_qkv.weight")).view(b, s, groups, r + 2, d)
        q, k, v = qkv[:, :, :, :r].reshape(b, s, groups * r, d), qkv[:, :, :, r], qkv[:, :, :, r + 1]
        if c.qk_layernorm:
            q = _rms(q, w("self_attention.q_layernorm.weight"), c.norm_eps)
            k = _rms(k, w("self_attention.k_layernorm.weight"), c.norm_eps)
        q, k = _rope(q, c.rope_theta), _rope(k, c.rope_theta)
        q, k, v = q.transpose(1, 2), k.repeat_interleave(r, 2).transpose(1, 2), v.repeat_interleave(r, 2).transpose(1, 2)
        scale = c.softmax_scale if c.softmax_scale is not None else d ** -0.5
        scores = (q @ k.transpose(-1, -2) * scale).masked_fill(torch.ones(s, s, dtype=torch.bool).triu(1), -math.inf)
        a = linear((scores.softmax(-1) @ v).transpose(1, 2).reshape(b, s, -1), w("self_attention.linear_proj.weight"))
        x = residual_add(x, _rms(a, w("attention_output_layernorm.weight"), c.norm_eps) if c.post_norm else a)
        h = _rms(x, w("pre_mlp_layernorm.weight"), c.norm_eps) if c.pre_norm else x
        if c.activation == "xielu":
            m = linear(xielu(linear(h, w("mlp.linear_fc1.weight")), w("mlp.xielu.alpha_p"), w("mlp.xielu.alpha_n")),
                       w("mlp.linear_fc2.weight"))
        else:
            gate, up = linear(h, w("mlp.linear_fc1.weight")).chunk(2, -1)
            m = linear(F.silu(gate) * up, w("mlp.linear_fc2.weight"))
        x = residual_add(x, _rms(m, w("mlp_output_layernorm.weight"), c.norm_eps) if c.post_norm else m)
    head = p["embedding.weight"] if c.tie_embeddings else p["output_layer.weight"]
    return linear(_rms(x, p["final_layernorm.weight"], c.norm_eps), head)


@pytest.mark.parametrize("options", [FOG, dict(post_norm=True), dict(pre_norm=False, softmax_scale=1.0), MUS,
                                     dict(unit_scaling=True, tie_embeddings=False), dict(residual_tau=0.3), FOG_XIELU],
                         ids=["fog", "pre-and-post-norm", "no-norm-fixed-scale", "mus", "unit-scaling", "tau",
                              "fog-xielu"])
def test_block_options_match_an_fp64_reimplementation(options):
    config = _config(**options)
    model = GPTModel(config, ParallelState().init_process_groups())
    names = dict(model.named_parameters())
    if config.post_norm:  # the output norms start at 1/sqrt(L), at 1 under --residual-tau
        gain = 1.0 if config.residual_tau is not None else 2 ** -0.5
        assert torch.allclose(names["layers.1.mlp_output_layernorm.weight"], torch.full((32,), gain))
    if config.unit_scaling:  # unit-variance weights (output projections too), from the model's own init
        for name in ("embedding.weight", "layers.0.mlp.linear_fc2.weight", "layers.1.self_attention.linear_qkv.weight"):
            assert 0.8 < names[name].std().item() < 1.2, name
    assert ("layers.0.input_layernorm.weight" in names) == config.pre_norm
    with torch.no_grad():  # gains away from their init, so a swapped or missing norm shows
        for name, param in names.items():
            if "layernorm" in name or "xielu" in name:  # (the xIELU scalars too: raw values around their init)
                param.uniform_(0.5, 1.5, generator=torch.Generator().manual_seed(len(name)))
    ids = torch.randint(0, config.vocab_size, (2, config.seq_length), generator=torch.Generator().manual_seed(1))
    reference = {name: param.detach().double().requires_grad_() for name, param in names.items()}
    expected = _reference_logits(reference, config, ids)
    logits = model(ids)[..., : config.vocab_size]
    assert (logits.double() - expected).abs().max() <= 1e-5 * expected.abs().max()
    for out in (logits, expected):
        F.cross_entropy(out.reshape(-1, config.vocab_size), ids.reshape(-1)).backward()
    for name, param in names.items():
        grad, want = param.grad.double(), reference[name].grad
        assert (grad - want).abs().max() <= 1e-4 * want.abs().max(), name


def _pipeline_body(rank: int, world_size: int, options: dict) -> None:
    run_case(Case(pp=2, tp=2, sp=True, model=tuple(options.items())), world_size)


@pytest.mark.parametrize("options", [FOG_XIELU, MUS], ids=["fog-xielu", "mus"])
def test_block_tp2_sp_pp2_from_scratch_equals_the_single_process_model(options):
    run_distributed(_pipeline_body, world_size=4, args=(options,))


def test_training_entry_trains_the_fog_block_and_keeps_it(tmp_path):
    flags = [*LLAMA_FLAGS, "--no-pre-norm", "--post-norm", "--qk-layernorm", "--softmax-scale", "0.3",
             "--embedding-scale", "2.0", "--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4",
             "--seq-length", "32", "--micro-batch-size", "2", "--global-batch-size", "4", "--lr", "1e-3",
             "--mock-data", "--tokenizer-type", "NullTokenizer", "--vocab-size", "200", "--log-interval", "1",
             "--eval-iters", "0", "--fp8-format", "hybrid", "--fp8-recipe", "delayed"]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}

    def pretrain(*extra: str) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-m", "megafp8.pretrain", *flags, *extra], cwd=REPO_ROOT,
                              capture_output=True, text=True, timeout=300, env=env)

    result = pretrain("--train-iters", "3", "--save", str(tmp_path / "run"), "--save-interval", "3")
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.count("lm loss:") == 3
    dropped = [f for f in flags if f not in ("--no-pre-norm", "--post-norm")]
    resumed = subprocess.run([sys.executable, "-m", "megafp8.pretrain", *dropped, "--train-iters", "4", "--load",
                              str(tmp_path / "run")], cwd=REPO_ROOT, capture_output=True, text=True, timeout=300,
                             env=env)
    assert resumed.returncode != 0 and "--pre-norm: checkpoint False, now True" in resumed.stdout + resumed.stderr
    exported = convert("--load-format", "megafp8", "--save-format", "hf", "--load-dir", tmp_path / "run",
                       "--save-dir", tmp_path / "hf")
    assert exported.returncode == 1 and "--no-pre-norm, --post-norm, --softmax-scale, --embedding-scale" in \
        exported.stderr and not (tmp_path / "hf").exists()
