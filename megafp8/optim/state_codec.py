"""Storage formats ("codecs") for the optimizer's per-element state: fp32, bf16, and FP8 E4M3 with
COAT-style dynamic range expansion in 128-element groups. A codec stores a flat shard and decodes /
encodes any 128-aligned range (the optimizer's step takes the whole shard at once: a fixed number of ops).

FP8 codec (COAT, Xi et al. 2024, "dynamic range expansion"): Adam's moments span far more binades
inside a group than E4M3 can hold with one scale (448 / 2^-6 = 2^14.8 between the largest value and
the smallest normal), and the second moment is the worst. Per 128-element group we store the group's
max |x| (``amax``) and an exponent ``k`` chosen so that the group's range ``amax / amin`` (``amin`` =
smallest nonzero |x|) maps exactly onto E4M3's normal range::

    k      = min(log(448 / 2^-6) / log(amax / amin), K_MAX)      (K_MAX when all nonzero |x| are equal)
    code   = e4m3( sign(x) * (|x| / amax)^k * 448 )               every nonzero |x| lands in [2^-6, 448]
    decode = sign(code) * amax * (|code| / 448)^(1 / k)

E4M3 round-to-nearest has relative error at most 2^-4 on that range, so the round trip's relative
error per nonzero element is at most ``max((17/16)^(1/k) - 1, 1 - (15/16)^(1/k))`` (k > 1 shrinks
it, a group spanning more than 2^14.8 pays for its range with k < 1); zeros stay exactly zero.
amax and k are stored as bf16: amax rounded up (so |x| / amax <= 1), k computed from that amax and
rounded down (so amin still lands on or above 2^-6), and encode uses the stored values, so the bound
holds with the stored k. Overhead: 4 bytes per 128 elements, 1.03125 bytes per element in all.

The powers are taken as ``exp2(k (log2 |x| - log2 amax))`` and ``exp2(log2(|code| / 448) / k)`` in fp64 with
megafp8.optim.reproducible_math, not with torch's ``log``/``pow``: those differ in the last bit between devices and
libraries, and the fused optimizer step (megafp8.optim.fused_adamw_coded) must store exactly the bits this codec
stores. ``log2(|code| / 448)`` takes one of 128 values: a table (``fp8_code_table``), as in the kernel.
"""
from __future__ import annotations

import math

import torch

from megafp8.optim import reproducible_math

GROUP = 128
E4M3_MAX = 448.0
E4M3_MIN_NORMAL = 2.0 ** -6
K_MAX = 16.0

STATE_DTYPES = ("fp32", "bf16", "fp8")


class StateCodec:
    """A flat fp32-valued shard of ``numel`` elements (a multiple of GROUP) in some storage format."""

    name = ""

    def __init__(self, numel: int, device: torch.device | str | None = None) -> None:
        if numel % GROUP:
            raise ValueError(f"codec shards hold whole {GROUP}-element groups, got {numel} elements")
        self.numel = numel

    def decode(self, start: int, end: int) -> torch.Tensor:
        raise NotImplementedError

    def encode(self, start: int, end: int, values: torch.Tensor, keep: torch.Tensor | None = None) -> None:
        """Store ``values`` in ``[start, end)``; where ``keep`` (a bool tensor, on the device) is False the
        stored state stays as it was: the optimizer skips a non-finite step without asking the host."""
        raise NotImplementedError

    def tensors(self) -> dict[str, torch.Tensor]:
        """Storage by name: per-element tensors have ``numel`` entries, per-group ones ``numel / GROUP``."""
        raise NotImplementedError


class PlainCodec(StateCodec):
    """fp32 (exact) or bf16 (round to nearest) storage."""

    def __init__(self, numel: int, device=None, dtype: torch.dtype = torch.float32) -> None:
        super().__init__(numel, device)
        self.name = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}[dtype]
        self.values = torch.zeros(numel, dtype=dtype, device=device)

    def decode(self, start: int, end: int) -> torch.Tensor:
        return self.values[start:end].float()

    def encode(self, start: int, end: int, values: torch.Tensor, keep: torch.Tensor | None = None) -> None:
        stored = self.values[start:end]
        stored.copy_(values if keep is None else torch.where(keep, values.to(stored.dtype), stored))

    def tensors(self) -> dict[str, torch.Tensor]:
        return {"values": self.values}


