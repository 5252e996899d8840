"""MoE through `megafp8.pretrain`, as users run it: built from scratch at every layout (TP2 + SP x DP2 with ZeRO, PP2
under a zero-bubble schedule, CP2, EP, ETP), each reproduces the single-process run's per-step losses, grad norms, balancing
losses and expert loads in fp32; FP8 stays within FP8's bounds; checkpoints (the expert biases included) resume
bit-exact and load at another layout."""
from __future__ import annotations

import json
import math
import os
import subprocess
import sys

import pytest

from data_fixtures import REPO_ROOT
from megafp8.training.megatron_flags import LLAMA_FLAGS

# DeepSeek-V3's router (sigmoid, expert bias, sequence balancing loss) with a z loss and a shared expert; layer 0 dense.
MOE = ["--num-experts", "4", "--moe-ffn-hidden-size", "32", "--moe-layer-freq", "0,1,1,1", "--moe-router-topk", "2",
       "--moe-router-score-function", "sigmoid", "--moe-router-enable-expert-bias",
       "--moe-router-bias-update-rate", "0.01", "--moe-router-load-balancing-type", "seq_aux_loss",
       "--moe-aux-loss-coeff", "0.01", "--moe-z-loss-coeff", "0.001", "--moe-shared-expert-intermediate-size", "16"]


def _train(tmp_path, name: str, nproc: int, *flags: str, iters: int = 4, entry: list[str] | None = None) -> list[dict]:
    """The per-iteration metrics of one run; ``entry``: what torchrun starts instead of ``-m megafp8.pretrain``."""
    log_dir = tmp_path / name
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}",
               *(entry or ["-m", "megafp8.pretrain"]), *LLAMA_FLAGS, *MOE, "--mock-data", "--tokenizer-type", "NullTokenizer",
               "--vocab-size", "200", "--num-layers", "4", "--hidden-size", "64", "--num-attention-heads", "4",
               "--seq-length", "32", "--micro-batch-size", "1", "--global-batch-size", "4", "--lr", "1e-3",
               "--attention-dropout", "0", "--hidden-dropout", "0", "--eval-iters", "0", "--log-interval", "1",
               "--distributed-timeout-minutes", "2", "--train-iters", str(iters), "--log-dir", str(log_dir), *flags]
    result = subprocess.run(command, cwd=REPO_ROOT, capture_output=True, text=True, timeout=300,
                            env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-4000:]
    return [r for r in map(json.loads, (log_dir / "metrics.jsonl").read_text().splitlines()) if "lm_loss" in r]


def _assert_same_run(actual: list[dict], expected: list[dict], rtol: float = 1e-5) -> None:
    assert [r["iteration"] for r in actual] == [r["iteration"] for r in expected]
    for a, e in zip(actual, expected):
        for key in ("lm_loss", "grad_norm", "moe_aux_loss", "moe_z_loss"):
            assert abs(a[key] - e[key]) <= rtol * abs(e[key]), (key, a, e)
        assert a["moe_tokens_per_expert"] == e["moe_tokens_per_expert"], (a, e)


@pytest.fixture(scope="module")
def single_process(tmp_path_factory):
    """The reference: one process, fp32."""
    tmp_path = tmp_path_factory.mktemp("moe")
    return tmp_path, _train(tmp_path, "one", 1)


@pytest.mark.distributed
def test_the_single_process_run_logs_the_routers_and_balances(single_process):
    _, run = single_process
    for record in run:
        loads = record["moe_tokens_per_expert"]
        assert list(loads) == ["layers.1", "layers.2", "layers.3"]  # --moe-layer-freq 0,1,1,1: layer 0 is dense
        assert all(sum(load) == 4 * 32 * 2 for load in loads.values())  # every token's two choices
        assert 0.9 < record["moe_aux_loss"] < 2.0 and record["moe_z_loss"] > 0


