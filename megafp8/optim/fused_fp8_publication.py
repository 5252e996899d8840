"""--fp8-param-gather's publication as two Triton launches whatever the parameter count (group amaxes, then the cast
straight into the buckets' fp8_data), beside its torch twin: megafp8.optim.fp8_publication's slab path.

Both kernels take every FP8 fragment's storage 128-groups in one launch (``groups``: storage group per row) and
compute each element's master value and scaling group ("slot") as the twin's ``_decode`` does: fp32 master values,
or fp16 codes divided (IEEE) by their tensor's scale; the slot from the element's flat index in its weight with the
per-fragment constants of the publication's ``frag_table`` (megafp8.optim.fp8_param_cast.element_groups), padding
lanes (past the weight's end) in the dummy slot.

``group_amax``  MAX of |value| per slot, by atomic MAX on the fp32 bits as int32 (non-negative floats order like
                their bits; a NaN, 0x7FC00000 with the sign cleared, orders above inf, so it wins as in torch's
                amax). A 128-group whose elements share one slot (every group of a tensorwise weight, and of a
                rowwise or blockwise one whose rows are multiples of 128: every weight of a real model) sends one
                source, its MAX (exactly one per 128 elements); a group spanning slots sends one per run of
                equal slots (the runs numbered by a cumulative sum of their heads, then one masked MAX per run: a few
                runs per group for rows off the 128 grid). Per-element atomics were ~1e9 contended updates per step for a
                tensorwise weight at 1B parameters.
``cast``        ``saturating_cast(value * scale[slot])`` (megafp8_kernels' Triton rounding: round to nearest even,
                finite values past the range saturate, inf -> NaN; in integer steps under the interpreter, whose own
                float8 cast drops the carry into the exponent), each weight in its own FP8 format, written at the
                group's byte offset in its bucket's fp8_data: the buckets' buffers are separate tensors, so the
                kernel reads each group's buffer address from a table of their ``data_ptr()`` (as Triton's grouped
                GEMM does) and one launch serves every bucket.

Launched with ``enable_fp_fusion=False`` like every optimizer kernel (no product here feeds a sum, but the rule is
kept). The bits equal the twin's: tests/test_optim_fused_publication.py. The kernels are in
fused_fp8_publication_triton.py, imported at the first launch.
"""
from __future__ import annotations

import torch

from megafp8.optim.fused_adamw import cdiv
from megafp8.optim.fused_adamw_coded import GPU_ROWS, INTERPRETER_ROWS
from megafp8.optim.state_codec import GROUP
from megafp8.parallel.grad_buffer import BYTE_BITS
from megafp8_kernels import element_format


LAUNCHES_PER_PUBLISH = 2
TABLE_WIDTH = 7  # Fp8Publication.frag_table's columns: slot base, cols, row divisor, groups per band, col divisor,
#                  numel, FP8 format id (the position of the weight's dtype in the publication's sorted ``dtypes``)


def format_ids(dtypes: list[torch.dtype]) -> tuple[int, int]:
    """(E4M3's id, E5M2's id) in the publication's ``dtypes`` list, -1 for a format no weight uses."""
    ids = {dtype: k for k, dtype in enumerate(dtypes)}
    unknown = set(ids) - {torch.float8_e4m3fn, torch.float8_e5m2}
    if unknown:
        raise ValueError(f"the fused FP8 publication casts to E4M3 and E5M2 only, not {sorted(map(str, unknown))}")
    packed = sorted(str(dtype) for dtype in ids if element_format(dtype).bits != BYTE_BITS)
    if packed:  # the cast stores one byte per lane at byte offsets: a packed format needs its own store
        raise ValueError(f"the fused FP8 publication writes one byte per element, not the packed {packed}")
    return ids.get(torch.float8_e4m3fn, -1), ids.get(torch.float8_e5m2, -1)


def _rows(device: torch.device) -> int:
    return GPU_ROWS if device.type == "cuda" else INTERPRETER_ROWS


def _software_rounding(device: torch.device) -> bool:
    # The interpreter's fp32 -> fp8 conversion drops the carry into the exponent (to_fp8_bits rounds in software there;
    # a GPU's cvt.rn rounds right). The offline kernel audit patches this to False to compile the variant a GPU runs.
    return device.type != "cuda"


# ---- launchers -----------------------------------------------------------------------------------
def group_amax_triton(master: torch.Tensor, master_scale: torch.Tensor, frag_of_group: torch.Tensor,
                      index_offset: torch.Tensor, groups: torch.Tensor, frag_table: torch.Tensor, dummy_slot: int,
                      amax: torch.Tensor, sources: torch.Tensor | None = None) -> None:
    """``amax[slot] = MAX(amax[slot], |value|)`` over the elements of storage ``groups`` (fp32 ``amax``, >= 0, its
    last entry the dummy slot), in one launch; ``master_scale`` per fragment is read for fp16 codes only.
    ``sources`` (int32 per slot), when given, counts each slot's atomic sources."""
    rows = _rows(master.device)
    n = groups.numel()
    from megafp8.optim import fused_fp8_publication_triton  # Triton is imported only where it is used

    fused_fp8_publication_triton._group_amax_kernel[(cdiv(n, rows),)](
        master, master_scale, frag_of_group, index_offset, groups, n, frag_table, amax.view(torch.int32),
        amax if sources is None else sources, dummy_slot, FP16_MASTER=master.dtype == torch.float16,
        COUNT_SOURCES=sources is not None, ROWS=rows, GROUP_SIZE=GROUP, WIDTH=TABLE_WIDTH, num_warps=4,
        enable_fp_fusion=False)


def cast_triton(master: torch.Tensor, master_scale: torch.Tensor, frag_of_group: torch.Tensor,
                index_offset: torch.Tensor, groups: torch.Tensor, frag_table: torch.Tensor, dummy_slot: int,
                scale: torch.Tensor, dest_buffer: torch.Tensor, dest_offset: torch.Tensor,
                buffer_address: torch.Tensor, formats: tuple[int, int]) -> None:
    """The FP8 bytes of storage ``groups`` (128 per group, padding lanes included, as the twin writes them) at byte
    ``dest_offset[k]`` (bytes, as Bucket.fp8_bytes counts them) of buffer ``dest_buffer[k]``, whose address is
    ``buffer_address[dest_buffer[k]]`` (int64 ``data_ptr()`` of uint8 tensors on this device, kept alive by their
    owner), in one launch; ``formats``: the ``format_ids`` of ``frag_table``'s last column."""
    rows = _rows(master.device)
    n = groups.numel()
    from megafp8.optim import fused_fp8_publication_triton

    fused_fp8_publication_triton._cast_kernel[(cdiv(n, rows),)](
        master, master_scale, frag_of_group, index_offset, groups, n, frag_table, scale, dest_buffer, dest_offset,
        buffer_address, dummy_slot, FP16_MASTER=master.dtype == torch.float16, E4M3_ID=formats[0],
        E5M2_ID=formats[1], SOFTWARE_ROUNDING=_software_rounding(master.device), ROWS=rows, GROUP_SIZE=GROUP,
        WIDTH=TABLE_WIDTH, num_warps=4, enable_fp_fusion=False)
