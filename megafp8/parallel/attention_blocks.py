"""One block of blockwise attention (queries x one K/V block) and its backward, for ring attention to merge.

``attend`` returns the block's output and its log-sum-exp; ``attend_backward`` takes the *merged* output and
log-sum-exp of all blocks (FlashAttention's trick: each block's probabilities are renormalized by the global
``lse``, so the block's dQ/dK/dV are its exact share of the full attention's gradients). Both run through SDPA's
fused flash kernels in the input dtype (CPU: any float dtype; CUDA: fp16/bf16 with a head size that is a multiple
of 8 up to 256), which return the log-sum-exp in fp32 and keep no ``s x s`` scores; anything else, and
``FUSED = False``, runs the written-out twin in fp32 (fp64 for fp64 inputs) in query tiles of ``Q_TILE_ROWS``
rows. Shapes: q ``[b, H, sq, d]``, k/v ``[b, G, sk, d]`` (query head i uses K/V head i // (H / G)), lse
``[b, H, sq]``. A causal block is square: query i sees keys 0..i.
"""
from __future__ import annotations

import torch

from megafp8_kernels.fp8_attention_reference import masked_scores, query_tiles

aten = torch.ops.aten

FUSED = True  # False: every block through the fp32 twin (the tests compare both with fp64 attention)
# Twin only: query rows per tile; its fp32 scores are ``b * H * Q_TILE_ROWS * sk`` elements, linear in the
# local sequence. Rows are independent (each has its own lse), so tiling changes nothing in the math.
Q_TILE_ROWS = 1024


def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """What blocks are merged and dK/dV accumulated in: fp32, or fp64 for fp64 inputs."""
    return torch.promote_types(dtype, torch.float32)


def _fused(q: torch.Tensor) -> bool:
    if not FUSED:
        return False
    if q.device.type == "cpu":
        return True
    return q.device.type == "cuda" and q.dtype in (torch.float16, torch.bfloat16) and q.shape[-1] % 8 == 0 \
        and q.shape[-1] <= 256


def _expand(kv: torch.Tensor, heads: int) -> torch.Tensor:
    """K or V with one head per query head (the fused kernels take equal head counts)."""
    return kv.repeat_interleave(heads // kv.shape[1], dim=1) if kv.shape[1] != heads else kv.contiguous()


def _sum_groups(grad: torch.Tensor, groups: int) -> torch.Tensor:
    """dK or dV per query head -> per K/V head, summed in the compute dtype."""
    b, heads, s, d = grad.shape
    return grad.to(compute_dtype(grad.dtype)).view(b, groups, heads // groups, s, d).sum(dim=2)


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool, scale: float):
    """(out, lse) of the queries over this K/V block: out in q's dtype (fused) or the compute dtype (twin)."""
    if not _fused(q):
        return _twin_forward(q, k, v, causal, scale)
    q, k, v = q.contiguous(), _expand(k, q.shape[1]), _expand(v, q.shape[1])
    if q.device.type == "cpu":
        return aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, causal, scale=scale)
    out, lse, *_ = aten._scaled_dot_product_flash_attention(q, k, v, 0.0, causal, scale=scale)
    return out, lse


def attend_backward(dout, q, k, v, out, lse, causal: bool, scale: float):
    """(dq, dk, dv) of this block given the merged ``out`` (q's dtype) and ``lse``; dk/dv per K/V head."""
    if not _fused(q):
        return _twin_backward(dout, q, k, v, out, lse, causal, scale)
    groups = k.shape[1]
    args = (dout.contiguous(), q.contiguous(), _expand(k, q.shape[1]), _expand(v, q.shape[1]), out.contiguous(),
            lse.contiguous())
    if q.device.type == "cpu":
        dq, dk, dv = aten._scaled_dot_product_flash_attention_for_cpu_backward(*args, 0.0, causal, scale=scale)
    else:  # no dropout: the philox state is not read; no cumulative lengths: not a varlen batch
        empty = torch.empty((), dtype=torch.int64, device=q.device)
        dq, dk, dv = aten._scaled_dot_product_flash_attention_backward(
            *args, None, None, q.shape[2], k.shape[2], 0.0, causal, empty, empty, scale=scale)
    return dq, _sum_groups(dk, groups), _sum_groups(dv, groups)


