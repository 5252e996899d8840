"""Checkpoints are atomic and fail loudly: crash safety under SIGKILL, keep-last, loader options, and one
clear CheckpointError (naming the path or flag) for every damaged or mismatched checkpoint.

The crash tests kill real processes with SIGKILL: (1) a 2-rank gloo job whose rank 0 is killed after
every shard is written but before the commit rename (made deterministic by patching the commit step in
the child to wait), (2) a single process killed while it writes a large shard. In both, the previous
checkpoint stays ``latest`` and loads, the half-written directory is ignored, and the next save
cleans it up.
"""
import multiprocessing
import os
import random
import signal
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from distributed_testing import run_distributed
from megafp8.checkpoint import (TRACKER_FILE, ArgsMismatchError, CheckpointError, check_args, flat_sharded_state,
                                load_checkpoint, read_tracker, save_checkpoint)
from megafp8.checkpoint import atomic
from megafp8.model import GPTModel, ModelConfig
from megafp8.parallel.parallel_state import ParallelState

BIG = 24 * 1024 * 1024  # fp32 elements: ~96 MB, so a write lasts long enough to be interrupted


def _config(hidden: int = 32) -> ModelConfig:
    return ModelConfig(num_layers=2, hidden_size=hidden, ffn_hidden_size=64, num_attention_heads=4,
                       num_query_groups=2, seq_length=8, vocab_size=50, make_vocab_size_divisible_by=8)


def _model(ps: ParallelState, seed: int = 0) -> GPTModel:
    torch.manual_seed(seed)
    return GPTModel(_config(), ps)


def _state_equal(a: GPTModel, b: GPTModel) -> bool:
    return all(torch.equal(x, y) for x, y in zip(a.state_dict().values(), b.state_dict().values()))


def _crash_child(rank: int, world_size: int, init_file: str, root: str, mode: str) -> None:
    torch.set_num_threads(1)
    if world_size > 1:
        dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world_size)
    ps = ParallelState(world_size=world_size).init_process_groups()
    model = _model(ps)
    save_checkpoint(root, 1, model=model, parallel_state=ps)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(1.0)
    Path(root, f"first_done_{rank}").touch()
    if mode == "before_commit":
        def hang(tmp, final):  # every shard and the manifest are written: wait here to be killed
            Path(root, "at_commit").touch()
            time.sleep(600)
        atomic.commit_directory = hang
        save_checkpoint(root, 2, model=model, parallel_state=ps)
    else:
        big = {"big": (torch.randn(BIG), 0, BIG)}
        save_checkpoint(root, 2, model=model, parallel_state=ps, optimizer_state={"flat": flat_sharded_state(big)})
    time.sleep(600)  # must not be reached before the kill


def _run_and_kill(root: Path, world_size: int, mode: str, ready) -> None:
    ctx = multiprocessing.get_context("spawn")
    procs = [ctx.Process(target=_crash_child, args=(r, world_size, str(root / "rendezvous"), str(root), mode),
                         daemon=True) for r in range(world_size)]
    for p in procs:
        p.start()
    deadline = time.monotonic() + 300
    try:
        while not ready():
            assert time.monotonic() < deadline, "the child never reached the point to kill it"
            assert all(p.is_alive() for p in procs), [p.exitcode for p in procs]
            time.sleep(0.001)
        os.kill(procs[0].pid, signal.SIGKILL)
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
            p.join(10)


def _assert_previous_checkpoint_survives(root: Path, world_size: int) -> None:
    assert read_tracker(root) == 1 and atomic.committed_iterations(root) == [1]
    assert [p.name for p in root.glob("iter_0000002.tmp-*")], "the half-written directory should be left behind"
    ps = ParallelState().init_process_groups()
    model = _model(ps, seed=5)
    loaded = load_checkpoint(root, model=model, parallel_state=ps)
    assert loaded.iteration == 1 and _state_equal(model, _model(ps))  # the weights of iteration 1, not +1
    save_checkpoint(root, 2, model=model, parallel_state=ps)  # the next save cleans the leftover up
    assert read_tracker(root) == 2 and not list(root.glob("*.tmp-*"))