ZERO = ["--use-distributed-optimizer"]
LAYOUTS = {
    "tp2-sp-dp2-zero": (4, ["--tensor-model-parallel-size", "2", "--sequence-parallel", *ZERO]),
    "pp2-zbv": (2, ["--pipeline-model-parallel-size", "2", "--num-layers-per-virtual-pipeline-stage", "1",
                    "--pipeline-schedule", "zbv"]),
    "cp2": (2, ["--context-parallel-size", "2"]),
    # expert parallelism, folded into the data-parallel (and TP, CP) ranks
    "ep2-dp2": (2, ["--expert-model-parallel-size", "2", *ZERO]),
    "ep4-tp2-sp-dp2": (4, ["--expert-model-parallel-size", "4", "--tensor-model-parallel-size", "2",
                           "--sequence-parallel", *ZERO]),
    "ep2-pp2-1f1b": (4, ["--expert-model-parallel-size", "2", "--pipeline-model-parallel-size", "2",
                         "--pipeline-schedule", "1f1b", *ZERO]),
    "ep2-tp2-sp-pp2-zbv": (4, ["--expert-model-parallel-size", "2", "--tensor-model-parallel-size", "2",
                               "--sequence-parallel", "--pipeline-model-parallel-size", "2",
                               "--num-layers-per-virtual-pipeline-stage", "1", "--pipeline-schedule", "zbv", *ZERO]),
    "ep2-cp2": (4, ["--expert-model-parallel-size", "2", "--context-parallel-size", "2", *ZERO]),
    # Megatron-Core's allgather dispatcher: every token to every EP rank, the per-token sums reduce-scattered back
    "ep4-tp2-sp-dp2-allgather": (4, ["--expert-model-parallel-size", "4", "--tensor-model-parallel-size", "2",
                                     "--sequence-parallel", *ZERO, "--moe-token-dispatcher-type", "allgather"]),
    "ep2-dp2-allgather": (2, ["--expert-model-parallel-size", "2", *ZERO, "--moe-token-dispatcher-type", "allgather"]),
    # --moe-grouped-gemm: each rank's experts as grouped GEMMs on the rows the all-to-all brought
    "ep2-dp2-grouped-gemm": (2, ["--expert-model-parallel-size", "2", *ZERO, "--moe-grouped-gemm",
                                 "--overlap-grad-reduce", "--overlap-param-gather"]),  # (the on-demand gather too)
    # expert tensor parallelism: each expert split over the TP ranks (ETP x EP x DP below: test_expert_tensor_...)
    "etp2-tp2-sp-dp2": (4, ["--expert-tensor-parallel-size", "2", "--tensor-model-parallel-size", "2",
                            "--sequence-parallel", *ZERO]),
    "etp2-ep2-tp2-sp-pp2-allgather": (8, ["--expert-tensor-parallel-size", "2", "--expert-model-parallel-size", "2",
                                          "--tensor-model-parallel-size", "2", "--sequence-parallel",
                                          "--pipeline-model-parallel-size", "2", "--pipeline-schedule", "1f1b", *ZERO,
                                          "--moe-token-dispatcher-type", "allgather"]),
}
SLOW_LAYOUTS = ("cp2", "ep2-cp2", "ep2-pp2-1f1b", "ep2-dp2", "ep2-dp2-allgather", "etp2-tp2-sp-dp2",
                "etp2-ep2-tp2-sp-pp2-allgather")


@pytest.mark.distributed
@pytest.mark.parametrize("layout", [pytest.param(name, marks=pytest.mark.slow) if name in SLOW_LAYOUTS else name
                                    for name in LAYOUTS])
def test_every_layout_built_from_scratch_reproduces_the_single_process_run(single_process, layout):
    tmp_path, reference = single_process
    nproc, flags = LAYOUTS[layout]
    _assert_same_run(_train(tmp_path, layout, nproc, *flags), reference)


