"""Pipeline parallelism on torch.distributed.pipelining vs the PP=1 run on the same weights and data.

Each schedule / layout runs 2 plain SGD steps; per step the loss and every gradient must match the
single-process run (fp32: max|a-b| / max|b| <= 1e-5, FP8 delayed: loss <= 1e-3 relative, gradients
>= 40 dB), the pp_p2p bytes must equal one activation / gradient per micro-batch and stage boundary,
and tied embeddings must stay bit-identical across the first and last stage (tests/pipeline_testing.py).
Several layouts share one spawned world to save process start-up time on the 2-core test machines.
"""
import time
from collections import Counter
from datetime import timedelta

import pytest
import torch

from distributed_testing import run_distributed
from megafp8.fp8 import Fp8GemmModule
from megafp8.model import ModelConfig
from megafp8.parallel.parallel_state import LayoutError, ParallelState
from megafp8.parallel.pipeline import PipelineCommunicationError, build_pipeline
from megafp8.parallel.pipeline_layout import PipelineLayout
from pipeline_testing import Case, assert_tied_embeddings_identical, config, run_case


def _count_weight_quantizations(pipe) -> Counter:
    """Wrap every FP8 layer's weight quantization; the counter fills as the next step runs."""
    calls: Counter = Counter()
    for chunk in pipe.chunks:
        for name, module in chunk.named_modules():
            if isinstance(module, Fp8GemmModule) and not module.runs_high_precision:
                real = module._quantize_weight

                def counting(*args, _real=real, _name=name, **kwargs):
                    calls[_name] += 1
                    return _real(*args, **kwargs)
                module._quantize_weight = counting
    return calls


def _check_evaluate(pipe, reference, step, counted) -> None:
    """Forward-only evaluation matches PP=1 and leaves the FP8 delayed-scaling state untouched."""
    cfg, rows = pipe.config, pipe.micro_batch_size * pipe.num_microbatches
    ids = torch.randint(0, cfg.vocab_size, (rows, cfg.seq_length), generator=torch.Generator().manual_seed(9 + step))
    before = {k: v.clone() for k, v in pipe.state_dict().items() if ".fp8_scaling." in k}
    ref_loss = reference.evaluate(ids, ids.roll(-1, dims=1)) if pipe.parallel_state.dp_size == 1 else None
    loss = pipe.evaluate(ids, ids.roll(-1, dims=1))
    if ref_loss is not None:
        assert abs(loss.item() - ref_loss.item()) <= (1e-3 if pipe.fp8_manager else 1e-5) * abs(ref_loss.item())
    after = {k: v for k, v in pipe.state_dict().items() if ".fp8_scaling." in k}
    assert all(torch.equal(before[k], after[k]) for k in before), "evaluation moved the FP8 scaling state"


def _cases_body(rank: int, world_size: int, cases: list[Case]) -> None:
    for case in cases:
        pipe = run_case(case, world_size, step_hook=_check_evaluate)
        if case.tie:
            assert_tied_embeddings_identical(pipe)
        if case.fp8:
            # One more step with 4 micro-batches: each FP8 weight is quantized exactly once.
            calls = _count_weight_quantizations(pipe)
            cfg = config(case)
            rows = case.micro_batch_size * case.microbatches
            ids = torch.randint(0, cfg.vocab_size, (rows, cfg.seq_length), generator=torch.Generator().manual_seed(2))
            pipe.step(ids, ids.roll(-1, dims=1))
            assert calls and set(calls.values()) == {1}, (str(case), dict(calls))


PP2_CASES = [
    Case(tie=True),
    Case(schedule="interleaved", vpp=1, tie=True),  # 2 virtual chunks per rank
    Case(schedule="interleaved-zb", vpp=1),
    Case(schedule="zbv", tie=True),                  # V: rank 0 holds the first and the last stage
    Case(schedule="dualpipev"),
    Case(first=1, last=3),                           # uneven split
    Case(fp8=True, tie=True),
    Case(fp8=True, schedule="dualpipev"),            # zero-bubble with FP8: W folded into B
    Case(schedule="zbv", recompute="full"),          # recomputation under torch's split B / W passes
    Case(recompute="selective", fp8=True),
]


