"""AdamW over the DP-sharded grad buffer (ZeRO-1, Megatron's distributed optimizer) with low-precision
master weights and optimizer states, global grad-norm clipping, NaN/inf step skipping, and the
parameter publication (high precision or FP8 bytes) that follows each step.

Each rank owns a ``Fragment`` of some parameters, laid out in its flat storage (megafp8.optim.storage_layout:
Megatron's ranges). Without the distributed optimizer every rank owns every bucket whole (plain DDP with the same
update code).

The step takes the storage in slabs of up to ``STEP_SLAB`` elements (across bucket boundaries), in a fixed
number of tensor ops per slab whatever the number of parameters or buckets: decode master, m and v, update
in fp32, encode, with the per-parameter constants (weight decay, fp16 scale, rounding key, grad-norm weight) broadcast from per-128-group tables
built once (a parameter's fragment starts on a group boundary, so each group belongs to one parameter).
The update itself (megafp8.optim.storage_update) can instead run as two Triton launches per bucket shard, for
every preset (``fused_step``: megafp8.optim.fused_adamw, fused_adamw_coded), bit-identical to the slabs (its twin).
The global grad norm and the non-finite check stay on the device: a non-finite step keeps every stored
state (``torch.where`` on the finite flag) instead of returning early, so no step asks the host. Master weights: ``fp32``, or ``fp16`` with one power-of-two scale per tensor
(FP8-LM), agreed over DP by a MAX all-reduce of the per-tensor amaxes so a checkpoint re-slices at any
DP size; the scale moves only when ``amax * scale`` leaves ``[2^8, 2^13]`` (exact power-of-two rescale).
The step's fp16 encode rounds stochastically (megafp8.optim.stochastic_rounding), keyed by (seed, step,
parameter, the element's flat index in the parameter): a scale cannot change fp16's 2^-11 relative grid, so
round-to-nearest would drop every update below half a grid step (a norm gain at 1.0 never moves at lr 1e-4).
"""
from __future__ import annotations

import functools
import os
from collections.abc import Collection
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from megafp8.fp8 import invalidate_fp8_weight_caches
from megafp8.optim import fused_adamw, fused_adamw_coded, reproducible_math
from megafp8.optim.amax_groups import Members, all_reduce_max, amax_group, members_by_group
from megafp8.optim.fp8_publication import Fp8Publication, publication_key
from megafp8.optim.loss_scaler import LossScaler
from megafp8.optim.optimizer_checkpoint import load_optimizer_state_dicts, optimizer_state_dict
from megafp8.optim.precision_follower import PrecisionFollower
from megafp8.optim.state_codec import GROUP, PlainCodec, StateCodec, make_state_codec
from megafp8.optim.storage_layout import Fragment, StorageLayout
from megafp8.optim.storage_slabs import STEP_SLAB, StorageSlab
from megafp8.optim.storage_update import Fp16Master, adamw_update
from megafp8.optim.stochastic_rounding import rounding_keys
from megafp8.parallel import collectives as C
from megafp8.parallel.collectives import GroupHandle
from megafp8.parallel.data_parallel import Bucket, DistributedDataParallel, tensor_bytes

MASTER_DTYPES = ("fp32", "fp16")
FP16_SCALE_LOW, FP16_SCALE_HIGH, FP16_SCALE_TARGET = 8, 13, 10  # log2 of amax * scale
FUSED_ENV = "MEGAFP8_FUSED_OPTIMIZER"  # 1: the fused Triton step (on a CPU: under TRITON_INTERPRET); 0: never


@dataclass
class GradStats:
    """What ``DistributedOptimizer.prepare`` found in the reduced grads, as device tensors (no host sync)."""

    grad_norm: torch.Tensor        # fp64, 0-dim: the global grad norm before clipping
    finite: torch.Tensor           # bool, 0-dim: no NaN/inf anywhere (else ``apply`` keeps every stored state)
    clip: torch.Tensor | None      # fp32, 0-dim: the factor --clip-grad scales the grads by; None without it
    # bool, 0-dim: a result check rejected the step (megafp8.training.rerun): skipped like a non-finite one, but
    # no overflow for --fp16's loss scaler. None: no check.
    rejected: torch.Tensor | None = None


