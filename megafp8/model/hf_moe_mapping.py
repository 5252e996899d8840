"""megafp8 MoE layers <-> HF ``MixtralForCausalLM`` / ``Qwen3MoeForCausalLM``: tensor names, config fields, refusals."""
from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

from megafp8.model.config import ModelConfig
from megafp8.model.moe_options import MOE_FLAG_DEFAULTS, moe_layer_pattern


# A MoE layer i, megafp8 (Megatron-Core's names) <- HF (the names of both families' Hub checkpoints, which
# transformers 4 reads and transformers 5 still writes with save_pretrained), under model.layers.{i}.:
#
#   megafp8                                          Mixtral                             Qwen3-MoE
#   mlp.router.weight  [E, h]                        block_sparse_moe.gate.weight        mlp.gate.weight
#   mlp.experts.local_experts.{e}.linear_fc1.weight  block_sparse_moe.experts.{e}.w1     mlp.experts.{e}.gate_proj
#                                          [gate; up]   ...and .w3 (up)                     ...and .up_proj
#   mlp.experts.local_experts.{e}.linear_fc2.weight  block_sparse_moe.experts.{e}.w2     mlp.experts.{e}.down_proj
#
# Routing. Mixtral softmaxes the router logits over all experts, takes the top k and renormalises them to sum to 1:
# that is the softmax over the k largest logits, megafp8's default path (moe_router_pre_softmax=False). Qwen3-MoE does
# the same with norm_topk_prob true; with false it keeps the unrenormalised all-expert probabilities, megafp8's
# --moe-router-pre-softmax. Qwen3-MoE layer i is sparse when i is not in mlp_only_layers and
# (i + 1) % decoder_sparse_step == 0; not megafp8's i % N == 0 rule, so it is always written as the 0/1 list
# --moe-layer-freq accepts (1 when every layer is sparse). The family of a megafp8 model is fixed by --qk-layernorm
# (Qwen3-MoE has q_norm / k_norm, Mixtral has not), so each direction is the other's inverse.
@dataclasses.dataclass(frozen=True)
class _Family:
    architecture: str
    block: str  # the MoE block's module under model.layers.{i}
    gate: str  # the experts' SwiGLU projections: gate, up, down
    up: str
    down: str
    defaults: Mapping[str, Any]  # transformers' defaults for fields a config.json may leave out


FAMILIES = {
    "mixtral": _Family("MixtralForCausalLM", "block_sparse_moe", "w1", "w3", "w2",
                       {"num_local_experts": 8, "num_experts_per_tok": 2, "router_jitter_noise": 0.0}),
    "qwen3_moe": _Family("Qwen3MoeForCausalLM", "mlp", "gate_proj", "up_proj", "down_proj",
                         {"num_experts": 128, "num_experts_per_tok": 8, "norm_topk_prob": False,
                          "decoder_sparse_step": 1, "mlp_only_layers": [], "moe_intermediate_size": 768}),
}
# What megafp8 saves in a converted checkpoint's manifest (and prints as flags): the MoE options HF can express.
_MANIFEST_FIELDS = ("num_experts", "moe_layer_freq", "moe_ffn_hidden_size", "moe_router_topk", "moe_router_pre_softmax")


def moe_family(config: ModelConfig) -> str:
    """The HF family a megafp8 MoE model is written as (and was read from): Qwen3-MoE has QK norms, Mixtral not."""
    return "qwen3_moe" if config.qk_layernorm else "mixtral"


def moe_mlp_sources(config: ModelConfig, layer: int) -> dict[str, list[str]]:
    """megafp8 suffix -> the HF suffixes (under ``model.layers.{layer}.``) it concatenates along dim 0."""
    f = FAMILIES[moe_family(config)]
    sources = {"mlp.router.weight": [f"{f.block}.gate.weight"]}
    for e in range(config.num_experts):
        ours, theirs = f"mlp.experts.local_experts.{e}.", f"{f.block}.experts.{e}."
        sources[ours + "linear_fc1.weight"] = [theirs + f"{f.gate}.weight", theirs + f"{f.up}.weight"]
        sources[ours + "linear_fc2.weight"] = [theirs + f"{f.down}.weight"]
    return sources


