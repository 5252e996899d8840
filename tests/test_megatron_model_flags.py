"""Megatron-LM's model flags megafp8 honours (issue 30): --kv-channels (a head dim other than hidden / heads),
--apply-layernorm-1p (zero-centred RMSNorm gains) and dropout (--attention-dropout, --hidden-dropout), checked
against transformers' Llama, the TP=1 model built from scratch, and the training entry and converter as users
run them."""
from __future__ import annotations

import dataclasses
import os
import subprocess
import sys

import pytest
import torch
import torch.distributed as dist

from convert_testing import TOLERANCE, checkpoint_tensors, convert, rel_err, tiny_hf_llama
from data_fixtures import REPO_ROOT
from distributed_testing import run_distributed
from megafp8.checkpoint import load_checkpoint
from megafp8.checkpoint.args_check import ArgsMismatchError
from megafp8.checkpoint.convert_hf import training_args
from megafp8.fp8 import Fp8Recipe
from megafp8.model import GPTModel, ModelConfig
from megafp8.model.hf_mapping import from_hf_state_dict, hf_llama_config_kwargs, model_config_from_hf, to_hf_state_dict
from megafp8.parallel.parallel_state import ParallelState
from megafp8.training.megatron_flags import LLAMA_FLAGS

transformers = pytest.importorskip("transformers")


def _config(**fields) -> ModelConfig:
    base = dict(num_layers=2, hidden_size=64, ffn_hidden_size=96, num_attention_heads=4, num_query_groups=2,
                seq_length=16, max_position_embeddings=32, vocab_size=100, make_vocab_size_divisible_by=16,
                rope_theta=500000.0, norm_eps=1e-6, seed=5)
    return ModelConfig(**{**base, **fields})


def _ids(config: ModelConfig, batch: int = 2) -> torch.Tensor:
    return torch.randint(0, config.vocab_size, (batch, config.seq_length), generator=torch.Generator().manual_seed(3))


def _hf(config: ModelConfig):
    hf_config = transformers.LlamaConfig(**hf_llama_config_kwargs(config), attn_implementation="eager")
    return transformers.LlamaForCausalLM(hf_config).eval()


def _randomize_norms(model: torch.nn.Module, low: float, high: float) -> None:
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "layernorm" in name:
                param.uniform_(low, high)


# ---- --kv-channels --------------------------------------------------------------------------------------------

def test_kv_channels_head_dim_matches_transformers_llama_with_head_dim():
    config = _config(kv_channels=24)  # d = 24, hidden / heads = 16: QKV [(4 + 4) 24, 64], proj [64, 96]
    model = GPTModel(config, ParallelState().init_process_groups())
    assert model.layers["0"].self_attention.linear_qkv.weight.shape == (8 * 24, 64)
    assert model.layers["0"].self_attention.linear_proj.weight.shape == (64, 4 * 24)
    _randomize_norms(model, 0.5, 1.5)
    hf = _hf(config)
    assert hf.config.head_dim == 24
    hf.load_state_dict(to_hf_state_dict(model.state_dict(), config), strict=True)
    ids = _ids(config)
    with torch.no_grad():
        assert rel_err(model(ids)[..., : config.vocab_size], hf(ids).logits) <= TOLERANCE
    back = model_config_from_hf(hf.config, seq_length=config.seq_length)
    assert back.kv_channels == 24 and back.head_dim == 24
    assert model_config_from_hf(_hf(_config()).config).kv_channels is None  # the default head dim stays implicit


def _kv_channels_tp_body(rank: int, world_size: int) -> None:
    config = _config(kv_channels=24, hidden_size=48)  # hidden 48 = 4 heads x 12, but d = 24
    ids = _ids(config)
    reference = GPTModel(config, ParallelState().init_process_groups())  # TP=1, built from scratch with the same seed
    with torch.no_grad():
        expected = reference(ids)[..., : config.vocab_size]
    ps = ParallelState(world_size=world_size, tensor_model_parallel_size=world_size).init_process_groups(rank)
    sharded = GPTModel(config, ps)  # from scratch: no state dict loaded, so an init bug would show
    with torch.no_grad():
        local = sharded(ids)
    parts = [torch.empty_like(local) for _ in range(world_size)]
    dist.all_gather(parts, local.contiguous())
    logits = torch.cat(parts, dim=-1)[..., : config.vocab_size]
    assert rel_err(logits, expected) <= TOLERANCE, rel_err(logits, expected)


def test_kv_channels_tp2_built_from_scratch_equals_tp1():
    run_distributed(_kv_channels_tp_body, world_size=2)


