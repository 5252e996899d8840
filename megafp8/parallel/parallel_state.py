"""The parallel layout (TP x CP x DP x PP, and its expert view ETP x EP x EDP x PP) as one object: validated once,
then asked for process groups by name.

Ranks are laid out as in Megatron-LM (order tp-cp-dp-pp): tensor parallel innermost, then context
parallel, then data parallel, then pipeline, so ``rank = tp + TP * (cp + CP * (dp + DP * pp))``. TP peers
are therefore neighbours (same node, fastest links), CP peers the next closest (their K/V ring is the
next busiest link). The rank arithmetic is pure (``rank_coordinates``, ``group_ranks``) and unit-testable
without processes; ``ParallelState.init_process_groups`` turns it into real groups. Nothing here is a
module-level global: the state object is created once and passed to whatever needs a group.

The same ranks are read through two mesh views (``MeshView``): the dense one (TP, CP, DP, PP) and the expert one
(ETP, EP, EDP, PP, Megatron's order etp-ep-edp-pp, with ETP x EP x EDP = TP x CP x DP). Without MoE, EP = 1 and
ETP = TP, so every expert group has the ranks of a dense one (and shares its communicator).
"""
from __future__ import annotations

import math
import os
from collections.abc import Sequence
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from megafp8.parallel.collectives import CommCounters, GroupHandle
from megafp8.parallel.pipeline_layout import PipelineLayout, default_schedule, pipeline_layout_errors

GROUP_KINDS = ("tp", "cp", "dp", "pp", "amax", "embedding")
# Named groups of each view: the mesh dimensions along which their members differ.
DENSE_GROUPS: dict[str, tuple[str, ...]] = {"tp": ("tp",), "cp": ("cp",), "dp": ("cp", "dp"), "pp": ("pp",),
                                            "amax": ("tp", "cp", "dp")}
EXPERT_GROUPS: dict[str, tuple[str, ...]] = {"etp": ("etp",), "ep": ("ep",), "edp": ("edp",),
                                             "expert_amax": ("etp", "edp")}
CHECKPOINT_GLOO = "checkpoint_gloo"  # the whole world over gloo: checkpoint coordination moves python objects on CPU


class LayoutError(ValueError):
    """A user-caused invalid parallel layout; the message names the flag(s) to change."""


@dataclass(frozen=True)
class RankCoordinates:
    tp: int
    dp: int
    pp: int
    cp: int = 0


