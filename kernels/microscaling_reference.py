"""Torch reference twin of the microscaling quantizers: MXFP8 / MXFP4 (one E8M0 scale per 1x32) and NVFP4 (E2M1
codes, one E4M3 scale per 1x16 or 16x16 under one fp32 scale per tensor), with stochastic rounding from the counter
hash and the 16-point random Hadamard transform. The oracle in tests and the execution path on CPU.

The rules, exact (the anchors they follow, and where they deviate, in docs/kernels.md "Microscaling"):
  MX scale      E8M0 exponent e = ceil(log2(amax / ELEM_MAX)) (RCEIL: the block maximum never saturates; "floor"
                = floor(log2(amax)) - emax_elem, OCP's rule, kept for comparison), clamped to [-127, 127]; the
                values are x * 2^-e, except e = -127 (amax <= ELEM_MAX * 2^-127, zero blocks) which scales by 1.
  NVFP4 scales  S_enc = 448 * 6 / amax_tensor (1 if amax is 0; FLOAT32_MAX caps it), the block's decode scale
                e4m3(min(blk_amax * (S_enc * (1/6)), 448)) rounded once, no lower clamp, and the values
                x * min(1 / (s_block * (1 / S_enc)), FLOAT32_MAX): TransformerEngine's chain.
  codes         round to nearest even (E2M1: the grid 0, .5, 1, 1.5, 2, 3, 4, 6) after clamping to +-ELEM_MAX, or
                stochastically to one of the two neighbours, up with probability (x - lo) / (hi - lo), the uniform
                a pure function of (key, flat index) (counter_hash).
  non-finite    a NaN or inf in a block gives that block a NaN scale (E8M0 0xFF, E4M3 NaN; NVFP4: an inf or NaN
                tensor amax makes every scale NaN): it dequantizes to NaN, loudly, as the FP8 recipes do (the
                anchors map an inf amax to a finite scale, which hides the overflow).
  RHT           the transposed copy's rows, in blocks of 16 along K, times (D H16) / 4 (H16 Sylvester's Hadamard
                matrix, D one fixed diagonal of signs): orthogonal, so (A M)(B M)^T = A B^T; summed in fp64.
  tiny blocks   an MX block whose amax / ELEM_MAX underflows to 0 gets the smallest scale (byte 0), as any block
                below 2^-127 ELEM_MAX does.
"""
from __future__ import annotations

import torch

from .counter_hash import counter_uniform_at, mix32_int
from .formats import E2M1, MX_1X32, NVFP4_1X16, NVFP4_16X16, ElementFormat, ScaleLayout, WHOLE
from .scaling import FLOAT32_MAX

E8M0_BIAS = 127
E8M0_NAN = 255
NVFP4_SCALE_MAX = 448.0  # E4M3's largest finite value: the block scales' range
HADAMARD_SIZE = 16
_SIGN_KEY = 0x5EED16  # the one fixed sign vector of the Hadamard transform (a pure function of this key)
_TRANSPOSED_KEY_SALT = 0x7A5F0000  # the transposed copy draws its own uniforms

# E2M1 magnitudes by code (bit 3 is the sign).
_E2M1_VALUES = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])


# ---- E2M1 codes -------------------------------------------------------------------------------------------------

def _e2m1_quantum(magnitude: torch.Tensor) -> torch.Tensor:
    """The E2M1 grid step at |x|: 0.5 below 2, 1 in [2, 4), 2 from 4."""
    return torch.where(magnitude < 2, 0.5, torch.where(magnitude < 4, 1.0, 2.0))


def _e2m1_code_of_magnitude(rounded: torch.Tensor) -> torch.Tensor:
    """The 3-bit magnitude code of a value already on the E2M1 grid."""
    code = torch.where(rounded < 2, rounded * 2, torch.where(rounded < 4, rounded + 2, rounded / 2 + 4))
    return code.to(torch.uint8)


def e2m1_codes(scaled: torch.Tensor, uniform: torch.Tensor | None = None) -> torch.Tensor:
    """fp32 values (already scaled) -> 4-bit E2M1 codes (uint8, one per element): clamped to +-6, rounded to the
    nearest even neighbour, or stochastically with `uniform` (one in [0, 1) per element). A NaN becomes +0 (its
    block's scale carries the NaN). The sign bit follows x < 0, so a small negative that rounds to 0 is -0."""
    x = torch.nan_to_num(scaled.float(), nan=0.0)
    magnitude = x.abs().clamp(max=E2M1.max)
    quantum = _e2m1_quantum(magnitude)
    if uniform is None:
        rounded = torch.round(magnitude / quantum) * quantum  # torch.round is half-to-even: 0.25 -> 0, 0.75 -> 1
    else:
        lo = torch.floor(magnitude / quantum) * quantum
        rounded = torch.where(uniform < (magnitude - lo) / quantum, lo + quantum, lo)  # p(up) = 0 when exact
    return _e2m1_code_of_magnitude(rounded) | torch.where(x < 0, 8, 0).to(torch.uint8)


