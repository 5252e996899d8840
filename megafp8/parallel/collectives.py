"""The one module every collective goes through: thin wrappers over torch.distributed that count the
bytes this rank sends per collective kind and move low-precision payloads (float8, packed FP4, E8M0 scales) as uint8
views.

Byte-counting convention ("bytes this rank puts on the wire" under the ring / direct algorithms that
NCCL and gloo use, i.e. NCCL-tests' bus bytes), with ``n`` the group size and ``B`` byte sizes:

=====================  =========================================================
collective             bytes charged to the calling rank
=====================  =========================================================
all-gather             ``B(local shard) * (n - 1)``  (every peer needs our shard)
reduce-scatter         ``B(input) / n * (n - 1)``    (one output-sized chunk per peer)
all-reduce             ``2 * B(tensor) * (n - 1) // n`` (reduce-scatter + all-gather)
all-to-all             ``B(input) / n * (n - 1)``    (one equal chunk to each peer; ours stays)
send                   ``B(tensor)``; a receive is charged nothing (the sender paid)
=====================  =========================================================

Groups of size 1 issue no collective and are charged nothing. Payloads are charged at their bytes (FP8: one per
element; a packed 4-bit format: one per two), and their scales separately under the same kind, so an FP8
all-gather's counter is exactly what a uint8 + fp32-scale transfer costs. QuantizedTensors travel through
quantized_collectives.py, which packs each one's parts into one collective.

These wrappers are not differentiable (inputs are detached); ``mappings`` pairs them into autograd Functions.
The ``*_async`` variants return a ``PendingCollective`` whose ``wait()`` gives the result, so a caller can
compute while the collective is in flight (the FP8 linear runs wgrad under the dgrad reduce-scatter).
"""
from __future__ import annotations

import math
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist

from megafp8_kernels import wire_bytes

# The keys of `comm_bytes` in metrics.jsonl (see DESIGN.md). A fixed set catches a misspelt kind at
# the call site instead of silently opening a new counter.
COMM_KINDS: tuple[str, ...] = (
    "tp_sp_allgather",      # sequence-parallel all-gather along the sequence dim (activations)
    "tp_reduce_scatter",    # sequence-parallel reduce-scatter after row-parallel layers / in backward
    "tp_allreduce",         # TP all-reduce: row-parallel output without SP, column input grads, CE
    "tp_allgather",         # TP all-gather along the last (hidden / vocab) dim, e.g. gather_output
    "pp_p2p",               # pipeline send/recv of activations and their grads
    "cp_kv_p2p",            # context-parallel ring exchange of K/V (and their grads in backward)
    "dp_grad_reduce",       # data-parallel gradient all-reduce / reduce-scatter
    "dp_param_allgather",   # ZeRO parameter all-gather after the optimizer step
    "amax_reduce",          # FP8 amax reduction over the TP x DP group
    "embedding_allreduce",  # tied-embedding grad all-reduce between first and last PP stage
    "ep_alltoall",          # MoE token dispatch to the experts' ranks and the combine back (expert parallelism)
    "ep_allgather",         # the same with --moe-token-dispatcher-type allgather: tokens gathered, sums reduce-scattered
    "etp_allgather",        # --expert-tensor-parallel-size: an expert's rows gathered from its ETP ranks (and in backward)
    "etp_reduce_scatter",   # its outputs reduce-scattered back to them (and its rows' gradient in backward)
)

# torch 2.13 renamed the tensor-in/tensor-out collectives and deprecated the old names; GPU machines
# may bring an older torch that only has the old ones.
_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