@dataclass
class StepResult:
    """What a step did, as device tensors (reading ``skipped`` or ``grad_norm`` is a host sync: the training
    loop reads them on log iterations only)."""

    skipped_flag: torch.Tensor      # bool, 0-dim: the grads were not finite, nothing was updated
    grad_norm_tensor: torch.Tensor  # fp64, 0-dim: the global grad norm before clipping

    @property
    def skipped(self) -> bool:
        return bool(self.skipped_flag)

    @property
    def grad_norm(self) -> float:
        return float(self.grad_norm_tensor)


class DistributedOptimizer:
    """AdamW (torch.optim.AdamW's update rule) on the shards this rank owns.

    ddp:                    the DistributedDataParallel wrapper (its config says whether states are sharded)
    betas, eps:             AdamW's
    weight_decay:           --weight-decay; decoupled, applied to parameters with >= 2 dims only (not norms, biases)
    clip_grad:              --clip-grad; global L2 norm over TP x PP x DP (0 = off)
    master_weight_dtype:    --master-weight-dtype fp32|fp16
    optimizer_state_dtype:  --optimizer-state-dtype fp32|bf16|fp8 (see megafp8.optim.state_codec)
    chunk_size:             elements encoded or decoded at once outside the step: initializing the master, writing
                            a guard-switched weight, copying the master out for a checkpoint (bounds those fp32
                            temporaries; the step and the FP8 publication take whole slabs)
    rounding_seed:          seeds the fp16 master's stochastic rounding (the same seed resumes bit-exactly)
    fused_step:             the step as Triton kernels, a fixed number of launches per bucket shard, for every preset
                            (megafp8.optim.fused_adamw for fp32 master + fp32 states, megafp8.optim.fused_adamw_coded
                            for the others). None: on where the storage is on CUDA, else $MEGAFP8_FUSED_OPTIMIZER
                            (1/0) decides; the torch twin (slabs) elsewhere.
    decoupled_lr_params:    names of the parameters a step's ``decoupled_lr`` applies to (--decoupled-lr: the
                            embedding and the output layer); the others step at ``lr``
    """

    def __init__(self, ddp: DistributedDataParallel, *, betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8,
                 weight_decay: float = 0.0, clip_grad: float = 0.0, master_weight_dtype: str = "fp32",
                 optimizer_state_dtype: str = "fp32", chunk_size: int = 1 << 16, rounding_seed: int = 0,
                 fused_step: bool | None = None, decoupled_lr_params: Collection[str] = ()) -> None:
        if master_weight_dtype not in MASTER_DTYPES:
            raise ValueError(f"--master-weight-dtype must be one of {', '.join(MASTER_DTYPES)}, got {master_weight_dtype!r}")
        if clip_grad < 0 or weight_decay < 0:
            raise ValueError(f"--clip-grad ({clip_grad}) and --weight-decay ({weight_decay}) must be >= 0")
        self.ddp = ddp
        self.betas, self.eps, self.weight_decay, self.clip_grad = betas, eps, weight_decay, clip_grad
        self.master_weight_dtype, self.optimizer_state_dtype = master_weight_dtype, optimizer_state_dtype
        self.chunk_size = max(GROUP, chunk_size // GROUP * GROUP)
        self.rounding_seed = rounding_seed
        self.decoupled_lr_params = frozenset(decoupled_lr_params)
        ps = ddp.parallel_state
        self.dp, self.tp = ddp.dp, ddp.tp
        self.world = _world_handle(ps)
        device = ddp.grad_buffers[0].device
        layout = StorageLayout(ddp, weight_decay=weight_decay, decoupled_lr_params=self.decoupled_lr_params,
                               slab_size=STEP_SLAB, device=device)
        self.fragments, numel, self._shards, self._slabs = layout.fragments, layout.numel, layout.shards, layout.slabs
        self._frag_of_group, self._index_offset = layout.frag_of_group, layout.index_offset
        self._group_decay, self._group_counted = layout.group_decay, layout.group_counted
        self._group_decoupled, self._decoupled_launches = layout.group_decoupled, layout.decoupled_launches
        self._param_of_frag, self._rounding_salts, self._num_params = (layout.param_of_frag, layout.rounding_salts,
                                                                       layout.num_params)
        self._amax_members: Members | None = None  # built at the first amax agreement
        self._param_views: tuple[tuple, list] | None = None  # per slab piece, its param_data view (key, views)
        self._shard_view_cache: tuple[tuple, tuple] | None = None  # per bucket shard: param_data and master views
        # Counters on the device: whether a step counts is known there only (the finite flag).
        self._step = torch.zeros((), dtype=torch.int64, device=device)
        self.pending_stats: GradStats | None = None  # prepare()'s, until apply() consumes them
        self.loss_scaler: LossScaler | None = None  # --fp16: the grads hold loss scale x the gradient
        self._skipped = torch.zeros((), dtype=torch.int64, device=device)
        self._betas = torch.tensor(betas, dtype=torch.float64, device=device)  # once, not a blocking copy per step
        self._fp8_publication: Fp8Publication | None = None
        self.master: StateCodec = PlainCodec(numel, device, torch.float16 if master_weight_dtype == "fp16" else torch.float32)
        self.master_scale = torch.ones(len(self.fragments), device=device)  # fp16 codes = value * scale
        self.exp_avg = make_state_codec(optimizer_state_dtype, numel, device)
        self.exp_avg_sq = make_state_codec(optimizer_state_dtype, numel, device)
        self.fused_step = self._choose_fused_step(fused_step, torch.device(device))
        coded = (master_weight_dtype, optimizer_state_dtype) != ("fp32", "fp32")  # else fused_adamw's kernel
        self._coded_storage = (fused_adamw_coded.coded_storage(self.master, self.exp_avg, self.exp_avg_sq)
                               if coded else None)
        self._init_master()
        ddp.release_fp8_param_storage()  # the master now holds those values
        self.publish()
        ddp.finish_param_sync()
        # Precision changes after this (the guard's, a schedule's) reach the FP8-gathered weights before their next use.
        self._precision_follower = PrecisionFollower(self)

    def _choose_fused_step(self, requested: bool | None, device: torch.device) -> bool:
        if requested is None:
            env = os.environ.get(FUSED_ENV, "")
            requested = env == "1" if env in ("0", "1") else device.type == "cuda"
            return requested and fused_adamw.AVAILABLE
        if requested and not fused_adamw.AVAILABLE:
            raise ValueError("the fused optimizer step needs Triton, which is not installed")
        return requested

    def device_counters(self) -> dict[str, torch.Tensor]:
        """The step and skipped counts (and --fp16's loss scaler state) as the device holds them (read without a
        sync; a step re-run restores them)."""
        scaler = self.loss_scaler.live_state() if self.loss_scaler is not None else {}
        return {"step": self._step, "skipped": self._skipped, **{f"loss_scaler.{k}": v for k, v in scaler.items()}}

    @property
    def step_count(self) -> int:
        """Updates applied so far (a host sync: read it at log or save time)."""
        return int(self._step)

    @step_count.setter
    def step_count(self, value: int) -> None:
        self._step.fill_(value)

    @property
    def skipped_steps(self) -> int:
        return int(self._skipped)

    @skipped_steps.setter
    def skipped_steps(self, value: int) -> None:
        self._skipped.fill_(value)

    def _chunks(self, frag: Fragment):
        """(bucket index range, storage range) of each chunk of a fragment."""
        for off in range(0, frag.numel, self.chunk_size):
            n = min(self.chunk_size, frag.numel - off)
            yield frag.bucket_lo + off, frag.storage_lo + off, n, frag.param_lo + off

    # ---- master weights -------------------------------------------------------------------------
    def _decode_master(self, frag: Fragment, s: int, n: int) -> torch.Tensor:
        values = self.master.decode(s, s + n)
        return values / self.master_scale[frag.index] if self.master_weight_dtype == "fp16" else values

    def _encode_master(self, frag: Fragment, s: int, n: int, values: torch.Tensor) -> None:
        """Round to nearest (start-up and reloads; the step's update rounds stochastically, in ``step``)."""
        if self.master_weight_dtype == "fp16":
            values = values * self.master_scale[frag.index]
        self.master.encode(s, s + n, values)

    def _agreed_param_amax(self, frag_amax: dict[Fragment, torch.Tensor]) -> dict[nn.Parameter, torch.Tensor]:
        """Whole-tensor amax of every parameter: per-fragment amaxes, one MAX all-reduce over its shards' holders
        (DP; an expert's: its expert-data-parallel group)."""
        params, local = list(self.ddp.bucket_of), {f.param: a for f, a in frag_amax.items()}
        amax = torch.stack([local.get(p, torch.zeros((), device=self.master_scale.device)) for p in params])
        all_reduce_max(amax, self._param_amax_members(), "amax_reduce")
        return dict(zip(params, amax))

    def _param_amax_members(self) -> Members:
        """The groups agreeing each parameter's amax, in ``ddp.bucket_of``'s order (megafp8.optim.amax_groups)."""
        if self._amax_members is None:
            self._amax_members = members_by_group([amax_group(self, p) for p in self.ddp.bucket_of], self.dp,
                                                  self.master_scale.device)
        return self._amax_members

    def _init_master(self, given: dict[str, torch.Tensor] | None = None) -> None:
        """Encode each owned fragment's values (``given[name]``, on any device, else the parameter's storage) into the
        master one chunk at a time: an fp32 copy of the whole shard would be 4 B/param (5 GB at 1B parameters). An
        fp16 master's per-tensor scales need the amaxes first: a pass of per-chunk amaxes, one MAX over DP, the encode
        (max is exact: the same scales, and codes, as from whole-fragment values)."""
        device = self.master_scale.device

        def chunk(frag: Fragment, s: int, n: int) -> torch.Tensor:
            off = s - frag.storage_lo
            if given is not None and frag.name in given:
                return given[frag.name][off:off + n].to(device)
            return frag.bucket.param_data[frag.bucket_lo + off:frag.bucket_lo + off + n]

        if self.master_weight_dtype == "fp16":
            # A running max (NaN-propagating like amax): its temporaries are one chunk's whatever the fragment's size.
            frag_amax = {f: functools.reduce(torch.maximum, (chunk(f, s, n).abs().amax() for _b, s, n, _pl in
                                                             self._chunks(f))) for f in self.fragments}
            amax = self._agreed_param_amax({f: a.float() for f, a in frag_amax.items()})
            if self.fragments:
                self.master_scale.copy_(_pow2_scale(torch.stack([amax[f.param] for f in self.fragments])))
        for frag in self.fragments:
            for _b, s, n, _pl in self._chunks(frag):
                self._encode_master(frag, s, n, chunk(frag, s, n).float())

    @torch.no_grad()
    def owned_master_weights(self,
                             device: torch.device | str = "cpu") -> dict[str, tuple[nn.Parameter, int, torch.Tensor]]:
        """``{name: (param, start, fp32 values)}``: the range ``[start, start + n)`` of each parameter's
        flat (TP-local) values this rank owns, decoded from the master weights. What a checkpoint saves
        for FP8 layers whose high-precision storage was released (--fp8-param-gather). The values are
        written on ``device`` (the host by default) one decoded chunk at a time: a save adds no device memory."""
        owned = {}
        for frag in self.fragments:
            values = torch.empty(frag.numel, dtype=torch.float32, device=device)
            for _b, s, n, _pl in self._chunks(frag):
                values[s - frag.storage_lo:s - frag.storage_lo + n].copy_(self._decode_master(frag, s, n))
            owned[frag.name] = (frag.param, frag.param_lo, values)
        return owned

    @torch.no_grad()
    def reload_master_weights(self, owned: dict[str, torch.Tensor] | None = None) -> None:
        """Restart the master weights from the model's parameters (after loading weights without optimizer
        state: --finetune, --no-load-optim), taking ``owned[name]`` (this rank's range, as from
        ``owned_master_weights``) for parameters without high-precision storage; then publish them."""
        self._init_master(owned)
        self.publish()

    # ---- the step -------------------------------------------------------------------------------
    def zero_grad(self) -> None:
        self.ddp.zero_grad_buffer()

    @staticmethod
    def _slab_grads(slab: StorageSlab) -> torch.Tensor:
        return (slab.grads[0] if len(slab.grads) == 1 else torch.cat(slab.grads)).float()

    @staticmethod
    def _groups(start: int, n: int) -> slice:
        return slice(start // GROUP, (start + n) // GROUP)

    @torch.no_grad()
    def grad_norm_squared(self) -> torch.Tensor:
        """Sum of squared grads over the whole model, each element once: TP-replicated parameters count
        on TP rank 0, a pipeline copy of a tied embedding (``shared_embedding``) not at all, DP shards are
        disjoint (plain DDP: replicas are identical, so each counts 1/DP). NaN/inf anywhere -> non-finite.
        fp64 sums of squares per 128-group (one pass per slab, or one launch per bucket shard), one masked sum of
        that table (so both paths give the same bits), one all-reduce, no host sync."""
        squares = torch.empty(self._group_counted.numel(), dtype=torch.float64, device=self.master_scale.device)
        if self.fused_step:
            for bucket, lo, hi, storage in self._shards:
                fused_adamw.grad_group_squares_triton(bucket.grad_data, lo, squares, storage // GROUP, hi - lo)
        else:
            for slab in self._slabs:
                squares[self._groups(slab.start, slab.n)] = fused_adamw.group_square_sums(self._slab_grads(slab))
        total = torch.where(self._group_counted, squares, 0.0).sum()
        if not self.ddp.distributed:
            total /= self.dp.size
        return C.all_reduce(total, self.world, "dp_grad_reduce")

    @torch.no_grad()
    def step(self, lr: float, decoupled_lr: float | None = None) -> StepResult:
        """One AdamW step with learning rate ``lr``, and ``decoupled_lr`` for the ``decoupled_lr_params`` (None: ``lr``
        for all); the training loop owns the schedules. Skipped (every stored state kept) when the global grad norm
        is not finite; every rank sees the same all-reduced norm. ``prepare`` then ``apply``; when the caller already
        ran ``prepare`` (the trainer's phases), its stats, still pending, are the ones applied."""
        stats = self.pending_stats if self.pending_stats is not None else self.prepare()
        return self.apply(lr, stats, decoupled_lr=decoupled_lr)

    @torch.no_grad()
    def prepare(self) -> GradStats:
        """The step's first half, which changes no parameter and no optimizer state: finish the DP grad reduction
        and the parameter gather, then the global grad norm, its finite flag and the clip factor (device tensors,
        no host sync). Until ``apply`` the step can still be dropped and re-run (megafp8.training.step_state)."""
        self.ddp.finish_grad_sync()
        self.ddp.finish_param_sync()  # no gather may still be writing into the parameters
        norm = reproducible_math.sqrt(self.grad_norm_squared())  # the same bits on every machine
        unscale = self.loss_scaler.inverse() if self.loss_scaler is not None else None
        if unscale is not None:  # --fp16: the norm, the clip and the update see the unscaled gradient
            norm = norm * unscale.double()
        clip = None
        if self.clip_grad > 0:  # the python rule clip_grad / (norm + 1e-6), in fp64 as before, then fp32
            shifted = norm + 1e-6
            clip = torch.where(shifted > self.clip_grad, torch.full_like(shifted, self.clip_grad) / shifted, 1.0).float()
        if unscale is not None:  # the update multiplies each grad by clip: 1 / scale folded in (exact for 2^k)
            clip = unscale if clip is None else clip * unscale
        self.pending_stats = GradStats(norm, torch.isfinite(norm), clip)
        return self.pending_stats

    @torch.no_grad()
    def apply(self, lr: float, stats: GradStats, decoupled_lr: float | None = None) -> StepResult:
        """The step's second half: the AdamW update from ``prepare``'s ``stats`` (kept states where they say
        non-finite), the counters, and the publication of the new weights (see ``step`` for the LRs)."""
        norm, overflow_free, clip = stats.grad_norm, stats.finite, stats.clip
        finite = overflow_free if stats.rejected is None else overflow_free & ~stats.rejected  # applied or kept
        self.pending_stats = None
        step = self._step + 1  # this update's count, committed only if finite
        beta1, beta2 = self.betas
        powers = torch.pow(self._betas, step.double())
        bias_correction1 = 1 - powers[0]
        bias_correction2_sqrt = reproducible_math.sqrt(1 - powers[1]).float()
        step_size = (torch.full_like(bias_correction1, -lr) / bias_correction1).float()
        decay_factor = 1 - lr * self.weight_decay
        # Two LRs: per-group constants for the slabs, per-launch ones for the fused step; each the one-LR
        # arithmetic on that LR, so every element gets the bits a one-LR step at its LR would give it.
        two_lrs = decoupled_lr is not None and decoupled_lr != lr and self._group_decoupled is not None
        if two_lrs:
            lrs = torch.full(self._group_decoupled.shape, lr, dtype=torch.float64, device=self._group_decoupled.device)
            lrs.masked_fill_(self._group_decoupled, decoupled_lr)
            step_sizes, decay_factors = (lrs.neg() / bias_correction1).float(), (1 - lrs * self.weight_decay).float()
        common = dict(group_decay=self._group_decay if self.weight_decay > 0 else None, clip=clip, finite=finite,
                      bias_correction2_sqrt=bias_correction2_sqrt, beta1=beta1, beta2=beta2, eps=self.eps,
                      fp16=self._fp16_tables(step))
        if self.fused_step:  # one launch per bucket shard (per same-LR run with two LRs)
            launches = self._decoupled_launches if two_lrs else [(b, lo, s, hi - lo, False) for b, lo, hi, s in self._shards]
            if two_lrs:
                decoupled_step_size = (torch.full_like(bias_correction1, -decoupled_lr) / bias_correction1).float()
            for bucket, lo, storage, n, decoupled in launches:
                self._launch_update(bucket.grad_data, lo, storage, n,
                                    step_size=decoupled_step_size if decoupled else step_size,
                                    decay_factor=1 - decoupled_lr * self.weight_decay if decoupled else decay_factor,
                                    **common)
        for slab in [] if self.fused_step else self._slabs:  # the torch twin
            adamw_update(slab.grads, slab.start, slab.n, self.master, self.exp_avg, self.exp_avg_sq,
                         step_size=step_sizes if two_lrs else step_size,
                         decay_factor=decay_factors if two_lrs else decay_factor, **common)
        if common["fp16"] is not None and self.fragments:
            frag_amax = self.master_scale.new_zeros(len(self.fragments) + 1)
            frag_amax.scatter_reduce_(0, self._frag_of_group, common["fp16"].group_amax, "amax")
            self._rescale_fp16_master(frag_amax[:-1], finite)
        self._step += finite
        self._skipped += ~finite
        if self.loss_scaler is not None:  # Megatron's order: the scale moves after the (possibly skipped) update
            self.loss_scaler.update(~overflow_free)
        # Always published (a skipped step publishes the same weights): FP8 weights are cast again under the
        # scales this step's update() set, as a run resumed from this step's checkpoint casts them.
        self.publish()
        return StepResult(~finite, norm)

    def _fp16_tables(self, step: torch.Tensor) -> Fp16Master | None:
        """This step's per-group tables of the fp16 master (None for an fp32 master)."""
        if self.master_weight_dtype != "fp16":
            return None
        return Fp16Master(torch.cat([self.master_scale, self.master_scale.new_ones(1)])[self._frag_of_group],
                          rounding_keys(self.rounding_seed, step, self._rounding_salts)[self._frag_of_group],
                          self._index_offset, self.master_scale.new_empty(self._frag_of_group.numel()))

    def _launch_update(self, grads: torch.Tensor, grad_lo: int, start: int, n: int, *, fp16: Fp16Master | None,
                       **kw) -> None:
        """The fused update of storage ``[start, start + n)``: fp32 master and moments in megafp8.optim.fused_adamw's
        kernel, every other preset in megafp8.optim.fused_adamw_coded's."""
        if self._coded_storage is not None:
            fused_adamw_coded.adamw_coded_triton(grads, grad_lo, start, n, self._coded_storage, fp16=fp16, **kw)
            return
        fused_adamw.adamw_fp32_triton(grads, grad_lo, self.master.values, self.exp_avg.values, self.exp_avg_sq.values,
                                      start, n, kw["group_decay"], kw["clip"], kw["finite"], kw["step_size"],
                                      kw["bias_correction2_sqrt"], kw["decay_factor"], kw["beta1"], kw["beta2"],
                                      kw["eps"])

    def _rescale_fp16_master(self, frag_amax: torch.Tensor, finite: torch.Tensor) -> None:
        """Move a tensor's power-of-two scale when its agreed amax left ``[2^8, 2^13]`` (exact: codes times a
        power of two; 1 elsewhere), for every fragment at once."""
        param_amax = frag_amax.new_zeros(self._num_params).index_copy_(0, self._param_of_frag, frag_amax)
        all_reduce_max(param_amax, self._param_amax_members(), "amax_reduce")
        amax = param_amax[self._param_of_frag]
        level = torch.log2(amax * self.master_scale)
        moved = (amax > 0) & ((level < FP16_SCALE_LOW) | (level > FP16_SCALE_HIGH)) & finite
        new_scales = torch.where(moved, _pow2_scale(amax), self.master_scale)
        ratio = torch.cat([new_scales / self.master_scale, new_scales.new_ones(1)])[self._frag_of_group]
        codes = self.master.values
        codes.copy_(codes.float().view(-1, GROUP).mul_(ratio[:, None]).view(-1))
        self.master_scale.copy_(new_scales)

    # ---- publishing the new weights -------------------------------------------------------------
    def publish(self) -> None:
        """Write every owned shard into the model (high precision, or FP8 bytes for FP8 layers under
        --fp8-param-gather), then start the DP all-gather. A layer the saturation guard switched (in this
        run, or in the run a checkpoint came from) is published in high precision."""
        invalidate_fp8_weight_caches(self.ddp.module)
        self.ddp.take_guard_switches()
        whole = self._whole_shard_buckets()
        if self.master_weight_dtype == "fp32":  # the master is its own decode: one foreach copy of views, no temporary
            params, masters = self._shard_views(whole)
            if params:
                torch._foreach_copy_(params, masters)
        elif self.fused_step and whole:  # codes / their tensor's scale, one launch per shard: the slab decode's bits
            scale_of_group = torch.cat([self.master_scale, self.master_scale.new_ones(1)])[self._frag_of_group]
            for param, codes, shard in zip(*self._shard_views(whole), [sh for sh in self._shards if sh[0] in whole]):
                fused_adamw_coded.publish_fp16_master_triton(codes, scale_of_group, shard[3] // GROUP, param)
        slabs = [] if self.master_weight_dtype == "fp32" or self.fused_step else self._slabs
        for slab, views in zip(slabs, self._slab_param_views()):
            picks = [k for k, (bucket, _lo, _hi) in enumerate(slab.pieces) if bucket in whole]
            if not picks:
                continue
            values = self._decode_storage(slab.start, slab.n)  # one decode per slab (padding holds zeros in both)
            if len(slab.pieces) == 1:
                views[0].copy_(values)
            else:
                parts = values.split(slab.sizes)
                torch._foreach_copy_([views[k] for k in picks], [parts[k] for k in picks])
        for frag in self.fragments:
            if frag.param not in self.ddp.fp8_params and frag.bucket not in whole:
                self.write_high_precision(frag)
        if self.ddp.fp8_params:
            if self._fp8_publication is None or self._fp8_publication.key != publication_key(self.ddp.fp8_params):
                self._fp8_publication = Fp8Publication(self)  # built once, again when a plan moves a gathered weight
            self._fp8_publication.publish()
        self.ddp.start_param_sync()

    def _whole_shard_buckets(self) -> set[Bucket]:
        """Buckets whose owned shard is written to ``param_data`` as is: high-precision weights only."""
        special = set(self.ddp.fp8_params) | set(self.ddp.switched_weights)
        return {b for b, *_ in self._shards if b.param_data is not None and not any(p in special for p in b.params)}

    def _shard_views(self, whole: set[Bucket]) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """The param_data views of the ``whole`` buckets' shards and their master views, built again only when
        a bucket's param_data or the set changed (views made per step would cost ops per bucket)."""
        key = (tuple(id(b.param_data) for b in self.ddp.buckets), frozenset(id(b) for b in whole))
        if self._shard_view_cache is None or self._shard_view_cache[0] != key:
            picked = [(b, lo, hi, s) for b, lo, hi, s in self._shards if b in whole]
            self._shard_view_cache = (key, ([b.param_data[lo:hi] for b, lo, hi, _s in picked],
                                            [self.master.values[s:s + hi - lo] for _b, lo, hi, s in picked]))
        return self._shard_view_cache[1]

    def _slab_param_views(self) -> list[list[torch.Tensor | None]]:
        """Per slab piece, its bucket's param_data view (None once released), built again only when a bucket's
        param_data changed (the FP8 buckets' release): views made per step would cost ops per bucket."""
        key = tuple(id(b.param_data) for b in self.ddp.buckets)
        if self._param_views is None or self._param_views[0] != key:
            views = [[None if b.param_data is None else b.param_data[lo:hi] for b, lo, hi in slab.pieces]
                     for slab in self._slabs]
            self._param_views = (key, views)
        return self._param_views[1]

    def _decode_storage(self, start: int, n: int) -> torch.Tensor:
        """The master values of storage ``[start, start + n)`` (group-aligned), in fp32."""
        values = self.master.decode(start, start + n)
        if self.master_weight_dtype != "fp16":
            return values
        scales = torch.cat([self.master_scale, self.master_scale.new_ones(1)])[self._frag_of_group[self._groups(start, n)]]
        return (values.view(-1, GROUP) / scales[:, None]).view(-1)

    def drop_fp8_publication(self) -> None:
        """Forget the FP8 publication (a precision plan changed a gathered weight's recipe): the next publish builds it."""
        self._fp8_publication = None

    def write_high_precision(self, frag: Fragment) -> None:
        for b, s, n, _pl in self._chunks(frag):
            self.ddp.param_shard_view(frag.param, b, n).copy_(self._decode_master(frag, s, n))

    # ---- accounting -----------------------------------------------------------------------------
    def state_tensors(self) -> list[torch.Tensor]:
        return [*self.master.tensors().values(), self.master_scale, *self.exp_avg.tensors().values(),
                *self.exp_avg_sq.tensors().values()]

    def model_state_bytes_per_param(self) -> float:
        """(weights + grads + master + optimizer state held by this rank) / parameters of this rank's
        model shard, from the actual tensors."""
        return tensor_bytes(self.ddp.state_tensors() + self.state_tensors()) / self.ddp.num_params()

    # ---- checkpointing (megafp8.optim.optimizer_checkpoint) ---------------------------------------
    def state_dict(self, device: torch.device | str = "cpu") -> dict:
        """This rank's shard, each fragment addressed by parameter name and flat ``[start, end)`` (a checkpoint
        saved at one DP size loads at another), as copies on ``device``: the host by default, each slice copied
        straight there, so collecting a checkpoint adds no device memory."""
        return optimizer_state_dict(self, device)

    @torch.no_grad()
    def load_state_dict(self, state_dicts: dict | list[dict]) -> None:
        """Load from the state dicts of every DP rank of the saving run (same TP/PP position), any DP size."""
        load_optimizer_state_dicts(self, [state_dicts] if isinstance(state_dicts, dict) else list(state_dicts))
        self.publish()


def _pow2_scale(amax: torch.Tensor) -> torch.Tensor:
    """Power-of-two scales putting each amax in [2^10, 2^11); 1 where the amax is 0 or not finite."""
    scale = torch.exp2(FP16_SCALE_TARGET - torch.floor(torch.log2(amax)))
    return torch.where((amax > 0) & torch.isfinite(amax), scale, torch.ones_like(scale))


def _world_handle(ps) -> GroupHandle:
    if ps.world_size == 1 or not dist.is_initialized():
        return GroupHandle.solo(ps.rank, ps.comm)
    return GroupHandle(group=dist.group.WORLD, ranks=tuple(range(ps.world_size)), rank=ps.rank, counters=ps.comm)

