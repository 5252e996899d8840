"""Pipeline parallelism on torch.distributed.pipelining: megafp8 builds this rank's stages from the
layout and runs one training step's micro-batches through torch's schedule.

torch owns the schedules (1F1B, interleaved 1F1B, interleaved zero-bubble, ZBV, DualPipeV) and the
point-to-point transfers. megafp8 owns what torch cannot know:

- the stages: one ``GPTModel`` chunk per (virtual) stage with its global layer numbers
  (``megafp8.parallel.pipeline_layout``), embedding on the first stage, norm + head on the last;
- the p2p shapes: ``[s/TP, mb, h]`` under sequence parallelism (the sequence shard travels), declared
  statically so torch never runs a shape-probing forward (which would fold extra FP8 amaxes);
- byte counting: every activation / gradient send is charged to ``pp_p2p``;
- the loss: each micro-batch contributes ``sum(loss * mask) / tokens in the step``, so the summed
  micro-batch losses and the gradients equal the PP=1 run on the same batch (no ``scale_grads``);
- the tied embedding: the first stage's ``embedding.weight`` and the last stage's
  ``output_layer.weight`` start identical (layout-invariant init) and their gradients are summed over
  the embedding group once per step (``embedding_allreduce``); when one rank holds both ends (V
  schedules) the two chunks share one Parameter instead;
- FP8: every micro-batch reuses the layer's cached FP8 weight (quantized once per optimizer step) and
  the delayed-scaling amaxes of this rank's chunks are reduced once per step over the stage's TP x DP
  group (``ParallelState.amax_group``).

Zero-bubble schedules split each backward into an input-gradient (B) and a weight-gradient (W) pass.
torch implements W by re-running autograd from saved intermediates, which would call the FP8 linear's
autograd Function a second time (its wgrad accumulated into ``main_grad`` twice, its sequence-parallel
collectives repeated) and bypasses post-accumulate-grad hooks (which feed ``DistributedDataParallel``'s
grad buffer). So with an FP8 recipe megafp8 splits the FP8 weight gradient itself
(``megafp8.fp8.deferred_wgrad``): B runs autograd over this chunk's inputs and every parameter except
the FP8 linears' weights, and each FP8 linear queues its wgrad GEMM (its FP8 ``dY^T`` / ``x^T``); the
stage's ``dw_builder`` hands that queue to W, which runs the wgrads into ``main_grad`` and fires the
weights' grad hooks once, as the unsplit backward would. Non-FP8 parameters (norms, embedding, a BF16
head or first/last layers) get their gradients in B. Without FP8 the W pass is empty (B computes both
gradients) unless ``split_weight_grads=True`` asks for torch's own split, which is only for a model whose
gradients are read from ``.grad`` (no grad buffer: torch's W assigns ``.grad`` and skips the hooks).
``split_weight_grads=False`` with FP8 turns the deferral off (empty W).
"""
from __future__ import annotations

from collections.abc import Iterator

import torch
import torch.distributed as dist
from torch import nn

from megafp8.fp8 import Fp8GemmModule, Fp8Recipe, Fp8ScalingManager, precision_plans
from megafp8.fp8.deferred_wgrad import WgradDeferral
from megafp8.model import GPTModel, ModelConfig
from megafp8.model.moe import set_aux_loss_scale
from megafp8.parallel import collectives as C
from megafp8.parallel.cross_entropy import loss_normalizer, vocab_parallel_cross_entropy
from megafp8.parallel.fp8_sequence_parallel import fp8_scaling_manager
from megafp8.parallel.parallel_state import ParallelState
from megafp8.parallel.pipeline_layout import ZERO_BUBBLE_SCHEDULES
from megafp8.parallel.random import build_on_device, model_parallel_rng
from megafp8.parallel.tensor_parallel import allreduce_sequence_parallel_grads

class PipelineCommunicationError(RuntimeError):
    """A pipeline step failed in (or while waiting on) point-to-point communication with a peer stage."""


class _StageModule(nn.Module):
    """What torch's stage calls: token ids on the first stage, the previous stage's hidden states after it."""

    def __init__(self, chunk: GPTModel) -> None:
        super().__init__()
        self.chunk = chunk

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.chunk(x) if self.chunk.pre_process else self.chunk(None, hidden_states=x)