def rank_coordinates(rank: int, tp: int, dp: int, pp: int, cp: int = 1) -> RankCoordinates:
    """Position of global ``rank`` in the (TP, CP, DP, PP) grid, TP innermost."""
    if not 0 <= rank < tp * cp * dp * pp:
        raise ValueError(f"rank {rank} is outside a world of {tp * cp * dp * pp} "
                         f"(TP {tp} x CP {cp} x DP {dp} x PP {pp})")
    return RankCoordinates(tp=rank % tp, cp=(rank // tp) % cp, dp=(rank // (tp * cp)) % dp, pp=rank // (tp * cp * dp))


def global_rank(coords: RankCoordinates, tp: int, dp: int, cp: int = 1) -> int:
    return coords.tp + tp * (coords.cp + cp * (coords.dp + dp * coords.pp))


@dataclass(frozen=True)
class MeshView:
    """One factorization of the world's ranks, innermost dimension first: ``rank = c0 + n0 * (c1 + n1 * ...)``."""

    dims: tuple[str, ...]
    sizes: tuple[int, ...]

    @property
    def world_size(self) -> int:
        return math.prod(self.sizes)

    def coordinates(self, rank: int) -> dict[str, int]:
        coords = {}
        for dim, size in zip(self.dims, self.sizes):
            coords[dim], rank = rank % size, rank // size
        return coords

    def groups(self, over: Sequence[str]) -> list[list[int]]:
        """The groups whose members differ only along the dims ``over``: members in global-rank order (the
        innermost dim fastest), groups ordered by their first member, so every rank lists them alike."""
        unknown = set(over) - set(self.dims)
        if unknown:
            raise ValueError(f"MeshView {self.dims}: no dimension {sorted(unknown)}")
        groups: dict[tuple[int, ...], list[int]] = {}
        for rank in range(self.world_size):
            coords = self.coordinates(rank)
            groups.setdefault(tuple(coords[d] for d in self.dims if d not in over), []).append(rank)
        return sorted(groups.values())


def dense_view(tp: int, dp: int, pp: int, cp: int = 1) -> MeshView:
    return MeshView(("tp", "cp", "dp", "pp"), (tp, cp, dp, pp))


def expert_view(etp: int, ep: int, edp: int, pp: int) -> MeshView:
    return MeshView(("etp", "ep", "edp", "pp"), (etp, ep, edp, pp))


def group_ranks(tp: int, dp: int, pp: int, cp: int = 1) -> dict[str, list[list[int]]]:
    """Every group of every kind, as lists of global ranks, in a fixed order all ranks agree on.

    - tp: same (cp, dp, pp), consecutive ranks.
    - cp: same (tp, dp, pp), stride TP: the ranks that split one sequence (the K/V ring).
    - dp: same (tp, pp), the DP x CP ranks (Megatron's data-parallel group "with context parallel"), in
      global-rank order: CP ranks hold the same parameters and their gradients are partial sums over the
      sequence, so gradients are reduced and ZeRO shards spread over all of them.
    - pp: same (tp, cp, dp), stride TP*CP*DP, first stage first.
    - amax: the TP x CP x DP ranks of one pipeline stage; FP8 amaxes are reduced over it once per step so
      every shard of a tensor, every sequence chunk and every replica use the same scale.
    - embedding: the first and last stage of each pipeline (just the one rank when PP=1); tied
      input/output embeddings all-reduce their grads over it.
    """
    view = dense_view(tp, dp, pp, cp)
    groups = {name: view.groups(over) for name, over in DENSE_GROUPS.items()}
    groups["embedding"] = [sorted({ranks[0], ranks[-1]}) for ranks in groups["pp"]]
    return groups


def expert_group_ranks(etp: int, ep: int, edp: int, pp: int) -> dict[str, list[list[int]]]:
    """The expert view's groups: etp (an expert's tensor split), ep (the ranks holding different experts), edp
    (an expert's data-parallel replicas: gradients and ZeRO shards) and expert_amax (ETP x EDP of one stage: every
    holder of one expert's weights)."""
    view = expert_view(etp, ep, edp, pp)
    return {name: view.groups(over) for name, over in EXPERT_GROUPS.items()}


def layout_errors(*, world_size: int, tp: int, pp: int, cp: int = 1, vpp_layers: int | None = None,
                  sequence_parallel: bool = False, num_layers: int | None = None,
                  hidden_size: int | None = None, ffn_hidden_size: int | None = None,
                  num_attention_heads: int | None = None, num_query_groups: int | None = None,
                  kv_channels: int | None = None, seq_length: int | None = None, global_batch_size: int | None = None,
                  micro_batch_size: int | None = None, pipeline_schedule: str | None = None,
                  first_stage_layers: int | None = None, last_stage_layers: int | None = None,
                  ep: int = 1, etp: int | None = None) -> list[str]:
    """Every rule the layout breaks, each naming its flag; model/batch checks run only when given.
    The pipeline rules (stage split, schedule, micro-batch count) are ``pipeline_layout_errors``."""
    errors: list[str] = []
    for flag, value in (("--tensor-model-parallel-size", tp), ("--pipeline-model-parallel-size", pp),
                        ("--context-parallel-size", cp), ("world size", world_size), ("--micro-batch-size", micro_batch_size),
                        ("--num-layers-per-virtual-pipeline-stage", vpp_layers),
                        ("--expert-model-parallel-size", ep), ("--expert-tensor-parallel-size", etp)):
        if value is not None and value < 1:
            errors.append(f"{flag} must be >= 1, got {value}")
    if errors:
        return errors
    if world_size % (tp * cp * pp):
        errors.append(f"--tensor-model-parallel-size ({tp}) x " + (f"--context-parallel-size ({cp}) x " if cp > 1 else "")
                      + f"--pipeline-model-parallel-size ({pp}) = {tp * cp * pp} does not divide the world size "
                      f"({world_size})")
    dp = max(world_size // (tp * cp * pp), 1)
    errors += expert_layout_errors(stage_ranks=tp * cp * dp, ep=ep, etp=tp if etp is None else etp)

    def not_divisible(flag: str, value: int | None, by_flag: str, by: int) -> None:
        if value is not None and value % by:
            errors.append(f"{flag} ({value}) must be divisible by {by_flag} ({by})")

    not_divisible("--num-attention-heads", num_attention_heads, "--tensor-model-parallel-size", tp)
    not_divisible("--num-query-groups", num_query_groups, "--tensor-model-parallel-size", tp)
    if num_attention_heads is not None and num_query_groups is not None:
        not_divisible("--num-attention-heads", num_attention_heads, "--num-query-groups", num_query_groups)
    not_divisible("--hidden-size", hidden_size, "--tensor-model-parallel-size", tp)
    if kv_channels is not None:  # the head dim is given, so hidden need not divide by the heads (Megatron's rule)
        if kv_channels % 2:
            errors.append(f"--kv-channels ({kv_channels}, the head dim) must be even for rotary embeddings")
    elif hidden_size is not None and num_attention_heads is not None:
        not_divisible("--hidden-size", hidden_size, "--num-attention-heads", num_attention_heads)
        if hidden_size % num_attention_heads == 0 and (hidden_size // num_attention_heads) % 2:
            errors.append(f"--hidden-size / --num-attention-heads = {hidden_size // num_attention_heads} "
                          "(the head dim) must be even for rotary embeddings")
    not_divisible("--ffn-hidden-size", ffn_hidden_size, "--tensor-model-parallel-size", tp)
    sp_split = tp if sequence_parallel and tp > 1 else 1
    if cp > 1:  # 2 x CP load-balanced chunks, each split again over TP under sequence parallelism
        by = "2 x --context-parallel-size" + (" x --tensor-model-parallel-size (with --sequence-parallel)"
                                              if sp_split > 1 else "")
        not_divisible("--seq-length", seq_length, by, 2 * cp * sp_split)
    elif sp_split > 1:
        not_divisible("--seq-length", seq_length, "--tensor-model-parallel-size (with --sequence-parallel)", tp)
    num_microbatches = None
    if global_batch_size is not None and micro_batch_size is not None:
        if global_batch_size % (micro_batch_size * dp):
            errors.append(f"--global-batch-size ({global_batch_size}) must be divisible by --micro-batch-size "
                          f"({micro_batch_size}) x data-parallel size ({dp}"
                          + (f" = world / (TP x CP {cp} x PP)" if cp > 1 else "") + ")")
        else:
            num_microbatches = global_batch_size // (micro_batch_size * dp)
    errors += pipeline_layout_errors(num_layers=num_layers, pp=pp, schedule=pipeline_schedule, vpp_layers=vpp_layers,
                                     first_stage_layers=first_stage_layers, last_stage_layers=last_stage_layers,
                                     num_microbatches=num_microbatches)
    return errors


def expert_layout_errors(*, stage_ranks: int, ep: int, etp: int) -> list[str]:
    """The expert view splits the TP x CP x DP ranks of a stage into ETP x EP x EDP: ETP x EP must divide them."""
    if stage_ranks % (etp * ep):
        return [f"--expert-tensor-parallel-size ({etp}) x --expert-model-parallel-size ({ep}) = {etp * ep} does not "
                f"divide the ranks of a pipeline stage (TP x CP x DP = {stage_ranks})"]
    return []


@dataclass
class ParallelState:
    """The TP x CP x DP x PP layout of this run and, after ``init_process_groups``, this rank's groups.

    The data-parallel size is derived: ``world_size / (TP * CP * PP)``; it counts the ranks that read different
    samples (``dp_size``, ``data_parallel_rank``). ``dp_group`` is the DP x CP group of the gradients and the
    ZeRO shards (CP ranks hold the same parameters). Validation of the factors runs in
    ``__post_init__``; ``validate_model`` adds the checks that need the model and batch sizes and is
    called by the model constructor, so a bad layout always fails before any compute.

    Groups are looked up by name (``group(name)``: the dense view's tp, cp, dp, pp, amax, embedding, the expert
    view's etp, ep, edp, expert_amax, the world, and ``CHECKPOINT_GLOO``); ``tp_group`` etc. are shorthands.
    """

    world_size: int = 1
    tensor_model_parallel_size: int = 1
    pipeline_model_parallel_size: int = 1
    num_layers_per_virtual_pipeline_stage: int | None = None
    sequence_parallel: bool = False
    pipeline_schedule: str | None = None  # None: interleaved with virtual stages, else 1f1b (Megatron's default)
    decoder_first_pipeline_num_layers: int | None = None
    decoder_last_pipeline_num_layers: int | None = None
    context_parallel_size: int = 1
    cp_comm_type: str = "p2p"  # --cp-comm-type: how the attention's CP ranks exchange K/V
    expert_model_parallel_size: int = 1
    expert_tensor_parallel_size: int | None = None  # None: the TP size (Megatron's default)
    data_parallel_size: int = field(init=False)
    expert_data_parallel_size: int = field(init=False)
    # Filled by init_process_groups(): this process's rank, coordinates and group handles.
    rank: int = field(init=False, default=0)
    coords: RankCoordinates = field(init=False, default=RankCoordinates(0, 0, 0))
    comm: CommCounters = field(init=False, default_factory=CommCounters, repr=False)
    _handles: dict[str, GroupHandle | None] = field(init=False, default_factory=dict, repr=False)

    def __post_init__(self) -> None:
        self._raise_if(layout_errors(**self._layout_kwargs()))
        self.data_parallel_size = self.world_size // (self.tp_size * self.cp_size * self.pp_size)
        if self.expert_tensor_parallel_size is None:
            self.expert_tensor_parallel_size = self.tensor_model_parallel_size
        self.expert_data_parallel_size = self.world_size // (self.etp_size * self.ep_size * self.pp_size)
        self.pipeline_schedule = self.pipeline_schedule or default_schedule(self.num_layers_per_virtual_pipeline_stage)

    # -- sizes -----------------------------------------------------------------------------------
    @property
    def tp_size(self) -> int:
        return self.tensor_model_parallel_size

    @property
    def pp_size(self) -> int:
        return self.pipeline_model_parallel_size

    @property
    def cp_size(self) -> int:
        return self.context_parallel_size

    @property
    def ep_size(self) -> int:
        return self.expert_model_parallel_size

    @property
    def etp_size(self) -> int:
        return self.expert_tensor_parallel_size

    @property
    def edp_size(self) -> int:
        """An expert's data-parallel replicas: TP x CP x DP / (ETP x EP); ``dp_group.size`` when EP = 1, ETP = TP."""
        return self.expert_data_parallel_size

    @property
    def dense_view(self) -> MeshView:
        return dense_view(self.tp_size, self.dp_size, self.pp_size, self.cp_size)

    @property
    def expert_view(self) -> MeshView:
        return expert_view(self.etp_size, self.ep_size, self.edp_size, self.pp_size)

    def group_ranks(self) -> dict[str, list[list[int]]]:
        """Every named group of both views (without the world and CHECKPOINT_GLOO), dense first."""
        return {**group_ranks(self.tp_size, self.dp_size, self.pp_size, self.cp_size),
                **expert_group_ranks(self.etp_size, self.ep_size, self.edp_size, self.pp_size)}

    def group_coordinates(self) -> dict[str, tuple[int, int]]:
        """(this rank's index, size) in every named group it belongs to, by rank arithmetic alone (no process group
        needed): checkpoint sharding reads the coordinates of a placement's shard group from it."""
        coords = {name: (ranks.index(self.rank), len(ranks)) for name, all_groups in self.group_ranks().items()
                  for ranks in all_groups if self.rank in ranks}
        coords["world"] = coords[CHECKPOINT_GLOO] = (self.rank, self.world_size)
        return coords

    @property
    def dp_size(self) -> int:
        """Ranks reading different samples (pure DP, without CP); ``dp_group.size`` is DP x CP."""
        return self.data_parallel_size

    @property
    def data_parallel_rank(self) -> int:
        """Which samples this rank reads (every CP rank of a DP rank reads the same ones)."""
        return self.coords.dp

    @property
    def cp_rank(self) -> int:
        return self.coords.cp

    @property
    def cp_enabled(self) -> bool:
        return self.cp_size > 1

    @property
    def tp_enabled(self) -> bool:
        return self.tp_size > 1

    @property
    def pp_enabled(self) -> bool:
        return self.pp_size > 1

    @property
    def dp_enabled(self) -> bool:
        return self.dp_size > 1

    def describe(self) -> str:
        vpp = self.num_layers_per_virtual_pipeline_stage
        cp = self.context_parallel_size
        return (f"world size {self.world_size} = --tensor-model-parallel-size {self.tp_size} x "
                + (f"--context-parallel-size {cp} x " if cp > 1 else "") + "data parallel "
                f"{max(self.world_size // (self.tp_size * max(cp, 1) * self.pp_size), 1)} x --pipeline-model-parallel-size "
                f"{self.pp_size}" + (f", --num-layers-per-virtual-pipeline-stage {vpp}" if vpp else "")
                + (", --sequence-parallel" if self.sequence_parallel else "")
                + (f", --pipeline-schedule {self.pipeline_schedule}" if self.pp_size > 1 else "")
                + (f", --expert-model-parallel-size {self.ep_size}" if self.ep_size != 1 else "")
                + (f", --expert-tensor-parallel-size {self.etp_size}"
                   if self.etp_size not in (None, self.tp_size) else "")
                + "".join(f", {flag} {value}" for flag, value in (
                    ("--decoder-first-pipeline-num-layers", self.decoder_first_pipeline_num_layers),
                    ("--decoder-last-pipeline-num-layers", self.decoder_last_pipeline_num_layers)) if value is not None))

    # -- validation ------------------------------------------------------------------------------
    def _layout_kwargs(self) -> dict[str, Any]:
        return dict(world_size=self.world_size, tp=self.tensor_model_parallel_size,
                    pp=self.pipeline_model_parallel_size, cp=self.context_parallel_size, vpp_layers=self.num_layers_per_virtual_pipeline_stage,
                    sequence_parallel=self.sequence_parallel, pipeline_schedule=self.pipeline_schedule,
                    first_stage_layers=self.decoder_first_pipeline_num_layers,
                    last_stage_layers=self.decoder_last_pipeline_num_layers, ep=self.expert_model_parallel_size,
                    etp=self.expert_tensor_parallel_size)

    def _raise_if(self, errors: list[str], model_facts: str = "") -> None:
        if errors:
            raise LayoutError("invalid parallel layout:\n  - " + "\n  - ".join(errors)
                              + f"\n  layout: {self.describe()}" + (f"\n  model: {model_facts}" if model_facts else ""))

    def validate_model(self, config: Any, global_batch_size: int | None = None,
                       micro_batch_size: int | None = None) -> None:
        """Check the model dims (any object with ModelConfig's attribute names) and batch sizes."""
        dims = {name: getattr(config, name, None) for name in (
            "num_layers", "hidden_size", "ffn_hidden_size", "num_attention_heads", "num_query_groups", "kv_channels",
            "seq_length")}
        facts = ", ".join(f"{k}={v}" for k, v in dims.items() if v is not None)
        if global_batch_size is not None:
            facts += f", global_batch_size={global_batch_size}, micro_batch_size={micro_batch_size}"
        self._raise_if(layout_errors(**self._layout_kwargs(), **dims, global_batch_size=global_batch_size,
                                     micro_batch_size=micro_batch_size), facts)

    def pipeline_layout(self, num_layers: int) -> PipelineLayout:
        """Which layers each pipeline stage holds and which rank runs it (megafp8.parallel.pipeline_layout)."""
        return PipelineLayout(num_layers, self.pp_size, self.pipeline_schedule, self.num_layers_per_virtual_pipeline_stage,
                              self.decoder_first_pipeline_num_layers, self.decoder_last_pipeline_num_layers)

    # -- process groups --------------------------------------------------------------------------
    def init_process_groups(self, rank: int | None = None, timeout: timedelta | None = None) -> "ParallelState":
        """Create every group (all ranks must call this, in the same order) and keep this rank's.

        ``timeout`` (``--distributed-timeout-minutes``) bounds every collective and point-to-point wait on
        these groups: a dead or hung peer then raises instead of blocking forever.

        With ``world_size == 1`` nothing touches torch.distributed, so single-process runs and the
        TP=1 reference in tests need no process group at all.
        """
        if self.world_size > 1:
            if not dist.is_initialized():
                raise RuntimeError("ParallelState.init_process_groups: torch.distributed is not initialized; "
                                   "call megafp8.parallel.parallel_state.initialize_distributed() first")
            if dist.get_world_size() != self.world_size:
                raise LayoutError(f"torch.distributed has {dist.get_world_size()} ranks but the layout expects "
                                  f"{self.world_size}: {self.describe()}")
            rank = dist.get_rank() if rank is None else rank
        self.rank = 0 if rank is None else rank
        self.coords = rank_coordinates(self.rank, self.tp_size, self.dp_size, self.pp_size, self.cp_size)
        created: dict[tuple[int, ...], dist.ProcessGroup] = {}
        for kind, all_groups in self.group_ranks().items():
            self._handles[kind] = None
            for ranks in all_groups:
                # Every rank creates every group (a torch.distributed rule); single-member groups need none. An
                # expert group with a dense group's ranks (all of them without MoE) shares its communicator.
                group = None
                if len(ranks) > 1:
                    group = created.get(tuple(ranks)) if kind in EXPERT_GROUPS else None
                    if group is None:
                        group = created.setdefault(tuple(ranks), dist.new_group(ranks, timeout=timeout))
                if self.rank in ranks:
                    self._handles[kind] = GroupHandle(group=group, ranks=tuple(ranks), rank=ranks.index(self.rank),
                                                      counters=self.comm)
        self._handles["world"] = self._whole_world(dist.group.WORLD if self.world_size > 1 else None)
        gloo = None
        if self.world_size > 1:  # created now, by every rank together: a lazy creation could deadlock
            gloo = dist.group.WORLD if dist.get_backend() == "gloo" else dist.new_group(
                list(range(self.world_size)), timeout=timeout, backend="gloo")
        self._handles[CHECKPOINT_GLOO] = self._whole_world(gloo)
        return self

    def _whole_world(self, group: dist.ProcessGroup | None) -> GroupHandle:
        return GroupHandle(group=group, ranks=tuple(range(self.world_size)), rank=self.rank, counters=self.comm)

    def group(self, name: str) -> GroupHandle:
        """This rank's group called ``name`` (see the class docstring)."""
        if self._handles and name not in self._handles:
            raise KeyError(f"ParallelState: no process group named {name!r}; known: {', '.join(self._handles)}")
        return self._handle(name)

    def _handle(self, kind: str) -> GroupHandle:
        if kind not in self._handles:
            raise RuntimeError("ParallelState: call init_process_groups() before asking for process groups")
        handle = self._handles[kind]
        if handle is None:
            raise RuntimeError(f"rank {self.rank} (pipeline stage {self.coords.pp}) is not in an {kind} group")
        return handle

    @property
    def tp_group(self) -> GroupHandle:
        return self._handle("tp")

    @property
    def cp_group(self) -> GroupHandle:
        """The ranks splitting this rank's sequences (a single-member handle when CP = 1)."""
        return self._handle("cp")

    @property
    def dp_group(self) -> GroupHandle:
        """DP x CP: gradients are reduced and ZeRO shards spread over it (``dp_size`` is DP alone)."""
        return self._handle("dp")

    @property
    def pp_group(self) -> GroupHandle:
        return self._handle("pp")

    @property
    def amax_group(self) -> GroupHandle:
        return self._handle("amax")

    @property
    def embedding_group(self) -> GroupHandle:
        """First + last pipeline stage; raises on a middle stage (it holds no embedding)."""
        return self._handle("embedding")

    @property
    def is_pipeline_first_stage(self) -> bool:
        return self.coords.pp == 0

    @property
    def is_pipeline_last_stage(self) -> bool:
        return self.coords.pp == self.pp_size - 1


def default_backend() -> str:
    """nccl on CUDA machines, gloo on CPU."""
    return "nccl" if torch.cuda.is_available() else "gloo"


def initialize_distributed(backend: str | None = None, init_method: str | None = None,
                           world_size: int | None = None, rank: int | None = None,
                           timeout_minutes: float | None = None) -> None:
    """Initialize torch.distributed from torchrun's environment (or the given values), once.

    ``timeout_minutes`` (--distributed-timeout-minutes): a collective whose peer died or never comes
    raises after this long instead of hanging the job forever."""
    if dist.is_initialized():
        return
    backend = backend or default_backend()
    kwargs: dict[str, Any] = {"backend": backend, "init_method": init_method or "env://"}
    if backend == "nccl":
        local_rank = int(os.environ.get("LOCAL_RANK", 0))
        torch.cuda.set_device(local_rank)
        # Bound to its GPU: NCCL's communicator is created now, not at the first collective, and barriers need
        # not guess the device.
        kwargs["device_id"] = torch.device("cuda", local_rank)
    if timeout_minutes is not None:
        kwargs["timeout"] = timedelta(minutes=timeout_minutes)
    if world_size is not None:
        kwargs.update(world_size=world_size, rank=rank)
    dist.init_process_group(**kwargs)
