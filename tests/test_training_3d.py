"""The training product in 3D, as a user launches it (torchrun, real gloo process groups, fresh processes):
exact resume with FP8 and the FP8 ZeRO optimizer, resharding on load, a two-agent (multi-node) launch,
skipped non-finite steps, clear failures instead of hangs, SIGTERM, and kill -9 during a checkpoint save."""
from __future__ import annotations

import json
import math
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from data_fixtures import REPO_ROOT, write_synthetic_dataset
from megafp8.training.megatron_flags import LLAMA_FLAGS

TIMEOUT = 300  # seconds per launch: a hang fails the test instead of stalling the suite
MODEL = [*LLAMA_FLAGS, "--tokenizer-type", "NullTokenizer", "--vocab-size", "500", "--num-layers", "4",
         "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "32", "--micro-batch-size", "2",
         "--global-batch-size", "8", "--lr", "1e-3", "--eval-iters", "0", "--log-interval", "1",
         "--distributed-timeout-minutes", "1"]
LAYOUT_3D = ["--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "2", "--sequence-parallel"]
FP8_ZERO = ["--fp8-format", "hybrid", "--fp8-recipe", "delayed", "--fp8-amax-history-len", "1024",
            "--fp8-amax-compute-algo", "max", "--use-distributed-optimizer", "--fp8-param-gather",
            "--overlap-grad-reduce", "--overlap-param-gather"]


@pytest.fixture(scope="module")
def data_prefix(tmp_path_factory) -> str:
    prefix = str(tmp_path_factory.mktemp("data") / "synthetic_text_document")
    write_synthetic_dataset(prefix, [50] * 200, vocab_size=500)
    return prefix


def _command(nproc: int, launcher: list[str] | None = None) -> list[str]:
    launcher = launcher or ["--standalone", f"--nproc-per-node={nproc}"]
    return [sys.executable, "-m", "torch.distributed.run", *launcher, "-m", "megafp8.pretrain"]


def _env(**extra: str) -> dict:
    return {**os.environ, "OMP_NUM_THREADS": "1", **extra}


def _pretrain(nproc: int, *flags: str, **env: str) -> subprocess.CompletedProcess:
    return subprocess.run([*_command(nproc), *flags], cwd=REPO_ROOT, capture_output=True, text=True,
                          timeout=TIMEOUT, env=_env(**env))


def _ok(result: subprocess.CompletedProcess) -> str:
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-4000:]
    return result.stdout


def _losses(log_dir: Path) -> dict[int, float | None]:
    records = [json.loads(line) for line in (log_dir / "metrics.jsonl").read_text().splitlines()]
    return {r["iteration"]: r["lm_loss"] for r in records if "lm_loss" in r}


def _records(log_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (log_dir / "metrics.jsonl").read_text().splitlines()]


def _no_megafp8_traceback(result: subprocess.CompletedProcess) -> bool:
    """A user error is a message, not a stack trace through megafp8 (torchrun prints its own summary)."""
    return os.path.join(REPO_ROOT, "megafp8") not in result.stderr


def _tracker(save: Path) -> int:
    return int((save / "latest_checkpointed_iteration.txt").read_text())


# ---- exact resume and the two-agent launch share the uninterrupted run ------------------------------
FP8_3D_RUN = [*MODEL, *LAYOUT_3D, *FP8_ZERO, "--train-iters", "6"]


@pytest.fixture(scope="module")
def straight_fp8_3d(data_prefix, tmp_path_factory) -> dict[int, float]:
    """Six iterations of TP2 x PP2 x DP2, FP8 delayed scaling, FP8 ZeRO, one torchrun agent, never stopped."""
    logs = tmp_path_factory.mktemp("straight")
    _ok(_pretrain(8, *FP8_3D_RUN, "--data-path", data_prefix, "--log-dir", str(logs)))
    losses = _losses(logs)
    assert sorted(losses) == list(range(1, 7)) and all(math.isfinite(v) for v in losses.values())
    return losses


