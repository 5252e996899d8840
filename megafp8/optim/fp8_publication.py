"""--fp8-param-gather's publication: the owned shards of every FP8 weight cast to FP8 bytes in a fixed number of tensor ops.

Scaling groups ("slots") of all FP8 weights are numbered in one flat vector (weights in ``ddp.fp8_params``
order, each its ``scale_shape`` row-major, then one dummy slot with scale 1 for padding). Tables built once:
per storage 128-group of an FP8 fragment its storage group (int64, 0.0625 B per FP8 weight element), per
fragment its weight's slot base and shape constants. Each slab of up to ``SLAB_GROUPS`` groups decodes its
master values and computes every element's slot on the fly (int64 temporaries, freed per slab): one scatter
with one source per 128-group and slot (`_accumulate_amax`) gives the local group amaxes (a delayed weight observes its fragment's MAX, as the old per-chunk loop did),
one batched MAX all-reduce over DP agrees on the current-scaling ones, one gather of scales and one cast
give the bytes, one foreach copy writes them into the buckets' ``fp8_data``. The layers' ``scale_inv`` are
views of one flat tensor, rewritten in place each publish. A delayed state that is still cold (the first
step, or a load of an empty history) is observed one weight at a time: its host-side warm-up needs observe().
With the optimizer's fused step (``opt.fused_step``) the slabs' decode, scatter and cast run as two Triton launches
over all FP8 groups instead (megafp8.optim.fused_fp8_publication: group amaxes, then the bytes straight into
fp8_data); the slabs are this path's torch twin and the CPU storage's path.

--fp4-param-gather (NVFP4's 16x16 weight tiles) takes the slabs' path with a tile per slot: the same scatter and
MAX all-reduce give every tile's amax, each weight's tensor amax is the MAX of its tiles (so TransformerEngine's
all-reduced global amax costs no second collective), and the cast follows TE's scale chain (nvfp4_quantize_copy:
S_enc per weight, E4M3 tile scales, round to nearest) and packs two E2M1 codes per byte. The bytes, tile scales and
decode scale equal quantize_microscaled of the whole weight on one rank.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from megafp8.optim import fused_fp8_publication
from megafp8.optim.amax_groups import all_reduce_max, amax_group, members_by_group
from megafp8.optim.fp8_param_cast import cast_to_fp8, element_groups, group_divisors, num_scale_groups
from megafp8.optim.state_codec import GROUP
from megafp8.optim.storage_slabs import STEP_SLAB, cut_into_slabs
from megafp8.parallel.grad_buffer import BYTE_BITS
from megafp8_kernels import fp8_format, scale_from_amax, scale_shape
from megafp8_kernels.formats import E2M1
from megafp8_kernels.microscaling_reference import NVFP4_SCALE_MAX, e2m1_codes, nvfp4_encode_scales, pack_e2m1
from megafp8_kernels.scaling import FLOAT32_MAX

SLAB_GROUPS = STEP_SLAB // GROUP  # the step's slab: bounds the per-element temporaries, not the op count's growth


@dataclass
class _Slab:
    groups: torch.Tensor       # storage 128-groups of FP8 fragments, in storage order
    dests: list[torch.Tensor]  # the fp8_data ranges their bytes fill, in the same order
    sizes: list[int]


@dataclass
class _FusedTables:
    """What the fused publication's launches read, built once: per FP8 storage group (in storage order) its byte
    destination, and the destination buffers (the buckets' fp8_data) whose addresses the cast reads from a table."""

    groups: torch.Tensor       # int64 storage groups
    dest_buffer: torch.Tensor  # int64 position in ``buckets`` of each group's bucket
    dest_offset: torch.Tensor  # int64 first byte of each group in its bucket's fp8_data
    buckets: list              # whose fp8_data the bytes go to
    formats: tuple[int, int]   # fused_fp8_publication.format_ids of the publication's dtypes
    addresses: tuple[tuple[int, ...], torch.Tensor] | None = None  # (data_ptr()s, as a device tensor)

    def buffer_addresses(self, device) -> torch.Tensor:
        """The fp8_data addresses, a device tensor made again only when a buffer moved (reading data_ptr() costs no
        tensor op)."""
        key = tuple(b.fp8_data.data_ptr() for b in self.buckets)
        if self.addresses is None or self.addresses[0] != key:
            self.addresses = (key, torch.tensor(key, dtype=torch.int64, device=device))
        return self.addresses[1]


@dataclass
class _ScalePlan:
    """Which weights take current scaling this step (changes only when a delayed state warms up)."""

    current: list[int]                     # positions of current-scaled weights (and cold delayed ones)
    current_slots: torch.Tensor | None     # their slots (None: every slot, in order)
    combos: list[tuple[float, bool, torch.Tensor | None]]  # (fp8 max, power-of-2, mask over current slots)
    delayed: list[int]                     # warm delayed weights: their state's scale
    delayed_slots: torch.Tensor | None
    delayed_owner: torch.Tensor | None     # per delayed slot, its weight's place in ``delayed``
    current_members: list | None = None    # the groups agreeing the current slots' amaxes (amax_groups.Members)


class Fp8Publication:
    """Publishes the FP8 weights of ``opt.ddp.fp8_params`` (rebuilt by the optimizer when that set or a recipe in it
    changes: the precision plans' changes)."""

    def __init__(self, opt) -> None:
        ddp = opt.ddp
        self.opt, self.params = opt, list(ddp.fp8_params)
        self.key = publication_key(ddp.fp8_params)
        device = opt.master_scale.device
        position = {p: j for j, p in enumerate(self.params)}
        sizes = [num_scale_groups(tuple(p.shape), ddp.fp8_params[p].recipe.granularity("weight")) for p in self.params]
        bases = [sum(sizes[:j]) for j in range(len(sizes))]
        self.num_slots = sum(sizes)
        self.slot_sizes, self.slot_bases = sizes, bases
        # Per weight, the ranks agreeing its current-scaling amax: DP, an expert's expert-data-parallel group.
        self.param_groups = [amax_group(opt, p) for p in self.params]
        # output_size: known here, so no device read of the counts' sum (and meta tensors need it)
        self.param_of_slot = torch.repeat_interleave(torch.arange(len(sizes) + 1, device=device),
                                                     torch.tensor(sizes + [1], device=device),
                                                     output_size=self.num_slots + 1)
        self.dtypes = sorted({info.recipe.dtype("weight") for info in ddp.fp8_params.values()}, key=str)
        layouts = {info.recipe.quantizer("weight").layout for info in ddp.fp8_params.values()}
        self.nvfp4 = any(layout.two_level for layout in layouts)
        if self.nvfp4 and len(layouts) > 1:  # data_parallel demotes a gathered FP4 weight that changes recipe
            raise NotImplementedError(f"one publication of NVFP4 and other weights: {sorted(l.name for l in layouts)}")
        # Per fragment (then a padding row): slot base, cols, row divisor, groups per band, col divisor, numel, dtype.
        rows = [[self.num_slots, 1, 1, 1, 1, 0, 0] for _ in range(len(opt.fragments) + 1)]
        fp8_frags = sorted((f for f in opt.fragments if f.param in position), key=lambda f: f.storage_lo)
        for frag in fp8_frags:
            p, info = frag.param, ddp.fp8_params[frag.param]
            rows[frag.index] = [bases[position[p]], p.shape[1], *group_divisors(tuple(p.shape), info.recipe.granularity("weight")),
                                p.numel(), self.dtypes.index(info.recipe.dtype("weight"))]
        self.frag_table = torch.tensor(rows, dtype=torch.int64, device=device)
        self.lane = torch.arange(GROUP, device=device)
        runs = _contiguous_runs(fp8_frags)
        packed = sorted({bucket.fp8_bits for _g0, _n, bucket, _pos in runs} - {BYTE_BITS})
        if packed and not self.nvfp4:  # the offsets count bytes already; the FP8 cast writes one byte per element
            raise NotImplementedError(f"--fp8-param-gather publishes one byte per element, not {packed}-bit weights")
        # The fused launches cast to FP8 only: NVFP4 weights take the slabs (their twin's ops, a fixed number per slab).
        self.fused = _fused_tables(runs, self.dtypes, device) if opt.fused_step and runs and not self.nvfp4 else None
        self.slabs = [] if self.fused is not None else _make_slabs(runs, device)
        # The layers' dequantization scales: views of one flat tensor, rewritten in place by every publish.
        # NVFP4: E4M3 tile scales and one fp32 decode scale (1 / S_enc) per weight.
        self.scale_inv = torch.zeros(self.num_slots, device=device,
                                     dtype=torch.float8_e4m3fn if self.nvfp4 else torch.float32)
        self.global_scale_inv = torch.zeros(len(self.params), device=device) if self.nvfp4 else None
        for j, (p, base, n) in enumerate(zip(self.params, bases, sizes)):
            info = ddp.fp8_params[p]
            info.scale_inv = self.scale_inv[base:base + n].view(
                scale_shape(p.shape[0], p.shape[1], info.recipe.granularity("weight")))
            info.global_scale_inv = self.global_scale_inv[j] if self.nvfp4 else None
        self._plans: dict[tuple[bool, ...], _ScalePlan] = {}
        self._warm_index: dict[tuple[int, ...], torch.Tensor] = {}

    @torch.no_grad()
    def publish(self) -> None:
        infos = self.ddp_infos()
        quant = [infos[p].module.fp8_weight_quantization(infos[p].recipe) for p in self.params]
        plan = self._plan(quant)
        device = self.scale_inv.device
        scale = torch.ones(self.num_slots + 1, device=device)
        if plan.delayed:
            delayed = torch.stack([quant[j].scale for j in plan.delayed]).view(-1)
            scale.index_copy_(0, plan.delayed_slots, delayed[plan.delayed_owner])
        amax = torch.zeros(self.num_slots + 1, device=device)
        if self.fused is not None:
            self._publish_fused(quant, plan, amax, scale)
        else:
            self._publish_slabs(quant, plan, amax, scale)
        if not self.nvfp4:  # (NVFP4's tile and tensor scales were written with the cast's multipliers)
            torch.div(torch.ones_like(self.scale_inv), scale[:self.num_slots], out=self.scale_inv)  # IEEE 1 / scale

    def _publish_fused(self, quant, plan: _ScalePlan, amax: torch.Tensor, scale: torch.Tensor) -> None:
        """Two launches over every FP8 group (amax, cast) around the torch steps on the [num_slots] vectors."""
        opt, fused = self.opt, self.fused
        tables = (opt.master.values, opt.master_scale, opt._frag_of_group, opt._index_offset, fused.groups,
                  self.frag_table, self.num_slots)
        fused_fp8_publication.group_amax_triton(*tables, amax)
        self._observe(quant, amax)
        if plan.current:
            self._current_scales(quant, plan, amax, scale)
        fused_fp8_publication.cast_triton(*tables, scale, fused.dest_buffer, fused.dest_offset,
                                          fused.buffer_addresses(scale.device), fused.formats)

    def _publish_slabs(self, quant, plan: _ScalePlan, amax: torch.Tensor, scale: torch.Tensor) -> None:
        """The fused publication's torch twin: each slab decoded (twice under current scaling), scattered, cast."""
        master_scale = torch.cat([self.opt.master_scale, self.opt.master_scale.new_ones(1)])
        for slab in self.slabs:  # one pass when every scale is known before the cast
            values, slots = self._decode(slab, master_scale)
            self._accumulate_amax(amax, values, slots)
            if not plan.current:
                self._write(slab, values, slots, scale)
            del values, slots  # before the next slab's
        self._observe(quant, amax)
        if plan.current:
            self._current_scales(quant, plan, amax, scale)
            for slab in self.slabs:
                self._write(slab, *self._decode(slab, master_scale), scale)

    def ddp_infos(self):
        return self.opt.ddp.fp8_params

    def _plan(self, quant) -> _ScalePlan:
        key = tuple(q.scale is None for q in quant)
        if key not in self._plans:
            self._plans[key] = self._make_plan(quant)
        return self._plans[key]

    def _make_plan(self, quant) -> _ScalePlan:
        device = self.scale_inv.device
        current = [j for j, q in enumerate(quant) if q.scale is None]
        delayed = [j for j, q in enumerate(quant) if q.scale is not None]

        def slots_of(js):
            return [s for j in js for s in range(self.slot_bases[j], self.slot_bases[j] + self.slot_sizes[j])]

        cur_slots = slots_of(current)
        combos, owner_of = [], {}
        for j in current if not self.nvfp4 else ():  # (NVFP4: one scale chain for every weight)
            owner_of.setdefault((fp8_format(quant[j].fp8_dtype).max, quant[j].power_of_2_scale), []).append(j)
        for k, ((fmax, pow2), js) in enumerate(owner_of.items()):
            members = set(slots_of(js))
            mask = None if k == 0 else torch.tensor([s in members for s in cur_slots], device=device)
            combos.append((fmax, pow2, mask))
        del_slots = slots_of(delayed)
        owner = [k for k, j in enumerate(delayed) for _ in range(self.slot_sizes[j])]
        members = members_by_group([self.param_groups[j] for j in current for _ in range(self.slot_sizes[j])],
                                   self.opt.dp, device)
        return _ScalePlan(current, None if cur_slots == list(range(self.num_slots)) else
                          torch.tensor(cur_slots, dtype=torch.int64, device=device), combos, delayed,
                          torch.tensor(del_slots, dtype=torch.int64, device=device) if delayed else None,
                          torch.tensor(owner, dtype=torch.int64, device=device) if delayed else None, members)

    def _decode(self, slab: _Slab, master_scale: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The slab's master values (fp32, [groups, 128]) and each element's slot (padding: the dummy slot)."""
        opt, g = self.opt, slab.groups
        frag = opt._frag_of_group[g]
        values = opt.master.values.view(-1, GROUP)[g].float()
        if opt.master_weight_dtype == "fp16":
            values = values / master_scale[frag][:, None]
        flat_index = (g * GROUP + opt._index_offset[g])[:, None] + self.lane  # in the weight
        base, cols, row_div, per_band, col_div, numel, _dtype = self.frag_table[frag][:, :, None].unbind(1)
        padding = flat_index >= numel
        slots = element_groups(flat_index, cols, row_div, per_band, col_div).add_(base)
        return values, slots.masked_fill_(padding, self.num_slots)

    def _accumulate_amax(self, amax: torch.Tensor, values: torch.Tensor, slots: torch.Tensor) -> None:
        """amax[slot] = MAX(amax[slot], |value|) over the slab's [groups, 128] elements, one scatter. A 128-group whose
        elements share a slot (each group of a tensorwise weight, and of a rowwise or blockwise one whose rows are
        multiples of 128: every weight of a real model) sends one source, its MAX, from lane 0; its other lanes go
        to scratch addresses of their own. Only a group spanning slots sends its elements one by one. (Sending every
        element to its slot made a tensorwise weight's slab ~1e9 contended atomics per step at 1B parameters.)"""
        magnitude = values.abs()
        uniform = (slots == slots[:, :1]).all(1, keepdim=True)
        magnitude[:, :1] = torch.where(uniform, magnitude.amax(1, keepdim=True), magnitude[:, :1])
        first_scratch = amax.numel()
        scratch = torch.arange(first_scratch, first_scratch + slots.numel(), device=slots.device).view_as(slots)
        index = torch.where(uniform & (self.lane > 0), scratch, slots)
        del scratch
        target = torch.cat([amax, amax.new_zeros(slots.numel())])
        target.scatter_reduce_(0, index.view(-1), magnitude.view(-1), "amax")
        amax.copy_(target[:first_scratch])

    def _write(self, slab: _Slab, values: torch.Tensor, slots: torch.Tensor, scale: torch.Tensor) -> None:
        """The slab's FP8 bytes into fp8_data (``values`` is consumed)."""
        per_element = scale[slots]
        del slots
        if self.nvfp4:  # E2M1 codes of x * encode, two per byte (a row's even-odd pairs: K and the 128-groups are even)
            out = pack_e2m1(e2m1_codes(values.mul_(per_element)))
        elif len(self.dtypes) == 1:
            out = cast_to_fp8(values, per_element, self.dtypes[0])
        else:  # weights in several FP8 formats: each element cast in its own
            dtype_id = self.frag_table[self.opt._frag_of_group[slab.groups], 6][:, None]
            out = cast_to_fp8(values.clone(), per_element, self.dtypes[0])
            for d, dtype in enumerate(self.dtypes[1:], 1):
                out = torch.where(dtype_id == d, cast_to_fp8(values.clone(), per_element, dtype), out)
        out = out.view(-1)
        if len(slab.dests) == 1:
            slab.dests[0].copy_(out)
        else:
            torch._foreach_copy_(slab.dests, list(out.split(slab.sizes)))

    def _observe(self, quant, amax: torch.Tensor) -> None:
        """Every delayed weight observes the MAX over its owned fragment (0 where it owns none: the amax
        group's MAX gives the whole tensor's, and every rank must observe for the cold/warm switch)."""
        states = [j for j, q in enumerate(quant) if q.state is not None]
        if not states:
            return
        local = amax.new_zeros(len(self.params) + 1).scatter_reduce_(0, self.param_of_slot, amax, "amax")
        warm = [j for j in states if quant[j].scale is not None]
        if warm:
            index = None
            if len(warm) < len(self.params):  # built once per set of warm weights: no host->device copy per step
                index = self._warm_index.get(tuple(warm))
                if index is None:
                    index = self._warm_index[tuple(warm)] = torch.tensor(warm, device=amax.device)
            torch._foreach_maximum_([quant[j].state.pending_amax for j in warm],
                                    list((local[:-1] if index is None else local[index]).unbind()))
        for j in states:
            if quant[j].scale is None:  # cold: observe() also marks the state for its warm-up
                quant[j].observe(local[j])

    def _current_scales(self, quant, plan: _ScalePlan, amax: torch.Tensor, scale: torch.Tensor) -> None:
        """Current scaling (or a cold delayed state): one MAX all-reduce over DP of the group amaxes (an expert's over
        its expert-data-parallel group: megafp8.optim.amax_groups)."""
        reduced = amax[:self.num_slots] if plan.current_slots is None else amax[plan.current_slots]
        all_reduce_max(reduced, plan.current_members, "dp_param_allgather")
        if self.nvfp4:
            self._nvfp4_scales(reduced, scale)
            return
        infos, views = self.ddp_infos(), None
        for k, j in enumerate(plan.current):
            tp_sync = infos[self.params[j]].module.sharded_amax_sync() if quant[j].state is not None else None
            if tp_sync is not None:  # a cold delayed weight: the whole tensor's scale, as the layer's own cast
                views = views or reduced.split([self.slot_sizes[i] for i in plan.current])
                tp_sync(views[k])
        current = None
        for fmax, pow2, mask in plan.combos:
            s = scale_from_amax(reduced, fmax, pow2)
            current = s if mask is None else torch.where(mask, s, current)
        if plan.current_slots is None:
            scale[:self.num_slots].copy_(current)
        else:
            scale.index_copy_(0, plan.current_slots, current)


    def _nvfp4_scales(self, tile_amax: torch.Tensor, scale: torch.Tensor) -> None:
        """TE's NVFP4 chain from the agreed tile amaxes (nvfp4_quantize_copy's ops, elementwise over every weight's
        tiles): S_enc = 448 * 6 / tensor amax, tile scale e4m3(min(amax * (S_enc * (1/6)), 448)), and the cast's
        multiplier min(1 / (tile scale * (1 / S_enc)), FLOAT32_MAX) into ``scale``."""
        n = self.num_slots
        tensor_amax = tile_amax.new_zeros(len(self.params)).scatter_reduce_(0, self.param_of_slot[:n], tile_amax,
                                                                            "amax")
        s_enc = nvfp4_encode_scales(tensor_amax)
        s_dec_global = torch.ones_like(s_enc) / s_enc
        self.global_scale_inv.copy_(s_dec_global)
        multiplier = s_enc * (torch.ones_like(s_enc) / E2M1.max)
        s_block = torch.clamp(tile_amax * multiplier[self.param_of_slot[:n]], max=NVFP4_SCALE_MAX)
        self.scale_inv.copy_(s_block)  # rounded to E4M3 once (NaN stays NaN)
        encode = torch.ones_like(s_block) / (self.scale_inv.float() * s_dec_global[self.param_of_slot[:n]])
        scale[:n].copy_(torch.clamp(encode, max=FLOAT32_MAX))


def publication_key(fp8_params) -> tuple[tuple[int, object], ...]:
    """Which weights, under which recipes, a publication was built for (ids: comparing Parameters would compare
    their values); a precision plan moving a gathered weight to another recipe changes it too."""
    return tuple((id(p), info.recipe) for p, info in fp8_params.items())


def _contiguous_runs(fp8_frags) -> list[list]:
    """[first storage group, groups, bucket, first byte] of each run of storage groups whose bytes are contiguous
    in one bucket's fp8_data (a fragment's last group is written whole: the bucket pads every parameter to 128).
    Offsets count bytes (Bucket.fp8_bytes), which a packed format makes fewer than elements."""
    runs = []
    for frag in fp8_frags:
        g0, n = frag.storage_lo // GROUP, -(-frag.numel // GROUP)
        bucket, pos = frag.bucket, frag.bucket.fp8_bytes(frag.bucket_lo)
        last = runs[-1] if runs else None
        if last and last[0] + last[1] == g0 and last[2] is bucket \
                and last[3] + bucket.fp8_bytes(last[1] * GROUP) == pos:
            last[1] += n
        else:
            runs.append([g0, n, bucket, pos])
    return runs


def _fused_tables(runs, dtypes, device) -> _FusedTables:
    buckets = list({id(bucket): bucket for _g0, _n, bucket, _pos in runs}.values())
    position = {id(bucket): k for k, bucket in enumerate(buckets)}
    groups = torch.cat([torch.arange(g0, g0 + n) for g0, n, _bucket, _pos in runs])
    dest_buffer = torch.cat([torch.full((n,), position[id(bucket)]) for _g0, n, bucket, _pos in runs])
    dest_offset = torch.cat([torch.arange(pos, pos + bucket.fp8_bytes(n * GROUP), bucket.fp8_bytes(GROUP))
                             for _g0, n, bucket, pos in runs])
    return _FusedTables(groups.to(device), dest_buffer.to(device), dest_offset.to(device), buckets,
                        fused_fp8_publication.format_ids(dtypes))


def _make_slabs(runs, device) -> list[_Slab]:
    """The runs cut into slabs of up to SLAB_GROUPS groups (each group's bytes: its bucket's fp8_bytes(GROUP))."""
    slabs = []
    for pieces in cut_into_slabs([n for _g0, n, _bucket, _pos in runs], SLAB_GROUPS):
        groups = [torch.arange(runs[r][0] + offset, runs[r][0] + offset + n) for r, offset, n in pieces]
        dests = []
        for r, offset, n in pieces:
            _g0, _n, bucket, pos = runs[r]
            group_bytes = bucket.fp8_bytes(GROUP)
            dests.append(bucket.fp8_data[pos + offset * group_bytes:pos + (offset + n) * group_bytes])
        slabs.append(_Slab(torch.cat(groups).to(device), dests, [dest.numel() for dest in dests]))
    return slabs
