"""The grad buffer's layout (views, 128-aligned parameters, DP x 128-padded buckets in backward order), the
bf16 buffer (--grad-reduce-in-bf16) against the fp32 AdamW reference, and the user errors it raises."""
import argparse
import contextlib

import pytest
import torch

from optim_testing import build, make_ddp, reference_step, tiny_config, train_step
from megafp8.optim import DistributedOptimizer
from megafp8.parallel.data_parallel import ALIGN, DDPConfig
from megafp8.parallel.parallel_state import ParallelState


def test_layout_views_alignment_and_buckets():
    cfg = tiny_config()
    ps = ParallelState().init_process_groups()
    model = build(cfg, ps)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    ddp = make_ddp(model, ps, bucket_size=3000)
    (buffer,) = ddp.grad_buffers
    for name, p in model.named_parameters():
        assert torch.equal(p.detach(), before[name])  # moving values into the bucket buffers changed nothing
        assert p.main_grad.untyped_storage().data_ptr() == buffer.untyped_storage().data_ptr()
        assert (p.main_grad.data_ptr() - buffer.data_ptr()) // buffer.element_size() % ALIGN == 0
    assert [b.offset for b in ddp.buckets] == [sum(b.numel for b in ddp.buckets[:i]) for i in range(len(ddp.buckets))]
    assert all(b.numel % ALIGN == 0 for b in ddp.buckets) and len(ddp.buckets) > 1
    # Backward order: the first bucket holds the last registered parameters.
    assert ddp.buckets[0].params[0] is list(model.parameters())[-1]
    assert ddp.buckets[-1].params[-1] is list(model.parameters())[0]
    # A bucket closes once it reaches the bucket size.
    assert all(sum(-(-p.numel() // ALIGN) * ALIGN for p in b.params[:-1]) < 3000 for b in ddp.buckets)


def test_bf16_grad_buffer_matches_fp32_grads():
    """--grad-reduce-in-bf16: the accumulated (2 micro-batches) and reduced grads equal the fp32 reference's
    to bf16 precision (relative L2 error <= 2^-7: two roundings of 2^-9 each, with margin)."""
    cfg = tiny_config()
    ps = ParallelState().init_process_groups()
    ddp = make_ddp(build(cfg, ps), ps, grad_reduce_in_bf16=True, overlap_grad_reduce=True)
    assert ddp.grad_buffers[0].dtype == torch.bfloat16
    opt = DistributedOptimizer(ddp, weight_decay=0.1)
    opt.step = lambda lr: ddp.finish_grad_sync()  # stop after the grad sync: compare grads, not Adam's update
    train_step(ddp, opt, cfg, 0, 1e-3)
    reference = build(cfg, ParallelState().init_process_groups())
    reference_step(reference, torch.optim.SGD(reference.parameters(), lr=0.0), cfg, 0, 1)
    for name, p in reference.named_parameters():
        got = dict(ddp.module.named_parameters())[name].main_grad.float()
        rel = float((got - p.grad).norm() / p.grad.norm())
        assert rel <= 2.0 ** -7, (name, rel)


def test_overlap_without_no_sync_is_an_error():
    cfg = tiny_config()
    ps = ParallelState().init_process_groups()
    ddp = make_ddp(build(cfg, ps), ps, overlap_grad_reduce=True)
    ids = torch.randint(0, cfg.vocab_size, (2, cfg.seq_length))
    ddp(ids, ids).mean().backward()
    with pytest.raises(RuntimeError, match="no_sync"):
        ddp(ids, ids).mean().backward()


def test_num_microbatches_delays_the_overlapped_reduction():
    """A schedule that runs every micro-batch's backward itself sets num_microbatches instead of no_sync():
    the buckets reduce after the last one, and the grads equal the no_sync() loop's bit for bit."""
    cfg = tiny_config()
    ps = ParallelState().init_process_groups()
    grads = []
    for use_no_sync in (True, False):
        ddp = make_ddp(build(cfg, ps), ps, overlap_grad_reduce=True, bucket_size=2000)
        opt = DistributedOptimizer(ddp)
        opt.step = lambda lr, ddp=ddp: ddp.finish_grad_sync()
        if not use_no_sync:
            ddp.num_microbatches = 2
            ddp.no_sync = contextlib.nullcontext
        train_step(ddp, opt, cfg, 0, 1e-3)
        grads.append(ddp.grad_buffers[0].clone())
    assert torch.equal(grads[0], grads[1])


def test_config_from_megatron_flags():
    args = argparse.Namespace(use_distributed_optimizer=True, overlap_grad_reduce=True, overlap_param_gather=True,
                              fp8_param_gather=False, grad_reduce_in_bf16=True, ddp_bucket_size=40_000_000,
                              num_micro_batches=4)
    config = DDPConfig.from_args(args)
    assert (config.use_distributed_optimizer, config.overlap_grad_reduce, config.overlap_param_gather,
            config.grad_reduce_in_bf16, config.bucket_size, config.num_microbatches) == (True, True, True, True,
                                                                                        40_000_000, 4)


def test_flag_errors_name_the_flag():
    with pytest.raises(ValueError, match="--fp8-param-gather needs --use-distributed-optimizer"):
        DDPConfig(fp8_param_gather=True)
    with pytest.raises(ValueError, match="--ddp-bucket-size"):
        DDPConfig(bucket_size=0)
    ps = ParallelState().init_process_groups()
    ddp = make_ddp(build(tiny_config(), ps), ps)
    with pytest.raises(ValueError, match="--optimizer-state-dtype"):
        DistributedOptimizer(ddp, optimizer_state_dtype="int4")
    with pytest.raises(ValueError, match="--master-weight-dtype"):
        DistributedOptimizer(ddp, master_weight_dtype="bf16")