def e2m1_values(codes: torch.Tensor) -> torch.Tensor:
    """4-bit codes (uint8, one per element) -> fp32 values."""
    magnitude = _E2M1_VALUES.to(codes.device)[(codes & 7).long()]
    return torch.where((codes & 8) != 0, -magnitude, magnitude)


def pack_e2m1(codes: torch.Tensor) -> torch.Tensor:
    """(rows, cols) codes -> (rows, cols / 2) bytes, element 2j in the low nibble (OCP, TE, torchao)."""
    if codes.shape[-1] % 2:
        raise ValueError(f"packed E2M1 needs an even number of columns, got {codes.shape[-1]}")
    return codes[..., 0::2] | (codes[..., 1::2] << 4)


def unpack_e2m1(packed: torch.Tensor) -> torch.Tensor:
    """(rows, cols / 2) bytes -> (rows, cols) codes."""
    return torch.stack([packed & 0xF, packed >> 4], dim=-1).flatten(-2)


# ---- scales -----------------------------------------------------------------------------------------------------

def _ceil_log2(x: torch.Tensor) -> torch.Tensor:
    """ceil(log2(x)) exactly for positive finite fp32 x (torch.log2 rounds: 2^k (1 + 2^-23) gives k for large k)."""
    mantissa, exponent = torch.frexp(x)  # x = m 2^e, m in [0.5, 1)
    return torch.where(mantissa == 0.5, exponent - 1, exponent)


def e8m0_exponents(amax: torch.Tensor, fmt: ElementFormat, scale_rounding: str = "ceil") -> torch.Tensor:
    """Block amaxes (fp32) -> biased E8M0 scale bytes (uint8); 0xFF (NaN) for a non-finite amax."""
    amax = amax.float()
    positive = amax > 0
    safe = torch.where(positive & torch.isfinite(amax), amax, torch.ones_like(amax))
    if scale_rounding == "ceil":
        q = safe / fmt.max  # underflows to 0 for amax below ~2^-141 (E4M3): the smallest scale, as a tiny amax gets
        unbiased = torch.where(q == 0, torch.full_like(q, -E8M0_BIAS, dtype=torch.int32), _ceil_log2(q))
    elif scale_rounding == "floor":  # OCP: floor(log2(amax)) - the element's largest exponent
        unbiased = torch.frexp(safe)[1] - 1 - (torch.frexp(torch.tensor(fmt.max))[1] - 1)
    else:
        raise ValueError(f"MX scale rounding {scale_rounding!r} is not 'ceil' or 'floor'")
    unbiased = torch.where(positive, unbiased, torch.full_like(unbiased, -E8M0_BIAS)).clamp(-E8M0_BIAS, E8M0_BIAS)
    biased = (unbiased + E8M0_BIAS).to(torch.uint8)
    return torch.where(torch.isfinite(amax), biased, torch.full_like(biased, E8M0_NAN))


def e8m0_values(biased: torch.Tensor) -> torch.Tensor:
    """Biased E8M0 bytes -> fp32 scales 2^(e - 127); 0xFF -> NaN."""
    value = torch.ldexp(torch.ones(biased.shape, device=biased.device), biased.int() - E8M0_BIAS)
    return torch.where(biased == E8M0_NAN, float("nan"), value)


def block_scale_values(scale: torch.Tensor) -> torch.Tensor:
    """Stored block scales -> fp32: E8M0 bytes (uint8) decoded, E4M3 scales widened (before any per-tensor scale)."""
    return e8m0_values(scale) if scale.dtype == torch.uint8 else scale.float()


def _mx_encode_factor(biased: torch.Tensor) -> torch.Tensor:
    """What x is multiplied by before the cast: 2^(127 - e), or 1 for e = 0 (TE's and torchao's rule); NaN for 0xFF."""
    factor = torch.ldexp(torch.ones(biased.shape, device=biased.device), E8M0_BIAS - biased.int())
    factor = torch.where(biased == 0, 1.0, factor)
    return torch.where(biased == E8M0_NAN, float("nan"), factor)


