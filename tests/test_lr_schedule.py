"""The LR schedule equals Megatron-Core's OptimizerParamScheduler step for step (the peer, in samples)."""
import pytest
import torch

from megafp8.optim.lr_schedule import LearningRateSchedule

GLOBAL_BATCH = 8


def _megatron_lrs(style: str, warmup_iters: int, decay_iters: int, iters: int, **wsd) -> list[float]:
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

    optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0.0)
    scheduler = OptimizerParamScheduler(
        optimizer, init_lr=1e-5, max_lr=3e-4, min_lr=3e-5, lr_warmup_steps=warmup_iters * GLOBAL_BATCH,
        lr_decay_steps=decay_iters * GLOBAL_BATCH, lr_decay_style=style, start_wd=0.1, end_wd=0.1,
        wd_incr_steps=1, wd_incr_style="constant", **wsd)
    lrs = [optimizer.param_groups[0]["lr"]]
    for _ in range(iters):
        scheduler.step(increment=GLOBAL_BATCH)  # Megatron's training loop advances by the global batch
        lrs.append(optimizer.param_groups[0]["lr"])
    return lrs


@pytest.mark.parametrize("style", ["constant", "linear", "cosine", "inverse-square-root", "WSD"])
def test_schedule_equals_megatron_core(style):
    wsd = {"wsd_decay_steps": 10 * GLOBAL_BATCH, "lr_wsd_decay_style": "cosine"} if style == "WSD" else {}
    expected = _megatron_lrs(style, warmup_iters=5, decay_iters=40, iters=50, **wsd)
    schedule = LearningRateSchedule.from_iterations(
        max_lr=3e-4, min_lr=3e-5, warmup_iters=5, decay_iters=40, global_batch_size=GLOBAL_BATCH,
        decay_style=style, init_lr=1e-5, wsd_decay_iters=10 if style == "WSD" else None, wsd_decay_style="cosine")
    ours = [schedule(i * GLOBAL_BATCH) for i in range(51)]
    assert ours == pytest.approx(expected, rel=1e-12, abs=0)


@pytest.mark.parametrize("kwargs, flag", [
    ({"min_lr": 1.0}, "--min-lr"),
    ({"warmup_samples": 100}, "--lr-warmup-iters"),
    ({"decay_style": "step"}, "--lr-decay-style"),
    ({"decay_samples": 0}, "--lr-decay-iters"),
])
def test_bad_schedule_names_the_flag(kwargs, flag):
    args = {"max_lr": 1e-3, "min_lr": 1e-4, "warmup_samples": 10, "decay_samples": 100, **kwargs}
    with pytest.raises(ValueError, match=flag):
        LearningRateSchedule(**args)