@pytest.mark.distributed
def test_pp2_schedules_match_pp1():
    run_distributed(_cases_body, world_size=2, args=(PP2_CASES,), timeout_s=600)


def _amax_once_per_step(pipe, reference, step, counted) -> None:
    """Delayed scaling reduces every FP8 state of this rank's stage in one all-reduce over TP x DP."""
    if step == 0:
        return  # cold start: current scaling also agrees on per-tensor scales over TP (not delayed traffic)
    states = pipe.fp8_manager.states()
    n = pipe.parallel_state.amax_group.size
    assert counted["amax_reduce"] == 2 * 4 * len(states) * (n - 1) // n, (counted["amax_reduce"], len(states))


def _pp4_body(rank: int, world_size: int) -> None:
    _cases_body(rank, world_size, [Case(pp=4, layers=8), Case(pp=4, layers=8, tie=True, fp8=True)])
    # TP=2 x PP=2 with sequence parallelism: the [s/TP, b, h] shard travels between stages.
    run_case(Case(pp=2, tp=2, sp=True, tie=True), world_size)
    run_case(Case(pp=2, tp=2, schedule="zbv"), world_size)  # without SP the replicated [s, mb, h] travels
    run_case(Case(pp=2, tp=2, sp=True, fp8=True), world_size, step_hook=_amax_once_per_step)


@pytest.mark.distributed
def test_pp4_and_tp2_pp2_match_pp1():
    run_distributed(_pp4_body, world_size=4, timeout_s=600)


def _timeout_body(rank: int, world_size: int) -> None:
    ps = ParallelState(world_size=2, pipeline_model_parallel_size=2).init_process_groups(timeout=timedelta(seconds=3))
    cfg = config(Case())
    pipe = build_pipeline(cfg, ps, micro_batch_size=1, num_microbatches=2)
    if rank == 1:
        return  # this stage "hangs": it never joins the step
    ids = torch.zeros(2, cfg.seq_length, dtype=torch.long)
    start = time.monotonic()
    with pytest.raises(PipelineCommunicationError, match="pipeline rank 0 .* point-to-point communication"):
        pipe.step(ids, ids)
    assert time.monotonic() - start < 60, "the process-group timeout must bound the wait"


@pytest.mark.distributed
def test_dead_peer_stage_raises_instead_of_hanging():
    run_distributed(_timeout_body, world_size=2, timeout_s=300)


@pytest.mark.parametrize("layout, model, batch, flag", [
    (dict(pipeline_model_parallel_size=2), dict(num_layers=3), None,
     "--num-layers (3) must be divisible by --pipeline-model-parallel-size (2)"),
    (dict(pipeline_model_parallel_size=2, num_layers_per_virtual_pipeline_stage=1), {}, (3, 1),
     "must be a multiple of --pipeline-model-parallel-size (2) for --pipeline-schedule interleaved"),
    (dict(pipeline_model_parallel_size=2), {}, (1, 1), "must be >= the number of pipeline stages (2)"),
    (dict(pipeline_model_parallel_size=2, pipeline_schedule="zbv"), dict(num_layers=6), None,
     "--num-layers (6) must be divisible by 2 x --pipeline-model-parallel-size"),
    (dict(pipeline_model_parallel_size=2, pipeline_schedule="interleaved"), {}, None,
     "--pipeline-schedule interleaved needs --num-layers-per-virtual-pipeline-stage"),
    (dict(pipeline_model_parallel_size=2, pipeline_schedule="gpipe"), {}, None, "--pipeline-schedule must be one of"),
    (dict(pipeline_model_parallel_size=2, pipeline_schedule="1f1b", num_layers_per_virtual_pipeline_stage=1), {}, None,
     "--num-layers-per-virtual-pipeline-stage needs --pipeline-schedule interleaved"),
    (dict(pipeline_model_parallel_size=4, decoder_first_pipeline_num_layers=1, decoder_last_pipeline_num_layers=1),
     dict(num_layers=5), None, "--decoder-first-pipeline-num-layers / --decoder-last-pipeline-num-layers (2) must divide"),
    (dict(pipeline_model_parallel_size=2, num_layers_per_virtual_pipeline_stage=1, decoder_first_pipeline_num_layers=1),
     {}, None, "supported with --pipeline-schedule 1f1b only"),
])
def test_bad_pipeline_layouts_fail_before_any_process_group(layout, model, batch, flag):
    """No torch.distributed here: the message must come from validation, not from a missing process group."""
    cfg = ModelConfig(**{**dict(num_layers=4, hidden_size=32, ffn_hidden_size=64, num_attention_heads=4), **model})
    with pytest.raises(LayoutError) as err:
        ps = ParallelState(world_size=layout["pipeline_model_parallel_size"], **layout)
        if batch is None:
            build_pipeline(cfg, ps, micro_batch_size=1, num_microbatches=4)
        else:
            ps.validate_model(cfg, global_batch_size=batch[0], micro_batch_size=batch[1])
    assert flag in str(err.value), str(err.value)


