"""Causal grouped-query self-attention with a fused, column-parallel QKV projection.

Fused QKV layout (rows of ``linear_qkv.weight``, full TP=1 tensor ``[(H + 2G) * d, hidden]``, with H
query heads, G query groups = KV heads, r = H / G and head dim d): one block per query group g, in
group order, each block ``[q heads g*r .. g*r + r - 1 (r*d rows), k head g (d rows), v head g (d rows)]``.
This is Megatron-Core's layout; because a group's block is contiguous, a plain dim-0 split over TP
gives each rank whole groups (G/TP of them) with their query heads, no reshuffling needed.
``hf_mapping`` converts it to and from HF's separate q_proj / k_proj / v_proj. The head dim d is
``config.head_dim`` (--kv-channels), so ``linear_proj`` maps ``H * d`` back to ``hidden``, whatever hidden / H is.
With --qk-layernorm, ``q_layernorm`` / ``k_layernorm`` normalize each head of q and k over its d channels before RoPE.
"""
from __future__ import annotations

import functools

import torch
import torch.nn.functional as F
from torch import nn

from megafp8.fp8.dot_product_attention import ROLES, Fp8AttentionFormats, Fp8Blocks
from megafp8.fp8.prologue import RMSNormPrologue
from megafp8.fp8.recipe import Fp8Recipe
from megafp8.fp8.scaling_state import ScalingState
from megafp8.model.config import ModelConfig
from megafp8.model.dropout import mask_generator
from megafp8.model.norm import RMSNorm
from megafp8.model.recompute import recompute
from megafp8.model.rotary import apply_rotary
from megafp8.parallel.context_parallel import context_parallel_attention
from megafp8.parallel.parallel_state import ParallelState
from megafp8.parallel.random import ModelParallelRNG
from megafp8.parallel.tensor_parallel import ColumnParallelLinear, RowParallelLinear, init_method_normal