def moe_mlp_hf_shapes(config: ModelConfig, layer: int) -> dict[str, tuple[int, ...]]:
    """The HF tensors of MoE layer ``layer`` (full names) and their shapes."""
    h, ffn = config.hidden_size, config.moe_ffn_hidden_size or config.ffn_hidden_size
    shapes = {}
    for src, parts in moe_mlp_sources(config, layer).items():
        for part in parts:
            shape = (config.num_experts, h) if src.endswith("router.weight") else \
                (h, ffn) if src.endswith("linear_fc2.weight") else (ffn, h)
            shapes[f"model.layers.{layer}.{part}"] = shape
    return shapes


# ---- HF config.json -> ModelConfig ------------------------------------------------------------------------------

def _field(hf: Mapping[str, Any], key: str) -> Any:
    return hf.get(key, FAMILIES[hf["model_type"]].defaults.get(key))


def _num_experts(hf: Mapping[str, Any]) -> Any:
    """Both families accept ``num_experts`` and ``num_local_experts`` (transformers' attribute_map); Mixtral's files
    spell the second, Qwen3-MoE's the first, transformers 5 writes the second for both."""
    spelled = [hf[key] for key in ("num_local_experts", "num_experts") if key in hf]
    if spelled:
        return spelled[0]
    return _field(hf, "num_local_experts" if hf["model_type"] == "mixtral" else "num_experts")


def _positive_int(value: Any) -> bool:
    return type(value) is int and value > 0


def hf_moe_problems(hf: Mapping[str, Any]) -> list[str]:
    """What in a Mixtral / Qwen3-MoE config.json megafp8's MoE cannot reproduce, each naming its field."""
    problems = []
    if "num_local_experts" in hf and "num_experts" in hf and hf["num_local_experts"] != hf["num_experts"]:
        problems.append(f"num_local_experts={hf['num_local_experts']!r} and num_experts={hf['num_experts']!r} differ")
    experts, k = _num_experts(hf), _field(hf, "num_experts_per_tok")
    if type(experts) is not int or experts < 2:
        problems.append(f"num_experts={experts!r} (megafp8's MoE needs at least 2 experts; a model without experts "
                        "converts as its dense family)")
    elif not _positive_int(k) or k > experts:
        problems.append(f"num_experts_per_tok={k!r} (must be between 1 and the {experts} experts)")
    # Mixtral multiplies the router's input by uniform noise while training: megafp8's router has no jitter.
    if hf["model_type"] == "mixtral" and _field(hf, "router_jitter_noise") not in (0, 0.0, None):
        problems.append(f"router_jitter_noise={hf['router_jitter_noise']!r} (megafp8's router adds no jitter)")
    # Qwen2-MoE's shared expert is scaled by a sigmoid gate (shared_expert_gate); megafp8's is added ungated.
    if hf.get("shared_expert_intermediate_size"):
        problems.append(f"shared_expert_intermediate_size={hf['shared_expert_intermediate_size']!r} (a gated "
                        "shared expert, shared_expert_gate: megafp8's shared experts have no gate)")
    if hf["model_type"] == "qwen3_moe":
        problems += _qwen3_moe_problems(hf)
    return problems


def _qwen3_moe_problems(hf: Mapping[str, Any]) -> list[str]:
    problems = []
    for key in ("decoder_sparse_step", "moe_intermediate_size"):
        if not _positive_int(_field(hf, key)):
            problems.append(f"{key}={hf[key]!r} must be a positive integer")
    only = _field(hf, "mlp_only_layers") or []
    layers = hf.get("num_hidden_layers")
    if not isinstance(only, list) or not all(type(i) is int and (type(layers) is not int or 0 <= i < layers)
                                             for i in only):
        problems.append(f"mlp_only_layers={only!r} must list layer indices below num_hidden_layers")
    if not isinstance(_field(hf, "norm_topk_prob"), bool):
        problems.append(f"norm_topk_prob={hf['norm_topk_prob']!r} must be true or false")
    return problems


def moe_fields_from_hf(hf: Mapping[str, Any]) -> dict[str, Any]:
    """The ModelConfig fields of a Mixtral / Qwen3-MoE config.json that ``hf_moe_problems`` accepted."""
    fields = {"num_experts": _num_experts(hf), "moe_router_topk": _field(hf, "num_experts_per_tok")}
    if hf["model_type"] == "mixtral":  # every layer sparse; the experts' width is intermediate_size (ffn_hidden_size)
        return fields
    layers, step, only = hf["num_hidden_layers"], _field(hf, "decoder_sparse_step"), _field(hf, "mlp_only_layers") or []
    pattern = [i not in only and (i + 1) % step == 0 for i in range(layers)]
    return {**fields, "qk_layernorm": True, "moe_ffn_hidden_size": _field(hf, "moe_intermediate_size"),
            "moe_router_pre_softmax": not _field(hf, "norm_topk_prob"),
            "moe_layer_freq": 1 if all(pattern) else ",".join("1" if moe else "0" for moe in pattern)}


