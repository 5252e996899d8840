"""Data parallelism: one contiguous main-grad buffer split into buckets, each reduced over DP as soon as
its grads are complete (reduce-scatter for the distributed optimizer, all-reduce for plain DDP), and
the bucketed parameter all-gather that follows a ZeRO step (high precision, or FP8 bytes; a weight the
saturation guard moved out of FP8 travels in high precision beside its FP8 bucket: switched_weight.py).
With ``--fp8-grad-reduce`` the buckets of FP8 layers' weights are reduce-scattered as FP8 bytes instead
(an all-to-all and a local fp32 sum: fp8_grad_reduce.py).

Layout (Megatron-Core's ``ParamAndGradBuffer``, built in grad_buffer.py): parameters are laid out in reverse
registration order (the order backward finishes them) in one flat buffer per (grad-sync group, parameter dtype): the
group of each parameter's ``Placement`` (placement.py; the DP x CP group for every parameter today, so one buffer
per dtype), which reduces its buckets, gathers them and spreads their shards. Every parameter starts on a
128-element boundary and every bucket is padded to a multiple of ``DP x 128`` elements, so the DP
shards of a bucket (rank r owns elements ``[r S, (r+1) S)``, ``S = numel / DP``) never cut a
128-element group of a parameter: the optimizer's per-group codec scales then stay whole, and a
checkpoint written at one DP size re-slices exactly at another. ``param.main_grad`` is a view into
the buffer; parameter values live in per-bucket buffers (``param.data`` is a view), so a gather
writes straight into the parameters. A bucket's FP8 bytes (``fp8_data``) are sized and addressed in bytes: its
format's ``bits`` per element (megafp8_kernels.element_format), so a packed format takes fewer than one each.

Extra reductions of replicated parameters happen once, when their bucket is reduced: grads of
parameters whose placement sums them over TP (sequence-parallel norm weights and row-parallel biases) are summed
(inside backward: every TP rank runs the same schedule); the tied embedding's two copies under
pipeline parallelism (the last stage's ``shared_embedding`` output weight and the first stage's
embedding weight) are summed over the embedding group in ``finish_grad_sync``, never inside backward
(the first stage reaches its embedding's backward only after the last stage's backward has run, so a
blocking collective there would deadlock); their buckets are reduced over DP after that sum. Do not
also call ``tensor_parallel.allreduce_sequence_parallel_grads`` or the pipeline's tied-embedding sum.
"""
from __future__ import annotations

import collections
import contextlib
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import torch
from torch import nn

from megafp8.fp8 import Float8Tensor, Fp8GemmModule, Fp8Recipe, PrecisionChange, plan_of, precision_plans
from megafp8.fp8.precision_plan import weight_format_bits
from megafp8.parallel import collectives as C
from megafp8.parallel.collectives import GroupHandle
from megafp8.parallel.fp8_grad_reduce import fp8_reduce_scatter_async
from megafp8.parallel.grad_buffer import ALIGN, BYTE_BITS, Bucket, bucket_layouts, fp8_bits, packed_shape, \
    param_piece_segments
from megafp8.parallel.parallel_state import ParallelState
from megafp8.parallel.placement import attach_placements, placement_of
from megafp8.parallel.switched_weight import SwitchedWeight

__all__ = ["ALIGN", "Bucket", "DDPConfig", "DistributedDataParallel", "Fp8ParamInfo", "gathers_as_bytes",
           "tensor_bytes"]