class HighPrecisionBlocks:
    """How ring attention holds and attends its operands in their own dtype: queries ``(q,)``, the K/V message
    ``stack([k, v])``, output gradients ``(dout,)``. ``megafp8.fp8.dot_product_attention.Fp8Blocks`` is the FP8 one."""

    def queries(self, q: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return (q,)

    def pack_kv(self, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return torch.stack([k, v]).contiguous()  # one message per ring step

    def attend(self, queries, kv: torch.Tensor, rows: slice, keys: slice, causal: bool, scale: float):
        (q,) = queries
        return attend(q[..., rows, :], kv[0, :, :, keys], kv[1, :, :, keys], causal, scale)

    def output_grads(self, dout: torch.Tensor, out: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return (dout,)

    def attend_backward(self, grads, queries, kv: torch.Tensor, out, lse, rows: slice, keys: slice, causal: bool,
                        scale: float):
        (dout,), (q,) = grads, queries
        return attend_backward(dout[..., rows, :], q[..., rows, :], kv[0, :, :, keys], kv[1, :, :, keys],
                               out[..., rows, :], lse[..., rows], causal, scale)


def merge(out: torch.Tensor, lse: torch.Tensor, block_out: torch.Tensor, block_lse: torch.Tensor) -> None:
    """In place, in the compute dtype: fold one block's (out, lse) into the running ones (rows already sliced)."""
    new_lse = torch.logaddexp(lse, block_lse)
    out.mul_(torch.exp(lse - new_lse).unsqueeze(-1)).add_(block_out * torch.exp(block_lse - new_lse).unsqueeze(-1))
    lse.copy_(new_lse)


# ---- the twin: written-out math in the compute dtype, query tiles ----------------------------------------------
def _grouped(q: torch.Tensor, groups: int) -> torch.Tensor:
    b, heads, s, d = q.shape
    return q.to(compute_dtype(q.dtype)).reshape(b, groups, heads // groups, s, d)


def _twin_forward(q, k, v, causal: bool, scale: float):
    groups, ct = k.shape[1], compute_dtype(q.dtype)
    q5, k5, v5 = _grouped(q, groups), k.to(ct).unsqueeze(2), v.to(ct).unsqueeze(2)
    out, lse = torch.empty_like(q5), q5.new_empty(q5.shape[:-1])
    for rows, keys, offset in query_tiles(q.shape[2], causal, Q_TILE_ROWS):
        scores = masked_scores(q5[..., rows, :], k5[..., keys, :], scale, offset)
        lse[..., rows] = torch.logsumexp(scores, dim=-1)
        out[..., rows, :] = torch.matmul(torch.exp(scores - lse[..., rows].unsqueeze(-1)), v5[..., keys, :])
    return out.reshape(q.shape), lse.reshape(q.shape[:-1])


def _twin_backward(dout, q, k, v, out, lse, causal: bool, scale: float):
    groups, ct = k.shape[1], compute_dtype(q.dtype)
    q5, dout5, k5, v5 = _grouped(q, groups), _grouped(dout, groups), k.to(ct).unsqueeze(2), v.to(ct).unsqueeze(2)
    lse5 = lse.to(ct).reshape(q5.shape[:-1])
    delta = (dout5 * _grouped(out, groups)).sum(dim=-1)
    dq, dk, dv = torch.zeros_like(q5), torch.zeros_like(k5), torch.zeros_like(v5)
    for rows, keys, offset in query_tiles(q.shape[2], causal, Q_TILE_ROWS):
        p = torch.exp(masked_scores(q5[..., rows, :], k5[..., keys, :], scale, offset) - lse5[..., rows].unsqueeze(-1))
        dv[..., keys, :] += torch.matmul(p.transpose(-1, -2), dout5[..., rows, :]).sum(dim=2, keepdim=True)
        ds = p * (torch.matmul(dout5[..., rows, :], v5[..., keys, :].transpose(-1, -2)) - delta[..., rows].unsqueeze(-1))
        dq[..., rows, :] += torch.matmul(ds, k5[..., keys, :]) * scale
        dk[..., keys, :] += torch.matmul(ds.transpose(-1, -2), q5[..., rows, :]).sum(dim=2, keepdim=True) * scale
    return dq.reshape(q.shape), dk.squeeze(2), dv.squeeze(2)