def nvfp4_encode_scale(amax: torch.Tensor) -> torch.Tensor:
    """S_enc = 448 * 6 / amax of the whole tensor (fp32 scalar): 1 if amax is 0, NaN if amax is not finite."""
    return nvfp4_encode_scales(amax.reshape(()))


def nvfp4_encode_scales(amax: torch.Tensor) -> torch.Tensor:
    """nvfp4_encode_scale of each element of `amax` (the tensor amaxes of several weights, same bits)."""
    amax = amax.float()
    s_enc = torch.clamp(torch.full_like(amax, NVFP4_SCALE_MAX * E2M1.max) / amax, max=FLOAT32_MAX)
    s_enc = torch.where(amax == 0, torch.ones_like(s_enc), s_enc)
    return torch.where(torch.isfinite(amax), s_enc, torch.full_like(s_enc, float("nan")))


# ---- the random Hadamard transform ------------------------------------------------------------------------------

def hadamard_signs() -> torch.Tensor:
    """The transform's fixed diagonal of +-1 (16 values drawn once from the counter hash; every rank, every run)."""
    u = counter_uniform_at(torch.tensor(_SIGN_KEY), torch.arange(HADAMARD_SIZE))
    return torch.where(u < 0.5, -1.0, 1.0)


def hadamard_matrix(dtype: torch.dtype = torch.float64) -> torch.Tensor:
    """M = D H16 / 4 (16 x 16, orthogonal): Sylvester's Hadamard matrix with its rows signed by hadamard_signs()."""
    h = torch.ones(1, 1, dtype=torch.float64)
    while h.shape[0] < HADAMARD_SIZE:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    return (hadamard_signs().double()[:, None] * h / 4).to(dtype)


