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
kept). The bits equal the twin's: tests/test_optim_fused_publication.py.
"""
from __future__ import annotations

import torch

from megafp8.optim.fused_adamw_coded import GPU_ROWS, INTERPRETER_ROWS
from megafp8.optim.state_codec import GROUP
from megafp8.parallel.grad_buffer import BYTE_BITS
from megafp8_kernels import element_format, fp8_format

try:
    import triton
    import triton.language as tl

    # megafp8_kernels' saturating fp32 -> FP8 bits (public: every Triton cast of the project uses it).
    from megafp8_kernels.quantize_triton import to_fp8_bits
except ImportError:  # pragma: no cover - triton is a dependency; the torch twin needs none of it
    triton = None

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


# ---- Triton kernels ------------------------------------------------------------------------------
if triton is not None:
    _E4M3, _E5M2 = fp8_format(torch.float8_e4m3fn), fp8_format(torch.float8_e5m2)
    _E4M3_MAX, _E4M3_MBITS, _E4M3_EMIN = (tl.constexpr(_E4M3.max), tl.constexpr(_E4M3.mantissa_bits),
                                          tl.constexpr(_E4M3.min_normal_exponent))
    _E5M2_MAX, _E5M2_MBITS, _E5M2_EMIN = (tl.constexpr(_E5M2.max), tl.constexpr(_E5M2.mantissa_bits),
                                          tl.constexpr(_E5M2.min_normal_exponent))

    @triton.jit
    def _slots(flat, base, cols, row_div, per_band, col_div, numel, dummy_slot):
        """fp8_param_cast.element_groups plus the weight's slot base; the dummy slot past the weight's end."""
        rows = flat // cols
        col = flat - rows * cols
        slot = base + (rows // row_div) * per_band + col // col_div
        return tl.where(flat < numel, slot, dummy_slot)

    @triton.jit
    def _load_groups(master_ptr, master_scale_ptr, frag_of_group_ptr, index_offset_ptr, groups_ptr, n_groups,
                     frag_table_ptr, dummy_slot, FP16_MASTER: tl.constexpr, ROWS: tl.constexpr,
                     GROUP_SIZE: tl.constexpr, WIDTH: tl.constexpr):
        """This program's rows of ``groups``: (row in range, fragment, master values [ROWS, GROUP] in fp32, flat
        index in the weight and slot [ROWS, GROUP], the fragment's slot constants [ROWS, 1] each)."""
        rows = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)
        row_in = rows < n_groups
        lane = tl.arange(0, GROUP_SIZE)[None, :]
        group = tl.load(groups_ptr + rows, mask=row_in, other=0)
        frag = tl.load(frag_of_group_ptr + group, mask=row_in, other=0)
        value = tl.load(master_ptr + group[:, None] * GROUP_SIZE + lane, mask=row_in[:, None], other=0.0)
        value = value.to(tl.float32)
        if FP16_MASTER:  # the twin's values / master_scale[fragment]
            value = tl.math.div_rn(value, tl.load(master_scale_ptr + frag, mask=row_in, other=1.0)[:, None])
        flat = (group * GROUP_SIZE + tl.load(index_offset_ptr + group, mask=row_in, other=0))[:, None] + lane
        row = frag_table_ptr + frag * WIDTH
        base = tl.load(row, mask=row_in, other=0)[:, None]
        cols = tl.load(row + 1, mask=row_in, other=1)[:, None]
        row_div = tl.load(row + 2, mask=row_in, other=1)[:, None]
        per_band = tl.load(row + 3, mask=row_in, other=1)[:, None]
        col_div = tl.load(row + 4, mask=row_in, other=1)[:, None]
        numel = tl.load(row + 5, mask=row_in, other=0)[:, None]
        slot = _slots(flat, base, cols, row_div, per_band, col_div, numel, dummy_slot)
        return row_in, frag, value, flat, slot, base, cols, row_div, per_band, col_div, numel

    @triton.jit
    def _group_amax_kernel(master_ptr, master_scale_ptr, frag_of_group_ptr, index_offset_ptr, groups_ptr, n_groups,
                           frag_table_ptr, amax_bits_ptr, sources_ptr, dummy_slot, FP16_MASTER: tl.constexpr,
                           COUNT_SOURCES: tl.constexpr, ROWS: tl.constexpr, GROUP_SIZE: tl.constexpr,
                           WIDTH: tl.constexpr):
        row_in, _frag, value, flat, slot, base, cols, row_div, per_band, col_div, numel = _load_groups(
            master_ptr, master_scale_ptr, frag_of_group_ptr, index_offset_ptr, groups_ptr, n_groups, frag_table_ptr,
            dummy_slot, FP16_MASTER, ROWS, GROUP_SIZE, WIDTH)
        magnitude = tl.abs(value).to(tl.int32, bitcast=True)
        first, last = tl.min(slot, axis=1), tl.max(slot, axis=1)
        uniform = row_in & (first == last)
        tl.atomic_max(amax_bits_ptr + first, tl.max(magnitude, axis=1), mask=uniform)
        if COUNT_SOURCES:
            tl.atomic_add(sources_ptr + first, 1, mask=uniform)
        mixed = row_in & (first != last)
        if tl.max(mixed.to(tl.int32), axis=0) > 0:  # groups spanning slots: one source per run of equal slots
            lane = tl.arange(0, GROUP_SIZE)[None, :]
            before = _slots(flat - 1, base, cols, row_div, per_band, col_div, numel, dummy_slot)
            run = tl.cumsum(((lane == 0) | (slot != before)).to(tl.int32), axis=1)  # 1, 2, ... along the group
            runs = tl.max(run, axis=1)
            for r in range(1, tl.max(tl.where(mixed, runs, 0), axis=0) + 1):  # a few per group
                in_run = run == r
                send = mixed & (runs >= r)
                run_slot = tl.max(tl.where(in_run, slot, 0), axis=1)
                tl.atomic_max(amax_bits_ptr + run_slot, tl.max(tl.where(in_run, magnitude, 0), axis=1), mask=send)
                if COUNT_SOURCES:
                    tl.atomic_add(sources_ptr + run_slot, 1, mask=send)

    @triton.jit
    def _cast_kernel(master_ptr, master_scale_ptr, frag_of_group_ptr, index_offset_ptr, groups_ptr, n_groups,
                     frag_table_ptr, scale_ptr, dest_buffer_ptr, dest_offset_ptr, buffer_address_ptr, dummy_slot,
                     FP16_MASTER: tl.constexpr, E4M3_ID: tl.constexpr, E5M2_ID: tl.constexpr,
                     SOFTWARE_ROUNDING: tl.constexpr, ROWS: tl.constexpr, GROUP_SIZE: tl.constexpr,
                     WIDTH: tl.constexpr):
        row_in, frag, value, flat, slot, base, cols, row_div, per_band, col_div, numel = _load_groups(
            master_ptr, master_scale_ptr, frag_of_group_ptr, index_offset_ptr, groups_ptr, n_groups, frag_table_ptr,
            dummy_slot, FP16_MASTER, ROWS, GROUP_SIZE, WIDTH)
        y = value * tl.load(scale_ptr + slot, mask=row_in[:, None], other=1.0)
        if E5M2_ID < 0:
            fp8 = to_fp8_bits(y, tl.float8e4nv, _E4M3_MAX, _E4M3_MBITS, _E4M3_EMIN, SOFTWARE_ROUNDING)
        elif E4M3_ID < 0:
            fp8 = to_fp8_bits(y, tl.float8e5, _E5M2_MAX, _E5M2_MBITS, _E5M2_EMIN, SOFTWARE_ROUNDING)
        else:  # weights in both formats: each element cast in its weight's
            format_id = tl.load(frag_table_ptr + frag * WIDTH + 6, mask=row_in, other=0)[:, None]
            fp8 = tl.where(format_id == E5M2_ID,
                           to_fp8_bits(y, tl.float8e5, _E5M2_MAX, _E5M2_MBITS, _E5M2_EMIN, SOFTWARE_ROUNDING),
                           to_fp8_bits(y, tl.float8e4nv, _E4M3_MAX, _E4M3_MBITS, _E4M3_EMIN, SOFTWARE_ROUNDING))
        rows = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)
        buffer = tl.load(dest_buffer_ptr + rows, mask=row_in, other=0)
        address = tl.load(buffer_address_ptr + buffer, mask=row_in, other=0).to(tl.pointer_type(tl.uint8))
        offset = tl.load(dest_offset_ptr + rows, mask=row_in, other=0)
        tl.store(address[:, None] + offset[:, None] + tl.arange(0, GROUP_SIZE)[None, :], fp8, mask=row_in[:, None])