class SelfAttention(nn.Module):
    """``[s/TP or s, b, hidden]`` in and out; attention itself runs on ``[b, heads/TP, s, d]``."""

    def __init__(self, config: ModelConfig, parallel_state: ParallelState) -> None:
        super().__init__()
        tp_size = parallel_state.tp_size
        self.head_dim = config.head_dim
        self.query_heads_per_group = config.num_attention_heads // config.num_query_groups
        self.local_heads = config.num_attention_heads // tp_size
        self.local_groups = config.num_query_groups // tp_size
        self.recompute_core_attention = config.recompute_granularity == "selective"
        self.attention_dropout = config.attention_dropout  # on the probabilities, in training mode only
        self.softmax_scale = config.softmax_scale  # None: SDPA's 1/sqrt(d)
        self.fp8_dot_product_attention = config.fp8_dot_product_attention
        # Context parallelism: this rank holds 2 of each sequence's 2 x CP chunks; K/V travel over the CP group.
        self.parallel_state = parallel_state
        qkv_size = (config.num_attention_heads + 2 * config.num_query_groups) * self.head_dim
        self.linear_qkv = ColumnParallelLinear(config.hidden_size, qkv_size, parallel_state,
                                               init_method=init_method_normal(config.init_method_std),
                                               params_dtype=config.params_dtype, perform_initialization=False)
        self.linear_proj = RowParallelLinear(config.num_attention_heads * self.head_dim, config.hidden_size,
                                             parallel_state, init_method=init_method_normal(config.output_init_std),
                                             params_dtype=config.params_dtype, perform_initialization=False)
        self.q_layernorm = self.k_layernorm = None
        if config.qk_layernorm:
            # Each TP rank normalizes other heads with the same gains, so their grads are summed over TP as a
            # sequence-parallel norm's are (the tag Megatron's finalize step also reads for q/k_layernorm).
            self.q_layernorm, self.k_layernorm = (
                RMSNorm(self.head_dim, config.norm_eps, sequence_parallel=True, params_dtype=config.params_dtype,
                        zero_centered_gamma=config.layernorm_zero_centered_gamma) for _ in range(2))
            for norm in (self.q_layernorm, self.k_layernorm):  # frozen: outside the grad buffers and the optimizer
                norm.weight.requires_grad_(not config.freeze_qk_layernorm)

    def forward(self, x: torch.Tensor, rotary: tuple[torch.Tensor, torch.Tensor],
                input_norm: RMSNormPrologue | None = None, rng: ModelParallelRNG | None = None) -> torch.Tensor:
        """`input_norm`: x is the input of this norm (RMSNorm(x, as_prologue=True)), fused into QKV's FP8 input cast;
        without it x is QKV's input. `rng`: the model-parallel RNG the attention-dropout masks come from (each TP
        rank holds other heads) and that selective recomputation replays."""
        qkv = self.linear_qkv(x, prologue=input_norm)
        # qkv: [s, b, G/TP * (r + 2) * d]
        s, b, _ = qkv.shape
        qkv = qkv.view(s, b, self.local_groups, self.query_heads_per_group + 2, self.head_dim)
        q, k, v = qkv.split([self.query_heads_per_group, 1, 1], dim=3)
        q = q.reshape(s, b, self.local_heads, self.head_dim)  # heads of a group stay adjacent
        k = k.reshape(s, b, self.local_groups, self.head_dim)
        v = v.reshape(s, b, self.local_groups, self.head_dim)
        core = functools.partial(self._core_attention, rng=rng)
        if self.recompute_core_attention and torch.is_grad_enabled():  # --recompute-granularity selective
            out = recompute(core, q, k, v, *rotary, rng=rng)
        else:
            out = core(q, k, v, *rotary)
        return self.linear_proj(out)

    def add_fp8_scaling(self, recipe: Fp8Recipe) -> None:
        """Delayed-scaling states for the attention's casts (Q, K, V, dO) under a delayed recipe: the model's
        scaling manager finds them with the linears' (one amax reduction per step) and checkpoints hold them."""
        self.fp8_scaling = nn.ModuleDict({role: ScalingState(recipe, recipe.dtype("grad_output" if role == "grad_output"
                                                                                  else "input"))
                                          for role in ROLES})

    def fp8_recipe(self) -> Fp8Recipe | None:
        """With --fp8-dot-product-attention, the recipe attention's casts follow now: its QKV projection's when that
        is an 8-bit one (so a guard or schedule move of that layer to high precision, or to FP4, takes attention
        with it, and fp8_autocast(enabled=False) turns both off), else None (high precision)."""
        if not self.fp8_dot_product_attention:
            return None
        recipe = self.linear_qkv.active_recipe
        return recipe if recipe is not None and recipe.element_bits == 8 else None

    def fp8_blocks(self) -> Fp8Blocks | None:
        """This call's FP8 operands (None: high precision), with the delayed states when the recipe is theirs."""
        recipe = self.fp8_recipe()
        if recipe is None:
            return None
        states = getattr(self, "fp8_scaling", None)  # built for a delayed recipe: used while that one runs
        delayed = states is not None and states["query"].recipe == recipe
        telemetry = self.linear_qkv.fp8_telemetry if self.linear_qkv.telemetry_enabled else None
        return Fp8Blocks(Fp8AttentionFormats.from_recipe(recipe), dict(states.items()) if delayed else None,
                         telemetry)

    def _core_attention(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cos: torch.Tensor,
                        sin: torch.Tensor, rng: ModelParallelRNG | None = None) -> torch.Tensor:
        """(QK norm +) rotary + causal attention (+ dropout on its probabilities): ``[s, b, heads, d]`` q/k/v to
        ``[s, b, H/TP * d]``."""
        s, b = q.shape[:2]
        if self.q_layernorm is not None:  # inside the recomputed region: selective recompute saves only q, k, v
            q, k = self.q_layernorm(q), self.k_layernorm(k)
        q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        q, k, v = (t.permute(1, 2, 0, 3) for t in (q, k, v))  # [b, heads, s, d]
        # enable_gqa maps query head i to KV head i // r, matching the group-major head order above.
        gqa = self.local_heads != self.local_groups
        ps = self.parallel_state
        dropout = self.attention_dropout if self.training else 0.0
        fp8 = self.fp8_blocks()
        if ps.cp_size > 1 or fp8 is not None:  # ring (or all-gather) attention over the CP ranks, merged by
            # log-sum-exp; FP8 attention at CP=1 is its single diagonal block
            if dropout:  # validate_model refuses the config; a hand-built layer would silently skip it
                raise ValueError("--attention-dropout is not supported with --context-parallel-size > 1 or "
                                 "--fp8-dot-product-attention")
            out = context_parallel_attention(q, k, v, group=ps.cp_group.group, cp_rank=ps.cp_rank, cp_size=ps.cp_size,
                                             comm_type=ps.cp_comm_type, counters=ps.comm, enable_gqa=gqa,
                                             scale=self.softmax_scale, blocks=fp8)
        elif dropout:
            # Each TP rank holds other heads: its masks come from its own stream (Megatron's tracker fork).
            with mask_generator(rng, True, ps.tp_size):
                out = F.scaled_dot_product_attention(q, k, v, dropout_p=dropout, is_causal=True, enable_gqa=gqa,
                                                 scale=self.softmax_scale)
        else:
            out = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=gqa, scale=self.softmax_scale)
        return out.permute(2, 0, 1, 3).reshape(s, b, self.local_heads * self.head_dim)  # [s, b, H/TP * d]