def random_hadamard_transform(x: torch.Tensor) -> torch.Tensor:
    """x (rows, K) with every 16 consecutive elements of a row times M (K a multiple of 16), summed in fp64 and
    rounded once to fp32: the 16 products are exact in fp64, and so is their sum (in any order) when the block's
    values lie within about 2^25 of each other; the Triton kernel sums the same way."""
    rows, cols = x.shape
    if cols % HADAMARD_SIZE:
        raise ValueError(f"the Hadamard transform runs in blocks of {HADAMARD_SIZE} along K, got K = {cols}")
    blocks = x.double().reshape(rows, cols // HADAMARD_SIZE, HADAMARD_SIZE)
    return (blocks @ hadamard_matrix()).reshape(rows, cols).float()


# ---- block amax -------------------------------------------------------------------------------------------------

def block_amax(x32: torch.Tensor, block: tuple[int, int]) -> torch.Tensor:
    """max |x| per (block rows x block cols) tile, in the scale shape; NaN propagates; ragged edges padded with 0."""
    rows, cols = x32.shape
    edge_rows = rows if block[0] == WHOLE else block[0]
    edge_cols = cols if block[1] == WHOLE else block[1]
    padded = torch.nn.functional.pad(x32.abs(), (0, -cols % edge_cols, 0, -rows % edge_rows))
    return padded.view(padded.shape[0] // edge_rows, edge_rows, -1, edge_cols).amax(dim=(1, 3))


def _expand(scale: torch.Tensor, rows: int, cols: int, block: tuple[int, int]) -> torch.Tensor:
    return scale.repeat_interleave(block[0], 0)[:rows].repeat_interleave(block[1], 1)[:, :cols]


def _uniforms(key: int | None, rows: int, cols: int, device) -> torch.Tensor | None:
    if key is None:
        return None
    index = torch.arange(rows * cols, dtype=torch.int64, device=device).view(rows, cols)
    return counter_uniform_at(torch.tensor(key, dtype=torch.int64, device=device), index)


def transposed_key(key: int | None) -> int | None:
    """The stochastic-rounding key of a tensor's transposed copy (its own draws)."""
    return None if key is None else mix32_int(key ^ _TRANSPOSED_KEY_SALT)


# ---- one copy ---------------------------------------------------------------------------------------------------

def _cast_counts(x32: torch.Tensor, scaled: torch.Tensor, fmt: ElementFormat,
                 dead_block: torch.Tensor | None = None) -> torch.Tensor:
    """int64 [saturated, flushed]: |scaled| past the format's saturation threshold; nonzero inputs that round to 0.
    `dead_block` marks elements whose block scale itself rounded to 0 (an NVFP4 block far below the tensor's amax):
    they dequantize to 0, so they count as flushed, not as saturated (their scaled values are huge)."""
    magnitude = scaled.abs()
    saturated = magnitude > fmt.saturation_threshold
    flushed = (magnitude <= fmt.flush_threshold) & (x32 != 0)
    if dead_block is not None:
        saturated, flushed = saturated & ~dead_block, flushed | (dead_block & (x32 != 0))
    return torch.stack([saturated.sum(), flushed.sum()])


def mx_quantize_copy(x32: torch.Tensor, fmt: ElementFormat, *, scale_rounding: str = "ceil", key: int | None = None,
                     stats: bool = False):
    """One MX copy of x32 (rows, K): (payload, E8M0 scale bytes (rows, K/32), block amax, counts or None).
    Payload: float8 for E4M3/E5M2, packed E2M1 bytes for FP4."""
    rows, cols = x32.shape
    amax = block_amax(x32, MX_1X32.block)
    scale_bytes = e8m0_exponents(amax, fmt, scale_rounding)
    factor = _expand(_mx_encode_factor(scale_bytes), rows, cols, MX_1X32.block)
    # A NaN block writes the factor's (positive) NaN: x * NaN's sign would depend on the platform's operand order.
    scaled = torch.where(factor.isnan(), factor, x32 * factor)
    counts = _cast_counts(x32, scaled, fmt) if stats else None
    if fmt is E2M1:
        payload = pack_e2m1(e2m1_codes(scaled, _uniforms(key, rows, cols, x32.device)))
    else:
        if key is not None:
            raise NotImplementedError("stochastic rounding is offered for E2M1 elements only")
        payload = scaled.clamp(-fmt.max, fmt.max).to(fmt.dtype)  # finite here, or NaN with the block's NaN scale
    return payload, scale_bytes, amax, counts


def nvfp4_quantize_copy(x32: torch.Tensor, layout: ScaleLayout, *, encode_scale: torch.Tensor | None = None,
                        key: int | None = None, stats: bool = False):
    """One NVFP4 copy of x32 (rows, K): (packed E2M1 bytes, E4M3 block scales, fp32 global decode scale 1/S_enc, block
    amax, counts or None). `encode_scale` is S_enc agreed over the ranks holding the tensor (TE: the amax is
    all-reduced with MAX before the cast); default: this tensor's own."""
    rows, cols = x32.shape
    amax = block_amax(x32, layout.block)
    s_enc = nvfp4_encode_scale(x32.abs().amax()) if encode_scale is None else encode_scale.float().reshape(())
    s_dec_global = torch.ones_like(s_enc) / s_enc
    multiplier = s_enc * (torch.ones_like(s_enc) / E2M1.max)
    s_block = torch.clamp(amax * multiplier, max=NVFP4_SCALE_MAX).to(torch.float8_e4m3fn)  # NaN stays NaN
    encode = torch.clamp(torch.ones_like(amax) / (s_block.float() * s_dec_global), max=FLOAT32_MAX)
    scaled = x32 * _expand(encode, rows, cols, layout.block)
    dead = _expand(s_block.float() == 0, rows, cols, layout.block) if stats else None
    counts = _cast_counts(x32, scaled, E2M1, dead) if stats else None
    payload = pack_e2m1(e2m1_codes(scaled, _uniforms(key, rows, cols, x32.device)))
    return payload, s_block, s_dec_global, amax, counts


# ---- dequantize -------------------------------------------------------------------------------------------------

def dequantize_microscaled(data: torch.Tensor, scale: torch.Tensor, fmt: ElementFormat, layout: ScaleLayout,
                           global_scale_inv: torch.Tensor | None = None) -> torch.Tensor:
    """A microscaled copy -> fp32: element value x block scale (x the per-tensor decode scale, NVFP4)."""
    values = e2m1_values(unpack_e2m1(data)) if fmt is E2M1 else data.float()
    rows, cols = values.shape
    out = values * _expand(block_scale_values(scale), rows, cols, layout.block)
    return out * global_scale_inv.float() if global_scale_inv is not None else out


__all__ = [
    "E8M0_BIAS", "HADAMARD_SIZE", "NVFP4_16X16", "NVFP4_1X16", "block_amax", "block_scale_values", "dequantize_microscaled", "e2m1_codes",
    "e2m1_values", "e8m0_exponents", "e8m0_values", "hadamard_matrix", "hadamard_signs", "mx_quantize_copy",
    "nvfp4_encode_scale", "nvfp4_encode_scales", "nvfp4_quantize_copy", "pack_e2m1", "random_hadamard_transform",
    "transposed_key", "unpack_e2m1",
]
