"""HF Mixtral / Qwen3-MoE <-> megafp8 through the converter: transformers' logits, bit-identical export, refusals."""
import json
import re
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

transformers = pytest.importorskip("transformers")

from convert_testing import TOLERANCE, checkpoint_tensors, convert, rel_err  # noqa: E402
from distributed_testing import run_distributed  # noqa: E402
from megafp8.checkpoint import load_checkpoint, save_checkpoint  # noqa: E402
from megafp8.checkpoint.convert_hf import hf_to_megafp8, megafp8_to_hf, training_args  # noqa: E402
from megafp8.checkpoint.export_megatron import megafp8_to_megatron  # noqa: E402
from megafp8.checkpoint.hf_files import ConversionError, model_config_from_hf_dict  # noqa: E402
from megafp8.model import GPTModel, ModelConfig  # noqa: E402
from megafp8.model.moe_options import MOE_FLAG_DEFAULTS  # noqa: E402
from megafp8.parallel import collectives as C  # noqa: E402
from megafp8.parallel.parallel_state import ParallelState, RankCoordinates, global_rank  # noqa: E402

BATCH, SEQ, VOCAB = 2, 16, 100
_COMMON = dict(vocab_size=VOCAB, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
               max_position_embeddings=32, rms_norm_eps=1e-6, num_experts_per_tok=2, tie_word_embeddings=False)
FAMILY_FIELDS = {"mixtral": dict(intermediate_size=48, num_local_experts=4),
                 "qwen3_moe": dict(intermediate_size=96, moe_intermediate_size=32, num_experts=4)}


def tiny_hf_moe(directory: Path, family: str, seed: int = 0, **fields):
    """A random MixtralForCausalLM / Qwen3MoeForCausalLM saved in 50 kB shards. Norm gains are random (a swapped norm
    shows) and router weights have std 0.15, so the logits are O(1): a wrong routing rule (softmax over all experts vs
    over the chosen k) changes the output far beyond the tolerance, where near one-hot weights would hide it."""
    config_class, model_class = {"mixtral": (transformers.MixtralConfig, transformers.MixtralForCausalLM),
                                 "qwen3_moe": (transformers.Qwen3MoeConfig, transformers.Qwen3MoeForCausalLM)}[family]
    config = config_class(**{**_COMMON, **FAMILY_FIELDS[family], **fields}, attn_implementation="eager")
    torch.manual_seed(seed)
    model = model_class(config).eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name:
                param.uniform_(0.5, 1.5)
            elif name.endswith("mlp.gate.weight"):
                param.normal_(0, 0.15)
    model.save_pretrained(directory, max_shard_size="50KB")
    return model


def _config(hf_dir: Path, seq: int = SEQ) -> ModelConfig:
    config = model_config_from_hf_dict(json.loads((hf_dir / "config.json").read_text()), "test")
    config.seq_length = seq
    config.make_vocab_size_divisible_by = 16  # padded: 112 at TP=1, 128 at TP=2
    return config


def _ids() -> torch.Tensor:
    return torch.randint(0, VOCAB, (BATCH, SEQ), generator=torch.Generator().manual_seed(3))


def _import(root: Path, *flags) -> str:
    result = convert("--load-format", "hf", "--save-format", "megafp8", "--load-dir", root / "hf",
                     "--save-dir", root / "m8", *flags)
    assert result.returncode == 0, result.stderr
    return result.stdout