@dataclass
class DDPConfig:
    """The data-parallel flags (Megatron names): --use-distributed-optimizer, --overlap-grad-reduce,
    --overlap-param-gather, --fp8-param-gather, --grad-reduce-in-bf16, --ddp-bucket-size (elements;
    None = one bucket per kind of parameter), --fp8-grad-reduce. ``fp8_recipe``: the run's recipe, for FP8 layers that
    follow fp8_autocast instead of holding their own. ``num_microbatches``: backward passes per iteration
    that run outside ``no_sync()`` (a pipeline schedule runs all of them; see ``DistributedDataParallel``)."""

    use_distributed_optimizer: bool = False
    overlap_grad_reduce: bool = False
    overlap_param_gather: bool = False
    fp8_param_gather: bool = False
    grad_reduce_in_bf16: bool = False
    fp8_grad_reduce: bool = False
    bucket_size: int | None = None
    fp8_recipe: Fp8Recipe | None = None
    num_microbatches: int = 1

    def __post_init__(self) -> None:
        if self.bucket_size is not None and self.bucket_size < 1:
            raise ValueError(f"--ddp-bucket-size must be >= 1, got {self.bucket_size}")
        if self.fp8_param_gather and not self.use_distributed_optimizer:
            raise ValueError("--fp8-param-gather needs --use-distributed-optimizer (the owner of a shard casts it)")
        if self.overlap_param_gather and not self.use_distributed_optimizer:
            raise ValueError("--overlap-param-gather needs --use-distributed-optimizer")
        if self.fp8_grad_reduce and not self.use_distributed_optimizer:
            raise ValueError("--fp8-grad-reduce needs --use-distributed-optimizer (it is a reduce-scatter)")

    @classmethod
    def from_args(cls, args, fp8_recipe: Fp8Recipe | None = None) -> "DDPConfig":
        return cls(use_distributed_optimizer=getattr(args, "use_distributed_optimizer", False),
                   overlap_grad_reduce=getattr(args, "overlap_grad_reduce", False),
                   overlap_param_gather=getattr(args, "overlap_param_gather", False),
                   fp8_param_gather=getattr(args, "fp8_param_gather", False)
                   or getattr(args, "fp4_param_gather", False),  # one gather path: the weight's recipe picks the bytes
                   grad_reduce_in_bf16=getattr(args, "grad_reduce_in_bf16", False),
                   fp8_grad_reduce=getattr(args, "fp8_grad_reduce", False),
                   bucket_size=getattr(args, "ddp_bucket_size", None), fp8_recipe=fp8_recipe,
                   num_microbatches=getattr(args, "num_micro_batches", None) or 1)


@dataclass(eq=False)
class Fp8ParamInfo:
    """How an FP8 layer's weight is cast and handed over after the gather."""

    module: Fp8GemmModule
    recipe: Fp8Recipe
    scale_inv: torch.Tensor | None = None  # written by the optimizer; identical on every DP rank
    global_scale_inv: torch.Tensor | None = None  # NVFP4's per-tensor decode scale (--fp4-param-gather)


def gathers_as_bytes(recipe: Fp8Recipe) -> bool:
    """Whether a weight under ``recipe`` is all-gathered as its quantized bytes: the FP8 recipes, and NVFP4's 16x16
    weight tiles (one copy serves fprop and dgrad). An MX weight's 1x32 copy and its transposed copy are each
    quantized from high precision (their groups run along different axes): gathering both would cost 2.06 bytes per
    element, more than BF16's 2, so such a weight is gathered in high precision (Megatron-Core gathers MXFP8
    weights in BF16 too)."""
    layout = recipe.quantizer("weight").layout
    return not recipe.is_microscaled or (layout.two_level and layout.transpose_is_relayout)


def _fp8_params(module: nn.Module, default_recipe: Fp8Recipe | None) -> dict[nn.Parameter, Fp8ParamInfo]:
    infos = {}
    for m in module.modules():
        if isinstance(m, Fp8GemmModule) and isinstance(getattr(m, "weight", None), nn.Parameter):
            recipe = m.recipe or default_recipe
            if recipe is not None and not m.runs_high_precision:
                infos[m.weight] = Fp8ParamInfo(m, recipe)
    return infos


