"""--compile and --enable-cuda-graph: torch.compile per transformer layer (torchtitan's unit), with the layer's host
work (forward pre-hooks, the FP8 weight cache, cold delayed-scaling states) kept eager in front of the graph.

What runs where, per call of a compiled layer (or its attention under --cuda-graph-scope attn):
    eager    the forward pre-hooks of its modules (the overlapped param gather, the precision follower: inside
             the graph they return at once), and each FP8 linear's weight for this step: quantized once per
             optimizer step (or the optimizer's injected FP8 weight checked), keyed on the weight's storage,
             version and delayed-scale version, host-side keys dynamo cannot trace;
    eager    the whole layer while one of its delayed-scaling states is cold (the first step of a run, after a
             reset or a load of an empty history): cold states quantize with current scaling and record on the
             host when they first observed, which a graph cannot do;
    eager    the FP8 telemetry's slots (the saturation guard reads it every step) and, on the kurtosis monitor's
             iterations, the input moments' slot: statistics the layer owns, of fixed shapes, which the graph writes
             in place (megafp8.fp8.telemetry.add_fp8_telemetry_slots, megafp8.fp8.kurtosis.add_moments_slot);
    graph    the rest: norms, RoPE, attention, SwiGLU, the activation and gradient casts, the FP8 GEMMs, the
             amax observations into the delayed states' device buffers, the in-cast telemetry counters.
Outside every graph, as in eager runs: the delayed-scaling update after the backward (one amax collective), the
optimizer and its FP8 publication, the saturation guard's device-side strikes and its host-side switches.

Collectives are not traced: under TP/SP/CP the FP8 linear's autograd op (its FP8 all-gather / reduce-scatter
overlapped with the GEMMs, and the byte counters) and ring attention run eagerly between graphs; dynamo splits
the layer there (fullgraph only without collectives). The compiled code is shared by all layers of a shape
(parameters are graph inputs); a guard that fails (a layer demoted to high precision, telemetry switched on)
compiles one more graph, counted by `compile_report`.

--enable-cuda-graph compiles with mode="reduce-overhead": inductor's CUDA graph trees capture each graph's kernels
once shapes are static and replay them; the eager parts above stay outside the captured graphs by design.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable

import torch
from torch import nn

from megafp8.fp8.kurtosis import add_moments_slot
from megafp8.fp8.linear import Fp8GemmModule
from megafp8.fp8.scaling_state import ScalingState
from megafp8.fp8.telemetry import add_fp8_telemetry_slots

CUDA_GRAPH_SCOPES = ("full", "attn")  # Megatron's --cuda-graph-scope names: the whole layer, or its attention


class _EagerPrologueThenCompiled:
    """A module's `_compiled_call_impl` (what nn.Module.__call__ runs when set): the eager work above, then the
    compiled `_call_impl`, or the eager one while a delayed-scaling state of the module is cold."""

    def __init__(self, module: nn.Module, compiled) -> None:
        self.module, self.compiled = module, compiled
        self.fp8_modules = [m for m in module.modules() if isinstance(m, Fp8GemmModule)]
        self._states, self._states_version = [], None

    def _scaling_states(self) -> list[ScalingState]:
        if self._states_version != ScalingState.layout_version:  # a state was allocated or replaced somewhere
            self._states = [m for m in self.module.modules() if isinstance(m, ScalingState)]
            self._states_version = ScalingState.layout_version
        return self._states

    def _add_telemetry_slots(self) -> None:
        """Statistics each FP8 linear recording telemetry owns, which its graph writes in place: the input's and
        gradient's, and the weight's where the layer quantizes its own (megafp8.fp8.telemetry), and the input's
        moments on the kurtosis monitor's iterations (megafp8.fp8.kurtosis)."""
        for m in self.fp8_modules:
            if m.active_recipe is None:
                continue
            if m.telemetry_enabled:
                roles = ("input", "grad_output") + (("weight",) if m._injected_weight is None else ())
                add_fp8_telemetry_slots(m, roles, m.weight.device)
            if m.kurtosis_enabled:
                add_moments_slot(m, m.weight.device)

    def __call__(self, *args, **kwargs):
        module = self.module
        if any(state.is_cold for state in self._scaling_states()):
            return module._call_impl(*args, **kwargs)
        for m in module.modules():  # walked per call: a hook may be armed between two calls
            for hook in list(m._forward_pre_hooks.values()):
                hook(m, args)
        self._add_telemetry_slots()  # after the hooks: a param-gather hook decides whether the weight is injected
        for m in self.fp8_modules:
            m.prepare_fp8_weight()
        return self.compiled(*args, **kwargs)