def _hf_files(directory: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    tensors = {}
    for path in sorted(directory.glob("*.safetensors")):
        tensors.update(load_file(path))
    return tensors


def assert_hf_files_equal(original: Path, exported: Path) -> None:
    """The tensors on disk (names, dtypes, values) are the same, and transformers loads the export completely."""
    before, after = _hf_files(original), _hf_files(exported)
    assert sorted(before) == sorted(after)
    for name in before:
        assert before[name].dtype == after[name].dtype and torch.equal(before[name], after[name]), name
    _, info = transformers.AutoModelForCausalLM.from_pretrained(exported, output_loading_info=True)
    assert not any(info.values()), info


def _flags_parse_to(stdout: str, config: ModelConfig) -> None:
    """The printed training flags build this MoE model in the training entry."""
    from megafp8.training.arguments import parse_args
    from megafp8.training.model_setup import model_config_from_args

    flags = re.search(r"--finetune (.*?) --tokenizer-", stdout).group(1).split()
    args = parse_args([*flags, "--data-path", "unused", "--tokenizer-type", "NullTokenizer", "--vocab-size",
                       str(VOCAB), "--train-iters", "1", "--seq-length", str(SEQ)])
    built = model_config_from_args(args, VOCAB)
    for name in ("num_experts", *MOE_FLAG_DEFAULTS, "qk_layernorm", "ffn_hidden_size"):
        assert getattr(built, name) == getattr(config, name), name


@pytest.mark.parametrize("family, fields", [("mixtral", {}), ("qwen3_moe", dict(mlp_only_layers=[0])),
                                            ("qwen3_moe", dict(norm_topk_prob=True, head_dim=32))],
                         ids=["mixtral", "qwen3_moe-dense0-pre_softmax", "qwen3_moe-norm_topk-head_dim"])
def test_hf_moe_to_megafp8_logits_and_back_bit_identical(tmp_path, family, fields):
    hf = tiny_hf_moe(tmp_path / "hf", family, **fields)
    stdout = _import(tmp_path)
    config = _config(tmp_path / "hf")
    assert config.num_experts == 4 and config.moe_router_topk == 2 and config.head_dim == fields.get("head_dim", 16)
    assert config.moe_router_pre_softmax == (family == "qwen3_moe" and not fields.get("norm_topk_prob"))
    assert [config.is_moe_layer(i) for i in range(2)] == [not fields.get("mlp_only_layers"), True]
    _flags_parse_to(stdout, config)
    model = GPTModel(config, ParallelState().init_process_groups())
    load_checkpoint(tmp_path / "m8", model=model, parallel_state=ParallelState(), args=training_args(config),
                    finetune=True)
    with torch.no_grad():
        ours, theirs = model(_ids())[..., :VOCAB], hf(_ids()).logits
    assert rel_err(ours, theirs) <= TOLERANCE
    result = convert("--load-format", "megafp8", "--save-format", "hf", "--save-dtype", "fp32", "--load-dir",
                     tmp_path / "m8", "--save-dir", tmp_path / "hf_back")
    assert result.returncode == 0, result.stderr
    assert_hf_files_equal(tmp_path / "hf", tmp_path / "hf_back")
    exported = json.loads((tmp_path / "hf_back" / "config.json").read_text())
    assert exported["model_type"] == family
    assert _config(tmp_path / "hf_back") == config  # the same model read back


def test_routing_rule_is_checked_by_the_logits(tmp_path):
    """The tolerance separates the two routing rules: Qwen3-MoE's norm_topk_prob false read as megafp8's default
    (softmax over the chosen k) gives other logits."""
    hf = tiny_hf_moe(tmp_path / "hf", "qwen3_moe")
    _import(tmp_path)
    config = _config(tmp_path / "hf")
    config.moe_router_pre_softmax = False
    model = GPTModel(config, ParallelState().init_process_groups())
    load_checkpoint(tmp_path / "m8", model=model, parallel_state=ParallelState(), args=training_args(config),
                    finetune=True)
    with torch.no_grad():
        assert rel_err(model(_ids())[..., :VOCAB], hf(_ids()).logits) > 100 * TOLERANCE


@pytest.mark.parametrize("fields, freq", [
    (dict(num_hidden_layers=4), 1),
    (dict(num_hidden_layers=4, decoder_sparse_step=2), "0,1,0,1"),  # HF: (i + 1) % step == 0, not megafp8's i % N
    (dict(num_hidden_layers=4, mlp_only_layers=[1]), "1,0,1,1"),
    (dict(num_hidden_layers=6, decoder_sparse_step=3, mlp_only_layers=[5]), "0,0,1,0,0,0"),
    (dict(num_hidden_layers=2, mlp_only_layers=[0, 1]), "0,0"),
])
def test_qwen3_moe_sparse_layers_map_to_moe_layer_freq(fields, freq):
    hf = transformers.Qwen3MoeConfig(**{**_COMMON, **FAMILY_FIELDS["qwen3_moe"], **fields}).to_dict()
    config = model_config_from_hf_dict(hf, "test")
    assert config.moe_layer_freq == freq
    expected = [i not in hf["mlp_only_layers"] and (i + 1) % hf["decoder_sparse_step"] == 0
                for i in range(hf["num_hidden_layers"])]
    assert [config.is_moe_layer(i) for i in range(config.num_layers)] == expected


def test_qwen3_moe_decoder_sparse_step_through_the_converter(tmp_path):
    """Layers 0 and 2 dense, 1 MoE (decoder_sparse_step 2 on 3 layers): logits and the round trip."""
    hf = tiny_hf_moe(tmp_path / "hf", "qwen3_moe", num_hidden_layers=3, decoder_sparse_step=2, norm_topk_prob=True)
    _import(tmp_path)
    config = _config(tmp_path / "hf")
    assert config.moe_layer_freq == "0,1,0"
    model = GPTModel(config, ParallelState().init_process_groups())
    load_checkpoint(tmp_path / "m8", model=model, parallel_state=ParallelState(), args=training_args(config),
                    finetune=True)
    with torch.no_grad():
        assert rel_err(model(_ids())[..., :VOCAB], hf(_ids()).logits) <= TOLERANCE
    megafp8_to_hf(tmp_path / "m8", tmp_path / "hf_back", save_dtype="fp32", progress=False)
    assert_hf_files_equal(tmp_path / "hf", tmp_path / "hf_back")
    exported = json.loads((tmp_path / "hf_back" / "config.json").read_text())
    assert (exported["decoder_sparse_step"], exported["mlp_only_layers"]) == (1, [0, 2])  # the same layers


# ---- TP=2 with sequence parallelism x PP=2 (x EP=2 or ETP=2) -------------------------------------------------------

LAYOUTS = {"ep1": dict(expert_tensor_parallel_size=1), "ep2": dict(expert_model_parallel_size=2, expert_tensor_parallel_size=1),
           "etp2": dict(expert_tensor_parallel_size=2)}  # each expert split over the two TP ranks


def tp2_sp_pp2_body(rank: int, world_size: int, roots: list[str]) -> None:
    """For each layout (TP=2 + SP x PP=2, then the same with the experts split over EP=2, then each expert split over
    ETP=2) and root: load the converted checkpoint into the stages, compare the logits with transformers', save the
    stages in saved_<layout>/."""
    for layout, expert_layout in LAYOUTS.items():
        ps = ParallelState(world_size=4, tensor_model_parallel_size=2, pipeline_model_parallel_size=2,
                           sequence_parallel=True, **expert_layout).init_process_groups()
        for root in map(Path, roots):
            _check_at_tp2_sp_pp2(root, ps, layout)


def _check_at_tp2_sp_pp2(root: Path, ps: ParallelState, layout: str) -> None:
    config = _config(root / "hf")
    first, last = ps.is_pipeline_first_stage, ps.is_pipeline_last_stage
    torch.manual_seed(100 + dist.get_rank())  # a different init: every weight must come from the checkpoint
    stage = GPTModel(config, ps, pre_process=first, post_process=last, layer_numbers=[ps.coords.pp])
    experts = {name.split(".local_experts.")[1].split(".")[0] for name, _ in stage.named_parameters()
               if ".local_experts." in name}
    assert len(experts) == (4 // ps.ep_size if config.is_moe_layer(ps.coords.pp) else 0)
    load_checkpoint(root / "m8", model=stage, parallel_state=ps, args=training_args(config), finetune=True)
    with torch.no_grad():
        if first:  # under SP each TP rank holds (and routes) its half of the sequence
            hidden = stage(_ids())
            assert hidden.shape == (SEQ // 2, BATCH, config.hidden_size)
            dist.send(hidden.contiguous(), global_rank(RankCoordinates(tp=ps.coords.tp, dp=0, pp=1), 2, 1))
        else:
            hidden = torch.empty(SEQ // 2, BATCH, config.hidden_size)
            dist.recv(hidden, global_rank(RankCoordinates(tp=ps.coords.tp, dp=0, pp=0), 2, 1))
            logits = C.all_gather(stage(None, hidden_states=hidden), ps.tp_group, "tp_allgather", dim=-1)
            hf = transformers.AutoModelForCausalLM.from_pretrained(root / "hf", attn_implementation="eager")
            assert rel_err(logits[..., :VOCAB], hf.eval()(_ids()).logits) <= TOLERANCE
    save_checkpoint(root / f"saved_{layout}", 7, model=stage, parallel_state=ps, args=training_args(config))


@pytest.mark.distributed
def test_hf_moe_runs_at_tp2_sp_pp2_with_ep2_or_etp2_and_exports_back(tmp_path):
    roots = []
    for family, fields in (("mixtral", {}), ("qwen3_moe", dict(mlp_only_layers=[0]))):
        root = tmp_path / family
        tiny_hf_moe(root / "hf", family, **fields)
        _import(root, "--target-tensor-parallel-size", 2, "--target-pipeline-parallel-size", 2)
        roots.append(str(root))
    run_distributed(tp2_sp_pp2_body, world_size=4, args=(roots,), timeout_s=600)
    for root in map(Path, roots):
        for layout in LAYOUTS:  # each expert was saved by the rank holding it: the export finds them all
            megafp8_to_hf(root / f"saved_{layout}", root / f"hf_{layout}", save_dtype="fp32", progress=False)
            assert_hf_files_equal(root / "hf", root / f"hf_{layout}")
        hf_to_megafp8(root / "hf_ep2", root / "m8_back", progress=False)
        saved, back = checkpoint_tensors(root / "saved_ep2"), checkpoint_tensors(root / "m8_back")
        assert sorted(saved) == sorted(back) and all(torch.equal(saved[k], back[k]) for k in saved)


# ---- refusals: HF -> megafp8 ---------------------------------------------------------------------------------------

def _hf_config(family: str, **fields) -> dict:
    config_class = transformers.MixtralConfig if family == "mixtral" else transformers.Qwen3MoeConfig
    return {**config_class(**_COMMON, **FAMILY_FIELDS[family]).to_dict(), **fields}


@pytest.mark.parametrize("family, fields, named", [
    ("mixtral", dict(router_jitter_noise=0.01), "router_jitter_noise=0.01"),
    ("mixtral", dict(sliding_window=4096), "sliding_window=4096"),
    ("qwen3_moe", dict(use_sliding_window=True, sliding_window=4096), "use_sliding_window=True"),
    ("qwen3_moe", dict(shared_expert_intermediate_size=128), "shared_expert_intermediate_size=128"),
    ("mixtral", dict(num_experts_per_tok=5), "num_experts_per_tok=5"),
    ("mixtral", dict(num_local_experts=1, num_experts=1), "num_experts=1"),
    ("qwen3_moe", dict(num_local_experts=4, num_experts=8), "num_local_experts=4 and num_experts=8"),
    ("qwen3_moe", dict(decoder_sparse_step=0), "decoder_sparse_step=0"),
    ("qwen3_moe", dict(mlp_only_layers=[2]), "mlp_only_layers=[2]"),
    ("qwen3_moe", dict(norm_topk_prob="yes"), "norm_topk_prob='yes'"),
    ("qwen3_moe", dict(moe_intermediate_size=0), "moe_intermediate_size=0"),
    ("qwen3_moe", dict(attention_bias=True), "attention_bias=True"),
    ("mixtral", dict(hidden_act="gelu"), "hidden_act='gelu'"),
], ids=["router_jitter_noise", "mixtral-sliding_window", "use_sliding_window", "shared_expert_intermediate_size",
        "num_experts_per_tok", "num_experts", "num_local_experts-vs-num_experts", "decoder_sparse_step",
        "mlp_only_layers", "norm_topk_prob", "moe_intermediate_size", "attention_bias", "hidden_act"])
def test_hf_moe_config_refusals_name_the_field(tmp_path, family, fields, named):
    (tmp_path / "hf").mkdir()
    (tmp_path / "hf" / "config.json").write_text(json.dumps(_hf_config(family, **fields)))
    with pytest.raises(ConversionError, match=re.escape(named)):
        hf_to_megafp8(tmp_path / "hf", tmp_path / "m8", progress=False)
    assert not (tmp_path / "m8").exists()


@pytest.mark.parametrize("family, tensor", [("mixtral", "model.layers.0.block_sparse_moe.gate.bias"),
                                            ("qwen3_moe", "model.layers.1.mlp.shared_expert_gate.weight")],
                         ids=["router-bias", "shared-expert-gate"])
def test_hf_moe_tensor_refusals_name_the_tensor(tmp_path, family, tensor):
    from safetensors.torch import save_file

    tiny_hf_moe(tmp_path / "hf", family, **({"mlp_only_layers": [0]} if family == "qwen3_moe" else {}))
    (tmp_path / "hf" / "model.safetensors.index.json").unlink()  # every *.safetensors file is read
    save_file({tensor: torch.zeros(4) if tensor.endswith("bias") else torch.zeros(1, 64)},
              tmp_path / "hf" / "extra.safetensors")
    result = convert("--load-format", "hf", "--save-format", "megafp8", "--load-dir", tmp_path / "hf",
                     "--save-dir", tmp_path / "m8")
    assert result.returncode == 1 and tensor in result.stderr, result.stderr


# ---- refusals: megafp8 -> HF ---------------------------------------------------------------------------------------

def _megafp8_checkpoint(root: Path, **fields) -> None:
    """A tiny MoE model saved as a training run saves it: every MoE flag in the manifest."""
    config = ModelConfig(num_layers=2, hidden_size=64, ffn_hidden_size=48, num_attention_heads=4, num_query_groups=2,
                         seq_length=SEQ, vocab_size=VOCAB, make_vocab_size_divisible_by=16, num_experts=4,
                         **fields)
    args = {**training_args(config), **{name: getattr(config, name) for name in ("num_experts", *MOE_FLAG_DEFAULTS)}}
    save_checkpoint(root, 3, model=GPTModel(config, ParallelState().init_process_groups()),
                    parallel_state=ParallelState(), args=args)


@pytest.mark.parametrize("fields, save_format, named", [
    (dict(moe_router_score_function="sigmoid"), "hf", "--moe-router-score-function sigmoid"),
    (dict(moe_router_score_function="sigmoid", moe_router_enable_expert_bias=True), "hf",
     "--moe-router-enable-expert-bias"),
    (dict(moe_shared_expert_intermediate_size=32), "hf", "--moe-shared-expert-intermediate-size 32"),
    (dict(moe_layer_freq=2), "hf", "--moe-layer-freq 2 without --qk-layernorm"),
    (dict(moe_router_pre_softmax=True), "hf", "--moe-router-pre-softmax without --qk-layernorm"),
    ({}, "hf-fp8", "--save-format hf-fp8"),
    ({}, "hf-mxfp8", "--save-format hf-mxfp8"),
], ids=["sigmoid", "expert-bias", "shared-experts", "mixtral-dense-layers", "mixtral-pre-softmax", "fp8", "mxfp8"])
def test_megafp8_moe_export_refusals_name_the_flag(tmp_path, fields, save_format, named):
    _megafp8_checkpoint(tmp_path / "m8", **fields)
    with pytest.raises(ConversionError, match=re.escape(named)):
        megafp8_to_hf(tmp_path / "m8", tmp_path / "hf", save_format=save_format, progress=False)
    assert not (tmp_path / "hf").exists()


def test_megafp8_moe_export_to_megatron_is_refused(tmp_path):
    _megafp8_checkpoint(tmp_path / "m8")
    with pytest.raises(ConversionError, match="--num-experts 4: the Megatron-LM export writes dense models only"):
        megafp8_to_megatron(tmp_path / "m8", tmp_path / "megatron", progress=False)


def test_capacity_factor_and_balancing_losses_are_training_only(tmp_path):
    """A model trained with token dropping and balancing losses exports as the dropless HF model (docs/conversion.md):
    with a capacity no expert overflows (factor 4 = E / k x 2), megafp8's logits equal the exported model's."""
    _megafp8_checkpoint(tmp_path / "m8", moe_expert_capacity_factor=4.0, moe_aux_loss_coeff=0.01,
                        moe_z_loss_coeff=0.001, qk_layernorm=True, moe_layer_freq="0,1")
    config = megafp8_to_hf(tmp_path / "m8", tmp_path / "hf", save_dtype="fp32", progress=False)
    assert config.moe_expert_capacity_factor == 4.0  # read from the manifest: the model megafp8 trained
    config.seq_length = SEQ
    model = GPTModel(config, ParallelState().init_process_groups())
    load_checkpoint(tmp_path / "m8", model=model, parallel_state=ParallelState(), args=training_args(config),
                    finetune=True)
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf", attn_implementation="eager").eval()
    with torch.no_grad():
        assert rel_err(model(_ids())[..., :VOCAB], hf(_ids()).logits) <= TOLERANCE
