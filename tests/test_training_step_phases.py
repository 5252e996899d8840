"""The training step in phases (issue 36): Trainer.train_step = forward_backward -> update_fp8_scales ->
prepare_optimizer_step -> apply_optimizer_step, bit-identical to Pipeline.step + DistributedOptimizer.step; and a
StepState captured before a step and restored after its first three phases re-runs the step bit for bit (the
same loss, grad norm, and after the run the same parameters, master weights, moments and FP8 scaling state as a
run that never went back). Through the training entry (megafp8.pretrain.main), an FP8 delayed recipe with amax
histories, dropout (the model-parallel RNG) and --decoupled-lr on."""
from __future__ import annotations

import os

import pytest
import torch

from distributed_testing import run_distributed
from host_sync_counting import FP8, MODEL
from megafp8 import pretrain
from megafp8.training import train as train_module
from megafp8.training.step_state import StepState

Trainer = train_module.Trainer
RUN = [*MODEL, "--mock-data", "--tokenizer-type", "NullTokenizer", "--vocab-size", "500", "--seed", "7",
       *FP8, "--fp8-amax-history-len", "4", "--hidden-dropout", "0.1", "--attention-dropout", "0.1",
       "--decoupled-lr", "1e-3"]


class Recorded:
    """Per phase call, the loss and grad norm (host floats), and the trainer the entry built."""

    def __init__(self, monkeypatch) -> None:
        self.losses, self.norms, self.trainer = [], [], None
        forward_backward, prepare, train = (Trainer.forward_backward, Trainer.prepare_optimizer_step, Trainer.train)

        def recorded_forward_backward(trainer):
            loss = forward_backward(trainer)
            self.losses.append(float(loss))
            return loss

        def recorded_prepare(trainer):
            stats = prepare(trainer)
            self.norms.append(float(stats.grad_norm))
            return stats

        def recorded_train(trainer):
            self.trainer = trainer
            return train(trainer)

        monkeypatch.setattr(Trainer, "forward_backward", recorded_forward_backward)
        monkeypatch.setattr(Trainer, "prepare_optimizer_step", recorded_prepare)
        monkeypatch.setattr(Trainer, "train", recorded_train)

    def final_state(self) -> dict[str, torch.Tensor]:
        """Parameters and FP8 scaling buffers, master weights and moments, the counters."""
        t = self.trainer
        state = {f"model.{k}": v.detach().clone() for k, v in t.pipeline.modules.state_dict().items()}
        state.update({f"optimizer.{i}": v.clone() for i, v in enumerate(t.optimizer.state_tensors())})
        state["optimizer.step"] = t.optimizer._step.clone()
        state["consumed"] = torch.tensor(t.progress.consumed_samples)
        return state


def _train(monkeypatch, tmp_path, argv=()) -> Recorded:
    recorded = Recorded(monkeypatch)
    assert pretrain.main([*RUN, *argv, "--log-dir", str(tmp_path / "logs")]) == 0
    return recorded


