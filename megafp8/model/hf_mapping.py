"""megafp8 (TP=1) state dict <-> HF ``LlamaForCausalLM`` state dict (``Qwen3ForCausalLM`` with --qk-layernorm; with
--num-experts ``MixtralForCausalLM`` / ``Qwen3MoeForCausalLM``, whose MoE layers hf_moe_mapping names), and the
matching config fields.

====================================================  ====================================================
megafp8                                               HF Llama
====================================================  ====================================================
embedding.weight  [V_padded, h]                       model.embed_tokens.weight [V, h] (padding rows cut)
layers.{i}.input_layernorm.weight                     model.layers.{i}.input_layernorm.weight
layers.{i}.self_attention.linear_qkv.weight           q_proj / k_proj / v_proj, group-interleaved (below)
layers.{i}.self_attention.linear_proj.weight          model.layers.{i}.self_attn.o_proj.weight
layers.{i}.pre_mlp_layernorm.weight                   model.layers.{i}.post_attention_layernorm.weight
layers.{i}.mlp.linear_fc1.weight  [2*ffn, h]          cat([mlp.gate_proj.weight, mlp.up_proj.weight])
layers.{i}.mlp.linear_fc2.weight                      model.layers.{i}.mlp.down_proj.weight
final_layernorm.weight                                model.norm.weight
output_layer.weight  [V_padded, h] (absent if tied)   lm_head.weight [V, h] (absent if tied)
layers.{i}.self_attention.q_layernorm.weight [d]      model.layers.{i}.self_attn.q_norm.weight (--qk-layernorm:
layers.{i}.self_attention.k_layernorm.weight [d]      model.layers.{i}.self_attn.k_norm.weight  Qwen3)
====================================================  ====================================================

``linear_qkv.weight`` viewed as ``[G, r + 2, d, h]`` (G KV heads, r = heads / G, head dim d): entry
``[g, :r]`` are q heads ``g*r .. g*r+r-1``, ``[g, r]`` is k head g, ``[g, r+1]`` is v head g. Both sides
use the same rotate-half RoPE convention, so q/k need no permutation. Sharded checkpoints are first
unsharded with ``megafp8.parallel.sharding``. RoPE: ``rope_theta``, and Llama-3.1's ``rope_scaling``
(``rope_type: "llama3"``) <-> ``use_rope_scaling`` / ``rope_scaling_*``.
"""
from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from megafp8.model.config import ModelConfig
from megafp8.model.hf_moe_mapping import FAMILIES, hf_moe_config, moe_family, moe_mlp_sources
from megafp8.model.rotary import Llama3RopeScaling
from megafp8.parallel.sharding import resize_vocab_dim


