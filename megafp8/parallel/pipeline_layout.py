"""Which transformer layers each pipeline stage holds, and which rank runs each stage: pure arithmetic
from the flags, validated (every rule names its flag) before any process group exists.

A pipeline of ``PP`` ranks runs ``PP x chunks`` *stages* (virtual stages when chunks > 1). Stage ``s``
holds a contiguous block of layers, in order, so parameter names keep their global layer index:

=================  ================  =====================================================
schedule           chunks per rank   stage -> pipeline rank
=================  ================  =====================================================
1f1b               1                 s
interleaved(-zb)   L / (PP x vpp)    s mod PP (looped: rank r holds r, r+PP, r+2PP, ...)
zbv, dualpipev     2                 s if s < PP else 2PP-1-s (V: rank 0 holds the first
                                     and the last stage)
=================  ================  =====================================================

``vpp`` is ``--num-layers-per-virtual-pipeline-stage``. Megatron's uneven split
(``--decoder-first-pipeline-num-layers`` / ``--decoder-last-pipeline-num-layers``) fixes the layer
count of the first / last stage and divides the rest evenly over the others (1f1b only here).
"""
from __future__ import annotations

from dataclasses import dataclass

SCHEDULES = ("1f1b", "interleaved", "interleaved-zb", "zbv", "dualpipev")
LOOPED_SCHEDULES = ("interleaved", "interleaved-zb")
V_SCHEDULES = ("zbv", "dualpipev")
ZERO_BUBBLE_SCHEDULES = ("interleaved-zb", "zbv", "dualpipev")  # split input and weight gradients

_VPP_FLAG = "--num-layers-per-virtual-pipeline-stage"
_FIRST_FLAG = "--decoder-first-pipeline-num-layers"
_LAST_FLAG = "--decoder-last-pipeline-num-layers"


def default_schedule(vpp_layers: int | None) -> str:
    """Megatron's choice: interleaved when virtual stages are requested, else 1F1B."""
    return "interleaved" if vpp_layers else "1f1b"


def pipeline_layout_errors(*, num_layers: int | None, pp: int, schedule: str | None = None,
                           vpp_layers: int | None = None, first_stage_layers: int | None = None,
                           last_stage_layers: int | None = None, num_microbatches: int | None = None) -> list[str]:
    """Every rule the pipeline flags break (empty when valid); model checks run only when ``num_layers`` is given."""
    schedule = schedule or default_schedule(vpp_layers)
    errors: list[str] = []
    if schedule not in SCHEDULES:
        return [f"--pipeline-schedule must be one of {'|'.join(SCHEDULES)}, got {schedule!r}"]
    uneven = first_stage_layers is not None or last_stage_layers is not None
    if pp == 1:
        if schedule != "1f1b":
            errors.append(f"--pipeline-schedule {schedule} needs --pipeline-model-parallel-size > 1")
        if vpp_layers is not None:
            errors.append(f"{_VPP_FLAG} needs --pipeline-model-parallel-size > 1")
        if uneven:
            errors.append(f"{_FIRST_FLAG} / {_LAST_FLAG} need --pipeline-model-parallel-size > 1")
        return errors
    for flag, value in ((_FIRST_FLAG, first_stage_layers), (_LAST_FLAG, last_stage_layers)):
        if value is not None and value < 0:
            errors.append(f"{flag} must be >= 0, got {value}")
    if schedule in LOOPED_SCHEDULES and vpp_layers is None:
        errors.append(f"--pipeline-schedule {schedule} needs {_VPP_FLAG}")
    if schedule == "1f1b" and vpp_layers is not None:
        errors.append(f"{_VPP_FLAG} needs --pipeline-schedule interleaved, interleaved-zb, zbv or dualpipev "
                      "(1f1b runs one chunk per rank)")
    if uneven and schedule != "1f1b":
        errors.append(f"{_FIRST_FLAG} / {_LAST_FLAG} are supported with --pipeline-schedule 1f1b only "
                      f"(got {schedule})")
    if errors or num_layers is None:
        return errors + _microbatch_errors(schedule, pp, num_microbatches)

    if schedule in V_SCHEDULES:
        if num_layers % (2 * pp):
            errors.append(f"--num-layers ({num_layers}) must be divisible by 2 x --pipeline-model-parallel-size "
                          f"({2 * pp}): --pipeline-schedule {schedule} runs two chunks per rank")
        elif vpp_layers is not None and vpp_layers * 2 * pp != num_layers:
            errors.append(f"{_VPP_FLAG} ({vpp_layers}) must be --num-layers / (2 x --pipeline-model-parallel-size) "
                          f"= {num_layers // (2 * pp)} with --pipeline-schedule {schedule} (two chunks per rank)")
    elif schedule in LOOPED_SCHEDULES:
        if num_layers % (pp * vpp_layers):
            errors.append(f"--num-layers ({num_layers}) must be divisible by --pipeline-model-parallel-size ({pp}) "
                          f"x {_VPP_FLAG} ({vpp_layers})")
    elif uneven:
        fixed = (first_stage_layers or 0) + (last_stage_layers or 0)
        others = pp - (first_stage_layers is not None) - (last_stage_layers is not None)
        rest = num_layers - fixed
        if rest < 0 or (others == 0 and rest != 0) or (others > 0 and rest % others):
            errors.append(f"--num-layers ({num_layers}) minus {_FIRST_FLAG} / {_LAST_FLAG} ({fixed}) must divide "
                          f"evenly over the other {others} pipeline stage(s) (--pipeline-model-parallel-size {pp})")
    elif num_layers % pp:
        errors.append(f"--num-layers ({num_layers}) must be divisible by --pipeline-model-parallel-size ({pp}) "
                      f"(or set {_FIRST_FLAG} / {_LAST_FLAG})")
    return errors + _microbatch_errors(schedule, pp, num_microbatches)