def test_sigkill_before_commit_keeps_previous_checkpoint(tmp_path):
    _run_and_kill(tmp_path, 2, "before_commit", ready=lambda: (tmp_path / "at_commit").exists())
    _assert_previous_checkpoint_survives(tmp_path, 2)


def test_sigkill_mid_write_keeps_previous_checkpoint(tmp_path):
    def writing() -> bool:
        temporaries = list(tmp_path.glob("iter_0000002.tmp-*"))
        return bool(temporaries) and any(f.suffix == ".distcp" and f.stat().st_size > 0 for f in temporaries[0].iterdir())
    _run_and_kill(tmp_path, 1, "mid_write", ready=writing)
    _assert_previous_checkpoint_survives(tmp_path, 1)


def test_keep_last_deletes_only_older_committed_checkpoints(tmp_path):
    ps = ParallelState().init_process_groups()
    model = _model(ps)
    (tmp_path / "iter_0000009.tmp-0123abcd").mkdir(parents=True)  # a dead writer's leftover
    for it in (1, 2, 3, 4):
        save_checkpoint(tmp_path, it * 10, model=model, parallel_state=ps, keep_last=2)
    assert atomic.committed_iterations(tmp_path) == [30, 40] and read_tracker(tmp_path) == 40
    assert sorted(p.name for p in tmp_path.iterdir()) == ["iter_0000030", "iter_0000040", TRACKER_FILE]
    # the tracker's checkpoint is never pruned, even when newer committed ones exist beside it
    atomic.write_text_atomic(tmp_path / TRACKER_FILE, "30\n")
    save_checkpoint(tmp_path, 50, model=model, parallel_state=ps)
    atomic.write_text_atomic(tmp_path / TRACKER_FILE, "30\n")
    atomic.prune_checkpoints(tmp_path, 1, protect=30)
    assert atomic.committed_iterations(tmp_path) == [30, 50]
    # saving an iteration that exists again replaces it whole (moved aside, then deleted)
    with torch.no_grad():
        model.final_layernorm.weight.add_(1.0)
    save_checkpoint(tmp_path, 50, model=model, parallel_state=ps)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["iter_0000030", "iter_0000050", TRACKER_FILE]
    fresh = _model(ps, seed=3)
    assert load_checkpoint(tmp_path, model=fresh, parallel_state=ps).iteration == 50 and _state_equal(fresh, model)


