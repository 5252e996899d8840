"""Torch twin of FP8 flash attention: Q·Kᵀ and P·V and the backward GEMMs with FP8 operands, softmax in fp32.

The math every backend follows (operands ``[b, H, s, d]`` for queries, ``[b, G, s, d]`` for keys and values;
query head i reads K/V head i // (H / G); each FP8 operand comes with its fp32 ``scale_inv``, a 0-d tensor):

  forward   S   = (Q8 · K8ᵀ) · (q_inv · k_inv · softmax_scale)                        fp32
            lse = logsumexp(S) per query row (the causal mask drops keys after the row)   fp32
            P8  = cast_E4M3(exp(S - lse) · P_SCALE)        P lies in [0, 1]: a fixed scale, never saturates
            O   = (P8 · V8) · (v_inv / P_SCALE)                                          fp32
  backward  dV  = (P8ᵀ · dO8) · (do_inv / P_SCALE)
            dP  = (dO8 · V8ᵀ) · (do_inv · v_inv)
            dS  = P ⊙ (dP - delta),   delta = rowsum(dO ⊙ O) (given, from the high-precision dO and O)
            dS8 = cast(dS · scale(amax of its tile)),  one scale per (batch, head, DS_TILE x DS_TILE tile)
            dQ  = (dS8 · K8) · (ds_inv · k_inv · softmax_scale)
            dK  = (dS8ᵀ · Q8) · (ds_inv · q_inv · softmax_scale)

P is normalised with the exact lse before its cast (two passes over the keys in a kernel: one for lse, one for
P·V), so its bytes do not depend on how the keys are tiled. dS has no bound, so it is current-scaled per tile, as a
flash backward kernel can in registers. Dequantize-then-fp32-matmul is what an FP8 tensor-core GEMM with these
scales computes, up to the order of the fp32 sums. Query rows run in tiles of ``Q_TILE_ROWS`` (the ``s x s``
scores are never whole).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from .formats import ElementFormat, element_format
from .quantize_reference import reciprocal, saturating_cast, scale_from_amax

_E4M3 = element_format(torch.float8_e4m3fn)
P_SCALE = _E4M3.max  # 448: P = 1 lands on E4M3's largest value exactly
DS_TILE = 64  # dS scale tile edge (query rows and keys): the Triton kernels' block
Q_TILE_ROWS = 1024  # query rows per step of the twin; a multiple of DS_TILE (tiling must not move a dS tile)


def _grouped(t: torch.Tensor, groups: int, scale_inv: torch.Tensor | None = None) -> torch.Tensor:
    """``[b, H, s, d]`` -> fp32 ``[b, G, H / G, s, d]`` (dequantized when ``scale_inv`` is given)."""
    b, heads, s, d = t.shape
    t = t.float() if scale_inv is None else t.float() * scale_inv
    return t.reshape(b, groups, heads // groups, s, d)


def query_tiles(sq: int, causal: bool, tile_rows: int):
    """(query rows, key rows, causal offset or None) per tile; a causal tile drops the keys after its last row."""
    for start in range(0, sq, tile_rows):
        stop = min(start + tile_rows, sq)
        yield (slice(start, stop), slice(0, stop), start) if causal else (slice(start, stop), slice(None), None)


def masked_scores(q5: torch.Tensor, k5: torch.Tensor, factor, offset: int | None) -> torch.Tensor:
    """``q5 @ k5ᵀ * factor`` with the causal mask of a tile starting at query row ``offset`` (None: no mask)."""
    scores = torch.matmul(q5, k5.transpose(-1, -2)) * factor
    if offset is not None:
        sq, sk = scores.shape[-2:]
        mask = torch.ones(sq, sk, dtype=torch.bool, device=scores.device).triu_(offset + 1)
        scores.masked_fill_(mask, float("-inf"))
    return scores


def _quantized_probabilities(scores: torch.Tensor, lse: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(P fp32, P8 dequantized to fp32 / P_SCALE undone later): the fixed-scale E4M3 cast of the probabilities."""
    p = torch.exp(scores - lse.unsqueeze(-1))
    return p, saturating_cast(p * P_SCALE, _E4M3).float()