def test_fp8_3d_resume_in_fresh_processes_is_bit_exact(straight_fp8_3d, data_prefix, tmp_path):
    save = str(tmp_path / "checkpoints")
    first = _ok(_pretrain(8, *FP8_3D_RUN, "--data-path", data_prefix, "--save", save, "--exit-interval", "3"))
    assert "saved checkpoint at iteration 3" in first and _tracker(Path(save)) == 3
    second = _ok(_pretrain(8, *FP8_3D_RUN, "--data-path", data_prefix, "--load", save,
                           "--log-dir", str(tmp_path / "logs")))
    assert "(iteration 3)" in second
    resumed = _losses(tmp_path / "logs")
    assert resumed == {i: straight_fp8_3d[i] for i in (4, 5, 6)}  # bit-identical floats


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.slow  # CI time: the single-agent 3D runs above and the quickstart cover the rest of the path
def test_two_torchrun_agents_train_like_one(straight_fp8_3d, data_prefix, tmp_path):
    """Two agents on localhost with the c10d rendezvous, 4 processes each: the multi-node launch."""
    port = _free_port()
    agents = [subprocess.Popen(
        [*_command(4, ["--nnodes", "2", "--node-rank", str(node), "--rdzv-backend", "c10d", "--rdzv-id", "t3d",
                       "--rdzv-endpoint", f"127.0.0.1:{port}", "--nproc-per-node", "4"]),
         *FP8_3D_RUN, "--data-path", data_prefix, "--log-dir", str(tmp_path / "logs")],
        cwd=REPO_ROOT, env=_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for node in (0, 1)]
    outputs = [agent.communicate(timeout=TIMEOUT) for agent in agents]
    for agent, (out, err) in zip(agents, outputs):
        assert agent.returncode == 0, out[-2000:] + err[-4000:]
    assert _losses(tmp_path / "logs") == straight_fp8_3d


# ---- resharding on load (fp32) ---------------------------------------------------------------------
# One sample per micro-batch: PP4 at DP2 needs 4 micro-batches for 1F1B (the loss is the step's token mean either way).
FP32_RUN = [*MODEL, "--micro-batch-size", "1", "--use-distributed-optimizer", "--train-iters", "4"]


@pytest.fixture(scope="module")
def fp32_3d_checkpoint(data_prefix, tmp_path_factory) -> tuple[Path, float]:
    """(a checkpoint of iteration 3 written at TP2 x PP2 x DP2, that layout's loss at iteration 4)."""
    work = tmp_path_factory.mktemp("fp32_3d")
    save = work / "checkpoints"
    _ok(_pretrain(8, *FP32_RUN, *LAYOUT_3D, "--data-path", data_prefix, "--save", str(save), "--save-interval", "3",
                  "--log-dir", str(work / "logs")))
    assert (save / "iter_0000003").is_dir() and _tracker(save) == 4
    # Roll the tracker back to iteration 3, as an operator would, so a load continues from there.
    (save / "latest_checkpointed_iteration.txt").write_text("3")
    return save, _losses(work / "logs")[4]


@pytest.mark.parametrize("layout", [
    ["--tensor-model-parallel-size", "1", "--pipeline-model-parallel-size", "4"],  # TP1 x PP4 x DP2
    # CI time: TP2 -> TP2 with PP2 -> PP1 and DP2 -> DP4 (tests/test_checkpoint_reshard.py reshards TP by itself)
    pytest.param(["--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "1", "--sequence-parallel"],
                 marks=pytest.mark.slow),  # DP4
], ids=["tp1_pp4_dp2", "tp2_pp1_dp4"])
def test_checkpoint_reshards_on_load(fp32_3d_checkpoint, layout, data_prefix, tmp_path):
    save, expected = fp32_3d_checkpoint
    out = _ok(_pretrain(8, *FP32_RUN, *layout, "--data-path", data_prefix, "--load", str(save),
                        "--log-dir", str(tmp_path / "logs")))
    assert "(iteration 3)" in out
    loss = _losses(tmp_path / "logs")
    assert sorted(loss) == [4] and loss[4] == pytest.approx(expected, rel=1e-5)


@pytest.mark.parametrize("damage", ["truncated", pytest.param("corrupt", marks=pytest.mark.slow)])
def test_damaged_checkpoint_fails_once_on_rank_0_without_a_hang(damage, fp32_3d_checkpoint, data_prefix, tmp_path):
    """The largest shard cut in half, or the same size with bytes flipped; loaded by a 2-process DP2 job."""
    source, _ = fp32_3d_checkpoint
    save = tmp_path / "checkpoints"
    shutil.copytree(source / "iter_0000003", save / "iter_0000003")
    (save / "latest_checkpointed_iteration.txt").write_text("3")
    shard = max((p for p in (save / "iter_0000003").rglob("*") if p.is_file()), key=lambda p: p.stat().st_size)
    data = shard.read_bytes()
    middle = len(data) // 2
    shard.write_bytes(data[:middle] if damage == "truncated" else
                      data[:middle] + bytes(b ^ 0xFF for b in data[middle:middle + 64]) + data[middle + 64:])
    result = _pretrain(2, *FP32_RUN, "--data-path", data_prefix, "--load", str(save))
    assert result.returncode != 0
    assert result.stderr.count("megafp8-pretrain: error:") == 1 and shard.name in result.stderr, result.stderr[-3000:]
    assert _no_megafp8_traceback(result)


@pytest.mark.parametrize("flags, message", [
    (["--data-path", "/nonexistent/prefix"], "/nonexistent/prefix"),
    (["--tensor-model-parallel-size", "4"], "--tensor-model-parallel-size"),  # 4 heads / 4 ... x PP 1 x DP 1 != 2
])
def test_bad_data_or_layout_fails_once_on_rank_0(flags, message, data_prefix):
    result = _pretrain(2, *FP32_RUN, "--data-path", data_prefix, *flags)
    assert result.returncode != 0
    assert result.stderr.count("megafp8-pretrain: error:") == 1 and message in result.stderr, result.stderr[-3000:]
    assert _no_megafp8_traceback(result)


# ---- a non-finite step --------------------------------------------------------------------------------
@pytest.mark.slow  # CI time: tests/test_rerun.py runs non-finite steps through the entry by default
def test_non_finite_step_is_skipped_counted_and_training_continues(data_prefix, tmp_path):
    out = _ok(_pretrain(8, *MODEL, *LAYOUT_3D, *FP8_ZERO, "--train-iters", "5", "--data-path", data_prefix,
                        "--log-dir", str(tmp_path / "logs"), MEGAFP8_INJECT_NAN_AT_ITERATION="2"))
    records = {r["iteration"]: r for r in _records(tmp_path / "logs") if "lm_loss" in r}
    assert records[1]["skipped_iterations"] == 0 and math.isfinite(records[1]["grad_norm"])
    assert records[2]["lm_loss"] is None  # NaN is written as null
    assert [records[i]["skipped_iterations"] for i in (2, 3, 4, 5)] == [1, 1, 1, 1]
    assert all(math.isfinite(records[i]["lm_loss"]) and math.isfinite(records[i]["grad_norm"]) for i in (3, 4, 5))
    line = next(line for line in out.splitlines() if "iteration        2/" in line)
    assert "number of skipped iterations:   1" in line and "number of nan iterations:   1" in line
    assert "trained 5 iterations (40 samples, 1 skipped)" in out


# ---- signals: SIGTERM saves and exits 0; kill -9 during a save loses only that save -----------------------
SMALL_RUN = [*MODEL, "--pipeline-model-parallel-size", "2", "--train-iters", "1000"]  # two processes


def _workers(agent: subprocess.Popen) -> dict[int, int]:
    """{global rank: pid} of the agent's worker processes."""
    ranks = {}
    for entry in Path("/proc").iterdir():
        try:
            if entry.name.isdigit() and int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1]) == agent.pid:
                env = dict(kv.split("=", 1) for kv in (entry / "environ").read_text().split("\0") if "=" in kv)
                ranks[int(env["RANK"])] = int(entry.name)
        except (OSError, KeyError, IndexError, ValueError):
            continue
    return ranks