@pytest.mark.distributed
@pytest.mark.slow  # CI time: FP8 experts run by default under EP (blockwise EP4, delayed EP2, the FP8 ZeRO paths)
def test_fp8_experts_under_tp2_sp_dp2_stay_within_fp8_bounds(single_process):
    """Delayed scaling (the default recipe) with FP8 parameter all-gathers, experts whole on every rank."""
    tmp_path, reference = single_process
    fp8 = _train(tmp_path, "fp8", 4, "--tensor-model-parallel-size", "2", "--sequence-parallel",
                 "--use-distributed-optimizer", "--fp8-format", "hybrid", "--fp8-recipe", "delayed",
                 "--fp8-param-gather")
    for a, e in zip(fp8, reference):
        assert abs(a["lm_loss"] - e["lm_loss"]) <= 0.01 * e["lm_loss"], (a, e)
    assert any(a["lm_loss"] != e["lm_loss"] for a, e in zip(fp8, reference))  # the experts did run in FP8


@pytest.mark.distributed
@pytest.mark.slow
def test_the_allgather_dispatcher_in_fp8_equals_the_alltoall_one(single_process):
    """Blockwise FP8 experts under EP4 with the allgather dispatcher: the gathered tokens are the alltoall dispatch's
    FP8 bytes and each expert sees the same rows in the same order, so the runs differ only in the order the token
    sums are added (and in the bytes: every token to every rank)."""
    tmp_path, _ = single_process
    blockwise = ["--hidden-size", "128", "--moe-ffn-hidden-size", "128", "--fp8-format", "e4m3", "--fp8-recipe",
                 "blockwise", "--fp8-power-of-2-scale", "--expert-model-parallel-size", "4", *ZERO]
    alltoall = _train(tmp_path, "blockwise-ep4-a2a", 4, *blockwise)
    allgather = _train(tmp_path, "blockwise-ep4-ag", 4, *blockwise, "--moe-token-dispatcher-type", "allgather")
    for a, e in zip(allgather, alltoall):
        assert abs(a["lm_loss"] - e["lm_loss"]) <= 1e-5 * e["lm_loss"], (a, e)
    assert all(r["comm_bytes"]["ep_allgather"] > 0 and r["comm_bytes"]["ep_alltoall"] == 0 for r in allgather)


@pytest.mark.distributed
def test_blockwise_fp8_experts_under_ep4_with_fp8_dispatch_equal_ep1_and_stay_within_fp8_bounds(single_process):
    """DeepSeek-V3's recipe (1x128 / 128x128 power-of-two scales), the one to use with expert parallelism: the FP8
    dispatch's bytes are the very values FC1's cast makes of them, so EP4's forward is EP1's. (Not bit for bit: the
    wgrad's 1x128 blocks run along the tokens, and EP4 runs one expert GEMM over every source's tokens where EP1 runs
    one per micro-batch, so the blocks group other tokens.)"""
    tmp_path, _ = single_process
    wide = ["--hidden-size", "128", "--moe-ffn-hidden-size", "128"]
    blockwise = [*wide, "--fp8-format", "e4m3", "--fp8-recipe", "blockwise", "--fp8-power-of-2-scale"]
    ep4 = _train(tmp_path, "blockwise-ep4", 4, "--expert-model-parallel-size", "4", *ZERO, *blockwise)
    ep1 = _train(tmp_path, "blockwise-ep1", 1, *blockwise)
    for a, e in zip(ep4, ep1):
        assert abs(a["lm_loss"] - e["lm_loss"]) <= 1e-5 * e["lm_loss"], (a, e)
        assert abs(a["grad_norm"] - e["grad_norm"]) <= 1e-3 * e["grad_norm"]
    assert all(r["comm_bytes"]["ep_alltoall"] > 0 for r in ep4)
    fp32 = _train(tmp_path, "wide", 1, *wide)
    for a, e in zip(ep4, fp32):
        assert abs(a["lm_loss"] - e["lm_loss"]) <= 0.01 * e["lm_loss"], (a, e)
    assert any(a["lm_loss"] != e["lm_loss"] for a, e in zip(ep4, fp32))