def fp8_attention_forward(q8, k8, v8, q_inv, k_inv, v_inv, causal: bool, softmax_scale: float):
    """(out fp32 ``[b, H, sq, d]``, lse fp32 ``[b, H, sq]``) of FP8 queries over FP8 keys/values."""
    groups = k8.shape[1]
    q5, k5, v5 = _grouped(q8, groups), k8.float().unsqueeze(2), v8.float().unsqueeze(2)
    factor = q_inv * k_inv * softmax_scale
    out, lse = torch.empty_like(q5), q5.new_empty(q5.shape[:-1])
    for rows, keys, offset in query_tiles(q8.shape[2], causal, Q_TILE_ROWS):
        scores = masked_scores(q5[..., rows, :], k5[..., keys, :], factor, offset)
        lse[..., rows] = torch.logsumexp(scores, dim=-1)
        _, p8 = _quantized_probabilities(scores, lse[..., rows])
        out[..., rows, :] = torch.matmul(p8, v5[..., keys, :]) * (v_inv / P_SCALE)
    return out.reshape(q8.shape), lse.reshape(q8.shape[:-1])


def _tile_quantize(ds: torch.Tensor, fmt: ElementFormat, power_of_2_scale: bool) -> torch.Tensor:
    """dS ``[..., rows, keys]`` cast to FP8 with one current scale per DS_TILE x DS_TILE tile, returned
    dequantized (fp32)."""
    rows, keys = ds.shape[-2:]
    pad_r, pad_k = -rows % DS_TILE, -keys % DS_TILE
    tiles = F.pad(ds, (0, pad_k, 0, pad_r))
    lead = tiles.shape[:-2]
    tiles = tiles.reshape(*lead, (rows + pad_r) // DS_TILE, DS_TILE, (keys + pad_k) // DS_TILE, DS_TILE)
    amax = tiles.abs().amax(dim=(-3, -1), keepdim=True)
    scale = scale_from_amax(amax, fmt.max, power_of_2_scale)
    deq = saturating_cast(tiles * scale, fmt).float() * reciprocal(scale)
    return deq.reshape(*lead, rows + pad_r, keys + pad_k)[..., :rows, :keys]


def fp8_attention_backward(do8, q8, k8, v8, do_inv, q_inv, k_inv, v_inv, lse, delta, causal: bool,
                           softmax_scale: float, ds_format: ElementFormat, power_of_2_scale: bool = False):
    """(dq ``[b, H, sq, d]``, dk, dv ``[b, G, sk, d]``), all fp32, of this block; ``lse`` and ``delta``
    ``[b, H, sq]`` fp32 are the (merged) forward's."""
    groups = k8.shape[1]
    q5, do5 = _grouped(q8, groups), _grouped(do8, groups)
    k5, v5 = k8.float().unsqueeze(2), v8.float().unsqueeze(2)
    lse5, delta5 = lse.float().reshape(q5.shape[:-1]), delta.float().reshape(q5.shape[:-1])
    factor = q_inv * k_inv * softmax_scale
    dq, dk, dv = torch.zeros_like(q5), torch.zeros_like(k5), torch.zeros_like(v5)
    for rows, keys, offset in query_tiles(q8.shape[2], causal, Q_TILE_ROWS):
        scores = masked_scores(q5[..., rows, :], k5[..., keys, :], factor, offset)
        p, p8 = _quantized_probabilities(scores, lse5[..., rows])
        dv[..., keys, :] += (torch.matmul(p8.transpose(-1, -2), do5[..., rows, :]) * (do_inv / P_SCALE)).sum(
            dim=2, keepdim=True)
        dp = torch.matmul(do5[..., rows, :], v5[..., keys, :].transpose(-1, -2)) * (do_inv * v_inv)
        ds = _tile_quantize(p * (dp - delta5[..., rows].unsqueeze(-1)), ds_format, power_of_2_scale)
        dq[..., rows, :] += torch.matmul(ds, k5[..., keys, :]) * (k_inv * softmax_scale)
        dk[..., keys, :] += (torch.matmul(ds.transpose(-1, -2), q5[..., rows, :]) * (q_inv * softmax_scale)).sum(
            dim=2, keepdim=True)
    return dq.reshape(q8.shape), dk.squeeze(2), dv.squeeze(2)