class CommCounters:
    """Bytes sent by this rank per collective kind (and how many collectives), reset by the training loop
    once per iteration."""

    def __init__(self) -> None:
        self._bytes = dict.fromkeys(COMM_KINDS, 0)
        self._calls = dict.fromkeys(COMM_KINDS, 0)
        # Never reset, for the hang watchdog (megafp8.training.hang_watchdog): collectives entered per group (global
        # ranks; () for point-to-point) and the last one entered.
        self.entered: dict[tuple[int, ...], int] = {}
        self.last_entered: dict | None = None
        # Seconds this rank's thread spent blocked in collectives' waits (PendingCollective.wait), for the straggler
        # report: an iteration's time minus them is the rank's own work. Read and reset by take_wait_seconds.
        self.wait_seconds = 0.0

    def take_wait_seconds(self) -> float:
        seconds, self.wait_seconds = self.wait_seconds, 0.0
        return seconds

    def add(self, kind: str, nbytes: int, ranks: tuple[int, ...] = ()) -> None:
        """Charge a collective this rank enters now; ``ranks``: its group's global ranks."""
        if kind not in self._bytes:
            raise KeyError(f"unknown collective kind {kind!r}; known kinds: {', '.join(COMM_KINDS)}")
        self._bytes[kind] += int(nbytes)
        self._calls[kind] += 1
        number = self.entered[ranks] = self.entered.get(ranks, 0) + 1
        self.last_entered = dict(kind=kind, ranks=list(ranks), bytes=int(nbytes), number=number)

    def __getitem__(self, kind: str) -> int:
        return self._bytes[kind]

    def calls(self, kind: str) -> int:
        """Collectives of this kind issued since the last reset (one per add)."""
        return self._calls[kind]

    def snapshot(self) -> dict[str, int]:
        return dict(self._bytes)

    def reset(self) -> None:
        self._bytes = dict.fromkeys(COMM_KINDS, 0)
        self._calls = dict.fromkeys(COMM_KINDS, 0)

    def snapshot_and_reset(self) -> dict[str, int]:
        """What `comm_bytes` in metrics.jsonl records for one iteration."""
        snap = self.snapshot()
        self.reset()
        return snap


class RenamedKinds:
    """A view of counters that charges some kinds as others: the tensor-parallel linears count their collectives as
    ``tp_*``, and the same linears inside an expert split over ETP charge them as ``etp_*`` through this."""

    def __init__(self, counters: CommCounters, renamed: dict[str, str]) -> None:
        self._counters, self._renamed = counters, renamed

    def add(self, kind: str, nbytes: int, ranks: tuple[int, ...] = ()) -> None:
        self._counters.add(self._renamed.get(kind, kind), nbytes, ranks)

    def __getattr__(self, name: str):
        return getattr(self._counters, name)

    def __setattr__(self, name: str, value) -> None:  # wait_seconds += ...: the real counters' clock
        if name in ("_counters", "_renamed"):
            object.__setattr__(self, name, value)
        else:
            setattr(self._counters, name, value)


@dataclass(frozen=True)
class GroupHandle:
    """A process group with the facts every caller needs about it and the counters its traffic is charged to.

    ``group`` is None when the group has a single member: no collective is issued then, which also lets
    a TP=1 model run in a process that never initialized torch.distributed.
    """

    group: dist.ProcessGroup | None
    ranks: tuple[int, ...]   # global ranks, in group order
    rank: int                # this process's index inside `ranks`
    counters: CommCounters

    @property
    def size(self) -> int:
        return len(self.ranks)

    @classmethod
    def solo(cls, global_rank: int = 0, counters: CommCounters | None = None) -> "GroupHandle":
        return cls(group=None, ranks=(global_rank,), rank=0, counters=counters or CommCounters())


class PendingCollective:
    """A collective in flight: ``wait()`` blocks until it is done and returns its result (then idempotent)."""

    def __init__(self, result, work: dist.Work | None = None, finish=None,
                 counters: CommCounters | None = None) -> None:
        self._result, self._work, self._finish, self._counters = result, work, finish, counters

    def wait(self):
        """The result; ``finish`` (if given) post-processes the raw output once, after the transfer. The time blocked
        is added to ``counters.wait_seconds`` (a host clock: on a GPU it times the host's wait, not the kernel)."""
        if self._work is not None:
            start = time.perf_counter()
            self._work.wait()
            self._work = None
            if self._counters is not None:
                self._counters.wait_seconds += time.perf_counter() - start
        if self._finish is not None:
            self._result, self._finish = self._finish(self._result), None
        return self._result


