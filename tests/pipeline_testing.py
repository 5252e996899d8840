"""Shared body of the pipeline tests: run a layout for a few SGD steps and compare with the PP=1 run.

Every rank builds the single-process reference (``build_pipeline`` on a world of one: a plain
micro-batch loop) and its own stages; layout-invariant init makes both start from the same weights
without loading anything. Each step both runs the same global batch (this DP rank's share for the
sharded run), then compares the loss and every local gradient (TP shards gathered, vocab padding cut)
with the reference, then both take the same plain SGD step. DP gradients are averaged with one
all-reduce per parameter (the ZeRO issue replaces it). fp32 bound: max|a-b| / max|b| <= 1e-5; FP8
delayed: loss <= 1e-3 relative, gradients >= 40 dB SQNR.

FP8 with TP > 1: step 0 runs at cold-start current scaling, whose weight scales are per TP shard (not
the TP=1 full-tensor scales), so it only fills the amax histories (no comparison, no weight update) and
the reference's scaling state is then loaded (by global name) into the stages: "synchronized scales",
as in tests/test_model_fp8_tp.py. From then on each side updates its own scales; after every compared
step the stages' scales (amaxes reduced over the stage's TP x DP group) must match the reference's (1e-2:
the amaxes of tensors computed in FP8 differ in their last bits; a missing reduction is off by far more).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from fp8_testing import sqnr_db
from megafp8.fp8 import Fp8Recipe, invalidate_fp8_weight_caches
from megafp8.model import ModelConfig
from megafp8.parallel import collectives as C
from megafp8.parallel.parallel_state import ParallelState
from megafp8.parallel.pipeline import Pipeline, build_pipeline
from megafp8.parallel.sharding import gather_tensor_model_parallel

LR = 0.5  # large enough that a wrong gradient changes the next step's loss visibly


@dataclass(frozen=True)
class Case:
    pp: int = 2
    schedule: str | None = None
    vpp: int | None = None
    first: int | None = None
    last: int | None = None
    tp: int = 1
    sp: bool = False
    tie: bool = False
    fp8: bool = False
    layers: int = 4
    microbatches: int = 4
    micro_batch_size: int = 1
    steps: int = 2  # FP8 with TP > 1: one more (see the module docstring)
    recompute: str | None = None  # "full" (uniform, 1 layer per group) or "selective", both sides
    model: tuple = ()  # more ModelConfig fields, as (name, value) pairs

    def __str__(self) -> str:
        return ", ".join(f"{k}={v}" for k, v in self.__dict__.items() if v not in (None, False))


def config(case: Case) -> ModelConfig:
    # vocab 60 pads to 60 at TP=1 and 64 at TP=2: the padding differs between layouts.
    recompute = dict(recompute_granularity=case.recompute)
    if case.recompute == "full":
        recompute.update(recompute_method="uniform", recompute_num_layers=1)
    return ModelConfig(num_layers=case.layers, hidden_size=32, ffn_hidden_size=64, num_attention_heads=4,
                       num_query_groups=2, seq_length=8, vocab_size=60, make_vocab_size_divisible_by=4,
                       tie_embeddings=case.tie, seed=5, **recompute, **dict(case.model))


def rel_err(actual: torch.Tensor, expected: torch.Tensor) -> float:
    return ((actual - expected).abs().max() / expected.abs().max()).item()


def full_grad(param: torch.nn.Parameter, ps: ParallelState, vocab: int) -> torch.Tensor:
    grad = gather_tensor_model_parallel(param.grad, param, ps.tp_group)
    return grad[:vocab] if getattr(param, "padded_vocab", False) else grad


def sgd(params, lr: float = LR) -> None:
    with torch.no_grad():
        for p in params:
            p.sub_(lr * p.grad)
            p.grad = None


def expected_p2p_bytes(pipe: Pipeline, case: Case) -> int:
    """Activation sends to the next stage plus gradient sends to the previous one, when that stage lives
    on another rank, once per micro-batch; plus the scalar loss all-reduce over the pipeline."""
    cfg = pipe.config
    seq = cfg.seq_length // case.tp if case.sp else cfg.seq_length
    act = seq * case.micro_batch_size * cfg.hidden_size * 4
    layout, me = pipe.layout, pipe.parallel_state.coords.pp
    sends = 0
    for s in pipe.stage_ids:
        sends += s + 1 < layout.num_stages and layout.stage_rank(s + 1) != me
        sends += s > 0 and layout.stage_rank(s - 1) != me
    return sends * case.microbatches * act + 2 * 4 * (case.pp - 1) // case.pp


def run_case(case: Case, world_size: int, step_hook=None) -> Pipeline:
    """Run ``case`` against the PP=1 reference; returns the sharded pipeline for extra checks."""
    cfg = config(case)
    recipe = Fp8Recipe.delayed(amax_history_len=4) if case.fp8 else None
    ps = ParallelState(world_size=world_size, tensor_model_parallel_size=case.tp, pipeline_model_parallel_size=case.pp,
                       num_layers_per_virtual_pipeline_stage=case.vpp, sequence_parallel=case.sp,
                       pipeline_schedule=case.schedule, decoder_first_pipeline_num_layers=case.first,
                       decoder_last_pipeline_num_layers=case.last).init_process_groups()
    dp, dp_rank = ps.dp_size, ps.coords.dp
    reference = build_pipeline(cfg, ParallelState().init_process_groups(), micro_batch_size=case.micro_batch_size,
                               num_microbatches=case.microbatches * dp, fp8_recipe=recipe)
    # torch's split weight-gradient pass where it applies: these gradients are read from .grad (no grad buffer).
    pipe = build_pipeline(cfg, ps, micro_batch_size=case.micro_batch_size, num_microbatches=case.microbatches,
                          fp8_recipe=recipe, split_weight_grads=True)
    ref_params = dict(reference.named_parameters())
    for name, param in pipe.named_parameters():  # built from scratch: the same full model, bit for bit
        full = gather_tensor_model_parallel(param.detach(), param, ps.tp_group)
        ref_name = "embedding.weight" if case.tie and name == "output_layer.weight" else name
        if getattr(param, "padded_vocab", False):
            assert torch.all(full[cfg.vocab_size:] == 0), name
            full = full[: cfg.vocab_size]
        assert torch.equal(full, ref_params[ref_name].detach()[: full.shape[0]]), (str(case), "init", name)
    g = torch.Generator().manual_seed(11)
    rows = case.micro_batch_size * case.microbatches
    for step in range(case.steps + (case.fp8 and case.tp > 1)):
        ids = torch.randint(0, cfg.vocab_size, (rows * dp, cfg.seq_length), generator=g)
        labels = torch.randint(0, cfg.vocab_size, (rows * dp, cfg.seq_length), generator=g)
        ref_loss = reference.step(ids, labels)
        ps.comm.reset()
        mine = slice(dp_rank * rows, (dp_rank + 1) * rows)
        loss = pipe.step(ids[mine], labels[mine])
        counted = ps.comm.snapshot()
        if dp > 1:  # simple DP gradient averaging (the ZeRO issue replaces it)
            for p in pipe.parameters():
                C.all_reduce(p.grad, ps.dp_group, "dp_grad_reduce").div_(dp)
            loss = C.all_reduce(loss.clone(), ps.dp_group, "dp_grad_reduce") / dp
        where = f"[{case}] step {step}"
        if case.fp8 and case.tp > 1 and step == 0:
            if step_hook is not None:
                step_hook(pipe, reference, step, counted)
            pipe.zero_grad()
            reference.zero_grad()
            _load_reference_scaling_state(pipe, reference)
            for model in (*pipe.chunks, *reference.chunks):  # weights cached at the old scales
                invalidate_fp8_weight_caches(model)
            continue
        if case.fp8:
            assert abs(loss.item() - ref_loss.item()) <= 1e-3 * abs(ref_loss.item()), (where, loss, ref_loss)
        else:
            assert rel_err(loss, ref_loss) <= 1e-5, (where, loss.item(), ref_loss.item())
        # Under SP each TP rank sends its [s/TP, mb, h] shard; without SP the replicated [s, mb, h].
        assert counted["pp_p2p"] == expected_p2p_bytes(pipe, case), (where, counted["pp_p2p"])
        for name, param in pipe.named_parameters():
            ref_name = "embedding.weight" if case.tie and name == "output_layer.weight" else name
            ref_grad = ref_params[ref_name].grad
            if getattr(param, "padded_vocab", False):
                ref_grad = ref_grad[: cfg.vocab_size]
            got = full_grad(param, ps, cfg.vocab_size)
            if case.fp8:
                assert sqnr_db(got, ref_grad) >= 40, (where, name, sqnr_db(got, ref_grad))
            else:
                # A scalar's grad (xIELU's alphas) is one fp32 sum over all of its layer's activations, taken in
                # another order per layout (TP halves, then the TP sum): cancellation leaves ~1e-4 of it. A missing
                # TP sum would be off by about half.
                bound = 1e-3 if param.numel() == 1 else 1e-5
                assert rel_err(got, ref_grad) <= bound, (where, name, rel_err(got, ref_grad))
        if case.fp8:
            ref_state = reference.state_dict()
            for key, value in _scaling_state(pipe).items():  # amaxes of FP8-computed tensors agree to rounding
                assert rel_err(value, ref_state[key]) <= 1e-2, (where, key, value, ref_state[key])
        if step_hook is not None:
            step_hook(pipe, reference, step, counted)
        sgd(pipe.parameters())
        sgd(reference.parameters())
        for model in (*pipe.chunks, *reference.chunks):
            invalidate_fp8_weight_caches(model)
    return pipe


def _scaling_state(pipe: Pipeline) -> dict[str, torch.Tensor]:
    return {k: v for k, v in pipe.state_dict().items() if ".fp8_scaling." in k}


def _load_reference_scaling_state(pipe: Pipeline, reference: Pipeline) -> None:
    ref_state = reference.state_dict()
    for chunk in pipe.chunks:
        keys = [k for k in chunk.state_dict() if ".fp8_scaling." in k]
        chunk.load_state_dict({k: ref_state[k] for k in keys}, strict=False)


def assert_tied_embeddings_identical(pipe: Pipeline) -> None:
    """First stage's embedding.weight == last stage's output_layer.weight, bit for bit."""
    ps = pipe.parallel_state
    if pipe.holds_first_stage and pipe.holds_last_stage:
        assert pipe.chunks[-1].output_layer.weight is pipe.chunks[0].embedding.weight
        return
    if not (pipe.holds_first_stage or pipe.holds_last_stage):
        return
    weight = pipe.chunks[0].embedding.weight if pipe.holds_first_stage else pipe.chunks[-1].output_layer.weight
    both = C.all_gather(weight.detach().unsqueeze(0), ps.embedding_group, "embedding_allreduce")
    assert torch.equal(both[0], both[1]), "tied embedding copies differ between the first and last stage"
