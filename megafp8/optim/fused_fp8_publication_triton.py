"""The Triton kernels of megafp8.optim.fused_fp8_publication (beside its twin and launchers there), imported at the
first fused publication rather than at every process's start."""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from megafp8_kernels import fp8_format

# megafp8_kernels' saturating fp32 -> FP8 bits (public: every Triton cast of the project uses it).
from megafp8_kernels.quantize_triton import to_fp8_bits

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