def _wire_view(t: torch.Tensor) -> torch.Tensor:
    # gloo and some NCCL builds reject float8 (and packed FP4, E8M0) dtypes; the bytes are what matter on the wire,
    # so every one-byte dtype but the integer ones travels as uint8 (decided by itemsize, not a list of dtypes).
    return wire_bytes(t)


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def all_gather_into_tensor_async(output: torch.Tensor, input_: torch.Tensor, handle: GroupHandle,
                                 kind: str) -> PendingCollective:
    """Gather equal-sized ``input_`` from every group member into ``output`` (concatenated along dim 0).

    Accepts float8 tensors (sent as uint8). ``output`` must be contiguous with ``size * input_.numel()``
    elements of the same dtype.
    """
    if output.dtype != input_.dtype or output.numel() != input_.numel() * handle.size:
        raise ValueError(f"all_gather_into_tensor: output {tuple(output.shape)} {output.dtype} does not hold "
                         f"{handle.size} x input {tuple(input_.shape)} {input_.dtype}")
    if handle.size == 1:
        output.copy_(input_.reshape(output.shape))
        return PendingCollective(output)
    handle.counters.add(kind, _nbytes(input_) * (handle.size - 1), handle.ranks)
    work = _all_gather_single(_wire_view(output), _wire_view(input_.detach().contiguous()), group=handle.group,
                              async_op=True)
    return PendingCollective(output, work, counters=handle.counters)


def all_gather_into_tensor(output: torch.Tensor, input_: torch.Tensor, handle: GroupHandle, kind: str) -> torch.Tensor:
    """Blocking all_gather_into_tensor_async."""
    return all_gather_into_tensor_async(output, input_, handle, kind).wait()


def all_gather(input_: torch.Tensor, handle: GroupHandle, kind: str, dim: int = 0) -> torch.Tensor:
    """Concatenate every member's ``input_`` along ``dim`` (any dtype, float8 included)."""
    if handle.size == 1:
        return input_
    dim = dim % input_.dim()
    if dim == 0:
        gathered = torch.empty((handle.size * input_.shape[0], *input_.shape[1:]), dtype=input_.dtype,
                               device=input_.device)
        return all_gather_into_tensor(gathered, input_, handle, kind)
    # The wire format is dim-0 concatenation; move `dim` to the front and back (copies, but only
    # off the sequence-parallel hot path, which always gathers dim 0).
    moved = input_.movedim(dim, 0).contiguous()
    gathered = torch.empty((handle.size * moved.shape[0], *moved.shape[1:]), dtype=moved.dtype, device=moved.device)
    all_gather_into_tensor(gathered, moved, handle, kind)
    return gathered.movedim(0, dim).contiguous()


