"""Hugging Face Llama <-> megafp8 conversion: a tiny random transformers Llama (GQA, tied and untied, sharded
safetensors) converted to megafp8 gives HF's logits in the training entry's model at TP=2 x PP=2 and at TP=1
(fp32, <= 1e-5 relative to max |logit|); megafp8 -> HF -> megafp8 is bit-exact, also from a checkpoint
saved at TP=2 x PP=2; the HF output loads in transformers; block-FP8 export dequantizes within E4M3 error."""
import json
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

transformers = pytest.importorskip("transformers")

from convert_testing import TOLERANCE, checkpoint_tensors, convert, rel_err, tiny_hf_llama  # noqa: E402
from distributed_testing import run_distributed  # noqa: E402
from megafp8.checkpoint import load_checkpoint, save_checkpoint  # noqa: E402
from megafp8.checkpoint.convert_hf import hf_to_megafp8, megafp8_to_hf, training_args  # noqa: E402
from megafp8.checkpoint.fp8_export import dequantize_blockwise  # noqa: E402
from megafp8.checkpoint.hf_files import model_config_from_hf_dict  # noqa: E402
from megafp8.model import GPTModel  # noqa: E402
from megafp8.parallel import collectives as C  # noqa: E402
from megafp8.parallel.parallel_state import ParallelState, RankCoordinates, global_rank  # noqa: E402

BATCH, SEQ = 2, 16


def _within_e4m3_error(back: torch.Tensor, weight: torch.Tensor, scale_inv: torch.Tensor) -> bool:
    """Round-to-nearest E4M3: 3 mantissa bits (<= 2^-4 relative) for normals; below 2^-6 (subnormals,
    spacing 2^-9) the error is <= 2^-10 absolute, both in units of the block's scale."""
    scale = scale_inv.repeat_interleave(128, 0).repeat_interleave(128, 1)[: weight.shape[0], : weight.shape[1]]
    return bool(torch.all((back - weight).abs() <= weight.abs() * 2**-4 + scale * 2**-10))


def _ids(vocab: int, seq: int = SEQ) -> torch.Tensor:
    return torch.randint(0, vocab, (BATCH, seq), generator=torch.Generator().manual_seed(3))


def _config(hf_dir: Path, seq: int = SEQ):
    config = model_config_from_hf_dict(json.loads((hf_dir / "config.json").read_text()), "test")
    config.seq_length = seq
    config.make_vocab_size_divisible_by = 16  # padded: 112 at TP=1, 128 at TP=2 (rows that must be cut)
    return config


def tp2_pp2_body(rank: int, world_size: int, roots: list[str], seq: int = SEQ) -> None:
    """For each root (a HF model in hf/, its conversion in m8/): load the converted checkpoint into TP=2 x PP=2
    stages, run the two stages on ``seq`` tokens, compare with HF; then save the stages as a TP=2 x PP=2
    checkpoint in saved_tp2pp2/ (the megafp8 -> HF direction starts from it)."""
    ps = ParallelState(world_size=4, tensor_model_parallel_size=2, pipeline_model_parallel_size=2).init_process_groups()
    for root in roots:
        _check_at_tp2_pp2(Path(root), ps, seq)