def _launch(*flags: str, env: dict | None = None) -> subprocess.Popen:
    return subprocess.Popen([*_command(2), *flags], cwd=REPO_ROOT, env=_env(**(env or {})), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)


def _wait_for(condition, agent: subprocess.Popen, poll: float) -> None:
    deadline = time.monotonic() + TIMEOUT
    while not condition():
        assert agent.poll() is None, agent.communicate()[1][-3000:]
        assert time.monotonic() < deadline, "timed out"
        time.sleep(poll)


@pytest.mark.parametrize("target, async_save", [("ranks", False), pytest.param("agent", False, marks=pytest.mark.slow),
                                                ("ranks", True)],
                         ids=["ranks", "agent", "ranks-async-save"])
def test_sigterm_finishes_the_step_saves_and_exits_0(target, async_save, data_prefix, tmp_path):
    """SIGTERM to every rank (a scheduler's preemption) or to the torchrun agent, which forwards it to its
    workers: they finish the step, save it and exit 0. The agent itself then exits 1 (torchrun re-raises the
    signal it received), so that case checks the ranks' own clean end instead of the agent's status. With
    --async-save the save is still in the background when the loop ends (rank 0 holds its commit 3 s): the run
    commits it before exiting."""
    save, logs = tmp_path / "checkpoints", tmp_path / "logs"
    agent = _launch(*SMALL_RUN, "--data-path", data_prefix, "--save", str(save), "--log-dir", str(logs),
                    *(["--async-save"] if async_save else []),
                    env={"MEGAFP8_TEST_PAUSE_BEFORE_COMMIT_S": "3"} if async_save else None)
    _wait_for(lambda: (logs / "metrics.jsonl").exists() and len(_records(logs)) >= 2, agent, 0.2)
    for pid in _workers(agent).values() if target == "ranks" else [agent.pid]:
        os.kill(pid, signal.SIGTERM)
    out, err = agent.communicate(timeout=TIMEOUT)
    assert agent.returncode == (0 if target == "ranks" else 1), out[-2000:] + err[-3000:]
    last = max(_losses(logs))
    assert 2 <= last < 1000 and f"saved checkpoint at iteration {last} " in out and _tracker(save) == last
    assert f"megafp8: trained {last} iterations" in out  # the last rank's run() returned normally