# ---- launchers -----------------------------------------------------------------------------------
def group_amax_triton(master: torch.Tensor, master_scale: torch.Tensor, frag_of_group: torch.Tensor,
                      index_offset: torch.Tensor, groups: torch.Tensor, frag_table: torch.Tensor, dummy_slot: int,
                      amax: torch.Tensor, sources: torch.Tensor | None = None) -> None:
    """``amax[slot] = MAX(amax[slot], |value|)`` over the elements of storage ``groups`` (fp32 ``amax``, >= 0, its
    last entry the dummy slot), in one launch; ``master_scale`` per fragment is read for fp16 codes only.
    ``sources`` (int32 per slot), when given, counts each slot's atomic sources."""
    rows = _rows(master.device)
    n = groups.numel()
    _group_amax_kernel[(triton.cdiv(n, rows),)](
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
    _cast_kernel[(triton.cdiv(n, rows),)](
        master, master_scale, frag_of_group, index_offset, groups, n, frag_table, scale, dest_buffer, dest_offset,
        buffer_address, dummy_slot, FP16_MASTER=master.dtype == torch.float16, E4M3_ID=formats[0],
        E5M2_ID=formats[1], SOFTWARE_ROUNDING=_software_rounding(master.device), ROWS=rows, GROUP_SIZE=GROUP,
        WIDTH=TABLE_WIDTH, num_warps=4, enable_fp_fusion=False)