def test_hf_head_dim_checkpoint_converts_and_round_trips_bit_exact(tmp_path):
    hf = tiny_hf_llama(tmp_path / "hf", tie=False, head_dim=24)
    assert convert("--load-format", "hf", "--save-format", "megafp8", "--load-dir", tmp_path / "hf",
                   "--save-dir", tmp_path / "m8").returncode == 0
    config = model_config_from_hf(hf.config, seq_length=16)
    assert config.kv_channels == 24
    model = GPTModel(config, ParallelState().init_process_groups())
    load_checkpoint(tmp_path / "m8", model=model, parallel_state=ParallelState(), args=training_args(config),
                    finetune=True)
    ids = _ids(config)
    with torch.no_grad():
        assert rel_err(model(ids)[..., : config.vocab_size], hf(ids).logits) <= TOLERANCE
    result = convert("--load-format", "megafp8", "--save-format", "hf", "--load-dir", tmp_path / "m8",
                     "--save-dir", tmp_path / "hf_back", "--save-dtype", "fp32")
    assert result.returncode == 0, result.stderr
    back = transformers.LlamaForCausalLM.from_pretrained(tmp_path / "hf_back")
    assert back.config.head_dim == 24
    original, exported = hf.state_dict(), back.state_dict()
    assert sorted(original) == sorted(exported) and all(torch.equal(original[k], exported[k]) for k in original)


# ---- --apply-layernorm-1p -----------------------------------------------------------------------------------

def _plain_and_zero_centered(fp8_recipe: Fp8Recipe | None = None) -> tuple[GPTModel, GPTModel]:
    """Two models with the same weights where the zero-centred one stores w and the plain one 1 + w."""
    ps = ParallelState().init_process_groups()
    plain = GPTModel(_config(), ps, fp8_recipe=fp8_recipe)
    centred = GPTModel(_config(layernorm_zero_centered_gamma=True), ps, fp8_recipe=fp8_recipe)
    assert all(torch.equal(p, torch.zeros_like(p)) for n, p in centred.named_parameters() if "layernorm" in n)
    _randomize_norms(centred, -0.5, 0.5)
    state = centred.state_dict()
    plain.load_state_dict({k: (v + 1 if "layernorm" in k else v) for k, v in state.items()})
    return plain, centred


@pytest.mark.parametrize("fp8", [False, True], ids=["fp32", "fp8-fused-prologue"])
def test_zero_centered_gamma_is_one_plus_w_in_forward_and_backward(fp8):
    recipe = Fp8Recipe(scaling="delayed", amax_history_len=4) if fp8 else None
    plain, centred = _plain_and_zero_centered(recipe)
    ids = _ids(plain.config)
    losses = [m(ids, labels=ids).mean() for m in (plain, centred)]
    for loss in losses:
        loss.backward()
    assert torch.equal(losses[0], losses[1])  # the gain is computed exactly as the stored 1 + w
    grads = [dict((n, p.grad) for n, p in m.named_parameters()) for m in (plain, centred)]
    assert all(torch.equal(grads[0][n], grads[1][n]) for n in grads[0]), "d(1 + w)/dw = 1"


def test_zero_centered_gamma_exports_one_plus_w_to_transformers():
    _, centred = _plain_and_zero_centered()
    config = centred.config
    with torch.no_grad():  # multiples of 1/256 in [-0.5, 0.5]: 1 + w and back are exact in fp32
        for name, param in centred.named_parameters():
            if "layernorm" in name:
                param.copy_(torch.round(param * 256) / 256)
    hf_state = to_hf_state_dict(centred.state_dict(), config)
    assert torch.equal(hf_state["model.norm.weight"], centred.final_layernorm.weight + 1)
    hf = _hf(config)
    hf.load_state_dict(hf_state, strict=False)
    ids = _ids(config)
    with torch.no_grad():
        assert rel_err(centred(ids)[..., : config.vocab_size], hf(ids).logits) <= TOLERANCE
    back = from_hf_state_dict(hf_state, config)
    assert all(torch.equal(back[k], v) for k, v in centred.state_dict().items() if k in back)