@pytest.mark.distributed
def test_delayed_fp8_experts_under_ep2_reduce_their_amaxes_and_saturation_over_their_holders(single_process):
    """Each expert's delayed-scaling amaxes and saturation are max-reduced over the ranks holding it: EP2 tracks
    EP1's delayed FP8 run, and an expert forced to overflow (MEGAFP8_FORCE_FP8_OVERFLOW) on the ranks holding it is
    switched to high precision there, its switch logged once by rank 0, which does not hold it."""
    tmp_path, reference = single_process
    delayed = ["--fp8-format", "hybrid", "--fp8-recipe", "delayed"]
    ep1 = _train(tmp_path, "delayed-ep1", 1, *delayed)
    ep2 = _train(tmp_path, "delayed-ep2", 2, *delayed, "--expert-model-parallel-size", "2", *ZERO)
    for a, e, r in zip(ep2, ep1, reference):
        assert abs(a["lm_loss"] - e["lm_loss"]) <= 2e-3 * e["lm_loss"], (a, e)  # the FP8 dispatch's extra rounding
        assert abs(a["lm_loss"] - r["lm_loss"]) <= 0.01 * r["lm_loss"], (a, r)
    os.environ["MEGAFP8_FORCE_FP8_OVERFLOW"] = "layers.2.mlp.experts.local_experts.3.linear_fc2@1"
    try:
        log = _train(tmp_path, "delayed-ep2-overflow", 2, *delayed, "--expert-model-parallel-size", "2", *ZERO)
    finally:
        del os.environ["MEGAFP8_FORCE_FP8_OVERFLOW"]
    switches = [json.loads(line) for line in (tmp_path / "delayed-ep2-overflow" / "metrics.jsonl").read_text()
                .splitlines() if "fp8_guard_switch" in line]
    assert [(s["iteration"], s["fp8_guard_switch"]) for s in switches] == [
        (3, "layers.2.mlp.experts.local_experts.3.linear_fc2")]
    assert len(log) == 4 and all(math.isfinite(r["lm_loss"]) for r in log)


@pytest.mark.distributed
def test_the_fp8_zero_paths_work_for_experts_over_their_expert_data_parallel_group(single_process):
    """Under EP2 x DP2 an expert's ZeRO shards are held by its expert-data-parallel group (the ranks with the same
    experts), not by DP: --fp8-param-gather agrees each expert weight's amax there and gathers its FP8 bytes there,
    so with tensorwise (current) scaling its first step is the run without it bit for bit (a scale agreed over the
    wrong ranks, another expert's amax, changes the bytes) and the rest within round-off; --moe-grouped-gemm on those
    weights is the same run; --fp8-grad-reduce and an fp16 master on top stay within FP8's bounds of it."""
    tmp_path, _ = single_process
    ep2 = ["--expert-model-parallel-size", "2", *ZERO, "--fp8-format", "hybrid", "--fp8-recipe", "tensorwise"]
    plain = _train(tmp_path, "ep2-tensorwise", 4, *ep2)
    gathered = _train(tmp_path, "ep2-fp8-param-gather", 4, *ep2, "--fp8-param-gather")
    # Step 1 runs on the weights as published at start: the same FP8 bytes, the same loss to the bit. Later steps
    # differ in round-off only (FP8 weights take buckets of their own, so the grad norm sums in another order).
    assert gathered[0]["lm_loss"] == plain[0]["lm_loss"]
    for a, e in zip(gathered, plain):
        assert abs(a["lm_loss"] - e["lm_loss"]) <= 1e-5 * e["lm_loss"], (a, e)
    assert all(r["comm_bytes"]["dp_param_allgather"] < p["comm_bytes"]["dp_param_allgather"]
               for r, p in zip(gathered, plain))  # FP8 bytes on the wire
    # --moe-grouped-gemm on the gathered FP8 weights: fprop, dgrad and wgrad as grouped FP8 GEMMs, whose CPU twins are
    # the loop's GEMMs on the same operands: the same run to the bit.
    grouped = _train(tmp_path, "ep2-fp8-param-gather-grouped", 4, *ep2, "--fp8-param-gather", "--moe-grouped-gemm",
                     entry=[os.path.join(REPO_ROOT, "tests", "counted_grouped_gemm_entry.py")])
    assert [(r["lm_loss"], r["grad_norm"], r["moe_tokens_per_expert"]) for r in grouped] == [
        (r["lm_loss"], r["grad_norm"], r["moe_tokens_per_expert"]) for r in gathered]
    for rank in range(4):  # 4 iterations x 1 micro-batch (DP4) x 3 MoE layers x (fc1, fc2): fprop + dgrad, and wgrad
        calls = json.loads((tmp_path / "ep2-fp8-param-gather-grouped" / f"grouped_gemm_calls.{rank}.json").read_text())
        assert calls == {"grouped_fp8_gemm": 4 * 3 * 2 * 2, "grouped_fp8_wgrad": 4 * 3 * 2}, calls
    everything = _train(tmp_path, "ep2-fp8-zero", 4, *ep2, "--fp8-param-gather", "--fp8-grad-reduce",
                        "--master-weight-dtype", "fp16")
    for a, e in zip(everything, plain):
        assert abs(a["lm_loss"] - e["lm_loss"]) <= 0.01 * e["lm_loss"], (a, e)