def _check_at_tp2_pp2(root: Path, ps: ParallelState, seq: int) -> None:
    rank = dist.get_rank()
    config = _config(root / "hf", seq)
    first, last = ps.is_pipeline_first_stage, ps.is_pipeline_last_stage
    torch.manual_seed(100 + rank)  # a different init: every weight must come from the checkpoint
    stage = GPTModel(config, ps, pre_process=first, post_process=last, layer_numbers=[ps.coords.pp])
    loaded = load_checkpoint(root / "m8", model=stage, parallel_state=ps, args=training_args(config), finetune=True)
    assert loaded.iteration == 0
    ids = _ids(config.vocab_size, seq)
    with torch.no_grad():
        if first:
            hidden = stage(ids)
            dist.send(hidden.contiguous(), global_rank(RankCoordinates(tp=ps.coords.tp, dp=0, pp=1), 2, 1))
        else:
            hidden = torch.empty(seq, BATCH, config.hidden_size)
            dist.recv(hidden, global_rank(RankCoordinates(tp=ps.coords.tp, dp=0, pp=0), 2, 1))
            logits = C.all_gather(stage(None, hidden_states=hidden), ps.tp_group, "tp_allgather", dim=-1)
            hf = transformers.LlamaForCausalLM.from_pretrained(root / "hf", attn_implementation="eager").eval()
            expected = hf(ids).logits
            assert rel_err(logits[..., : config.vocab_size], expected) <= TOLERANCE
            assert torch.all(logits[..., config.vocab_size:] == 0)  # padding rows were zeroed, not garbage
    save_checkpoint(root / "saved_tp2pp2", 7, model=stage, parallel_state=ps, args=training_args(config))


@pytest.mark.distributed
def test_hf_to_megafp8_runs_at_tp2_pp2_and_back(tmp_path):
    tiny_hf_llama(tmp_path / "hf", tie=True)
    result = convert("--load-format", "hf", "--save-format", "megafp8", "--load-dir", tmp_path / "hf",
                     "--save-dir", tmp_path / "m8", "--target-tensor-parallel-size", 2,
                     "--target-pipeline-parallel-size", 2)
    assert result.returncode == 0, result.stderr
    assert "--load" in result.stdout and "--num-query-groups 2" in result.stdout
    run_distributed(tp2_pp2_body, world_size=4, args=([str(tmp_path)],), timeout_s=600)
    assert_exported_back_bit_exact(tmp_path)


def assert_exported_back_bit_exact(root: Path) -> None:
    """The TP=2 x PP=2 checkpoint in saved_tp2pp2/ -> HF (fp32, hf_back/) -> megafp8: bit-exact; and hf_back/
    equals the original hf/, tensor for tensor."""
    # in this process (the other tests run the command line): two fewer interpreter start-ups per model
    megafp8_to_hf(root / "saved_tp2pp2", root / "hf_back", save_format="hf", save_dtype="fp32", progress=False)
    hf_to_megafp8(root / "hf_back", root / "m8_back", progress=False)
    saved, back = checkpoint_tensors(root / "saved_tp2pp2"), checkpoint_tensors(root / "m8_back")
    assert sorted(saved) == sorted(back)
    for name in saved:
        assert saved[name].dtype == back[name].dtype and torch.equal(saved[name], back[name]), name
    # (tied: no lm_head.weight on disk)
    original = transformers.LlamaForCausalLM.from_pretrained(root / "hf").state_dict()
    exported = transformers.LlamaForCausalLM.from_pretrained(root / "hf_back").state_dict()
    assert sorted(original) == sorted(exported)
    assert all(torch.equal(original[k], exported[k]) for k in original)