def test_vpp_without_pipeline_fails():
    with pytest.raises(LayoutError, match="--num-layers-per-virtual-pipeline-stage needs --pipeline-model-parallel-size > 1"):
        ParallelState(num_layers_per_virtual_pipeline_stage=1)


def test_stage_split_keeps_global_layer_numbers():
    one = PipelineLayout(8, 4)
    assert [list(one.layer_numbers(s)) for s in range(4)] == [[0, 1], [2, 3], [4, 5], [6, 7]]
    looped = PipelineLayout(8, 2, "interleaved", vpp_layers=2)
    assert looped.stages_of_rank(0) == [0, 2] and looped.stages_of_rank(1) == [1, 3]
    assert list(looped.layer_numbers(2)) == [4, 5]
    v = PipelineLayout(8, 2, "zbv")
    assert v.stages_of_rank(0) == [0, 3] and v.stages_of_rank(1) == [1, 2]
    assert [list(v.layer_numbers(s)) for s in v.stages_of_rank(0)] == [[0, 1], [6, 7]]
    uneven = PipelineLayout(10, 4, first_stage_layers=1, last_stage_layers=3)
    assert uneven.layer_counts() == [1, 3, 3, 3]
    assert list(uneven.layer_numbers(3)) == [7, 8, 9]
    assert PipelineLayout(6, 3, last_stage_layers=0).layer_counts() == [3, 3, 0]


def _default_split_under_ddp_body(rank: int, world_size: int) -> None:
    """A library user's zero-bubble pipeline with build_pipeline's defaults under the DDP grad buffer: every
    main_grad equals the PP=1 gradient (torch's split W pass, which bypasses the buffer's hooks, is opt-in)."""
    from megafp8.parallel.data_parallel import DDPConfig, DistributedDataParallel

    cfg = config(Case(schedule="zbv"))
    ids = torch.randint(0, cfg.vocab_size, (4, cfg.seq_length), generator=torch.Generator().manual_seed(3))
    reference = build_pipeline(cfg, ParallelState().init_process_groups(), micro_batch_size=1, num_microbatches=4)
    reference.step(ids, ids.roll(-1, dims=1))
    ps = ParallelState(world_size=world_size, pipeline_model_parallel_size=2,
                       pipeline_schedule="zbv").init_process_groups()
    pipe = build_pipeline(cfg, ps, micro_batch_size=1, num_microbatches=4, reduce_replicated_grads=False)
    ddp = DistributedDataParallel(pipe.modules, ps, DDPConfig(num_microbatches=4))
    pipe.step(ids, ids.roll(-1, dims=1))
    ddp.finish_grad_sync()
    ref = dict(reference.named_parameters())
    for name, param in pipe.named_parameters():
        expected = ref[name].grad
        assert expected.abs().max() > 0, name
        err = float((param.main_grad - expected).abs().max() / expected.abs().max())
        assert err <= 1e-5, (name, err)


@pytest.mark.distributed
def test_zero_bubble_default_feeds_the_ddp_grad_buffer():
    run_distributed(_default_split_under_ddp_body, world_size=2, timeout_s=300)