@pytest.mark.distributed
@pytest.mark.slow  # CI time: the same path as --fp8-param-gather's under EP (default, above)
def test_fp4_param_gather_moves_expert_tiles_over_their_expert_data_parallel_group(single_process):
    """NVFP4 experts under EP2 x DP2 with --fp4-param-gather: each expert weight's 16x16 tile amaxes are MAX-reduced
    over its expert-data-parallel group (its shard holders) and its packed E2M1 bytes gathered there, so the first
    step is the run without the flag bit for bit and the rest within round-off, with fewer gathered bytes."""
    tmp_path, _ = single_process
    ep2 = ["--expert-model-parallel-size", "2", *ZERO, "--fp4-format", "e2m1"]
    plain = _train(tmp_path, "ep2-nvfp4", 4, *ep2)
    gathered = _train(tmp_path, "ep2-fp4-param-gather", 4, *ep2, "--fp4-param-gather")
    assert gathered[0]["lm_loss"] == plain[0]["lm_loss"]
    for a, e in zip(gathered, plain):
        assert abs(a["lm_loss"] - e["lm_loss"]) <= 1e-5 * e["lm_loss"], (a, e)
    assert all(r["comm_bytes"]["dp_param_allgather"] < p["comm_bytes"]["dp_param_allgather"]
               for r, p in zip(gathered, plain))  # packed FP4 bytes on the wire


@pytest.mark.distributed
def test_an_ep2_checkpoint_resumes_bit_exact_and_loads_at_ep1_and_ep4(single_process):
    tmp_path, reference = single_process
    ep2 = ["--expert-model-parallel-size", "2", *ZERO]
    uninterrupted = _train(tmp_path, "ep2", 2, *ep2, "--save", str(tmp_path / "ckpt"), "--save-interval", "2")
    (tmp_path / "ckpt" / "latest_checkpointed_iteration.txt").write_text("2")  # back to iteration 2 (Megatron's way)
    load = ["--load", str(tmp_path / "ckpt")]
    same = _train(tmp_path, "resumed", 2, *ep2, *load)
    assert [r["lm_loss"] for r in same] == [r["lm_loss"] for r in uninterrupted[2:]]  # expert biases restored too
    assert [r["moe_tokens_per_expert"] for r in same] == [r["moe_tokens_per_expert"] for r in uninterrupted[2:]]
    _assert_same_run(_train(tmp_path, "ep1", 1, *load), reference[2:])
    _assert_same_run(_train(tmp_path, "ep4", 4, *load, "--expert-model-parallel-size", "4",
                            "--tensor-model-parallel-size", "2", "--sequence-parallel", *ZERO), reference[2:])