def test_hf_checkpoint_converts_zero_centered_and_round_trips_bit_exact(tmp_path):
    """HF -> megafp8 --apply-layernorm-1p (w = g - 1) -> HF gives every gain back bit for bit: g - 1 is exact for
    g in [0.5, 2] and then 1 + w is g."""
    hf = tiny_hf_llama(tmp_path / "hf", tie=True)
    assert convert("--load-format", "hf", "--save-format", "megafp8", "--load-dir", tmp_path / "hf",
                   "--save-dir", tmp_path / "m8", "--apply-layernorm-1p").returncode == 0
    stored = checkpoint_tensors(tmp_path / "m8")
    assert torch.equal(stored["model.final_layernorm.weight"], hf.model.norm.weight - 1)
    config = model_config_from_hf(hf.config, seq_length=16, layernorm_zero_centered_gamma=True)
    model = GPTModel(config, ParallelState().init_process_groups())
    load_checkpoint(tmp_path / "m8", model=model, parallel_state=ParallelState(), args=training_args(config),
                    finetune=True)
    ids = _ids(config)
    with torch.no_grad():
        assert rel_err(model(ids)[..., : config.vocab_size], hf(ids).logits) <= TOLERANCE
    result = convert("--load-format", "megafp8", "--save-format", "hf", "--load-dir", tmp_path / "m8",
                     "--save-dir", tmp_path / "hf_back", "--save-dtype", "fp32")
    assert result.returncode == 0, result.stderr
    original = hf.state_dict()
    exported = transformers.LlamaForCausalLM.from_pretrained(tmp_path / "hf_back").state_dict()
    assert sorted(original) == sorted(exported) and all(torch.equal(original[k], exported[k]) for k in original)
    # A plain-gain run cannot load the zero-centred checkpoint, even as --finetune: the gains would be 0 + w.
    plain = dataclasses.replace(config, layernorm_zero_centered_gamma=False)
    with pytest.raises(ArgsMismatchError, match="--layernorm-zero-centered-gamma: checkpoint True, now False"):
        load_checkpoint(tmp_path / "m8", model=GPTModel(plain, ParallelState().init_process_groups()),
                        parallel_state=ParallelState(), args=training_args(plain), finetune=True)
    wrong = convert("--load-format", "megafp8", "--save-format", "megatron", "--load-dir", tmp_path / "m8",
                    "--save-dir", tmp_path / "x", "--apply-layernorm-1p")
    assert wrong.returncode == 1 and "--apply-layernorm-1p applies to --load-format hf" in wrong.stderr


# ---- dropout --------------------------------------------------------------------------------------------------

def test_dropout_is_off_in_eval_and_replayed_by_recomputation():
    ps = ParallelState().init_process_groups()
    ids = _ids(_config())
    no_dropout = GPTModel(_config(), ps).eval()
    dropout = GPTModel(_config(attention_dropout=0.2, hidden_dropout=0.2), ps)
    assert dropout.rng is not None
    with torch.no_grad():
        assert torch.equal(dropout.eval()(ids), no_dropout(ids))  # eval: exactly the model without dropout
        dropout.train()
        torch.manual_seed(1)
        first = dropout(ids)
        torch.manual_seed(1)
        assert not torch.equal(first, dropout(ids)), "the tracker's stream moves on: new attention masks"
    results = {}
    for granularity, method in ((None, None), ("full", "uniform"), ("selective", None)):
        config = _config(attention_dropout=0.2, hidden_dropout=0.2, recompute_granularity=granularity,
                         recompute_method=method, recompute_num_layers=1 if method else None)
        model = GPTModel(config, ps)
        torch.manual_seed(11)
        loss = model(ids, labels=ids).mean()
        loss.backward()
        results[granularity] = (loss.detach(), {n: p.grad for n, p in model.named_parameters()})
    loss, grads = results[None]
    assert loss != no_dropout(ids, labels=ids).mean()
    for granularity in ("full", "selective"):  # recomputation redraws the very same masks
        assert torch.equal(results[granularity][0], loss), granularity
        assert all(torch.equal(results[granularity][1][n], g) for n, g in grads.items()), granularity


def test_attention_dropout_is_unbiased_over_many_masks():
    """Statistically, against the eval output (which equals transformers'): the attention output is linear in the
    dropped probabilities, so its mean over many masks is the output without dropout."""
    config = _config(num_layers=1, attention_dropout=0.25, seq_length=8)
    model = GPTModel(config, ParallelState().init_process_groups())
    attention = model.layers["0"].self_attention
    draws = 4000  # one sequence repeated over the batch: each copy gets its own masks
    x = torch.randn(config.seq_length, 1, config.hidden_size, generator=torch.Generator().manual_seed(2))
    rotary = model.rotary(config.seq_length)
    with torch.no_grad():
        expected = attention.eval()(x, rotary)[:, 0]
        attention.train()
        outputs = attention(x.expand(-1, draws, -1).contiguous(), rotary, rng=model.rng)
    assert not torch.equal(outputs[:, 0], outputs[:, 1])
    # The mean of 4000 draws: its standard error is std / 63; 5 standard errors bound it.
    bound = 5 * outputs.std(dim=1) / draws ** 0.5 + 1e-6
    assert ((outputs.mean(dim=1) - expected).abs() <= bound).all()


