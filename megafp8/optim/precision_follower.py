"""The distributed optimizer's side of a precision change under --fp8-param-gather: armed by the precision plans."""
from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import nn

from megafp8.fp8 import PrecisionChange

if TYPE_CHECKING:
    from megafp8.optim.distributed_optimizer import DistributedOptimizer


class PrecisionFollower:
    """Follows the model's precision plans for the optimizer, without looking at any layer per forward.

    A layer whose FP8-gathered weight left FP8 (the saturation guard runs after the step, so the weight has only FP8
    bytes until the next publish) gets a one-shot forward pre-hook: its first forward fetches every switched weight's
    high-precision values (the master as of the last step) and gathers them, as the optimizer's pre-hook on every FP8
    layer did. A layer whose FP8-gathered weight changed recipe (a schedule) lost its injected weight to the change:
    its first forward rebuilds the FP8 publication under the new recipes and publishes again (a delayed weight's
    history then observes its amax once more).
    """

    def __init__(self, opt: DistributedOptimizer) -> None:
        self.opt = opt
        self._armed: dict[nn.Module, object] = {}  # layer -> its pre-hook's handle
        self._recipe_changed = False
        for plan in opt.ddp.precision_plans:
            plan.on_change(self.on_change)

    def on_change(self, changes: list[PrecisionChange]) -> None:
        ddp = self.opt.ddp
        for change in changes:
            weight = getattr(change.module, "weight", None)
            if weight in ddp.demoted_fp8_params:
                self._arm(change.module)
            elif change.new is not None and weight in ddp.fp8_params:
                self._recipe_changed = True
                self.opt.drop_fp8_publication()
                self._arm(change.module)

    def _arm(self, module: nn.Module) -> None:
        if module not in self._armed:
            self._armed[module] = module.register_forward_pre_hook(self._before_forward)

    @torch.no_grad()
    def _before_forward(self, _module: nn.Module, _args) -> None:
        if torch.compiler.is_compiling():  # a compiled layer ran this hook eagerly before its graph (model/compile.py)
            return
        for handle in self._armed.values():
            handle.remove()
        self._armed.clear()
        opt, ddp = self.opt, self.opt.ddp
        if self._recipe_changed:
            self._recipe_changed = False
            opt.publish()  # takes any switch too
            ddp.finish_param_sync()  # this layer's own gather hook has run already
            return
        switched = ddp.take_guard_switches()  # empty when a publish took them first
        params = {sw.param for sw in switched}
        for frag in opt.fragments:
            if frag.param in params:
                opt.write_high_precision(frag)
        ddp.gather_switched_weights(switched)

    _before_forward.reads_no_input = True  # grouped MoE GEMMs run it by hand (megafp8.model.grouped_gemm)
