"""The MoE routers' statistics across ranks: the per-step expert-bias update and the logged losses and loads.

Each MoE layer accumulates, on the device and without a host read, its router's coefficient-free balancing and z
metrics (this rank's shares of them), the number of forwards and the tokens each expert was chosen by
(``MoELayer.stats``). Two readers sum them over the ranks of a pipeline stage (TP x CP x DP: the ``amax`` group):

- ``update_expert_biases``, once per step: DeepSeek-V3's bias update from the step's loads, one all-reduce;
- ``collect_moe_stats``, at log iterations: ``moe_aux_loss`` and ``moe_z_loss`` (means over layers, micro-batches
  and data-parallel replicas) and ``moe_tokens_per_expert`` per layer (summed over the logging window), gathered
  over the pipeline stages.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from megafp8.model.moe import MoELayer, moe_layers


def _layers(modules) -> list[tuple[str, MoELayer]]:
    """(``layers.{i}``, its MoE block) over this rank's chunks, by global layer index."""
    return [(name[:-len(".mlp")], layer) for module in modules for name, layer in moe_layers(module)]


def has_moe(modules) -> bool:
    return bool(_layers(modules))


def _sum_over(t: torch.Tensor, group) -> torch.Tensor:
    if group.size > 1:
        dist.all_reduce(t, group=group.group)  # statistics: not byte-counted, like the loss normalizer
    return t


@torch.no_grad()
def update_expert_biases(modules, group, applied: torch.Tensor | None = None) -> None:
    """DeepSeek-V3's aux-loss-free update of every expert bias from the tokens its experts received this step, over
    all ranks of the stage (``group``); ``applied`` (a device bool): the optimizer took the step (a skipped step leaves
    the biases). Resets the step's counts."""
    layers = [(name, layer) for name, layer in _layers(modules) if layer.router.enable_expert_bias]
    if not layers:
        return
    loads = _sum_over(torch.stack([layer.step_tokens_per_expert for _, layer in layers]), group)
    for (_, layer), load in zip(layers, loads):
        before = layer.router.expert_bias.clone()
        layer.router.update_expert_bias(load)
        if applied is not None:
            layer.router.expert_bias.copy_(torch.where(applied, layer.router.expert_bias, before))
        layer.step_tokens_per_expert.zero_()


@torch.no_grad()
def collect_moe_stats(modules, stage_group, pp_group, dp_size: int) -> dict:
    """The logging window's MoE metrics (every rank calls; collectives over the stage and the pipeline); resets them.
    ``dp_size``: the data-parallel replicas, whose metrics are averaged."""
    local = {}
    for name, layer in _layers(modules):
        stats = layer.stats
        experts = layer.num_experts
        if stats is None:
            packed = torch.zeros(3 + experts, device=layer.router.weight.device)
        else:
            packed = torch.cat([torch.stack([stats["aux_metric"], stats["z_metric"], stats["forwards"]]),
                                stats["tokens_per_expert"]])
        local[name] = (packed, _split_size(layer))
        layer.stats = None
    if local:
        summed = _sum_over(torch.stack([p for p, _ in local.values()]), stage_group).tolist()
        local = {name: (values, split) for (name, (_, split)), values in zip(local.items(), summed)}
    per_layer = {}
    for name, (values, split) in local.items():
        forwards = values[2] / split / dp_size  # each replica's forwards of this layer in the window
        scale = 1 / max(forwards * dp_size, 1)  # the shares of split ranks add up; replicas are averaged
        per_layer[name] = (values[0] * scale, values[1] * scale, [int(v) for v in values[3:]])
    if pp_group.size > 1:
        gathered: list = [None] * pp_group.size
        dist.all_gather_object(gathered, per_layer, group=pp_group.group)
        per_layer = {name: v for stage in gathered for name, v in stage.items()}
    if not per_layer:
        return {}
    names = sorted(per_layer, key=lambda n: int(n.split(".")[1]))
    return {"moe_aux_loss": sum(per_layer[n][0] for n in names) / len(names),
            "moe_z_loss": sum(per_layer[n][1] for n in names) / len(names),
            "moe_tokens_per_expert": {n: per_layer[n][2] for n in names}}


def _split_size(layer: MoELayer) -> int:
    """The ranks holding slices of the same sequences (TP under SP, CP): their metric shares add up to one value."""
    size = 1
    for group in layer.router.token_split_groups():
        size *= group.size
    return size