def mark_eager_islands() -> None:
    """Wrap the functions a compiled layer must call eagerly (graph breaks around them) in torch.compiler.disable,
    once, here rather than with decorators: importing torch._dynamo costs every process ~0.7 s at start, and only a
    compiled run needs it. Each island is looked up through its module or class at call time, so the wrapper takes
    effect everywhere:
    the FP8 linear op under a zero-bubble schedule (its backward queues host-side closures for the W pass),
    ring attention (collectives; FP8 K/V byte messages) and the MX/NVFP4 casts (inductor cannot tile their blocks)."""
    from megafp8.fp8 import linear_function
    from megafp8.fp8.microscaling_quantizer import MicroscalingQuantizer
    from megafp8.parallel import ring_attention

    for owner, name in ((linear_function, "_apply_outside_compiled_graphs"), (ring_attention, "ring_attention"),
                        (MicroscalingQuantizer, "cast")):
        function = getattr(owner, name)
        if not getattr(function, "_megafp8_eager_island", False):
            island = torch.compiler.disable(function)
            island._megafp8_eager_island = True
            setattr(owner, name, island)


def compile_layers(chunks: Iterable[nn.Module], *, backend: str = "inductor", mode: str | None = None,
                   scope: str = "full", fullgraph: bool = False) -> int:
    """Compile every transformer layer of these model chunks (GPTModel or a pipeline stage's chunk) in place
    (state dict names unchanged); returns how many modules were compiled. `scope` "attn" compiles only each
    layer's attention; a mixture-of-experts layer always compiles only its attention (its router's dispatch sorts
    a data-dependent number of tokens to each expert: shapes a graph would recompile for every step), the experts
    run eager. `fullgraph`: refuse a graph break (only possible without TP/SP/CP collectives)."""
    if scope not in CUDA_GRAPH_SCOPES:
        raise ValueError(f"compile scope must be one of {CUDA_GRAPH_SCOPES}, got {scope!r}")
    mark_eager_islands()
    count = 0
    for chunk in chunks:
        for layer in getattr(chunk, "layers", {}).values():
            moe = getattr(layer, "is_moe", False)
            target = layer if scope == "full" and not moe else layer.self_attention
            compiled = torch.compile(target._call_impl, backend=backend, mode=mode, fullgraph=fullgraph)
            target._compiled_call_impl = _EagerPrologueThenCompiled(target, compiled)
            count += 1
    return count


@dataclass(frozen=True)
class CompileReport:
    """What dynamo did in this process: graphs captured, recompilations (guard failures) and their reasons."""

    graphs: int
    recompilations: int
    reasons: tuple[str, ...]

    def line(self) -> str:
        reasons = "; ".join(dict.fromkeys(self.reasons))[:400]
        return (f"torch.compile: {self.graphs} graph{'s' if self.graphs != 1 else ''} captured, "
                f"{self.recompilations} recompilation{'s' if self.recompilations != 1 else ''}"
                + (f" ({reasons})" if reasons else ""))


def compile_report() -> CompileReport:
    from torch._dynamo.utils import counters, guard_failures

    reasons = tuple(str(r) for failures in guard_failures.values() for r in failures)
    return CompileReport(graphs=int(counters["stats"]["unique_graphs"]), recompilations=len(reasons), reasons=reasons)