class Fp8ExpandCodec(StateCodec):
    """E4M3 codes with per-group amax and expansion exponent k (see the module docstring)."""

    name = "fp8"

    def __init__(self, numel: int, device=None) -> None:
        super().__init__(numel, device)
        self.codes = torch.zeros(numel, dtype=torch.float8_e4m3fn, device=device)
        self.amax = torch.zeros(numel // GROUP, dtype=torch.bfloat16, device=device)
        self.k = torch.ones(numel // GROUP, dtype=torch.bfloat16, device=device)

    def decode(self, start: int, end: int) -> torch.Tensor:
        groups, n = _grouped(start, end)
        codes = _padded(self.codes[start:end].view(torch.uint8), n).view(-1, GROUP)
        return fp8_decode_groups(codes, self.amax[groups], self.k[groups]).reshape(-1)[: end - start]

    def encode(self, start: int, end: int, values: torch.Tensor, keep: torch.Tensor | None = None) -> None:
        groups, n = _grouped(start, end)
        codes, amax, k = fp8_encode_groups(_padded(values.float(), n).view(-1, GROUP))
        codes = codes.reshape(-1)[: end - start]
        # float8 has no torch.where: keep or replace the codes as bytes (amax and k are bf16-exact already).
        for stored, new in ((self.codes[start:end].view(torch.uint8), codes.view(torch.uint8)),
                            (self.amax[groups], amax.to(torch.bfloat16)), (self.k[groups], k.to(torch.bfloat16))):
            stored.copy_(new if keep is None else torch.where(keep, new, stored))

    def tensors(self) -> dict[str, torch.Tensor]:
        return {"codes": self.codes, "amax": self.amax, "k": self.k}


# ---- the FP8 codec's math on [groups, GROUP] tiles (what megafp8.optim.fused_adamw_coded computes per group) ----
_code_tables: dict[torch.device, torch.Tensor] = {}


def fp8_code_table(device: torch.device | str) -> torch.Tensor:
    """fp64 ``[log2(|code| / 448) for the 128 E4M3 magnitudes] + [log2(448 / 2^-6)]`` on ``device``: code 0 is
    -inf (decodes to 0), 0x7F (NaN) NaN; the last entry is the range k maps a group onto (its log2)."""
    device = torch.device(device)
    if device not in _code_tables:
        magnitudes = torch.arange(128, dtype=torch.uint8).view(torch.float8_e4m3fn).double()
        table = reproducible_math.log2_(magnitudes.clamp(min=2.0 ** -9) / E4M3_MAX)
        table[0], table[127] = -math.inf, math.nan
        e4m3_range = reproducible_math.log2_(torch.tensor([E4M3_MAX / E4M3_MIN_NORMAL], dtype=torch.float64))
        _code_tables[device] = torch.cat([table, e4m3_range]).to(device)
    return _code_tables[device]


def fp8_encode_groups(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """fp32 ``x`` [groups, GROUP] -> (E4M3 codes [groups, GROUP], amax [groups], k [groups]); amax and k are fp32
    holding bf16 values."""
    groups = x.shape[0]
    a = x.abs()
    amax = _bf16_round(a.amax(dim=1), up=True)
    amin = torch.where(a > 0, a, math.inf).amin(dim=1)
    # One log2 pass over |x|, amax and amin (the kernel takes them one by one: elementwise, the same bits). A zero
    # |x| or amin gives a finite placeholder (-1023 or 1024) that the zero masks below discard.
    logs = reproducible_math.log2_(torch.cat([a.view(-1), amax, amin]).double())
    log_a, log_amax, log_amin = logs[:-2 * groups].view(groups, GROUP), logs[-2 * groups:-groups], logs[-groups:]
    log_ratio = log_amax - log_amin
    k = torch.where(log_ratio > 0, fp8_code_table(x.device)[128] / log_ratio, K_MAX).clamp_(max=K_MAX)
    k = _bf16_round(torch.where(amax > 0, k, 1.0).float(), up=False)
    # |x| / amax in (0, 1] to the power k, times 448: |code| in [2^-6, 448] for every nonzero |x| (amax rounds up)
    y = reproducible_math.exp2_(log_a.sub_(log_amax[:, None]).mul_(k.double()[:, None])).mul_(E4M3_MAX)
    y = torch.where(a > 0, y, 0.0).float()
    codes = torch.where(x < 0, -y, y).clamp_(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn)
    return codes, amax, k


def fp8_decode_groups(codes: torch.Tensor, amax: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
    """E4M3 codes as bytes (uint8) [groups, GROUP] with their groups' bf16 amax and k -> fp32 [groups, GROUP]."""
    log_code = fp8_code_table(codes.device)[(codes & 0x7F).long()]  # log2(|code| / 448)
    # t >= -1000: 0 codes (-inf) give 2^-1000 amax, 0 in fp32, and exp2 stays in its domain.
    t = log_code.div_(k.double()[:, None]).clamp_(min=-1000.0)
    magnitude = reproducible_math.exp2_(t).mul_(amax.double()[:, None]).float()
    return torch.where(codes >= 0x80, -magnitude, magnitude)


def _bf16_round(x: torch.Tensor, up: bool) -> torch.Tensor:
    """Positive fp32 values rounded up or down to bf16-representable fp32 values (clear the low 16 bits)."""
    bits = x.float().view(torch.int32)
    if up:
        bits = bits + 0xFFFF
    return (bits & -0x10000).view(torch.float32)


def _grouped(start: int, end: int) -> tuple[slice, int]:
    if start % GROUP:
        raise ValueError(f"codec chunks start on a {GROUP}-element group boundary, got {start}")
    return slice(start // GROUP, -(-end // GROUP)), -(-(end - start) // GROUP) * GROUP


def _padded(x: torch.Tensor, n: int) -> torch.Tensor:
    return x if x.numel() == n else torch.nn.functional.pad(x, (0, n - x.numel()))


def fp8_round_trip_bound(k: torch.Tensor) -> torch.Tensor:
    """The per-element relative error bound of Fp8ExpandCodec for a group with exponent ``k``."""
    return torch.maximum((17 / 16) ** (1 / k) - 1, 1 - (15 / 16) ** (1 / k))


def make_state_codec(state_dtype: str, numel: int, device=None) -> StateCodec:
    """--optimizer-state-dtype fp32|bf16|fp8."""
    if state_dtype == "fp32":
        return PlainCodec(numel, device, torch.float32)
    if state_dtype == "bf16":
        return PlainCodec(numel, device, torch.bfloat16)
    if state_dtype == "fp8":
        return Fp8ExpandCodec(numel, device)
    raise ValueError(f"--optimizer-state-dtype must be one of {', '.join(STATE_DTYPES)}, got {state_dtype!r}")
