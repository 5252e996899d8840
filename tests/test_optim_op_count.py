"""The optimizer step's aten-op count does not grow with the model: a 2-layer model at two widths (16x the
parameters), fp32 states and the compressed preset (fp16 master, FP8 moments), each within the issue's budget of
400 ops per step and without a host read (`_local_scalar_dense`), also on a skipped (non-finite) step."""
import pytest

from op_counting import OpCounter
from optim_testing import build, make_ddp, tiny_config, train_step
from megafp8.optim import DistributedOptimizer
from megafp8.parallel.parallel_state import ParallelState

BUDGET = 400  # aten ops per step, a 2-layer model at any width (issue 19)


def _step_ops(hidden: int, master: str, states: str, poison: bool) -> tuple[int, int, int]:
    ps = ParallelState().init_process_groups()
    cfg = tiny_config(hidden_size=hidden, ffn_hidden_size=4 * hidden, vocab_size=256)
    ddp = make_ddp(build(cfg, ps), ps, use_distributed_optimizer=True)
    opt = DistributedOptimizer(ddp, weight_decay=0.1, clip_grad=1.0, master_weight_dtype=master,
                               optimizer_state_dtype=states)
    train_step(ddp, opt, cfg, 0, 1e-3)
    count = OpCounter()

    original = opt.step

    def counted_step(lr):
        with count:
            return original(lr)

    def poison_grads():
        ddp.buckets[0].grad_data[0] = float("nan")

    opt.step = counted_step
    result, _ = train_step(ddp, opt, cfg, 1, 1e-3, before_step=poison_grads if poison else None)
    assert result.skipped == poison
    return count.ops, count.host_reads, ddp.num_params()


@pytest.mark.parametrize("master, states", [("fp32", "fp32"), ("fp16", "fp8")], ids=["fp32", "compressed"])
@pytest.mark.parametrize("poison", [False, True], ids=["update", "skipped"])
def test_step_ops_do_not_grow_with_the_parameter_count(master, states, poison):
    small_ops, small_reads, small_params = _step_ops(64, master, states, poison)
    large_ops, large_reads, large_params = _step_ops(256, master, states, poison)
    assert large_params > 10 * small_params
    assert small_ops == large_ops <= BUDGET, (small_ops, large_ops)
    assert small_reads == large_reads == 0


if __name__ == "__main__":  # the figures of docs/benchmarks.md: python tests/test_optim_op_count.py 256 1024
    import sys

    for width in [int(w) for w in sys.argv[1:]] or [64, 256]:
        for preset in (("fp32", "fp32"), ("fp16", "fp8")):
            ops, reads, params = _step_ops(width, *preset, poison=False)
            print(f"hidden {width:5d} ({params:,} parameters) {'/'.join(preset)}: {ops} aten ops, {reads} host reads")
