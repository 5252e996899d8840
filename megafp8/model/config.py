"""ModelConfig: the architecture of a Llama-style decoder, with Megatron flag names for its fields."""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from megafp8.model.moe_options import moe_errors, moe_layer_pattern
from megafp8.model.recompute import recompute_errors
from megafp8.model.rotary import Llama3RopeScaling
from megafp8.parallel.sharding import pad_vocab_size

ACTIVATIONS = ("swiglu", "smooth_swiglu", "xielu")  # xielu: a non-gated MLP (FOG)


def rope_scaling_flag(field: str) -> str:
    """The training flag of a Llama3RopeScaling field: ``low_freq_factor`` -> ``--rope-scaling-low-freq-factor``."""
    return "--rope-scaling-" + field.replace("_", "-")


@dataclass
class ModelConfig:
    """Field ``foo_bar`` is the flag ``--foo-bar``. Defaults are a tiny model, not a recommendation."""

    num_layers: int = 2
    hidden_size: int = 64
    ffn_hidden_size: int = 172
    num_attention_heads: int = 4
    num_query_groups: int | None = None  # None: multi-head attention (one KV head per query head)
    seq_length: int = 16
    max_position_embeddings: int | None = None  # None: seq_length
    vocab_size: int = 100  # the tokenizer's vocab; the embedding is padded (see padded_vocab_size)
    make_vocab_size_divisible_by: int = 128
    norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    # Llama-3.1 RoPE frequency scaling (megafp8.model.rotary.Llama3RopeScaling): Megatron-LM's
    # --use-rope-scaling / --rope-scaling-factor, plus the three values Megatron hard-codes (1, 4, 8192).
    use_rope_scaling: bool = False
    rope_scaling_factor: float = 8.0
    rope_scaling_low_freq_factor: float = 1.0
    rope_scaling_high_freq_factor: float = 4.0
    rope_scaling_original_max_position_embeddings: int = 8192
    tie_embeddings: bool = False  # --untie-embeddings-and-output-weights is the Megatron flag's inverse
    init_method_std: float = 0.02
    # Output projections (attention linear_proj, MLP linear_fc2) use std / sqrt(2 * num_layers), as in
    # GPT-2 / Megatron: each adds into the residual stream, whose variance would otherwise grow with depth.
    scaled_init_output_projections: bool = True
    activation: str = "swiglu"
    params_dtype: torch.dtype = torch.float32
    # Every parameter is drawn from a generator seeded by (seed, its global name), full tensor then
    # sliced (megafp8.parallel.random): the same seed gives the same full model under any TP/PP layout.
    seed: int = 1234
    # Activation recomputation (megafp8.model.recompute), Megatron's flags: full|selective, uniform|block.
    recompute_granularity: str | None = None
    recompute_method: str | None = None
    recompute_num_layers: int | None = None
    # --kv-channels: the head dim d; None is hidden_size / num_attention_heads. QKV is [(H + 2G) d, hidden] and
    # linear_proj [hidden, H d], so d may differ from hidden / H (Qwen3, Gemma) and hidden need not divide by H.
    kv_channels: int | None = None
    # --attention-dropout (on the attention probabilities) and --hidden-dropout (on linear_proj's and linear_fc2's
    # outputs before each residual add), training mode only (megafp8.model.dropout). Megatron's defaults (0.1) are
    # the CLI's; 0 here keeps a library user's model deterministic.
    attention_dropout: float = 0.0
    hidden_dropout: float = 0.0
    # --apply-layernorm-1p: every RMSNorm gain is stored zero-centred (initialised to 0) and applied as 1 + w.
    layernorm_zero_centered_gamma: bool = False
    # --qk-layernorm: an RMSNorm over each query and each key head's d channels before RoPE (Qwen3's q_norm / k_norm,
    # Megatron's q_layernorm / k_layernorm), one gain vector [d] per projection shared by its heads.
    qk_layernorm: bool = False
    # --freeze-qk-layernorm: those gains stay as initialised (1) or loaded: no gradient, no optimizer state (FOG).
    freeze_qk_layernorm: bool = False
    # The FOG block (issue 32; docs/training.md "Architectures for FP8"): --no-pre-norm drops the RMSNorm in front of
    # attention and the MLP; --post-norm adds one on each sublayer's output, x + RMSNorm(F(x)) (FOG's and OLMo-2's
    # placement), its gains starting at 1/sqrt(num_layers).
    pre_norm: bool = True
    post_norm: bool = False
    # --softmax-scale: attention logits times this instead of 1/sqrt(head dim) (FOG keeps it fixed under QK norms).
    softmax_scale: float | None = None
    # --embedding-scale: the embedding's output times this constant (FOG's input activation scaling).
    embedding_scale: float = 1.0
    # μnit Scaling (docs/training.md "Architectures for FP8"): --unit-scaling initialises every weight (embedding and
    # linears) N(0, 1) and multiplies each linear's output by the fixed 1/sqrt(fan_in), so activations stay near unit
    # scale and static FP8 casts (--fp8-recipe static) fit them; --residual-tau T makes each residual add
    # variance-preserving, sqrt(1 - T) x + sqrt(T) F(x) (post-norm gains then start at 1).
    unit_scaling: bool = False
    residual_tau: float | None = None
    # --fp8-dot-product-attention: Q·Kᵀ, P·V and their backward GEMMs in FP8 (megafp8/fp8/dot_product_attention.py)
    # in every layer whose QKV projection runs an 8-bit recipe at the time; the others keep SDPA.
    fp8_dot_product_attention: bool = False
    # Mixture of experts (megafp8/model/moe.py, docs/parallelism.md "Mixture of experts"; Megatron-LM's flags, checked
    # by megafp8.model.moe_options): None keeps every MLP dense.
    num_experts: int | None = None
    moe_layer_freq: int | str = 1
    moe_ffn_hidden_size: int | None = None  # None: ffn_hidden_size
    moe_router_topk: int = 2
    moe_router_score_function: str = "softmax"
    moe_router_pre_softmax: bool = False
    moe_router_topk_scaling_factor: float | None = None  # DeepSeek-V3's routed scaling factor (2.5); None: 1
    moe_router_load_balancing_type: str = "aux_loss"
    moe_aux_loss_coeff: float = 0.0
    moe_z_loss_coeff: float | None = None
    moe_router_enable_expert_bias: bool = False
    moe_router_bias_update_rate: float = 1e-3
    moe_shared_expert_intermediate_size: int | None = None
    moe_expert_capacity_factor: float | None = None  # None: dropless
    moe_token_drop_policy: str = "probs"
    moe_pad_expert_input_to_capacity: bool = False
    moe_token_dispatcher_type: str = "alltoall"  # under expert parallelism (megafp8.parallel.expert_dispatch)
    moe_grouped_gemm: bool = False  # high-precision experts as one grouped GEMM per linear (megafp8.model.grouped_gemm)

    def __post_init__(self) -> None:
        if self.num_query_groups is None:
            self.num_query_groups = self.num_attention_heads
        if self.max_position_embeddings is None:
            self.max_position_embeddings = self.seq_length
        if self.freeze_qk_layernorm and not self.qk_layernorm:
            raise ValueError("--freeze-qk-layernorm needs --qk-layernorm")
        if self.residual_tau is not None and not 0 < self.residual_tau < 1:
            raise ValueError(f"--residual-tau must be in (0, 1), got {self.residual_tau}")
        if self.unit_scaling:
            self.init_method_std = 1.0  # unit-variance weights; the 1/sqrt(fan_in) multipliers scale the outputs
        if self.activation not in ACTIVATIONS:
            raise ValueError(f"--activation must be one of {', '.join(ACTIVATIONS)}, got {self.activation!r}")
        errors = recompute_errors(self.recompute_granularity, self.recompute_method, self.recompute_num_layers)
        if errors:
            raise ValueError("; ".join(errors))
        if self.use_rope_scaling:
            errors = self.rope_scaling.errors(rope_scaling_flag)
            if errors:
                raise ValueError("; ".join(errors))
        if self.kv_channels is not None and (type(self.kv_channels) is not int or self.kv_channels < 1):
            raise ValueError(f"--kv-channels must be a positive integer, got {self.kv_channels!r}")
        if self.fp8_dot_product_attention and self.attention_dropout:
            raise ValueError("--fp8-dot-product-attention does not drop attention probabilities: "
                             "set --attention-dropout 0")
        for flag, p in (("--attention-dropout", self.attention_dropout), ("--hidden-dropout", self.hidden_dropout)):
            if not 0.0 <= p < 1.0:  # also a NaN
                raise ValueError(f"{flag} must be in [0, 1), got {p}")
        errors = moe_errors(self)
        if errors:
            raise ValueError("; ".join(errors))
        if self.seq_length > self.max_position_embeddings:
            raise ValueError(f"--seq-length ({self.seq_length}) exceeds --max-position-embeddings "
                             f"({self.max_position_embeddings})")

    @property
    def head_dim(self) -> int:
        """d, the size of one attention head (--kv-channels, else hidden_size / num_attention_heads)."""
        if self.kv_channels is not None:
            return self.kv_channels
        return self.hidden_size // self.num_attention_heads

    def is_moe_layer(self, layer_number: int) -> bool:
        """Whether global layer ``layer_number`` has a MoE block instead of the dense MLP."""
        return self.num_experts is not None and moe_layer_pattern(self.num_layers, self.moe_layer_freq)[layer_number]

    @property
    def rope_scaling(self) -> Llama3RopeScaling | None:
        if not self.use_rope_scaling:
            return None
        return Llama3RopeScaling(self.rope_scaling_factor, self.rope_scaling_low_freq_factor,
                                 self.rope_scaling_high_freq_factor,
                                 self.rope_scaling_original_max_position_embeddings)

    @property
    def output_init_std(self) -> float:
        if self.unit_scaling:
            return 1.0
        if not self.scaled_init_output_projections:
            return self.init_method_std
        return self.init_method_std / math.sqrt(2.0 * self.num_layers)

    def padded_vocab_size(self, tp_size: int) -> int:
        return pad_vocab_size(self.vocab_size, self.make_vocab_size_divisible_by, tp_size)