def _assert_same_state(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> None:
    assert got.keys() == want.keys()
    differing = [k for k in want if not torch.equal(got[k], want[k])]
    assert not differing, differing


def _legacy_train_step(pipeline_step: bool, optimizer_step: bool):
    """train_step with Pipeline.step (forward/backward and the FP8 update in one) and/or DistributedOptimizer.step
    (prepare and apply in one) in place of the phases."""
    def train_step(trainer):
        if pipeline_step:
            trainer.ddp.zero_grad_buffer()
            inputs, labels = trainer._global_batch(trainer.train_batches)
            loss = trainer.pipeline.step(inputs, labels, trainer.loss_mask(labels))
        else:
            loss = trainer.forward_backward()
            trainer.update_fp8_scales()
        if optimizer_step:
            consumed = trainer.progress.consumed_samples
            result = trainer.optimizer.step(trainer.schedule(consumed),
                                            decoupled_lr=trainer.decoupled_schedule(consumed))
            trainer.guard.check(trainer.ddp.module, trainer.progress.iteration + 1)
        else:
            result = trainer.apply_optimizer_step(trainer.prepare_optimizer_step())
        return train_module._mean_over(loss, trainer.ps.dp_group.group), ~result.skipped_flag, result.grad_norm_tensor
    return train_step


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """The phased train_step, every step run once: per step loss and grad norm, and the final state."""
    with pytest.MonkeyPatch.context() as monkeypatch:
        recorded = _train(monkeypatch, tmp_path_factory.mktemp("reference"))
    assert len(recorded.losses) == len(recorded.norms) == 4
    return recorded.losses, recorded.norms, recorded.final_state()


@pytest.mark.parametrize("pipeline_step, optimizer_step", [(False, True), (True, False), (True, True)],
                         ids=["optimizer.step", "pipeline.step", "both"])
def test_phases_equal_the_one_call_steps(monkeypatch, tmp_path, reference, pipeline_step, optimizer_step):
    """(b) prepare() + apply() == step(); (c) forward_backward + update_fp8_scales == Pipeline.step: bit for bit."""
    monkeypatch.setattr(Trainer, "train_step", _legacy_train_step(pipeline_step, optimizer_step))
    recorded = _train(monkeypatch, tmp_path)
    losses, norms, state = reference
    if not pipeline_step:
        assert recorded.losses == losses
    if not optimizer_step:
        assert recorded.norms == norms
    _assert_same_state(recorded.final_state(), state)


_PHASED_TRAIN_STEP = Trainer.train_step


def _re_run_train_step(trainer):
    """Capture, the phases before the optimizer update, restore, then the whole step."""
    state = StepState.capture(trainer)
    trainer.forward_backward()
    trainer.update_fp8_scales()
    trainer.prepare_optimizer_step()
    state.restore(trainer)
    return _PHASED_TRAIN_STEP(trainer)


def _assert_re_run_matches(recorded: Recorded, losses: list[float], norms: list[float],
                           state: dict[str, torch.Tensor]) -> None:
    assert recorded.losses == [loss for loss in losses for _ in range(2)]
    assert recorded.norms == [norm for norm in norms for _ in range(2)]
    _assert_same_state(recorded.final_state(), state)


def test_a_restored_step_re_runs_bit_for_bit(monkeypatch, tmp_path, reference):
    """(a) Every step re-run after a restore: both attempts give the reference's loss and grad norm, and the run
    ends in the reference's state (the first attempt moved the RNGs, the data iterator, the amax histories and
    scales, the FP8 weight caches; restore put all of it back)."""
    monkeypatch.setattr(Trainer, "train_step", _re_run_train_step)
    _assert_re_run_matches(_train(monkeypatch, tmp_path), *reference)


def _pp2_body(rank: int, world_size: int, argv: list[str]) -> None:
    from megafp8.training.run import run

    os.environ.update(WORLD_SIZE=str(world_size), RANK=str(rank), LOCAL_RANK=str(rank))
    runs = []
    for re_run in (False, True):
        args, errors, _ = pretrain.parse_and_check(argv, world_size)
        vocab_size, more_errors = pretrain.input_errors(args)
        assert not errors + more_errors, errors + more_errors
        with pytest.MonkeyPatch.context() as monkeypatch:
            recorded = Recorded(monkeypatch)
            if re_run:
                monkeypatch.setattr(Trainer, "train_step", _re_run_train_step)
            assert run(args, pretrain.parallel_state_from_args(args),
                       pretrain.model_config_from_args(args, vocab_size)) == 0
        runs.append(recorded)
    reference, re_run = runs
    _assert_re_run_matches(re_run, reference.losses, reference.norms, reference.final_state())


@pytest.mark.distributed
def test_a_restored_step_re_runs_bit_for_bit_under_pp2(tmp_path):
    """(a) in two gloo processes, one pipeline stage each (1F1B over 2 micro-batches, the amaxes reduced per stage)."""
    argv = [*RUN, "--pipeline-model-parallel-size", "2", "--log-dir", str(tmp_path / "logs")]
    run_distributed(_pp2_body, world_size=2, args=(argv,), timeout_s=300)


def test_without_restore_the_re_run_differs(monkeypatch, tmp_path, reference):
    """The check above has teeth: running the first three phases twice without the restore changes the run."""
    original = Trainer.train_step

    def twice_train_step(trainer):
        trainer.forward_backward()
        trainer.update_fp8_scales()
        trainer.prepare_optimizer_step()
        return original(trainer)

    monkeypatch.setattr(Trainer, "train_step", twice_train_step)
    recorded = _train(monkeypatch, tmp_path)
    assert recorded.losses[1::2] != reference[0]


def test_restore_refuses_after_a_guard_switch(monkeypatch, tmp_path):
    """A layer the saturation guard switched to high precision cannot be switched back: restore says so."""
    captured = {}
    original = Trainer.train_step

    def capture_then_switch(trainer):
        captured.setdefault("state", StepState.capture(trainer))
        captured["trainer"] = trainer
        return original(trainer)

    monkeypatch.setattr(Trainer, "train_step", capture_then_switch)
    monkeypatch.setenv("MEGAFP8_FORCE_FP8_OVERFLOW", "layers.0.mlp.linear_fc2@1x1024")
    _train(monkeypatch, tmp_path, ["--fp8-saturation-guard-patience", "1"])
    trainer = captured["trainer"]
    assert trainer.guard.switched, "the forced overflow should have switched the layer"
    with pytest.raises(RuntimeError, match="switched layers to high precision"):
        captured["state"].restore(trainer)