def _hidden_dropout_tp_body(rank: int, world_size: int, sequence_parallel: bool) -> None:
    # Hidden dropout acts on the residual stream, replicated over TP: every rank draws the TP=1 masks from the
    # default generator, so the TP=2 model equals the single-process one (attention dropout off: its masks are
    # per TP rank by design).
    config = _config(hidden_dropout=0.3)
    ids = _ids(config)
    torch.manual_seed(21)
    reference = GPTModel(config, ParallelState().init_process_groups())
    torch.manual_seed(4)
    expected = reference(ids, labels=ids).mean().detach()
    assert not torch.equal(expected, reference.eval()(ids, labels=ids).mean().detach())  # the masks bite
    ps = ParallelState(world_size=world_size, tensor_model_parallel_size=world_size,
                       sequence_parallel=sequence_parallel).init_process_groups(rank)
    sharded = GPTModel(config, ps)
    torch.manual_seed(4)
    loss = sharded(ids, labels=ids).mean().detach()
    if sequence_parallel:  # each rank drops its own tokens (the model-parallel stream): another sample of masks
        assert torch.isfinite(loss) and not torch.equal(loss, expected)
    else:
        assert abs(loss - expected) <= TOLERANCE * abs(expected), (loss, expected)


@pytest.mark.parametrize("sequence_parallel", [False, True], ids=["tp2", "tp2-sp"])
def test_hidden_dropout_under_tp_draws_the_single_process_masks(sequence_parallel):
    run_distributed(_hidden_dropout_tp_body, world_size=2, args=(sequence_parallel,))


# ---- through the training entry and the converter -------------------------------------------------------------

def test_training_entry_with_megatron_model_flags_exports_to_transformers(tmp_path):
    """--kv-channels, --apply-layernorm-1p and dropout in a 2-process TP run, then its checkpoint in transformers."""
    flags = [*LLAMA_FLAGS, "--attention-dropout", "0.1", "--hidden-dropout", "0.1", "--kv-channels", "24",
             "--apply-layernorm-1p", "--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4",
             "--group-query-attention", "--num-query-groups", "2", "--ffn-hidden-size", "96", "--seq-length", "32",
             "--max-position-embeddings", "32", "--micro-batch-size", "2", "--global-batch-size", "4",
             "--lr", "1e-3", "--train-iters", "3", "--mock-data", "--tokenizer-type", "NullTokenizer",
             "--vocab-size", "200", "--tensor-model-parallel-size", "2", "--save", str(tmp_path / "run"),
             "--save-interval", "3", "--log-interval", "1", "--eval-iters", "0"]
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
               "-m", "megafp8.pretrain", *flags]
    result = subprocess.run(command, cwd=REPO_ROOT, capture_output=True, text=True, timeout=600,
                            env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-3000:]
    weights = checkpoint_tensors(tmp_path / "run")
    assert weights["model.layers.0.self_attention.linear_qkv.weight"].shape == (8 * 24, 64)
    assert weights["model.final_layernorm.weight"].abs().max() < 0.5  # trained from 0, not from 1
    result = convert("--load-format", "megafp8", "--save-format", "hf", "--load-dir", tmp_path / "run",
                     "--save-dir", tmp_path / "hf", "--save-dtype", "fp32")
    assert result.returncode == 0, result.stderr
    hf = transformers.LlamaForCausalLM.from_pretrained(tmp_path / "hf", attn_implementation="eager").eval()
    assert hf.config.head_dim == 24
    assert torch.equal(hf.model.norm.weight, weights["model.final_layernorm.weight"] + 1)
    config = _config(kv_channels=24, layernorm_zero_centered_gamma=True, vocab_size=hf.config.vocab_size,
                     ffn_hidden_size=96, seq_length=32, rope_theta=10000.0, norm_eps=1e-5, max_position_embeddings=32,
                     make_vocab_size_divisible_by=128, tie_embeddings=True)
    model = GPTModel(config, ParallelState().init_process_groups()).eval()
    load_checkpoint(tmp_path / "run", model=model, parallel_state=ParallelState(), args=training_args(config),
                    finetune=True)
    ids = _ids(config)
    with torch.no_grad():
        assert rel_err(model(ids)[..., : config.vocab_size], hf(ids).logits) <= TOLERANCE