def test_loader_options(tmp_path):
    ps = ParallelState().init_process_groups()
    model = _model(ps)
    saved_args = {"num_layers": 2, "hidden_size": 32, "lr": 1e-3, "seed": 1, "tensor_model_parallel_size": 2}
    optim = {"exp_avg": torch.arange(4.0), "step": 3}
    save_checkpoint(tmp_path, 7, model=model, parallel_state=ps, optimizer_state=optim, extra={"x": 1},
                    args=saved_args, consumed_samples=56)
    assert read_tracker(tmp_path) == 7

    fresh, template = _model(ps, seed=1), {"exp_avg": torch.zeros(4), "step": 0}
    loaded = load_checkpoint(tmp_path, model=fresh, parallel_state=ps, optimizer_state=template,
                             args={**saved_args, "tensor_model_parallel_size": 4})  # layout flags may change
    assert (loaded.iteration, loaded.consumed_samples, loaded.extra) == (7, 56, {"x": 1})
    assert torch.equal(template["exp_avg"], torch.arange(4.0)) and template["step"] == 3 and _state_equal(fresh, model)

    fresh, template = _model(ps, seed=1), {"exp_avg": torch.zeros(4), "step": 0}
    with pytest.raises(ArgsMismatchError, match="--lr: checkpoint 0.001, now 0.002"):
        load_checkpoint(tmp_path, model=fresh, parallel_state=ps, args={**saved_args, "lr": 2e-3})
    loaded = load_checkpoint(tmp_path, model=fresh, parallel_state=ps, optimizer_state=template,
                             args={**saved_args, "lr": 2e-3}, allow_changed_args=["--lr"], no_load_optim=True)
    assert not loaded.optimizer_loaded and template["step"] == 0

    fresh, template = _model(ps, seed=1), {"exp_avg": torch.zeros(4), "step": 0}
    random.seed(0)
    expected = random.random()
    random.seed(0)
    loaded = load_checkpoint(tmp_path, model=fresh, parallel_state=ps, optimizer_state=template, finetune=True,
                             args={**saved_args, "lr": 2e-3, "seed": 9})
    assert (loaded.iteration, loaded.consumed_samples, loaded.extra) == (0, 0, {})
    assert not loaded.optimizer_loaded and not loaded.rng_restored and template["step"] == 0
    assert random.random() == expected and _state_equal(fresh, model)

    loaded = load_checkpoint(tmp_path, model=_model(ps, seed=1), parallel_state=ps, no_load_rng=True)
    assert not loaded.rng_restored and loaded.messages == []
    with pytest.raises(ArgsMismatchError, match="--hidden-size"):  # shapes must match even under --finetune
        load_checkpoint(tmp_path, model=fresh, parallel_state=ps, finetune=True, args={**saved_args, "hidden_size": 64})

    save_checkpoint(tmp_path / "weights_only", 3, model=model, parallel_state=ps)
    with pytest.raises(CheckpointError, match="has no optimizer state.*--finetune.*--no-load-optim"):
        load_checkpoint(tmp_path / "weights_only", model=fresh, parallel_state=ps, optimizer_state=template)
    assert load_checkpoint(tmp_path / "nothing_here", model=fresh, parallel_state=ps) is None


def test_check_args_rules():
    check_args({"lr": 1.0, "tensor_model_parallel_size": 1}, {"lr": 1.0, "tensor_model_parallel_size": 8})
    check_args({"fp8_format": "hybrid"}, {"fp8_format": None}, finetune=True)
    with pytest.raises(ArgsMismatchError, match="--fp8-format: checkpoint 'hybrid', now None"):
        check_args({"fp8_format": "hybrid"}, {"fp8_format": None})
    with pytest.raises(ArgsMismatchError, match="--num-layers"):
        check_args({"num_layers": 2}, {"num_layers": 4}, finetune=True, allow_changed=["seed"])