def all_gather_quantized_async(data: torch.Tensor, scale_inv: torch.Tensor, handle: GroupHandle,
                               kind: str = "tp_sp_allgather") -> PendingCollective:
    """All-gather an FP8 payload (dim 0) and its fp32 scales in ONE collective: each member sends its bytes
    followed by its scales' bytes; ``wait()`` returns ``(data, scales)``.

    A per-tensor scale (0-dim) comes back as one scale per member, shape ``(size,)``; row/block scales
    whose dim 0 follows the payload's rows are concatenated along dim 0 like the payload.
    """
    scales = scale_inv.reshape(1) if scale_inv.dim() == 0 else scale_inv
    if handle.size == 1:
        return PendingCollective((data, scales))
    n, data_bytes = handle.size, data.numel()
    packed = torch.cat([_wire_view(data.contiguous()).reshape(-1), scales.reshape(-1).contiguous().view(torch.uint8)])
    gathered = torch.empty(n * packed.numel(), dtype=torch.uint8, device=packed.device)

    def unpack(flat: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        per_rank = flat.view(n, -1)
        all_data = per_rank[:, :data_bytes].reshape(n * data.shape[0], *data.shape[1:]).view(data.dtype)
        all_scales = per_rank[:, data_bytes:].contiguous().view(scales.dtype)
        return all_data, all_scales.reshape(n * scales.shape[0], *scales.shape[1:])

    in_flight = all_gather_into_tensor_async(gathered, packed, handle, kind)
    return PendingCollective(in_flight, finish=lambda pending: unpack(pending.wait()))


def all_gather_quantized(data: torch.Tensor, scale_inv: torch.Tensor, handle: GroupHandle,
                         kind: str = "tp_sp_allgather") -> tuple[torch.Tensor, torch.Tensor]:
    """Blocking all_gather_quantized_async: ``(data, scales)`` of every member, one collective."""
    return all_gather_quantized_async(data, scale_inv, handle, kind).wait()


def reduce_scatter_tensor_async(output: torch.Tensor, input_: torch.Tensor, handle: GroupHandle,
                                kind: str) -> PendingCollective:
    """Sum ``input_`` over the group and keep this member's dim-0 chunk in ``output``."""
    if input_.numel() != output.numel() * handle.size:
        raise ValueError(f"reduce_scatter_tensor: input {tuple(input_.shape)} is not {handle.size} x output "
                         f"{tuple(output.shape)}")
    if handle.size == 1:
        output.copy_(input_.reshape(output.shape))
        return PendingCollective(output)
    handle.counters.add(kind, _nbytes(output) * (handle.size - 1), handle.ranks)
    work = _reduce_scatter_single(output, input_.detach().contiguous(), op=dist.ReduceOp.SUM, group=handle.group,
                                  async_op=True)
    return PendingCollective(output, work, counters=handle.counters)


def reduce_scatter_tensor(output: torch.Tensor, input_: torch.Tensor, handle: GroupHandle, kind: str) -> torch.Tensor:
    """Blocking reduce_scatter_tensor_async."""
    return reduce_scatter_tensor_async(output, input_, handle, kind).wait()


def reduce_scatter(input_: torch.Tensor, handle: GroupHandle, kind: str, dim: int = 0) -> torch.Tensor:
    """Sum over the group, then split along ``dim`` and return this member's chunk."""
    if handle.size == 1:
        return input_
    dim = dim % input_.dim()
    if input_.shape[dim] % handle.size:
        raise ValueError(f"reduce_scatter: dim {dim} of size {input_.shape[dim]} does not split into "
                         f"{handle.size} equal chunks")
    moved = input_.movedim(dim, 0).contiguous() if dim else input_.contiguous()
    output = torch.empty((moved.shape[0] // handle.size, *moved.shape[1:]), dtype=moved.dtype, device=moved.device)
    reduce_scatter_tensor(output, moved, handle, kind)
    return output.movedim(0, dim).contiguous() if dim else output


def all_reduce_async(tensor: torch.Tensor, handle: GroupHandle, kind: str,
                     op: dist.ReduceOp.RedOpType = dist.ReduceOp.SUM) -> PendingCollective:
    """In-place all-reduce of ``tensor``, in flight until ``wait()`` (which returns it)."""
    if handle.size == 1:
        return PendingCollective(tensor)
    handle.counters.add(kind, 2 * _nbytes(tensor) * (handle.size - 1) // handle.size, handle.ranks)
    return PendingCollective(tensor, dist.all_reduce(tensor, op=op, group=handle.group, async_op=True),
                             counters=handle.counters)


def all_reduce(tensor: torch.Tensor, handle: GroupHandle, kind: str,
               op: dist.ReduceOp.RedOpType = dist.ReduceOp.SUM) -> torch.Tensor:
    """In-place all-reduce of ``tensor``; returns it for chaining."""
    return all_reduce_async(tensor, handle, kind, op).wait()


def all_to_all_single_async(output: torch.Tensor, input_: torch.Tensor, handle: GroupHandle,
                            kind: str) -> PendingCollective:
    """Chunk ``i`` of ``input_`` (dim 0, ``size`` equal chunks) goes to member ``i``; ``output``'s chunk ``j``
    comes from member ``j``. Accepts float8 tensors (sent as uint8)."""
    if output.dtype != input_.dtype or output.numel() != input_.numel() or input_.numel() % handle.size:
        raise ValueError(f"all_to_all_single: output {tuple(output.shape)} {output.dtype} and input "
                         f"{tuple(input_.shape)} {input_.dtype} must match and split into {handle.size} chunks")
    if handle.size == 1:
        output.copy_(input_)
        return PendingCollective(output)
    handle.counters.add(kind, _nbytes(input_) // handle.size * (handle.size - 1), handle.ranks)
    work = dist.all_to_all_single(_wire_view(output), _wire_view(input_.detach().contiguous()), group=handle.group,
                                  async_op=True)
    return PendingCollective(output, work, counters=handle.counters)


def all_to_all_uneven(input_: torch.Tensor, output_splits: list[int], input_splits: list[int],
                      handle: GroupHandle, kind: str) -> torch.Tensor:
    """Rows ``input_splits[i]`` of ``input_`` (dim 0, in member order) go to member ``i``; the result holds
    ``output_splits[j]`` rows from member ``j``. Counted: the rows this rank sends to the others."""
    output = input_.new_empty((sum(output_splits), *input_.shape[1:]))
    if handle.size == 1:
        return output.copy_(input_)
    row = input_.element_size() * math.prod(input_.shape[1:])
    handle.counters.add(kind, row * (sum(input_splits) - input_splits[handle.rank]), handle.ranks)
    dist.all_to_all_single(_wire_view(output), _wire_view(input_.detach().contiguous()), output_splits, input_splits,
                           group=handle.group)
    return output


def split_along_dim(input_: torch.Tensor, handle: GroupHandle, dim: int = 0) -> torch.Tensor:
    """This member's equal chunk of ``input_`` along ``dim`` (no communication)."""
    if handle.size == 1:
        return input_
    if input_.shape[dim] % handle.size:
        raise ValueError(f"split_along_dim: dim {dim} of size {input_.shape[dim]} does not split into "
                         f"{handle.size} equal chunks")
    return input_.chunk(handle.size, dim=dim)[handle.rank].contiguous()


def send(tensor: torch.Tensor, dst: int, counters: CommCounters, kind: str = "pp_p2p",
         group: dist.ProcessGroup | None = None) -> None:
    """Blocking point-to-point send to global rank ``dst``."""
    counters.add(kind, _nbytes(tensor))
    dist.send(_wire_view(tensor.contiguous()), dst=dst, group=group)


def isend(tensor: torch.Tensor, dst: int, counters: CommCounters, kind: str = "pp_p2p",
          group: dist.ProcessGroup | None = None) -> PendingCollective:
    """Non-blocking point-to-point send to global rank ``dst``; keep ``tensor`` alive until ``wait()``."""
    tensor = tensor.contiguous()
    counters.add(kind, _nbytes(tensor))
    return PendingCollective(tensor, dist.isend(_wire_view(tensor), dst=dst, group=group), counters=counters)


def recv(tensor: torch.Tensor, src: int, group: dist.ProcessGroup | None = None) -> torch.Tensor:
    """Blocking receive into ``tensor`` from global rank ``src`` (not counted: the sender pays)."""
    dist.recv(_wire_view(tensor), src=src, group=group)
    return tensor
