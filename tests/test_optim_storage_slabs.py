"""The step's storage slabs are an implementation detail: slabs of 3 groups (cutting buckets and parameters) give
bit-identical master weights, moments and published weights to one slab over all storage, for the fp32 and the
compressed preset, at DP=2 (without clipping, as written before the grad norm's group sums became independent of
the slab size: megafp8/optim/fused_adamw.py)."""
import pytest
import torch

from distributed_testing import run_distributed
from optim_testing import build, make_ddp, tiny_config, train_step
from megafp8.optim import DistributedOptimizer, distributed_optimizer
from megafp8.parallel.parallel_state import ParallelState


def _run(cfg, ps, slab: int, master: str, states: str):
    model = build(cfg, ps)
    ddp = make_ddp(model, ps, use_distributed_optimizer=True, bucket_size=700)
    default, distributed_optimizer.STEP_SLAB = distributed_optimizer.STEP_SLAB, slab
    try:
        opt = DistributedOptimizer(ddp, weight_decay=0.1, master_weight_dtype=master, optimizer_state_dtype=states)
    finally:
        distributed_optimizer.STEP_SLAB = default
    for step in range(3):
        assert not train_step(ddp, opt, cfg, step, 1e-3)[0].skipped
    ddp.finish_param_sync()
    return opt, model


def _slabs_body(rank, world_size):
    cfg = tiny_config()
    ps = ParallelState(world_size=world_size).init_process_groups()
    for master, states in (("fp32", "fp32"), ("fp16", "fp8")):
        (cut, cut_model), (whole, whole_model) = (_run(cfg, ps, slab, master, states) for slab in (384, 1 << 22))
        assert len(cut._slabs) > len(cut._shards) > 1 and len(whole._slabs) == 1
        for a, b in zip(cut.state_tensors(), whole.state_tensors()):
            assert torch.equal(a, b), master
        for (name, a), b in zip(cut_model.state_dict().items(), whole_model.state_dict().values()):
            assert torch.equal(a, b), (master, name)


@pytest.mark.distributed
def test_step_slabs_do_not_change_the_bits():
    run_distributed(_slabs_body, world_size=2, timeout_s=600)
