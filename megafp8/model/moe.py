"""The mixture-of-experts block (Megatron-Core's MoELayer): a top-k router, the routed experts, optional shared experts.

Data flow on this rank's tokens ``x [s_local, b, h]`` (``s/TP`` under sequence parallelism, this rank's chunks under
context parallelism: routing is per token, so nothing is gathered)::

    router (fp32)            -> each token's k experts and their weights (megafp8.model.router)
    dispatch                 -> the k T (token, expert) choices sorted by expert, token order kept within an expert;
                                with --moe-expert-capacity-factor each expert keeps its best `capacity` choices
                                (--moe-token-drop-policy probs: the highest weights; position: the earliest tokens);
                                under expert parallelism, an all-to-all to the experts' ranks and back
                                (megafp8.parallel.expert_dispatch; FP8 bytes when the experts run FP8), or with
                                --moe-token-dispatcher-type allgather every rank gathers every token, runs its
                                experts on their choices and the per-token sums are reduce-scattered back
    experts                  -> expert e's SwiGLU MLP on its rows, a loop of GEMMs (each an FP8 linear under the
                                run's recipe, like the dense MLP's; split over the etp group with ETP > 1), or with
                                --moe-grouped-gemm grouped GEMMs over every local expert (megafp8.model.grouped_gemm)
    combine                  -> each row times its weight, the k rows of a token summed in fp32 in a fixed order
    + shared experts         -> a dense MLP of --moe-shared-expert-intermediate-size on every token

By default experts are whole (ETP = 1). Without expert parallelism every rank holds all of them: their weights, like
the router's, are copies on each TP rank whose gradients are summed over TP under sequence parallelism (each TP rank
routed different tokens) and averaged over DP x CP like every dense weight. With --expert-model-parallel-size E a
rank holds E-th of them, and each expert's gradient is summed over its holders (the expert-data-parallel group)
before the same division by DP x CP (megafp8.parallel.data_parallel). With --expert-tensor-parallel-size T each
expert is split over T ranks (the etp group, which holds the same experts) as the dense MLP over TP under sequence
parallelism: an expert's fc1 all-gathers its rows from the T ranks (FP8 bytes in FP8, as the dense layers), fc2
reduce-scatters its outputs back, each rank's rows padded to the most any of the T has (Megatron-Core's ETP); each
piece's gradient is then summed over its holders as above. Parameter names are Megatron-Core's (``mlp.router.weight``, ``mlp.experts.local_experts.{e}.linear_fc1.weight``,
``mlp.shared_experts.linear_fc1.weight``), with the global expert index e.

The load-balancing and z losses enter the gradient without a loss term in the pipeline: their gradient is attached
to the block's output (Megatron-Core's MoEAuxLossAutoScaler) with the micro-batch's share of the step, which the
pipeline sets (``set_aux_loss_scale``). The router's statistics (losses, tokens per expert) accumulate on the device
for the log and for the expert-bias update (megafp8.model.moe_stats).
"""
from __future__ import annotations

import dataclasses
import math

import torch
from torch import nn

from megafp8.fp8 import Fp8Recipe, swiglu
from megafp8.fp8.autocast import resolve_recipe
from megafp8.fp8.grouped_linear_function import grouped_fp8_ready
from megafp8.model.config import ModelConfig
from megafp8.model.grouped_gemm import (grouped_fp8_mlp, grouped_gemm_supported, grouped_linear, hooks_allow_grouping,
                                        run_forward_pre_hooks)
from megafp8.model.mlp import MLP
from megafp8.model.router import TopKRouter
from megafp8.parallel import collectives as C
from megafp8.parallel.expert_dispatch import AllGatherExchange, ExpertExchange
from megafp8.parallel.parallel_state import ParallelState
from megafp8.parallel.placement import Placement
from megafp8.parallel.tensor_parallel import LinearLayout