def split_qkv(qkv: torch.Tensor, config: ModelConfig) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Fused ``linear_qkv.weight`` -> HF (q_proj, k_proj, v_proj) weights."""
    groups, d = config.num_query_groups, config.head_dim
    r = config.num_attention_heads // groups
    blocks = qkv.reshape(groups, r + 2, d, qkv.shape[-1])
    hidden = qkv.shape[-1]
    return (blocks[:, :r].reshape(groups * r * d, hidden).clone(),
            blocks[:, r].reshape(groups * d, hidden).clone(),
            blocks[:, r + 1].reshape(groups * d, hidden).clone())


def fuse_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, config: ModelConfig) -> torch.Tensor:
    """HF (q_proj, k_proj, v_proj) weights -> fused ``linear_qkv.weight`` in the group-interleaved layout."""
    groups, d = config.num_query_groups, config.head_dim
    r = config.num_attention_heads // groups
    hidden = q.shape[-1]
    blocks = torch.cat([q.reshape(groups, r, d, hidden), k.reshape(groups, 1, d, hidden),
                        v.reshape(groups, 1, d, hidden)], dim=1)
    return blocks.reshape(-1, hidden)


_LAYER_RENAMES = {  # megafp8 suffix -> HF suffix, for the one-to-one tensors of a layer
    "input_layernorm.weight": "input_layernorm.weight",
    "self_attention.linear_proj.weight": "self_attn.o_proj.weight",
    "pre_mlp_layernorm.weight": "post_attention_layernorm.weight",
}
# megafp8 suffix -> the HF suffixes it concatenates along dim 0, for a dense layer's MLP (mlp_sources)
_DENSE_MLP = {"mlp.linear_fc1.weight": ["mlp.gate_proj.weight", "mlp.up_proj.weight"],
              "mlp.linear_fc2.weight": ["mlp.down_proj.weight"]}
_QK_LAYERNORM_RENAMES = {"self_attention.q_layernorm.weight": "self_attn.q_norm.weight",
                         "self_attention.k_layernorm.weight": "self_attn.k_norm.weight"}
NORM_WEIGHTS = ("input_layernorm.weight", "pre_mlp_layernorm.weight", *_QK_LAYERNORM_RENAMES)  # a layer's RMSNorm gains


def layer_renames(config: ModelConfig) -> dict[str, str]:
    """megafp8 suffix -> HF suffix for the one-to-one tensors of a layer of ``config``."""
    return {**_LAYER_RENAMES, **(_QK_LAYERNORM_RENAMES if config.qk_layernorm else {})}


def mlp_sources(config: ModelConfig, layer: int) -> dict[str, list[str]]:
    """megafp8 suffix -> the HF suffixes it is the concatenation of (dim 0, equal parts), for the MLP of ``layer``:
    the dense SwiGLU's ``[gate; up]`` and down, or a MoE layer's router and experts."""
    return moe_mlp_sources(config, layer) if config.is_moe_layer(layer) else _DENSE_MLP


def hf_architecture(config: ModelConfig) -> dict[str, Any]:
    """config.json's model_type and architectures: Llama, or Qwen3 (Llama's block with q_norm / k_norm) when
    --qk-layernorm (their MoE families with --num-experts)."""
    if config.num_experts is not None:
        return {"model_type": moe_family(config), "architectures": [FAMILIES[moe_family(config)].architecture]}
    if config.qk_layernorm:
        return {"model_type": "qwen3", "architectures": ["Qwen3ForCausalLM"]}
    return {"model_type": "llama", "architectures": ["LlamaForCausalLM"]}


def to_hf_state_dict(state_dict: Mapping[str, torch.Tensor], config: ModelConfig) -> dict[str, torch.Tensor]:
    """A full (TP=1) megafp8 state dict as HF Llama tensors (vocab padding removed)."""
    hf = {"model.embed_tokens.weight": state_dict["embedding.weight"][: config.vocab_size].clone(),
          "model.norm.weight": hf_norm_gain(state_dict["final_layernorm.weight"], config)}
    if not config.tie_embeddings:
        hf["lm_head.weight"] = state_dict["output_layer.weight"][: config.vocab_size].clone()
    for i in range(config.num_layers):
        ours, theirs = f"layers.{i}.", f"model.layers.{i}."
        for src, dst in layer_renames(config).items():
            hf[theirs + dst] = state_dict[ours + src]
            if src in NORM_WEIGHTS:
                hf[theirs + dst] = hf_norm_gain(hf[theirs + dst], config)
        q, k, v = split_qkv(state_dict[ours + "self_attention.linear_qkv.weight"], config)
        hf[theirs + "self_attn.q_proj.weight"], hf[theirs + "self_attn.k_proj.weight"] = q, k
        hf[theirs + "self_attn.v_proj.weight"] = v
        for src, parts in mlp_sources(config, i).items():
            for dst, part in zip(parts, state_dict[ours + src].chunk(len(parts), dim=0)):
                hf[theirs + dst] = part.clone()
    return hf


def from_hf_state_dict(hf_state_dict: Mapping[str, torch.Tensor], config: ModelConfig,
                       tp_size: int = 1) -> dict[str, torch.Tensor]:
    """HF Llama tensors as a full megafp8 state dict, vocab zero-padded for ``tp_size``."""
    padded = config.padded_vocab_size(tp_size)
    sd = {"embedding.weight": resize_vocab_dim(hf_state_dict["model.embed_tokens.weight"], padded),
          "final_layernorm.weight": norm_weight_from_hf(hf_state_dict["model.norm.weight"], config)}
    if not config.tie_embeddings:
        sd["output_layer.weight"] = resize_vocab_dim(hf_state_dict["lm_head.weight"], padded)
    for i in range(config.num_layers):
        ours, theirs = f"layers.{i}.", f"model.layers.{i}."
        for src, dst in layer_renames(config).items():
            sd[ours + src] = hf_state_dict[theirs + dst]
            if src in NORM_WEIGHTS:
                sd[ours + src] = norm_weight_from_hf(sd[ours + src], config)
        sd[ours + "self_attention.linear_qkv.weight"] = fuse_qkv(
            hf_state_dict[theirs + "self_attn.q_proj.weight"], hf_state_dict[theirs + "self_attn.k_proj.weight"],
            hf_state_dict[theirs + "self_attn.v_proj.weight"], config)
        for src, parts in mlp_sources(config, i).items():
            sd[ours + src] = torch.cat([hf_state_dict[theirs + part] for part in parts])
    return sd


def hf_config_fields(config: ModelConfig) -> dict[str, Any]:
    """config.json's fields for ``config``: its architecture, and the family's config (Llama, Qwen3, Mixtral or
    Qwen3-MoE)."""
    fields = {**hf_llama_config_kwargs(config), **hf_architecture(config)}
    return hf_moe_config(config, fields) if config.num_experts is not None else fields


def hf_llama_config_kwargs(config: ModelConfig) -> dict[str, Any]:
    """Keyword arguments for ``transformers.LlamaConfig`` (or ``Qwen3Config``, hf_architecture) describing the same
    architecture."""
    qwen3 = dict(use_sliding_window=False, sliding_window=None) if config.qk_layernorm else {}
    return dict(**qwen3, vocab_size=config.vocab_size, hidden_size=config.hidden_size,
                intermediate_size=config.ffn_hidden_size, num_hidden_layers=config.num_layers,
                num_attention_heads=config.num_attention_heads, num_key_value_heads=config.num_query_groups,
                head_dim=config.head_dim, max_position_embeddings=config.max_position_embeddings,
                rms_norm_eps=config.norm_eps, rope_theta=config.rope_theta, hidden_act="silu",
                attention_bias=False, mlp_bias=False, tie_word_embeddings=config.tie_embeddings,
                initializer_range=config.init_method_std, **hf_rope_scaling_kwargs(config))


def hf_rope_scaling_kwargs(config: ModelConfig) -> dict[str, Any]:
    """``rope_scaling`` as Meta's Llama-3.1/3.2 config.json files spell it (read by transformers 4 and 5,
    vLLM, SGLang), or nothing for unscaled RoPE."""
    scaling = config.rope_scaling
    if scaling is None:
        return {}
    return {"rope_scaling": {"rope_type": "llama3", **{field: getattr(scaling, field) for field in scaling.FIELDS}}}


def hf_rope_parameters(hf_config: Any) -> tuple[str, dict[str, Any]]:
    """(the config field it came from, the RoPE dict) of a HF config: ``rope_scaling`` (Meta's files,
    transformers 4) wins over ``rope_parameters`` (transformers 5), as in transformers itself."""
    for field in ("rope_scaling", "rope_parameters"):
        value = getattr(hf_config, field, None)
        if value:
            return field, dict(value)
    return "rope_parameters", {}


def hf_rope_type(rope: Mapping[str, Any]) -> str:
    return rope.get("rope_type", rope.get("type", "default"))  # "type": the spelling before transformers 4.45


_LLAMA3_REQUIRED = ("factor", "low_freq_factor", "high_freq_factor")


def _llama3_scaling(rope: Mapping[str, Any], hf_config: Any) -> Llama3RopeScaling:
    # transformers' rule: without original_max_position_embeddings the model's own length is the original.
    original = rope.get("original_max_position_embeddings") or hf_config.max_position_embeddings
    return Llama3RopeScaling(float(rope["factor"]), float(rope["low_freq_factor"]),
                             float(rope["high_freq_factor"]), int(original))


def hf_rope_problems(hf_config: Any) -> list[str]:
    """What in a HF config's RoPE megafp8 cannot reproduce, each naming its config.json field."""
    field, rope = hf_rope_parameters(hf_config)
    rope_type = hf_rope_type(rope)
    if rope_type not in ("default", "llama3"):
        return [f"{field}.rope_type={rope_type!r} (megafp8 implements unscaled RoPE and Llama-3.1's 'llama3')"]
    problems = []
    for source, value in ((f"{field}.partial_rotary_factor", rope.get("partial_rotary_factor")),
                          ("partial_rotary_factor", getattr(hf_config, "partial_rotary_factor", None))):
        if value not in (None, 1, 1.0):
            problems.append(f"{source}={value!r} (megafp8 rotates the whole head)")
    if rope_type == "llama3":
        missing = [key for key in _LLAMA3_REQUIRED if rope.get(key) is None]
        if missing:
            problems.append(f"{field} with rope_type 'llama3' lacks {', '.join(missing)}")
        else:
            problems += _llama3_scaling(rope, hf_config).errors(lambda key: f"{field}.{key}")
    return problems


