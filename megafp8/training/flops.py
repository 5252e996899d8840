"""FLOPs per training iteration of the Llama-style decoder: the count behind TFLOP/s/GPU and MFU.

The formula is Megatron-LM's `num_floating_point_operations` for a dense model with SwiGLU and GQA
(3 passes: forward, and backward at twice the forward; 2 FLOPs per multiply-add), written out per GEMM:

    per layer and token, forward:   2h(h_q + 2 h_kv)      QKV projection (h_q = heads x head dim d, h_kv = kv heads x d)
                                    2 h h_q               attention output projection
                                    2 * 2 s h_q           QK^T and attention x V (full s x s, no causal halving)
                                    3 * 2 h f             SwiGLU: gate, up and down projections (f = ffn hidden;
                                                          2 * 2 h f for the non-gated xIELU MLP)

with d = --kv-channels, else h / heads (then h_q = h). A MoE layer (--num-experts E) replaces the MLP term by what a
token runs, Megatron's count too: 2 h E (the router) + k * 3 * 2 h f_moe (its k experts) + 3 * 2 h f_shared.
    per token, forward:             2 h V                 the logits (V = padded vocabulary)

    FLOPs(iteration) = 3 * global_batch * s * (num_layers * layer + logits)

Elementwise work (norms, RoPE, softmax, the loss) is left out, as in Megatron. Counting the full
s x s attention matches Megatron and makes TFLOP/s comparable with it; it over-counts causal
attention by its masked half, which is why the figure is an upper bound for long sequences.
"""
from __future__ import annotations


def flops_per_token_forward(*, num_layers: int, hidden_size: int, ffn_hidden_size: int, num_attention_heads: int,
                            num_query_groups: int, seq_length: int, padded_vocab_size: int,
                            kv_channels: int | None = None, gated_mlp: bool = True, num_moe_layers: int = 0,
                            num_experts: int = 0, moe_router_topk: int = 0, moe_ffn_hidden_size: int | None = None,
                            moe_shared_expert_intermediate_size: int | None = None) -> float:
    """Forward FLOPs per token (multiply-add = 2), as in the module docstring."""
    h, f, s = hidden_size, ffn_hidden_size, seq_length
    d = kv_channels if kv_channels is not None else h / num_attention_heads
    q, kv = num_attention_heads * d, num_query_groups * d
    attention = 2 * h * (q + 2 * kv) + 2 * h * q + 2 * 2 * s * q
    mlp = (3 if gated_mlp else 2) * 2 * h * f
    moe = (2 * h * num_experts + moe_router_topk * 3 * 2 * h * (moe_ffn_hidden_size or f)
           + 3 * 2 * h * (moe_shared_expert_intermediate_size or 0))
    return num_layers * attention + (num_layers - num_moe_layers) * mlp + num_moe_layers * moe \
        + 2 * h * padded_vocab_size


def flops_per_iteration(global_batch_size: int, **model) -> float:
    """Training FLOPs of one iteration: forward + backward (2x forward) over the global batch."""
    return 3.0 * global_batch_size * model["seq_length"] * flops_per_token_forward(**model)


def moe_flops_args(args) -> dict:
    """The MoE terms of flops_per_token_forward from the training flags (none for a dense model)."""
    if args.num_experts is None:
        return {}
    from megafp8.model.moe_options import moe_layer_pattern

    return dict(num_moe_layers=sum(moe_layer_pattern(args.num_layers, args.moe_layer_freq)),
                num_experts=args.num_experts, moe_router_topk=args.moe_router_topk,
                moe_ffn_hidden_size=args.moe_ffn_hidden_size,
                moe_shared_expert_intermediate_size=args.moe_shared_expert_intermediate_size)