@pytest.mark.distributed
def test_expert_tensor_parallelism_built_from_scratch_reproduces_the_single_process_run_and_reshards(single_process):
    """ETP2 x EP2 on four ranks (TP = 1: each expert split over two data-parallel ranks, which gather each other's
    rows): from scratch it reproduces the one-process run, its rows travel as etp_* traffic, and its checkpoint (each
    expert weight and its ZeRO state saved as ETP pieces) loads whole at EP1 and continues the one-process run."""
    tmp_path, reference = single_process
    etp = ["--expert-tensor-parallel-size", "2", "--expert-model-parallel-size", "2", *ZERO]
    first = _train(tmp_path, "etp2-ep2", 4, *etp, "--save", str(tmp_path / "etp-ckpt"), "--exit-interval", "2")
    _assert_same_run(first, reference[:2])
    assert all(r["comm_bytes"]["etp_allgather"] > 0 and r["comm_bytes"]["etp_reduce_scatter"] > 0
               and r["comm_bytes"]["tp_sp_allgather"] == 0 for r in first)
    _assert_same_run(_train(tmp_path, "etp-ep1", 1, "--load", str(tmp_path / "etp-ckpt")), reference[2:])


@pytest.mark.distributed
@pytest.mark.slow  # CI time: an ETP expert's FP8 linears are the dense layers' sequence-parallel FP8 path (default)
@pytest.mark.parametrize("recipe", [["--fp8-format", "e4m3", "--fp8-recipe", "blockwise", "--fp8-power-of-2-scale"],
                                    ["--fp8-format", "hybrid", "--fp8-recipe", "delayed"],
                                    ["--fp8-format", "e4m3", "--fp8-recipe", "mxfp8"]],  # rows padded to 32 under ETP
                         ids=["blockwise", "delayed", "mxfp8"])
def test_fp8_experts_split_over_etp2_track_the_one_process_fp8_run(single_process, recipe):
    """ETP2 x EP2 in FP8: each expert's rows gathered as FP8 bytes over ETP, its shards' scales those of the whole
    weight; the losses follow the one-process run of the same recipe (the gathered rows group other tokens into
    wgrad's blocks: not bit for bit) and stay within 1% of fp32."""
    tmp_path, _ = single_process
    wide = ["--hidden-size", "128", "--moe-ffn-hidden-size", "128"]
    etp = _train(tmp_path, f"etp-{recipe[3]}", 4, *wide, *recipe, "--expert-tensor-parallel-size", "2",
                 "--expert-model-parallel-size", "2", *ZERO)
    one = _train(tmp_path, f"one-{recipe[3]}", 1, *wide, *recipe)
    fp32 = _train(tmp_path, "wide-fp32", 1, *wide)
    for a, e, r in zip(etp, one, fp32):
        assert abs(a["lm_loss"] - e["lm_loss"]) <= 2e-3 * e["lm_loss"], (a, e)
        assert abs(a["grad_norm"] - e["grad_norm"]) <= 0.03 * e["grad_norm"], (a, e)
        assert abs(a["lm_loss"] - r["lm_loss"]) <= 0.01 * r["lm_loss"], (a, r)
    assert all(r["comm_bytes"]["etp_allgather"] > 0 for r in etp)


@pytest.mark.distributed
def test_the_numerics_report_draws_each_moe_layers_expert_load(single_process):
    tmp_path, run = single_process
    result = subprocess.run([sys.executable, "tools/fp8_report.py", str(tmp_path / "one"), "--output",
                             str(tmp_path / "report")], cwd=REPO_ROOT, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    report = (tmp_path / "report" / "report.md").read_text()
    assert "## Expert load" in report and (tmp_path / "report" / "expert_load_one.png").stat().st_size > 0
    last = run[-1]["moe_tokens_per_expert"]
    for layer, load in last.items():  # the table's max/mean of the last window, from the run's own counts
        assert f"| one | {layer} | {max(load) / (sum(load) / len(load)):.3f} |" in report