class MoELayer(nn.Module):
    """``[s_local, b, h]`` -> same; a drop-in for the dense MLP of a transformer block."""

    def __init__(self, config: ModelConfig, parallel_state: ParallelState) -> None:
        super().__init__()
        if parallel_state.tp_size > 1 and not parallel_state.sequence_parallel:
            raise ValueError("MoE with --tensor-model-parallel-size > 1 needs --sequence-parallel (Megatron-Core's "
                             "rule: each TP rank routes its own slice of the sequence)")
        self.num_experts, self.topk = config.num_experts, config.moe_router_topk
        self.capacity_factor = config.moe_expert_capacity_factor
        self.drop_policy = config.moe_token_drop_policy
        self.pad_to_capacity = config.moe_pad_expert_input_to_capacity
        self.dispatcher = config.moe_token_dispatcher_type
        self.grouped_gemm, self.activation = config.moe_grouped_gemm, config.activation
        self.router = TopKRouter(config, parallel_state)
        # Under expert parallelism this rank holds experts [r E/EP, (r+1) E/EP), named by their global index. With
        # ETP = 1 each is whole: its linears are built on a one-rank layout (no split, no collective). With ETP > 1
        # each is split over the etp group as the dense MLP over TP (fc1 by output, fc2 by input features), its rows
        # entering and leaving split over that group as sequence parallelism's sequence (see _run_experts).
        self.etp = parallel_state.group("etp")
        experts_layout = ParallelState().init_process_groups()
        if self.etp.size > 1:  # the linears' sequence-parallel traffic, charged as ETP's
            counters = C.RenamedKinds(self.etp.counters, {"tp_sp_allgather": "etp_allgather",
                                                          "tp_reduce_scatter": "etp_reduce_scatter"})
            experts_layout = LinearLayout(dataclasses.replace(self.etp, counters=counters), sequence_parallel=True)
        expert_ffn = config.moe_ffn_hidden_size or config.ffn_hidden_size
        expert_config = dataclasses.replace(config, ffn_hidden_size=expert_ffn)
        self.ep = parallel_state.group("ep")
        per_rank = config.num_experts // self.ep.size
        self.first_expert = self.ep.rank * per_rank
        self.experts = nn.Module()
        self.experts.local_experts = nn.ModuleDict({str(e): MLP(expert_config, experts_layout)
                                                    for e in range(self.first_expert, self.first_expert + per_rank)})
        self.shared_experts = None
        if config.moe_shared_expert_intermediate_size:
            shared = dataclasses.replace(config, ffn_hidden_size=config.moe_shared_expert_intermediate_size)
            self.shared_experts = MLP(shared, parallel_state)  # tensor-parallel, like the dense MLP
        for param in self.experts.parameters():
            if self.etp.size > 1:  # a piece on each ETP rank; each piece's holders together saw every routed token
                param.placement = Placement(shard_group="etp", shard_dim=param.partition_dim,
                                            shard_stride=param.partition_stride, grad_sync_group="edp")
                continue
            param.tensor_model_parallel = False  # whole on every rank holding it (initialised as one tensor)
            if self.ep.size == 1:  # copies on every TP rank: each TP rank's grads are partial sums (routed tokens)
                param.sequence_parallel = parallel_state.sequence_parallel
            else:  # its holders (the expert-data-parallel group) together saw every token routed to it
                param.placement = Placement(grad_sync_group="edp")
        if self.ep.size > 1:  # their FP8 amaxes and saturation reduce over the expert's holders, not the stage
            for module in self.experts.modules():
                module.expert_parallel = True
        self.aux_loss_scale: float | torch.Tensor = 1.0  # this micro-batch's share of the step: set_aux_loss_scale
        self.stats: dict[str, torch.Tensor] | None = None  # accumulated router statistics (megafp8.model.moe_stats)
        if self.router.enable_expert_bias:  # the step's loads, for the bias update (not checkpointed: reset each step)
            self.register_buffer("step_tokens_per_expert", torch.zeros(config.num_experts), persistent=False)

    def capacity(self, num_tokens: int) -> int | None:
        """Megatron's expert capacity, ``ceil(T k / E * factor)``; None without a capacity factor (dropless)."""
        if self.capacity_factor is None:
            return None
        return math.ceil(num_tokens * self.topk / self.num_experts * self.capacity_factor)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        seq, batch, hidden = x.shape
        tokens = x.reshape(-1, hidden)
        top_experts, top_probs, losses = self.router(tokens, batch)
        self._accumulate(losses)
        capacity = self.capacity(tokens.shape[0])
        order, counts = dispatch_order(top_experts, top_probs, self.num_experts, capacity, self.drop_policy)
        if self.ep.size > 1 and self.dispatcher == "allgather":  # every token to every rank, sums back
            out = self._allgather_experts(tokens, top_experts, top_probs, order).view(seq, batch, hidden)
        else:
            rows = tokens[order // self.topk]  # [kept choices, h], sorted by expert
            if self.ep.size == 1:
                outputs = self._run_experts(rows, top_experts.reshape(-1)[order], counts, capacity)
            else:  # to the experts' ranks and back (megafp8.parallel.expert_dispatch)
                exchange = ExpertExchange(counts, self.ep)
                local = exchange.dispatch(rows, fp8=self._experts_planned_low_precision())
                outputs = exchange.combine(self._run_experts(local, None, exchange.local_counts, None))
            weighted = outputs.float() * top_probs.reshape(-1)[order].unsqueeze(-1)
            combined = weighted.new_zeros(tokens.shape[0] * self.topk, hidden).index_copy_(0, order, weighted)
            out = combined.view(-1, self.topk, hidden).sum(1).to(x.dtype).view(seq, batch, hidden)
        if self.shared_experts is not None:
            out = out + self.shared_experts(x, fuse_activation=True)
        if losses["loss"] is not None and torch.is_grad_enabled():
            out = _AttachAuxLoss.apply(out, losses["loss"], self.aux_loss_scale)
        return out

    def _allgather_experts(self, tokens: torch.Tensor, top_experts: torch.Tensor, top_probs: torch.Tensor,
                           order: torch.Tensor) -> torch.Tensor:
        """--moe-token-dispatcher-type allgather: this rank's experts on every EP rank's choices of them (the capacity
        drops each rank decided for its own tokens travel as a kept mask), the tokens' sums reduce-scattered back."""
        exchange = AllGatherExchange(self.ep, self.first_expert, len(self.experts.local_experts))
        kept = torch.zeros(top_experts.numel(), dtype=torch.bool, device=tokens.device).index_fill_(0, order, True)
        rows, counts = exchange.gather(tokens, top_experts, top_probs, kept,
                                       fp8=self._experts_planned_low_precision())
        return exchange.combine(self._run_experts(rows, None, counts, None), tokens.dtype)

    def _run_experts(self, rows: torch.Tensor, row_experts: torch.Tensor, counts: torch.Tensor,
                     capacity: int | None) -> torch.Tensor:
        """Each expert on its rows (a loop of GEMMs, or grouped FP8 GEMMs on the same padded rows with
        --moe-grouped-gemm). Both need each expert's row count on the host: one read per layer and micro-batch, as
        Megatron's dropless dispatch. Padded to capacity (--moe-pad-expert-input-to-capacity) the rows are placed in an
        ``[E x capacity, h]`` grid on the device instead: static sizes, nothing read.

        Zero rows pad each expert's input (``_row_alignment``): to a multiple of 16 while the expert runs in FP8 or
        FP4 (the wgrad GEMM's K is the token count: cuBLAS FP8 GEMMs need it divisible by 16, NVFP4's Hadamard
        transform runs in blocks of 16; Megatron pads the same), and to at least one row, so every expert's weights
        get their (zero) gradient every step. Zero rows change no output, and add exact zeros to the weight
        gradients."""
        if self._runs_grouped(rows):
            return self._run_experts_grouped(rows, row_experts, counts, capacity)
        experts = list(self.experts.local_experts.values())
        slots = None
        if self.pad_to_capacity and capacity is not None:  # under EP the exchange read the counts anyway
            size = _round_up(capacity, max(map(self._row_alignment, experts)))
            rows, slots = self._capacity_grid(rows, row_experts, counts, size)
            sizes = run_sizes = [size] * self.num_experts  # the same on every ETP rank: nothing to agree
        else:
            sizes = counts.tolist()
            # Under ETP an expert's linears gather its rows from every ETP rank and reduce-scatter their outputs back,
            # in equal pieces: each rank pads its rows of an expert to the most any ETP rank has of it.
            run_sizes = self._most_rows_over_etp(sizes) if self.etp.size > 1 else sizes
        runs = []
        for expert, chunk, most in zip(experts, rows.split(sizes), run_sizes):
            padded = _round_up(max(most, 1), self._row_alignment(expert))
            n = chunk.shape[0]
            runs.append(chunk if padded == n else torch.cat([chunk, chunk.new_zeros(padded - n, chunk.shape[-1])]))
        recipe = self._grouped_fp8_recipe()
        if recipe is not None:  # the same padded rows, two grouped FP8 GEMMs instead of the loop's
            outputs = grouped_fp8_mlp(experts, runs, recipe)
        else:
            outputs = [expert(run.unsqueeze(1), fuse_activation=True).squeeze(1) for expert, run in zip(experts, runs)]
        outputs = torch.cat([out[:n] for out, n in zip(outputs, sizes)])
        return outputs if slots is None else outputs[slots]

    def _row_alignment(self, expert: MLP) -> int:
        """An expert's rows are padded to a multiple of this: 1 in high precision; 16 when one of its linears runs 8
        or 4 bits (the guard may switch one linear alone: each expert's own state, agreed by its holders), 32 under
        ETP (the MX recipes' sequence-split transpose groups 32 rows)."""
        if expert.linear_fc1.active_recipe is None and expert.linear_fc2.active_recipe is None:
            return 1
        return 32 if self.etp.size > 1 else 16

    def _runs_grouped(self, rows: torch.Tensor) -> bool:
        """--moe-grouped-gemm applies: every local expert's linears run in high precision now, whole (ETP 1), with a
        gated activation and no output multiplier, on rows torch._grouped_mm takes, with no hook the grouped path
        cannot run (megafp8.model.grouped_gemm); else the loop, its twin. No rows at all also take the loop (a grouped
        wgrad over zero rows is refused on GPUs)."""
        if not (self._may_group() and self.activation != "xielu" and rows.shape[0] > 0
                and grouped_gemm_supported(rows.dtype, rows.device)):
            return False
        return not any(m.active_recipe is not None or m.output_multiplier is not None for m in self._expert_linears())

    def _grouped_fp8_recipe(self) -> Fp8Recipe | None:
        """--moe-grouped-gemm with FP8 experts: the recipe every local expert's linears run now, when the grouped FP8
        path runs them as the loop would (whole experts, SwiGLU, a recipe with grouped kernels, no hook it cannot run:
        megafp8.fp8.grouped_linear_function.grouped_fp8_ready); else None, and the loop runs."""
        if not (self._may_group() and self.activation == "swiglu"):
            return None
        return grouped_fp8_ready(self._expert_linears())

    def _may_group(self) -> bool:
        """What both grouped paths need: --moe-grouped-gemm, whole experts (ETP 1), and no module hook they cannot run
        by hand (megafp8.model.grouped_gemm.hooks_allow_grouping)."""
        return self.grouped_gemm and self.etp.size == 1 and hooks_allow_grouping(self.experts.local_experts.modules())

    def _expert_linears(self) -> list[nn.Module]:
        """Every local expert's fc1 and fc2."""
        return [m for e in self.experts.local_experts.values() for m in (e.linear_fc1, e.linear_fc2)]

    def _capacity_grid(self, rows: torch.Tensor, row_experts: torch.Tensor, counts: torch.Tensor,
                       size: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The rows placed in an ``[E x size, h]`` grid of zeros, expert e's from row ``e x size`` on, and each row's
        slot in it (EP = 1: ``row_experts`` are the global experts)."""
        within = torch.arange(rows.shape[0], device=rows.device) - (torch.cumsum(counts, 0) - counts)[row_experts]
        slots = row_experts * size + within
        return rows.new_zeros(self.num_experts * size, rows.shape[-1]).index_copy_(0, slots, rows), slots

    def _run_experts_grouped(self, rows: torch.Tensor, row_experts: torch.Tensor | None, counts: torch.Tensor,
                             capacity: int | None) -> torch.Tensor:
        """Every expert's SwiGLU MLP on its rows as two grouped GEMMs; the row counts stay on the device (padded to
        capacity, the rows sit in the loop's grid)."""
        experts = list(self.experts.local_experts.values())
        slots = None
        if self.pad_to_capacity and capacity is not None:
            rows, slots = self._capacity_grid(rows, row_experts, counts, capacity)
            counts = torch.full_like(counts, capacity)
        offsets = torch.cumsum(counts, 0).to(torch.int32)
        for linear in self._expert_linears():
            run_forward_pre_hooks(linear)  # its weight is read below without calling it
        gate_up = grouped_linear(rows, [e.linear_fc1.weight for e in experts], offsets)
        # Smooth-SwiGLU's channel scales cancel exactly in high precision: plain SwiGLU is the same function.
        outputs = grouped_linear(swiglu(*gate_up.chunk(2, dim=-1)), [e.linear_fc2.weight for e in experts], offsets)
        return outputs if slots is None else outputs[slots]

    def _most_rows_over_etp(self, sizes: list[int]) -> list[int]:
        """Each local expert's largest row count over the ETP ranks (a small all-gather, read on the host)."""
        mine = torch.tensor(sizes, dtype=torch.int64, device=self.router.weight.device)
        return C.all_gather(mine, self.etp, "etp_allgather").view(self.etp.size, -1).amax(0).tolist()

    def _experts_planned_low_precision(self) -> bool:
        """Whether this rank's experts run an 8- or 4-bit recipe by the precision plan alone (the layer recipes and
        schedules every rank shares, not the guard's local switches), which the FP8 dispatch's sender and receiver
        must agree on."""
        fc1 = next(iter(self.experts.local_experts.values())).linear_fc1
        return resolve_recipe(fc1.recipe, fc1.force_high_precision) is not None

    def _accumulate(self, losses: dict[str, torch.Tensor]) -> None:
        """Add this forward's router statistics to ``stats`` (a forward recomputed in backward adds nothing)."""
        if not torch.is_grad_enabled() or torch._C._current_graph_task_id() != -1:
            return
        values = {"aux_metric": losses["aux_metric"], "z_metric": losses["z_metric"], "forwards": 1.0,
                  "tokens_per_expert": losses["tokens_per_expert"]}
        if self.stats is None:
            self.stats = {name: torch.zeros_like(losses["tokens_per_expert"]) if name == "tokens_per_expert"
                          else torch.zeros((), device=losses["z_metric"].device) for name in values}
        for name, value in values.items():
            self.stats[name] += value
        if self.router.enable_expert_bias:
            self.step_tokens_per_expert += losses["tokens_per_expert"]


def _round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


def dispatch_order(top_experts: torch.Tensor, top_probs: torch.Tensor, num_experts: int, capacity: int | None,
                   drop_policy: str = "probs") -> tuple[torch.Tensor, torch.Tensor]:
    """The kept (token, expert) choices as indices ``t * k + j`` into the flattened ``[T, k]`` choices, sorted by
    expert and, within an expert, by token; and each expert's count of them. With a ``capacity`` an expert keeps its
    ``capacity`` choices of highest weight (``probs``) or earliest token (``position``), Megatron's drop policies."""
    experts = top_experts.reshape(-1)
    keep = torch.ones_like(experts, dtype=torch.bool)
    if capacity is not None:
        # Rank every choice within its expert by priority; the first `capacity` of each expert stay.
        priority = (torch.argsort(-top_probs.reshape(-1), stable=True) if drop_policy == "probs"
                    else torch.arange(experts.numel(), device=experts.device))
        by_expert = priority[torch.argsort(experts[priority], stable=True)]
        counts = torch.bincount(experts, minlength=num_experts)
        starts = torch.cumsum(counts, 0) - counts
        rank = torch.arange(experts.numel(), device=experts.device) - starts[experts[by_expert]]
        keep = torch.zeros_like(keep).index_fill_(0, by_expert[rank < capacity], True)
    order = torch.argsort(experts, stable=True)
    order = order[keep[order]]
    return order, torch.bincount(experts[order], minlength=num_experts)


class _AttachAuxLoss(torch.autograd.Function):
    """Identity on the block's output; in backward the aux loss gets ``scale`` as its gradient (Megatron-Core's
    MoEAuxLossAutoScaler): the loss joins the step's objective without travelling to the pipeline's last stage."""

    @staticmethod
    def forward(ctx, output: torch.Tensor, aux_loss: torch.Tensor, scale):
        ctx.save_for_backward(aux_loss)
        ctx.scale = scale
        return output

    @staticmethod
    def backward(ctx, grad_output: torch.Tensor):
        (aux_loss,) = ctx.saved_tensors
        return grad_output, torch.ones_like(aux_loss) * ctx.scale, None


def moe_layers(module: nn.Module) -> list[tuple[str, MoELayer]]:
    return [(name, m) for name, m in module.named_modules() if isinstance(m, MoELayer)]


def set_aux_loss_scale(modules, scale: float | torch.Tensor) -> None:
    """The gradient each micro-batch's aux losses get: its share of the step (1 / micro-batches, x CP because the
    DP x CP gradient average divides the CP ranks' partial losses by CP, x the --fp16 loss scale)."""
    for module in modules:
        for _, layer in moe_layers(module):
            layer.aux_loss_scale = scale