def test_untied_hf_to_megafp8_single_process_logits_and_round_trip(tmp_path):
    hf = tiny_hf_llama(tmp_path / "hf", tie=False, max_shard_size="30KB")
    assert (tmp_path / "hf" / "model.safetensors.index.json").exists()  # the sharded-input path
    assert convert("--load-format", "hf", "--save-format", "megafp8", "--load-dir", tmp_path / "hf",
                   "--save-dir", tmp_path / "m8").returncode == 0
    config = _config(tmp_path / "hf")
    model = GPTModel(config, ParallelState().init_process_groups())
    load_checkpoint(tmp_path / "m8", model=model, parallel_state=ParallelState(), args=training_args(config),
                    finetune=True)
    ids = _ids(config.vocab_size)
    with torch.no_grad():
        assert rel_err(model(ids)[..., : config.vocab_size], hf(ids).logits) <= TOLERANCE
    # megafp8 -> HF fp32, sharded past 40 kB -> megafp8: bit-exact; bf16 export = the bf16 cast
    for dtype, shard in (("fp32", "40KB"), ("bf16", "5GB")):
        result = convert("--load-format", "megafp8", "--save-format", "hf", "--load-dir", tmp_path / "m8",
                         "--save-dir", tmp_path / f"hf_{dtype}", "--save-dtype", dtype, "--max-shard-size", shard)
        assert result.returncode == 0, result.stderr
    files = sorted(p.name for p in (tmp_path / "hf_fp32").iterdir())
    assert "model.safetensors.index.json" in files and len([f for f in files if f.startswith("model-")]) > 2
    assert sorted(p.name for p in (tmp_path / "hf_bf16").iterdir()) == ["config.json", "model.safetensors"]
    assert convert("--load-format", "hf", "--save-format", "megafp8", "--load-dir", tmp_path / "hf_fp32",
                   "--save-dir", tmp_path / "m8_back").returncode == 0
    first, back = checkpoint_tensors(tmp_path / "m8"), checkpoint_tensors(tmp_path / "m8_back")
    assert sorted(first) == sorted(back) and all(torch.equal(first[k], back[k]) for k in first)
    bf16 = transformers.LlamaForCausalLM.from_pretrained(tmp_path / "hf_bf16", dtype=torch.bfloat16).state_dict()
    for name, tensor in hf.state_dict().items():
        assert bf16[name].dtype == torch.bfloat16 and torch.equal(bf16[name], tensor.to(torch.bfloat16)), name


def test_hf_fp8_export_dequantizes_to_the_weights(tmp_path):
    from safetensors.torch import load_file

    hf = tiny_hf_llama(tmp_path / "hf", tie=False, num_layers=1)
    assert convert("--load-format", "hf", "--save-format", "megafp8", "--load-dir", tmp_path / "hf",
                   "--save-dir", tmp_path / "m8").returncode == 0
    result = convert("--load-format", "megafp8", "--save-format", "hf-fp8", "--load-dir", tmp_path / "m8",
                     "--save-dir", tmp_path / "fp8")
    assert result.returncode == 0, result.stderr
    config = json.loads((tmp_path / "fp8" / "config.json").read_text())
    assert config["quantization_config"] == {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                                             "weight_block_size": [128, 128], "modules_to_not_convert": ["lm_head"]}
    tensors = load_file(tmp_path / "fp8" / "model.safetensors")
    linears = 0
    for name, weight in hf.state_dict().items():
        stored = tensors[name]
        if name + "_scale_inv" not in tensors:  # embeddings, norms, lm_head: bf16
            assert stored.dtype == torch.bfloat16 and torch.equal(stored, weight.to(torch.bfloat16)), name
            continue
        linears += 1
        scale_inv = tensors[name + "_scale_inv"]
        assert stored.dtype == torch.float8_e4m3fn and stored.shape == weight.shape
        blocks = (-(-weight.shape[0] // 128), -(-weight.shape[1] // 128))
        assert scale_inv.dtype == torch.float32 and scale_inv.shape == blocks
        assert _within_e4m3_error(dequantize_blockwise(stored, scale_inv), weight, scale_inv), name
        assert rel_err(dequantize_blockwise(stored, scale_inv), weight) < 0.07
    assert linears == 7


def test_blockwise_quantization_scales_each_128x128_block():
    from megafp8.checkpoint.fp8_export import quantize_blockwise

    weight = torch.randn(200, 300, generator=torch.Generator().manual_seed(0))
    weight[128:, :128] *= 1000  # one block 1000x larger: its own scale, the neighbours keep their precision
    weight[:128, 256:] = 0  # an all-zero block stays exactly zero
    quantized, scale_inv = quantize_blockwise(weight)
    assert scale_inv.shape == (2, 3)
    for r, c in [(0, 0), (0, 1), (1, 0), (1, 1), (1, 2)]:
        block = weight[r * 128:(r + 1) * 128, c * 128:(c + 1) * 128]
        assert torch.isclose(scale_inv[r, c], block.abs().max() / 448)
    back = dequantize_blockwise(quantized, scale_inv)
    assert torch.all(back[:128, 256:] == 0)
    assert _within_e4m3_error(back, weight, scale_inv)