class ModelChunks(nn.ModuleList):
    """This rank's chunks as one module whose parameter names are the chunks' own global names (not
    ``0.layers.3...``), so a grad buffer, an optimizer or a checkpoint built on it is layout-independent.
    A Parameter shared by two chunks (a V schedule's tied embedding) is named once."""

    def named_parameters(self, prefix: str = "", recurse: bool = True, remove_duplicate: bool = True):
        seen: set[int] = set()
        for chunk in self:
            for name, param in chunk.named_parameters(prefix, recurse, remove_duplicate):
                if id(param) not in seen or not remove_duplicate:
                    seen.add(id(param))
                    yield name, param

    def named_modules(self, memo: set | None = None, prefix: str = "", remove_duplicate: bool = True):
        # Global names here too (FP8 telemetry tags, the saturation guard's switched layers, which a
        # checkpoint restores by name): `layers.3.mlp.linear_fc1`, not `0.layers.3.mlp.linear_fc1`.
        memo = set() if memo is None else memo
        if self not in memo or not remove_duplicate:
            memo.add(self)
            yield prefix, self
        for chunk in self:  # each chunk itself comes back named `prefix` too, like the container
            yield from chunk.named_modules(memo, prefix, remove_duplicate)


class Pipeline:
    """This rank's model chunks and the step that runs one global batch (this DP rank's share) through them.

    ``chunks``: the GPTModel of each local stage in pipeline order (their parameter names are global, so
    ``state_dict()`` is layout-independent). ``forward_backward(input_ids, labels, loss_mask=None)`` runs forward
    and backward over ``num_microbatches`` micro-batches and leaves in every parameter's ``.grad`` (or
    ``main_grad``) the gradient of the batch's mean token loss on this DP rank: sequence-parallel grads
    reduced over TP, tied-embedding grads summed over the embedding group. ``update_fp8_scales()`` then folds
    the step's amaxes into the delayed FP8 scales; ``step`` does both. The data-parallel reduction and the
    optimizer step are the caller's.
    """

    # --calculate-per-token-loss: the gradient is of the whole global batch's token mean (the DP x CP ranks'
    # summed token losses over their summed loss tokens), not the DP x CP mean of each rank's token mean.
    calculate_per_token_loss = False
    loss_scale: torch.Tensor | None = None  # --fp16: backward runs on loss x this (megafp8.optim.loss_scaler)

    def __init__(self, config: ModelConfig, parallel_state: ParallelState, *, micro_batch_size: int,
                 num_microbatches: int, fp8_recipe: Fp8Recipe | None = None, first_last_layers_bf16: int = 0,
                 split_weight_grads: bool | None = None, device: torch.device | str | None = None,
                 reduce_replicated_grads: bool = True) -> None:
        ps = parallel_state
        # False when a DistributedDataParallel grad buffer does these reductions itself (once per bucket).
        self.reduce_replicated_grads = reduce_replicated_grads
        ps.validate_model(config, global_batch_size=micro_batch_size * num_microbatches * ps.dp_size,
                          micro_batch_size=micro_batch_size)
        self.config, self.parallel_state = config, ps
        self.micro_batch_size, self.num_microbatches = micro_batch_size, num_microbatches
        self.device = torch.device(device) if device is not None else (
            torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu"))
        self.layout = ps.pipeline_layout(config.num_layers)
        self.stage_ids = self.layout.stages_of_rank(ps.coords.pp)
        last_stage = self.layout.num_stages - 1
        # One dropout-mask tracker per rank, shared by its chunks (virtual stages): one stream, saved in checkpoints.
        rng = (model_parallel_rng(config.seed, ps.coords.tp, ps.coords.pp)
               if config.attention_dropout or config.hidden_dropout else None)
        # Built on the device: each weight is allocated there once and drawn there from its (seed, name)
        # generator, no host copy (megafp8.parallel.random.build_on_device). The .to() only moves what a
        # module might have created on an explicit other device.
        with build_on_device(self.device):
            self.chunks: list[GPTModel] = [
                GPTModel(config, ps, pre_process=s == 0, post_process=s == last_stage,
                         layer_numbers=self.layout.layer_numbers(s), fp8_recipe=fp8_recipe,
                         first_last_layers_bf16=first_last_layers_bf16, rng=rng).to(self.device)
                for s in self.stage_ids]
        self.holds_first_stage = self.stage_ids[0] == 0
        self.holds_last_stage = self.stage_ids[-1] == last_stage
        if config.tie_embeddings and self.holds_first_stage and self.holds_last_stage and len(self.chunks) > 1:
            # V schedules: both ends on this rank, so the head can use the embedding Parameter itself.
            self.chunks[-1].output_layer.weight = self.chunks[0].embedding.weight
        self.modules = ModelChunks(self.chunks)
        self.fp8_manager: Fp8ScalingManager | None = (
            fp8_scaling_manager(self.modules, ps) if fp8_recipe is not None and fp8_recipe.is_delayed else None)
        self.precision_plans = precision_plans(self.modules)
        for plan in self.precision_plans:
            plan.on_change(self._follow_precision)
        self._step_tokens = torch.ones(())
        self.deferrals: list[WgradDeferral] = []  # one per chunk when FP8 wgrads are split into W
        self.schedule = self._build_schedule(fp8_recipe, split_weight_grads) if ps.pp_enabled else None

    # ---- construction ---------------------------------------------------------------------------
    def _follow_precision(self, _changes) -> None:
        """A plan moved layers: a delayed recipe that appears needs the scaling manager (once made, it stays: it finds
        the layers' states itself, and has none to update when no layer keeps any)."""
        if self.fp8_manager is None and any(plan.has_delayed_recipe() for plan in self.precision_plans):
            self.fp8_manager = fp8_scaling_manager(self.modules, self.parallel_state)

    def _p2p_shape(self) -> tuple[int, int, int]:
        ps = self.parallel_state
        seq = self._local_seq_length()
        return (seq // ps.tp_size if ps.sequence_parallel else seq), self.micro_batch_size, self.config.hidden_size

    def _cp_group(self):
        return self.parallel_state.cp_group if self.parallel_state.cp_enabled else None

    def _loss_token_group(self):
        """Whose loss tokens a rank's normalizer counts (megafp8.parallel.cross_entropy.loss_normalizer): its CP
        group's, or with calculate_per_token_loss every DP x CP rank's (the global batch's)."""
        return self.parallel_state.dp_group if self.calculate_per_token_loss else self._cp_group()

    def _local_seq_length(self) -> int:
        """Tokens of a sequence on this rank: context parallelism splits each sequence over its CP ranks."""
        return self.config.seq_length // self.parallel_state.cp_size

    def _build_schedule(self, fp8_recipe: Fp8Recipe | None, split_weight_grads: bool):
        # torch's pipelining (it imports torch._dynamo: ~0.7 s of a process's start) only where PP > 1
        from megafp8.parallel.pipeline_stages import CountedStage, DeferringStage, make_schedule

        ps, cfg = self.parallel_state, self.config
        # Static shapes (torch then skips its shape-probing forward); requires_grad marks what carries a gradient.
        hidden = torch.empty(self._p2p_shape(), dtype=cfg.params_dtype, device=self.device, requires_grad=True)
        seq = self._local_seq_length()
        ids = torch.empty(self.micro_batch_size, seq, dtype=torch.long, device=self.device)
        logits = torch.empty(self.micro_batch_size, seq, self.chunks[-1].padded_vocab_size // ps.tp_size,
                             dtype=cfg.params_dtype, device=self.device, requires_grad=True)
        zero_bubble = ps.pipeline_schedule in ZERO_BUBBLE_SCHEDULES
        fp8_split = zero_bubble and fp8_recipe is not None and split_weight_grads is not False
        no_split = zero_bubble and not fp8_split and not (fp8_recipe is None and split_weight_grads)
        stages = []
        for stage_id, chunk in zip(self.stage_ids, self.chunks):
            kwargs = dict(input_args=ids if chunk.pre_process else hidden,
                          output_args=logits if chunk.post_process else hidden,
                          group=ps.pp_group.group, counters=ps.comm)
            if fp8_split:  # FP8 wgrads in W, everything else in B (module docstring)
                deferral = WgradDeferral()
                for module in chunk.modules():
                    if isinstance(module, Fp8GemmModule):
                        module.wgrad_deferral = deferral
                self.deferrals.append(deferral)
                stages.append(DeferringStage(_StageModule(chunk), stage_id, self.layout.num_stages, self.device,
                                              deferral=deferral, **kwargs))
            else:  # no_split: an empty W pass, B computes input and weight grads together
                stages.append(CountedStage(_StageModule(chunk), stage_id, self.layout.num_stages, self.device,
                                            dw_builder=(lambda: (lambda: None)) if no_split else None, **kwargs))
        return make_schedule(ps.pipeline_schedule, stages, self.num_microbatches, self.microbatch_loss)

    # ---- the step -------------------------------------------------------------------------------
    def microbatch_loss(self, logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        """Last stage: this micro-batch's share of the step's mean token loss. ``target`` packs
        (labels, loss mask) as float64 ``[mb, s, 2]`` so torch splits both along the batch dim."""
        labels, mask = target[..., 0].long(), target[..., 1].to(torch.float32)
        per_token = vocab_parallel_cross_entropy(logits, labels, self.parallel_state.tp_group,
                                                 vocab_size=self.config.vocab_size)
        return (per_token * mask).sum() / self._step_tokens

    def step(self, input_ids: torch.Tensor, labels: torch.Tensor, loss_mask: torch.Tensor | None = None) -> torch.Tensor:
        """``forward_backward`` then ``update_fp8_scales``: one whole step's gradients and scales; returns the mean
        token loss (fp32 scalar, on every pipeline rank)."""
        loss = self.forward_backward(input_ids, labels, loss_mask)
        self.update_fp8_scales()
        return loss

    def forward_backward(self, input_ids: torch.Tensor, labels: torch.Tensor,
                         loss_mask: torch.Tensor | None = None) -> torch.Tensor:
        """Forward + backward of ``[micro_batch_size * num_microbatches, seq]`` tokens (every micro-batch, any
        schedule) and the SP / tied-embedding grad reductions, but no FP8 scale update: the observed amaxes stay
        pending, so the step can still be re-run from a restored state (megafp8.training.step_state). Returns the
        mean token loss (fp32 scalar, on every pipeline rank)."""
        expected = (self.micro_batch_size * self.num_microbatches, self._local_seq_length())
        if tuple(input_ids.shape) != expected or tuple(labels.shape) != expected:
            raise ValueError(f"Pipeline.forward_backward: input_ids {tuple(input_ids.shape)} / labels "
                             f"{tuple(labels.shape)} must be [--micro-batch-size x micro-batches, --seq-length / CP] "
                             f"= {list(expected)}")
        mask = torch.ones(expected, device=self.device) if loss_mask is None else loss_mask.to(self.device, torch.float32)
        self._step_tokens = loss_normalizer(mask, self._loss_token_group())  # the CP (or DP x CP) ranks' tokens too
        if self.loss_scale is not None:  # each micro-batch's loss x scale; exact for a power of two (dynamic scales)
            self._step_tokens = self._step_tokens / self.loss_scale
        # MoE aux losses: each micro-batch's share of the step (megafp8.model.moe.set_aux_loss_scale)
        set_aux_loss_scale(self.chunks, self.parallel_state.cp_size / self.num_microbatches
                           * (self.loss_scale if self.loss_scale is not None else 1.0))
        input_ids, labels = input_ids.to(self.device), labels.to(self.device)
        loss = self._run_plain(input_ids, labels, mask) if self.schedule is None else \
            self._run_schedule(input_ids, labels, mask)
        if self.loss_scale is not None:
            loss = loss / self.loss_scale
        if self.reduce_replicated_grads:
            allreduce_sequence_parallel_grads(self.modules, self.parallel_state)
            self._allreduce_tied_embedding_grads()
        return loss

    def update_fp8_scales(self) -> None:
        """The delayed-scaling update of this rank's chunks: the step's pending amaxes max-reduced over the stage's
        amax group (one collective), histories rolled, new scales. Once per step, after ``forward_backward``, also
        when the optimizer then skips the step; a no-op without a delayed FP8 recipe."""
        if self.fp8_manager is not None:
            self.fp8_manager.update()

    @torch.no_grad()
    def evaluate(self, input_ids: torch.Tensor, labels: torch.Tensor,
                 loss_mask: torch.Tensor | None = None) -> torch.Tensor:
        """Forward only (no grads, no FP8 scaling-state update); the mean token loss on every pipeline rank.

        Runs its own forward-only pass rather than ``schedule.eval``: torch's multi-stage schedules still
        issue backward actions in eval mode on V-shaped layouts. Each rank runs its stages in pipeline order,
        every micro-batch, and sends a stage's outputs on (counted as ``pp_p2p``) once it has received all of
        that stage's inputs, so consecutive ranks overlap stage by stage like a forward-only GPipe.
        """
        input_ids, labels = input_ids.to(self.device), labels.to(self.device)
        mask = torch.ones(labels.shape, device=self.device) if loss_mask is None else loss_mask.to(self.device, torch.float32)
        self._step_tokens = loss_normalizer(mask, self._loss_token_group())  # the CP (or DP x CP) ranks' tokens too
        for chunk in self.chunks:
            chunk.eval()
        try:
            if self.schedule is None:
                return sum((self.chunks[0](ids, lab) * m).sum() / self._step_tokens
                           for ids, lab, m in zip(*(t.split(self.micro_batch_size) for t in (input_ids, labels, mask))))
            return self._evaluate_stages(input_ids, labels, mask)
        except Exception as error:
            if _is_communication_failure(error):
                raise PipelineCommunicationError(self._failure_message(error)) from error
            raise
        finally:
            for chunk in self.chunks:
                chunk.train()

    def _evaluate_stages(self, input_ids: torch.Tensor, labels: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        ps, layout = self.parallel_state, self.layout
        me, peers = ps.coords.pp, ps.pp_group.ranks  # peers: global rank of each pipeline rank
        micro = [t.split(self.micro_batch_size) for t in (input_ids, labels, mask)]
        local = dict(zip(self.stage_ids, self.chunks))
        outputs: list[torch.Tensor | None] = [None] * self.num_microbatches  # between stages on this rank
        sends: list[C.PendingCollective] = []  # non-blocking: looped layouts send both ways
        loss = torch.zeros((), device=self.device)
        # Every rank walks its stages in pipeline order, and a stage's sends are issued after all of its receives:
        # then a rank pair's sends and receives come in the same order on both sides. NCCL runs each pair's p2p in
        # issue order and a large send waits for its receive, so a send issued between two receives (rank 1 of an
        # interleaved PP=2 sending stage 1's first output back while rank 0 still sends stage 0's) hangs both.
        for stage, chunk in local.items():
            source = layout.stage_rank(stage - 1) if stage > 0 else me
            sink = layout.stage_rank(stage + 1) if stage + 1 < layout.num_stages else me
            stage_outputs = []
            for mb in range(self.num_microbatches):
                if chunk.pre_process:
                    out = chunk(micro[0][mb])
                else:
                    x = outputs[mb] if source == me else C.recv(
                        torch.empty(self._p2p_shape(), dtype=self.config.params_dtype, device=self.device),
                        peers[source], ps.pp_group.group)
                    out = chunk(None, hidden_states=x)
                if chunk.post_process:
                    loss += self.microbatch_loss(out, torch.stack([micro[1][mb].double(), micro[2][mb].double()], -1))
                elif sink == me:
                    outputs[mb] = out
                else:
                    stage_outputs.append(out)
            sends += [C.isend(out, peers[sink], ps.comm, "pp_p2p", ps.pp_group.group) for out in stage_outputs]
        for pending in sends:
            pending.wait()
        return C.all_reduce(loss.float().reshape(1), ps.pp_group, "pp_p2p").reshape(())

    def _run_plain(self, input_ids: torch.Tensor, labels: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """PP=1: gradient accumulation over micro-batches, the same loss normalization as the schedules."""
        model, total = self.chunks[0], torch.zeros((), device=self.device)
        for ids, lab, m in zip(*(t.split(self.micro_batch_size) for t in (input_ids, labels, mask))):
            loss = (model(ids, lab) * m).sum() / self._step_tokens
            loss.backward()
            total += loss.detach()
        return total

    def _run_schedule(self, input_ids: torch.Tensor, labels: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        for deferral in self.deferrals:  # this step's forwards say which weights W delivers (guard switches)
            deferral.expected.clear()
        args = (input_ids,) if self.holds_first_stage else ()
        target = torch.stack([labels.double(), mask.double()], dim=-1) if self.holds_last_stage else None
        losses: list[torch.Tensor] = []
        try:
            self.schedule.step(*args, target=target, losses=losses if self.holds_last_stage else None,
                               return_outputs=False)
        except Exception as error:  # torch raises plain RuntimeErrors from its p2p waits
            if _is_communication_failure(error):
                raise PipelineCommunicationError(self._failure_message(error)) from error
            raise
        left = [d.pending() for d in self.deferrals]
        if any(left):  # a schedule that ran a B without its W: those weight grads would be lost
            raise RuntimeError(f"zero-bubble step ended with {sum(left)} FP8 weight gradients never run by a W pass")
        loss = torch.stack(losses).sum().float() if losses else torch.zeros((), device=self.device)
        # Every pipeline rank returns the loss (the last stage computed it): one scalar all-reduce.
        return C.all_reduce(loss.reshape(1), self.parallel_state.pp_group, "pp_p2p").reshape(())

    def _failure_message(self, error: BaseException) -> str:
        ps = self.parallel_state
        return (f"pipeline rank {ps.coords.pp} (global rank {ps.rank}, stages {self.stage_ids} of "
                f"{self.layout.num_stages}) failed in point-to-point communication: {error}\n"
                "A peer pipeline stage died, hung, or expects different activation shapes "
                f"(this rank sends [s/TP or s, micro-batch, hidden] = {list(self._p2p_shape())}). "
                "--distributed-timeout-minutes bounds how long a rank waits.")

    def _allreduce_tied_embedding_grads(self) -> None:
        """Sum the tied embedding's grads of the first and last stage (different ranks) once per step."""
        cfg, ps = self.config, self.parallel_state
        if not cfg.tie_embeddings or not ps.pp_enabled or (self.holds_first_stage and self.holds_last_stage):
            return
        if self.holds_first_stage:
            weight = self.chunks[0].embedding.weight
        elif self.holds_last_stage:
            weight = self.chunks[-1].output_layer.weight
        else:
            return
        grad = getattr(weight, "main_grad", None)
        if grad is None:
            if weight.grad is None:  # e.g. no token in this step reached it: contribute zeros
                weight.grad = torch.zeros_like(weight)
            grad = weight.grad
        C.all_reduce(grad, ps.embedding_group, "embedding_allreduce")

    # ---- parameters and state -------------------------------------------------------------------
    def named_parameters(self) -> Iterator[tuple[str, nn.Parameter]]:
        """Global (layout-independent) names; a Parameter shared by two chunks appears once."""
        return self.modules.named_parameters()

    def parameters(self) -> Iterator[nn.Parameter]:
        return (param for _, param in self.named_parameters())

    def state_dict(self) -> dict[str, torch.Tensor]:
        merged: dict[str, torch.Tensor] = {}
        for chunk in self.chunks:
            merged.update(chunk.state_dict())
        return merged

    def zero_grad(self) -> None:
        for chunk in self.chunks:
            chunk.zero_grad(set_to_none=True)


def _is_communication_failure(error: BaseException) -> bool:
    if isinstance(error, (dist.DistError, TimeoutError)):
        return True
    text = str(error).lower()
    return any(s in text for s in ("timed out", "timeout", "connection closed", "connection reset", "broken pipe"))


def build_pipeline(config: ModelConfig, parallel_state: ParallelState, *, micro_batch_size: int,
                   num_microbatches: int, fp8_recipe: Fp8Recipe | None = None, first_last_layers_bf16: int = 0,
                   split_weight_grads: bool | None = None, device: torch.device | str | None = None,
                   reduce_replicated_grads: bool = True) -> Pipeline:
    """This rank's stages and step for ``parallel_state`` (PP=1 included: then a plain accumulation loop).

    The schedule is ``parallel_state.pipeline_schedule`` (``--pipeline-schedule``); ``num_microbatches`` is
    ``--global-batch-size / (--micro-batch-size x DP)``. See ``Pipeline`` for what a step does.
    """
    return Pipeline(config, parallel_state, micro_batch_size=micro_batch_size, num_microbatches=num_microbatches,
                    fp8_recipe=fp8_recipe, first_last_layers_bf16=first_last_layers_bf16,
                    split_weight_grads=split_weight_grads, device=device,
                    reduce_replicated_grads=reduce_replicated_grads)