# ---- ModelConfig -> HF config.json ------------------------------------------------------------------------------

def moe_export_problems(config: ModelConfig) -> list[str]:
    """The options of a megafp8 MoE model its HF family cannot express, each naming the flag. Training-only options
    are not among them: the balancing and z losses, and the capacity factor (the HF model is dropless, which is
    what megafp8 computes too whenever no expert overflows; see docs/conversion.md)."""
    if config.num_experts is None:
        return []
    problems = []
    if config.moe_router_score_function != "softmax":
        problems.append(f"--moe-router-score-function {config.moe_router_score_function} (Mixtral and Qwen3-MoE "
                        "softmax the router logits)")
    if config.moe_router_enable_expert_bias:
        problems.append("--moe-router-enable-expert-bias (neither family has a routing bias)")
    if config.moe_router_topk_scaling_factor not in (None, 1.0):
        problems.append(f"--moe-router-topk-scaling-factor {config.moe_router_topk_scaling_factor} (neither family "
                        "scales the routed weights)")
    if config.moe_shared_expert_intermediate_size:
        problems.append(f"--moe-shared-expert-intermediate-size {config.moe_shared_expert_intermediate_size} "
                        "(neither family has a shared expert)")
    if moe_family(config) == "mixtral":
        if not all(moe_layer_pattern(config.num_layers, config.moe_layer_freq)):
            problems.append(f"--moe-layer-freq {config.moe_layer_freq} without --qk-layernorm (Mixtral has no dense "
                            "layers; Qwen3-MoE, which has, needs --qk-layernorm)")
        if config.moe_router_pre_softmax:
            problems.append("--moe-router-pre-softmax without --qk-layernorm (Mixtral renormalises the top-k weights; "
                            "Qwen3-MoE's norm_topk_prob false, which does not, needs --qk-layernorm)")
    return problems


def hf_moe_config(config: ModelConfig, llama_fields: Mapping[str, Any]) -> dict[str, Any]:
    """config.json of the HF family of MoE ``config``, from the Llama fields of its attention and embeddings (and its
    architecture, hf_mapping.hf_architecture)."""
    family = moe_family(config)
    pattern = moe_layer_pattern(config.num_layers, config.moe_layer_freq)
    expert_ffn = config.moe_ffn_hidden_size or config.ffn_hidden_size
    fields = {key: value for key, value in llama_fields.items() if key != "mlp_bias"}  # neither family has it
    fields.update(num_experts_per_tok=config.moe_router_topk, output_router_logits=False)
    if family == "mixtral":
        del fields["attention_bias"]
        fields.update(num_local_experts=config.num_experts, intermediate_size=expert_ffn, router_jitter_noise=0.0,
                      sliding_window=None)
    else:
        fields.update(num_experts=config.num_experts, moe_intermediate_size=expert_ffn,
                      norm_topk_prob=not config.moe_router_pre_softmax, decoder_sparse_step=1,
                      mlp_only_layers=[i for i, moe in enumerate(pattern) if not moe])
    return fields


# ---- the checkpoint's manifest -------------------------------------------------------------------------------

def moe_training_args(config: ModelConfig) -> dict[str, Any]:
    """The MoE flags a converted checkpoint saves (nothing for a dense model, whose manifest stays as before)."""
    if config.num_experts is None:
        return {}
    return {name: getattr(config, name) for name in _MANIFEST_FIELDS if getattr(config, name) is not None}


def moe_fields_from_manifest(args: Mapping[str, Any]) -> dict[str, Any]:
    """The ModelConfig MoE fields from a manifest's flags: a training run saves them all (so the export sees e.g. a
    sigmoid router and refuses it), a converted checkpoint those of ``moe_training_args``."""
    if args.get("num_experts") is None:
        return {}
    return {name: args[name] for name in ("num_experts", *MOE_FLAG_DEFAULTS) if name in args}