def _damage(path: Path, how: str) -> None:
    data = bytearray(path.read_bytes())
    if how == "truncate":
        path.write_bytes(data[: len(data) // 2])
    else:
        data[len(data) // 2] ^= 0xFF
        path.write_bytes(bytes(data))


@pytest.mark.parametrize("damage,message", [
    (lambda d: _damage(d / "__0_0.distcp", "truncate"), r"__0_0.distcp is truncated"),
    (lambda d: _damage(d / "__0_0.distcp", "flip"), r"__0_0.distcp is corrupt: its SHA-256"),
    (lambda d: (d / ".metadata").unlink(), r"\.metadata is missing"),
    (lambda d: (d / "megafp8_checkpoint.json").write_text("{\"format\": "), r"megafp8_checkpoint.json is corrupt"),
    (lambda d: (d / "megafp8_checkpoint.json").unlink(), r"not a complete megafp8 checkpoint"),
    (lambda d: (d.parent / TRACKER_FILE).write_text("iter_12\n"), r"latest_checkpointed_iteration.txt is corrupt"),
    (lambda d: (d.parent / TRACKER_FILE).write_text("8\n"), r"iter_0000008 does not exist"),
])
def test_damaged_checkpoint_gives_one_clear_error(tmp_path, damage, message):
    ps = ParallelState().init_process_groups()
    path = save_checkpoint(tmp_path, 7, model=_model(ps), parallel_state=ps)
    damage(path)
    with pytest.raises(CheckpointError, match=message) as error:
        load_checkpoint(tmp_path, model=_model(ps), parallel_state=ps)
    assert str(tmp_path) in str(error.value) and "Traceback" not in str(error.value)


def test_damage_found_by_the_reader_is_wrapped(tmp_path):
    """Sizes intact, checksums off: a corrupt DCP index, and a shape DCP rejects, each come out as one
    CheckpointError naming the path."""
    ps = ParallelState().init_process_groups()
    path = save_checkpoint(tmp_path, 7, model=_model(ps), parallel_state=ps)
    wider = GPTModel(ModelConfig(**{**vars(_config()), "hidden_size": 64}), ps)
    with pytest.raises(CheckpointError, match=f"loading checkpoint {path} failed: .*Size mismatch .* "
                                              "model.embedding.weight") as error:
        load_checkpoint(tmp_path, model=wider, parallel_state=ps, verify=False)
    assert "Traceback" not in str(error.value)
    _damage(path / ".metadata", "flip")
    with pytest.raises(CheckpointError, match=r"\.metadata is corrupt or unreadable") as error:
        load_checkpoint(tmp_path, model=_model(ps), parallel_state=ps, verify=False)
    assert str(path) in str(error.value) and "Traceback" not in str(error.value)


def _damaged_on_one_rank_body(rank: int, world_size: int, root: str) -> None:
    ps = ParallelState(world_size=2).init_process_groups()
    path = save_checkpoint(root, 3, model=_model(ps), parallel_state=ps)
    dist.barrier()
    if rank == 0:
        _damage(path / "__1_0.distcp", "flip")
    dist.barrier()
    with pytest.raises(CheckpointError, match="__1_0.distcp is corrupt"):  # every rank raises, none hangs
        load_checkpoint(root, model=_model(ps), parallel_state=ps)


@pytest.mark.distributed
def test_damage_seen_by_one_rank_fails_every_rank(tmp_path):
    run_distributed(_damaged_on_one_rank_body, world_size=2, args=(str(tmp_path),))


def test_fp8_turned_on_at_resume_starts_cold_scaling_states(tmp_path):
    from megafp8.fp8 import Fp8Recipe
    ps = ParallelState().init_process_groups()
    bf16_run = _model(ps)
    save_checkpoint(tmp_path, 4, model=bf16_run, parallel_state=ps, args={"fp8_format": None})
    fp8_run = GPTModel(_config(), ps, fp8_recipe=Fp8Recipe(scaling="delayed", amax_history_len=4))
    loaded = load_checkpoint(tmp_path, model=fp8_run, parallel_state=ps, args={"fp8_format": "hybrid"},
                             allow_changed_args=["fp8_format"])
    assert loaded.iteration == 4 and "48 FP8 scaling tensors are not in" in loaded.messages[0]  # 2 layers x 4 linears x 3 roles x 2
    weights = {k: v for k, v in fp8_run.state_dict().items() if "fp8_scaling" not in k}
    assert all(torch.equal(v, bf16_run.state_dict()[k]) for k, v in weights.items())
    for name, buf in fp8_run.state_dict().items():
        if name.endswith("amax_history"):
            assert torch.all(buf == 0), name


def test_keep_last_never_deletes_an_iter_directory_megafp8_did_not_write(tmp_path):
    """--keep-last prunes megafp8's checkpoints (a manifest inside); a user's iter_* folder without one stays."""
    from megafp8.checkpoint.atomic import MANIFEST_FILE, iteration_dir, prune_checkpoints

    for it in (1, 2, 3, 4):
        directory = iteration_dir(tmp_path, it)
        directory.mkdir()
        if it != 1:  # iter_0000001 is the user's own folder
            (directory / MANIFEST_FILE).write_text("{}")
        (directory / "data.txt").write_text(str(it))
    removed = prune_checkpoints(tmp_path, keep_last=1, protect=4)
    assert sorted(p.name for p in removed) == ["iter_0000002", "iter_0000003"]
    assert (iteration_dir(tmp_path, 1) / "data.txt").read_text() == "1" and iteration_dir(tmp_path, 4).is_dir()