# The sequence length a config without one gets: HF configs only state the longest (Llama-3.1: 131072 positions),
# which as a training or fine-tuning default would size every micro-batch (and its RoPE table) for 128k tokens.
DEFAULT_HF_SEQ_LENGTH = 4096


def model_config_from_hf(hf_config: Any, seq_length: int | None = None, **overrides: Any) -> ModelConfig:
    """The ModelConfig of an HF ``LlamaConfig`` or ``Qwen3Config`` (attribute access, so a loaded config.json works
    too). seq_length defaults to min(max_position_embeddings, DEFAULT_HF_SEQ_LENGTH); max_position_embeddings stays the model's."""
    problems = hf_rope_problems(hf_config)
    if problems:
        raise ValueError("unsupported RoPE: " + "; ".join(problems))
    _, rope = hf_rope_parameters(hf_config)
    theta = rope.get("rope_theta", getattr(hf_config, "rope_theta", 10000.0))
    scaling = {}
    if hf_rope_type(rope) == "llama3":
        values = _llama3_scaling(rope, hf_config)
        scaling = {"use_rope_scaling": True,
                   **{f"rope_scaling_{field}": getattr(values, field) for field in values.FIELDS}}
    fields = dict(num_layers=hf_config.num_hidden_layers, hidden_size=hf_config.hidden_size,
                  ffn_hidden_size=hf_config.intermediate_size, num_attention_heads=hf_config.num_attention_heads,
                  num_query_groups=hf_config.num_key_value_heads, vocab_size=hf_config.vocab_size,
                  max_position_embeddings=hf_config.max_position_embeddings,
                  seq_length=seq_length or min(hf_config.max_position_embeddings, DEFAULT_HF_SEQ_LENGTH), norm_eps=hf_config.rms_norm_eps,
                  rope_theta=theta, tie_embeddings=hf_config.tie_word_embeddings,
                  init_method_std=hf_config.initializer_range, kv_channels=_kv_channels(hf_config),
                  qk_layernorm=getattr(hf_config, "model_type", "llama") == "qwen3", **scaling)
    fields.update(overrides)
    return ModelConfig(**fields)


def _kv_channels(hf_config: Any) -> int | None:
    """--kv-channels for a HF ``head_dim`` other than hidden / heads (None: the default head dim)."""
    head_dim = getattr(hf_config, "head_dim", None)
    if head_dim is None or head_dim * hf_config.num_attention_heads == hf_config.hidden_size:
        return None
    return head_dim


def hf_norm_gain(weight: torch.Tensor, config: ModelConfig) -> torch.Tensor:
    """The RMSNorm gain HF stores: ``1 + w`` for zero-centred weights (--apply-layernorm-1p), else w itself."""
    return weight + 1 if config.layernorm_zero_centered_gamma else weight


def norm_weight_from_hf(gain: torch.Tensor, config: ModelConfig) -> torch.Tensor:
    """The inverse of ``hf_norm_gain``."""
    return gain - 1 if config.layernorm_zero_centered_gamma else gain