def _microbatch_errors(schedule: str, pp: int, num_microbatches: int | None) -> list[str]:
    if num_microbatches is None or pp == 1:
        return []
    what = (f"the number of micro-batches (--global-batch-size / (--micro-batch-size x data-parallel size) "
            f"= {num_microbatches})")
    if schedule in LOOPED_SCHEDULES and num_microbatches % pp:
        return [f"{what} must be a multiple of --pipeline-model-parallel-size ({pp}) for --pipeline-schedule {schedule}"]
    stages = 2 * pp if schedule in V_SCHEDULES else pp
    if num_microbatches < stages:
        return [f"{what} must be >= the number of pipeline stages ({stages}) for --pipeline-schedule {schedule}"]
    return []


@dataclass(frozen=True)
class PipelineLayout:
    """The stage split of one run; build it only from flags that ``pipeline_layout_errors`` accepted."""

    num_layers: int
    pp: int
    schedule: str = "1f1b"
    vpp_layers: int | None = None
    first_stage_layers: int | None = None
    last_stage_layers: int | None = None

    def __post_init__(self) -> None:
        errors = pipeline_layout_errors(num_layers=self.num_layers, pp=self.pp, schedule=self.schedule,
                                        vpp_layers=self.vpp_layers, first_stage_layers=self.first_stage_layers,
                                        last_stage_layers=self.last_stage_layers)
        if errors:
            raise ValueError("invalid pipeline layout:\n  - " + "\n  - ".join(errors))

    @property
    def chunks_per_rank(self) -> int:
        if self.schedule in V_SCHEDULES:
            return 2
        if self.schedule in LOOPED_SCHEDULES:
            return self.num_layers // (self.pp * self.vpp_layers)
        return 1

    @property
    def num_stages(self) -> int:
        return self.pp * self.chunks_per_rank

    def stage_rank(self, stage: int) -> int:
        """The pipeline rank that runs ``stage``."""
        if self.schedule in V_SCHEDULES:
            return stage if stage < self.pp else 2 * self.pp - 1 - stage
        return stage % self.pp

    def stages_of_rank(self, pp_rank: int) -> list[int]:
        """The stages ``pp_rank`` runs, in pipeline order."""
        return [s for s in range(self.num_stages) if self.stage_rank(s) == pp_rank]

    def layer_counts(self) -> list[int]:
        if self.first_stage_layers is None and self.last_stage_layers is None:
            return [self.num_layers // self.num_stages] * self.num_stages
        first, last = self.first_stage_layers, self.last_stage_layers
        others = self.pp - (first is not None) - (last is not None)
        each = (self.num_layers - (first or 0) - (last or 0)) // others if others else 0
        counts = [each] * self.pp
        if first is not None:
            counts[0] = first
        if last is not None:
            counts[-1] = last
        return counts

    def layer_numbers(self, stage: int) -> range:
        """Global indices of the layers of ``stage``."""
        counts = self.layer_counts()
        start = sum(counts[:stage])
        return range(start, start + counts[stage])