@pytest.mark.parametrize("async_save", [pytest.param(False, marks=pytest.mark.slow), True], ids=["sync", "async-save"])
def test_kill_9_during_a_save_resumes_from_the_previous_checkpoint(async_save, data_prefix, tmp_path):
    """With --async-save the kill lands while the background thread writes and the training goes on."""
    save = tmp_path / "checkpoints"
    # Rank 0 pauses 3 s before committing each save (a test hook), so the kill surely lands mid-save.
    agent = _launch(*SMALL_RUN, "--data-path", data_prefix, "--save", str(save), "--save-interval", "1",
                    *(["--async-save"] if async_save else []), env={"MEGAFP8_TEST_PAUSE_BEFORE_COMMIT_S": "3"})

    def second_save_in_progress() -> bool:
        return save.is_dir() and any(p.name.startswith("iter_") and ".tmp-" in p.name and int(p.name[5:12]) >= 2
                                     for p in save.iterdir())
    _wait_for(lambda: len(_workers(agent)) == 2, agent, 0.1)
    rank_0 = _workers(agent)[0]  # looked up beforehand: the kill must land inside the save's short window
    _wait_for(second_save_in_progress, agent, 0.05)
    os.kill(rank_0, signal.SIGKILL)  # rank 0 commits the save: it never completes
    agent.communicate(timeout=TIMEOUT)
    assert agent.returncode != 0
    half_written = [p.name for p in save.iterdir() if ".tmp-" in p.name]
    complete = _tracker(save)
    assert half_written and int(half_written[0][5:12]) == complete + 1  # killed mid-save, the previous one stands
    out = _ok(_pretrain(2, *SMALL_RUN[:-1], str(complete + 1), "--data-path", data_prefix, "--load", str(save),
                        "--save", str(save)))
    assert f"(iteration {complete})" in out and _tracker(save) == complete + 1
    assert not any(".tmp-" in p.name for p in save.iterdir())  # the next save cleared the leftover