def _tied_embedding_params(module: nn.Module, parallel_state: ParallelState) -> set[nn.Parameter]:
    """The two copies of a tied embedding split over pipeline stages: the last stage's output weight
    (tagged ``shared_embedding`` by the model) and the first stage's embedding weight of a model chunk
    that ties its embeddings but holds no output head. On a V layout one rank holds both ends and its
    head uses the embedding Parameter itself: nothing to sum across stages (the last pipeline rank holds
    no embedding and never joins the embedding group's collective)."""
    if parallel_state.pp_size == 1:
        return set()
    params = {p for p in module.parameters() if getattr(p, "shared_embedding", False)}
    heads = {getattr(m.output_layer, "weight", None) for m in module.modules() if getattr(m, "post_process", False)}
    for m in module.modules():
        config = getattr(m, "config", None)
        if getattr(config, "tie_embeddings", False) and getattr(m, "pre_process", False) \
                and not getattr(m, "post_process", False) and m.embedding.weight not in heads:
            params.add(m.embedding.weight)
    return params


class DistributedDataParallel(nn.Module):
    """Wraps a model: forward passes through; owns the grad buffer, buckets and their DP reductions.

    Per iteration: ``zero_grad_buffer()``, forward/backward of every micro-batch (with overlap: all but
    the last inside ``no_sync()``, or set ``num_microbatches``), ``finish_grad_sync()``, the optimizer
    step (which calls ``start_param_sync()`` under the distributed optimizer).
    """

    def __init__(self, module: nn.Module | Sequence[nn.Module], parallel_state: ParallelState,
                 config: DDPConfig | None = None) -> None:
        super().__init__()
        # A list of modules: the model chunks of one pipeline rank (virtual stages share one buffer); each
        # chunk names its parameters itself (layout-free names, as checkpoints expect).
        chunks = [module] if isinstance(module, nn.Module) else list(module)
        self.module = module if isinstance(module, nn.Module) else nn.ModuleList(chunks)
        self.config = config or DDPConfig()
        self.parallel_state = parallel_state
        self.dp: GroupHandle = parallel_state.dp_group
        self.tp: GroupHandle = parallel_state.tp_group
        self.distributed = self.config.use_distributed_optimizer
        module = self.module
        self.param_names = {p: n for chunk in chunks for n, p in chunk.named_parameters()}
        # Separate backward passes per micro-batch that reach a parameter: one per pipeline chunk using it
        # (a V schedule's tied embedding feeds the first chunk and the head of the last: two).
        parts = list(module) if isinstance(module, nn.ModuleList) else chunks
        uses = collections.Counter(p for part in parts for p in part.parameters())
        self.backward_passes = {p: n for p, n in uses.items() if n > 1}
        # The weights gathered as FP8 bytes: those of FP8 layers, until the saturation guard switches one
        # (take_guard_switches moves it to switched_weights; its bucket keeps the FP8 layout).
        self.fp8_params = {p: info for p, info in _fp8_params(module, self.config.fp8_recipe).items()
                           if gathers_as_bytes(info.recipe)} if self.config.fp8_param_gather else {}
        self.switched_weights: dict[nn.Parameter, SwitchedWeight] = {}
        # The chunks' precision plans tell this wrapper of every layer they move (no polling of the layers): a weight
        # gathered as FP8 whose layer went to high precision waits here until take_guard_switches moves it.
        self.precision_plans = precision_plans(module)
        self.demoted_fp8_params: dict[nn.Parameter, None] = {}  # ordered set
        for plan in self.precision_plans:
            plan.on_change(self._on_precision_change)
        # The weights whose grads are reduced as FP8 (fixed at construction: a weight the guard later switches
        # keeps its bucket; its grads are as well-scaled as any other's, the guard acts on forward casts).
        self.fp8_grad_params = set(_fp8_params(module, self.config.fp8_recipe)) if self.config.fp8_grad_reduce \
            else set()
        self.tied_embedding_params = _tied_embedding_params(module, parallel_state)
        grad_dtype = torch.bfloat16 if self.config.grad_reduce_in_bf16 else torch.float32
        params = [p for p in module.parameters() if p.requires_grad]
        self.buckets: list[Bucket] = []
        self.grad_buffers: list[torch.Tensor] = []
        attach_placements(params)
        # One buffer per (grad-sync group, dtype), in first-appearance order: with the one DP group of today
        # the buffers, their bucket order and their bytes are those of a buffer per dtype.
        for sync, dtype in dict.fromkeys((placement_of(p).grad_sync_group, p.dtype) for p in params):
            self._build_buffer([p for p in params if p.dtype == dtype and placement_of(p).grad_sync_group == sync],
                               grad_dtype, parallel_state.group(sync))
        self.bucket_of = {p: b for b in self.buckets for p in b.params}
        self._sync_enabled = True
        # Backward passes per iteration (micro-batches): a bucket is complete once every parameter's grad
        # hook fired this often. A pipeline schedule that runs all micro-batches itself sets it; a loop that
        # wraps all but the last micro-batch in no_sync() leaves it at 1.
        self.num_microbatches = self.config.num_microbatches
        for p in params:
            p.register_post_accumulate_grad_hook(self._make_grad_hook())
        self._hook_handles = []
        if self.config.overlap_param_gather:
            for m in module.modules():
                if any(True for _ in m.parameters(recurse=False)):
                    self._hook_handles.append(m.register_forward_pre_hook(self._param_sync_pre_hook))

    # ---- layout -------------------------------------------------------------------------------
    def _build_buffer(self, params: list[nn.Parameter], grad_dtype: torch.dtype, group: GroupHandle) -> None:
        layouts = bucket_layouts(params, self._bucket_kind, self.config.bucket_size, group.size)
        grad_buffer = torch.zeros(sum(numel for _, _, numel, _ in layouts), dtype=grad_dtype, device=params[0].device)
        self.grad_buffers.append(grad_buffer)
        for members, offset, numel, ranges in layouts:
            param_data = torch.zeros(numel, dtype=members[0].dtype, device=grad_buffer.device)
            bucket = Bucket(len(self.buckets), members, offset, numel, ranges, grad_buffer[offset:offset + numel],
                            param_data, fp8=members[0] in self.fp8_params, fp8_grad=members[0] in self.fp8_grad_params,
                            deferred=any(p in self.tied_embedding_params for p in members), group=group,
                            fp8_bits=self._bucket_kind(members[0])[1])
            for p, (start, end) in ranges.items():
                param_data[start:end].copy_(p.detach().reshape(-1))
                p.data = param_data[start:end].view(p.shape)
                p.main_grad = bucket.grad_data[start:end].view(p.shape)
            self.buckets.append(bucket)

    def _bucket_kind(self, p: nn.Parameter) -> tuple[bool, int]:
        """FP8 layers' weights share buckets only with each other (both FP8 paths select the same weights), and
        only with weights of as many bits per element (one bucket's bytes are addressed at one rate)."""
        info = self.fp8_params.get(p)
        return p in self.fp8_params or p in self.fp8_grad_params, \
            self._widest_weight_bits(info) if info is not None else BYTE_BITS

    @staticmethod
    def _widest_weight_bits(info: Fp8ParamInfo) -> int:
        """Bits per element a weight's FP8 bytes are sized for: the widest format on its layer's precision ladder (a
        layer moved down the ladder later still fits its bucket), or its recipe's format for a layer without one. An
        FP4 weight's bucket is packed at 4 bits: a move to any other recipe gathers it in high precision instead."""
        own = weight_format_bits(info.recipe)
        if own < BYTE_BITS:
            return own
        plan = plan_of(info.module)
        widest = plan.widest_bits(plan.name_of(info.module), lambda r: fp8_bits(r.dtype("weight"))) if plan else None
        return widest if widest is not None else own

    def _on_precision_change(self, changes: list[PrecisionChange]) -> None:
        """A plan moved layers: record the FP8-gathered weights that left FP8, follow the recipe of those that stay."""
        for change in changes:
            weight = getattr(change.module, "weight", None)
            info = self.fp8_params.get(weight) if isinstance(weight, nn.Parameter) else None
            if info is None:
                continue
            bits = self.bucket_of[weight].fp8_bits
            if change.new is None or (bits < BYTE_BITS and change.new != info.recipe) \
                    or not gathers_as_bytes(change.new):  # its layer quantizes a high-precision weight itself
                self.demoted_fp8_params[weight] = None
                continue
            if weight_format_bits(change.new) != bits:
                # Its bucket's bytes are addressed at one rate: a narrower rung needs per-weight addressing first.
                raise NotImplementedError(f"--fp8-param-gather: {self.param_names[weight]} moved to a weight format of "
                                          f"another width than its bucket's {self.bucket_of[weight].fp8_bits} bits")
            self.demoted_fp8_params.pop(weight, None)
            info.recipe = change.new

    def forward(self, *args, **kwargs):
        return self.module(*args, **kwargs)

    # ---- gradients ----------------------------------------------------------------------------
    def _make_grad_hook(self):
        def hook(param: nn.Parameter) -> None:
            if param.grad is not None:  # grads the FP8 op did not accumulate into main_grad itself
                param.main_grad.add_(param.grad.to(param.main_grad.dtype))
                param.grad = None
            if self.config.overlap_grad_reduce and self._sync_enabled:
                bucket = self.bucket_of[param]
                if bucket.grad_work is not None:
                    raise RuntimeError(
                        f"--overlap-grad-reduce: a gradient of {self.param_names[param]} arrived after its bucket's "
                        "DP reduction started; run every micro-batch but the last inside ddp.no_sync(), or set "
                        "ddp.num_microbatches to the number of backward passes per iteration")
                bucket.ready[param] = bucket.ready.get(param, 0) + 1
                if len(bucket.ready) == len(bucket.params) and bucket.grad_work is None and not bucket.deferred \
                        and all(n >= self.num_microbatches * self.backward_passes.get(p, 1)
                                for p, n in bucket.ready.items()):
                    self._start_grad_reduce(bucket)
        return hook

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Accumulate grads without reducing them (every micro-batch but the last)."""
        self._sync_enabled = False
        try:
            yield
        finally:
            self._sync_enabled = True

    def zero_grad_buffer(self) -> None:
        for grad_buffer in self.grad_buffers:
            grad_buffer.zero_()
        for bucket in self.buckets:
            bucket.ready.clear()
            bucket.grad_work = None
        for p in self.bucket_of:
            p.grad = None

    def _replicated_reductions(self, bucket: Bucket) -> None:
        """Sums that make replicated parameters' grads whole, once per bucket, before the DP reduction."""
        sp = [p.main_grad for p in bucket.params if placement_of(p).grad_sum_group == "tp"]
        if sp and self.tp.size > 1:
            flat = torch.cat([g.reshape(-1) for g in sp])
            C.all_reduce(flat, self.tp, "tp_allreduce")
            for g, reduced in zip(sp, flat.split([g.numel() for g in sp])):
                g.copy_(reduced.view_as(g))
        for p in bucket.params:
            if p in self.tied_embedding_params:
                C.all_reduce(p.main_grad, self.parallel_state.embedding_group, "embedding_allreduce")

    def _start_grad_reduce(self, bucket: Bucket) -> None:
        self._replicated_reductions(bucket)
        group = bucket.group
        # Average over the DP x CP replicas (a sum of per-replica mean losses / DP x CP), Megatron-Core's gradient
        # scaling for every parameter: an expert's holders (its expert-data-parallel group) together saw every
        # replica's tokens routed to it, so their sum is divided by DP x CP too, not by their own number.
        if self.dp.size > 1:
            bucket.grad_data.div_(self.dp.size)
        if group.size == 1:
            bucket.grad_work = True
            return
        if bucket.fp8_grad:
            if bucket.fp8_grad_segments is None:
                bucket.fp8_grad_segments = param_piece_segments(bucket, group.size)
            bucket.grad_work = fp8_reduce_scatter_async(bucket.grad_data, group, "dp_grad_reduce",
                                                        segments=bucket.fp8_grad_segments)
        elif self.distributed:
            size = bucket.numel // group.size
            shard_out = torch.empty(size, dtype=bucket.grad_data.dtype, device=bucket.grad_data.device)
            bucket.grad_work = C.reduce_scatter_tensor_async(shard_out, bucket.grad_data, group, "dp_grad_reduce")
        else:
            bucket.grad_work = C.all_reduce_async(bucket.grad_data, group, "dp_grad_reduce")

    def finish_grad_sync(self) -> None:
        """Start the reductions backward did not start, wait for all: afterwards each rank's owned
        range of every bucket holds the DP-averaged grad (all of it without the distributed optimizer)."""
        for bucket in self.buckets:
            if bucket.grad_work is None:
                self._start_grad_reduce(bucket)
        for bucket in self.buckets:
            if bucket.grad_work is not True:
                reduced = bucket.grad_work.wait()
                if self.distributed:  # a shard (reduce-scatter or FP8); plain DDP reduced grad_data in place
                    start, end = bucket.shard_range(bucket.group.rank, bucket.group.size, True)
                    bucket.grad_data[start:end].copy_(reduced)
            bucket.grad_work = True

    # ---- parameters ---------------------------------------------------------------------------
    def release_fp8_param_storage(self) -> None:
        """Drop the high-precision values of FP8 layers' weights (the optimizer holds their master):
        the Parameter stays the autograd leaf (its grad goes to main_grad) but holds one element."""
        for bucket in self.buckets:
            if bucket.fp8 and bucket.param_data is not None:
                bucket.fp8_data = torch.zeros(bucket.fp8_bytes(bucket.numel), dtype=torch.uint8,
                                              device=bucket.grad_data.device)
                for p in bucket.params:
                    p.data = torch.zeros(1, dtype=p.dtype, device=p.device).expand(p.shape)
                bucket.param_data = None

    def take_guard_switches(self) -> list[SwitchedWeight]:
        """Move the weights of FP8 layers that now run in high precision (the saturation guard switched them)
        off the FP8 path: each gets a whole high-precision weight (``param.data``) and a padded shard for its
        own all-gather. Returns the newly switched; their values arrive with the next gather of their shards.
        Consumes the switches the precision plans reported (in fp8_params order, the same on every rank)."""
        new = []
        for p, info in [(p, info) for p, info in self.fp8_params.items() if p in self.demoted_fp8_params]:
            del self.fp8_params[p]
            self.switched_weights[p] = SwitchedWeight.take(p, self.bucket_of[p], self.bucket_of[p].group)
            info.module.invalidate_weight_cache()
            new.append(self.switched_weights[p])
        self.demoted_fp8_params.clear()
        return new

    def param_shard_view(self, param: nn.Parameter, bucket_lo: int, n: int) -> torch.Tensor:
        """Where the owner of elements ``[bucket_lo, bucket_lo + n)`` of ``param``'s bucket writes their
        high-precision values before the gather (not for weights gathered as FP8 bytes)."""
        switched = self.switched_weights.get(param)
        if switched is not None:
            lo = bucket_lo - switched.owned_bucket_lo
            return switched.shard[lo:lo + n]
        return self.bucket_of[param].param_data[bucket_lo:bucket_lo + n]

    def gather_switched_weights(self, switched: list[SwitchedWeight]) -> None:
        """All-gather these switched weights' shards now (a switch between two publishes)."""
        for sw in switched:
            sw.pending = True
            sw.start_gather(sw.bucket.group)
        for sw in switched:
            sw.finish_gather(sw.bucket.group)

    def _switched_in(self, bucket: Bucket) -> list[SwitchedWeight]:
        return [sw for sw in self.switched_weights.values() if sw.bucket is bucket]

    def start_param_sync(self) -> None:
        """After the optimizer wrote each rank's owned shard: all-gather every bucket now, or (with
        --overlap-param-gather) on demand in the next forward, one bucket ahead."""
        if not self.distributed:
            self._inject_fp8_weights_all()
            return
        for bucket in self.buckets:
            bucket.param_sync_pending = True
        for sw in self.switched_weights.values():
            sw.pending = True
        if not self.config.overlap_param_gather:
            self.finish_param_sync()

    def _gather_source(self, bucket: Bucket) -> tuple[torch.Tensor, int, int]:
        """The buffer a gather fills and this rank's shard of it: bytes of fp8_data, or elements of param_data."""
        start, end = bucket.shard_range(bucket.group.rank, bucket.group.size, True)
        if bucket.fp8_data is not None:
            return bucket.fp8_data, bucket.fp8_bytes(start), bucket.fp8_bytes(end)
        return bucket.param_data, start, end

    def _start_param_gather(self, bucket: Bucket) -> None:
        if not bucket.param_sync_pending or bucket.param_work is not None:
            return
        for sw in self._switched_in(bucket):
            sw.start_gather(bucket.group)
        if bucket.group.size == 1:
            bucket.param_work = True
            return
        data, start, end = self._gather_source(bucket)
        shard = data[start:end].clone()  # the gather's output holds the input: do not alias them
        bucket.param_work = C.all_gather_into_tensor_async(data, shard, bucket.group, "dp_param_allgather")

    def _finish_param_gather(self, bucket: Bucket) -> None:
        if not bucket.param_sync_pending:
            return
        self._start_param_gather(bucket)
        if bucket.param_work is not True:
            bucket.param_work.wait()
        bucket.param_work, bucket.param_sync_pending = None, False
        for sw in self._switched_in(bucket):
            sw.finish_gather(bucket.group)
        if bucket.fp8:
            self._inject_fp8_weights(bucket)

    def finish_param_sync(self) -> None:
        for bucket in self.buckets:
            self._start_param_gather(bucket)
        for bucket in self.buckets:
            self._finish_param_gather(bucket)

    def _param_sync_pre_hook(self, module: nn.Module, _args) -> None:
        if torch.compiler.is_compiling():  # a compiled layer ran this hook eagerly before its graph (model/compile.py)
            return
        for p in module.parameters(recurse=False):
            bucket = self.bucket_of.get(p)
            if bucket is None or not bucket.param_sync_pending:
                continue
            # Forward runs the buckets backwards (bucket 0 holds the last layers): prefetch the next one.
            if bucket.index > 0:
                self._start_param_gather(self.buckets[bucket.index - 1])
            self._finish_param_gather(bucket)

    _param_sync_pre_hook.reads_no_input = True  # grouped MoE GEMMs run it by hand (megafp8.model.grouped_gemm)

    def _inject_fp8_weights(self, bucket: Bucket) -> None:
        for p in bucket.params:
            info = self.fp8_params.get(p)
            if info is None:  # switched to high precision by the saturation guard
                continue
            fmt = info.recipe.quantizer("weight").format  # E2M1 is stored as uint8, two per byte
            data = bucket.fp8_slice(*bucket.ranges[p]).view(fmt.dtype).view(packed_shape(p.shape, bucket.fp8_bits))
            info.module.set_fp8_weight(Float8Tensor(tuple(p.shape), fmt, info.recipe.granularity("weight"),
                                                    data, info.scale_inv, global_scale_inv=info.global_scale_inv))

    def _inject_fp8_weights_all(self) -> None:
        for bucket in self.buckets:
            if bucket.fp8 and bucket.fp8_data is not None:
                self._inject_fp8_weights(bucket)

    # ---- accounting ---------------------------------------------------------------------------
    def state_tensors(self) -> list[torch.Tensor]:
        """Every tensor of model weights and grads this rank holds (for model_state_bytes_per_param)."""
        tensors = list(self.grad_buffers)
        for bucket in self.buckets:
            tensors += [t for t in (bucket.param_data, bucket.fp8_data) if t is not None]
        tensors += [t for info in self.fp8_params.values() for t in (info.scale_inv, info.global_scale_inv)
                    if t is not None]
        tensors += [t for sw in self.switched_weights.values() for t in (sw.shard, sw.weight)]
        return tensors

    def num_params(self) -> int:
        return sum(p.numel() for p in self.bucket_of)


def tensor_bytes(tensors: list[torch.Tensor]) -> int:
    """Bytes of distinct storages behind ``tensors`` (views of one buffer are counted once)."""
    seen, total = set(), 0
    for t in tensors:
        storage = t.untyped_storage()
        if storage.data_ptr() in seen:
            continue
        seen.add(storage.data_ptr())
        total += storage.nbytes()
    return total


