"""Who tunes the Triton FP8 GEMM: nobody by default (every rank of a job launches the audited, non-spilling config:
no per-rank tuning that could differ between TP peers or sync the device while NCCL work is in flight); the
benchmark and `--fp8-gemm-autotune` do, with results kept in Triton's cache for the next process."""
import inspect
import os

import pytest
import triton

from data_fixtures import small_corpus, sp_model, text_prefix  # noqa: F401 (fixtures)
from megafp8_kernels import gemm


@pytest.fixture
def compiled_launch(monkeypatch):
    """The launch-config choice as on a GPU (the interpreter always takes its own small config)."""
    monkeypatch.setattr(gemm, "_interpreting", lambda: False)


def test_default_launch_is_the_audited_config_without_tuning(compiled_launch, monkeypatch):
    monkeypatch.delenv(gemm.AUTOTUNE_ENV_VAR, raising=False)
    assert gemm.default_config(hopper=True) is gemm.SM90_DEFAULT_CONFIG
    assert gemm.default_config(hopper=False) is gemm.FALLBACK_DEFAULT_CONFIG
    monkeypatch.setenv(gemm.AUTOTUNE_ENV_VAR, "0")
    assert gemm.default_config(hopper=True) is gemm.SM90_DEFAULT_CONFIG


def test_tuning_on_request_keeps_its_results_for_the_next_process(compiled_launch, monkeypatch):
    monkeypatch.setenv(gemm.AUTOTUNE_ENV_VAR, "1")
    assert gemm.default_config(hopper=True) is None  # None: the autotuner picks
    gemm._autotuned_kernel.cache_clear()
    tuner = gemm._autotuned_kernel(True)
    assert isinstance(tuner, triton.runtime.autotuner.Autotuner)
    assert [c.kwargs for c in tuner.configs] == [c.kwargs for c in gemm.SM90_CONFIGS]
    if "cache_results" in inspect.signature(triton.autotune).parameters:  # Triton >= 3.2 (3.6 and 3.9 here)
        assert gemm.tuning_cache_options() == {"cache_results": True}
        # Triton keeps no disk cache for the interpreter (this CPU run); on a GPU the tuner then writes one.
        assert tuner.cache_results is (os.environ.get("TRITON_INTERPRET") != "1")
    gemm._autotuned_kernel.cache_clear()


def test_the_benchmark_tunes_and_the_training_flag_asks_for_it(text_prefix, monkeypatch):
    import importlib.util
    from pathlib import Path

    from megafp8 import pretrain
    from megafp8.training.megatron_flags import LLAMA_FLAGS

    monkeypatch.delenv(gemm.AUTOTUNE_ENV_VAR, raising=False)
    bench = Path(__file__).resolve().parents[1] / "tools" / "bench" / "bench_gemm.py"
    spec = importlib.util.spec_from_file_location("bench_gemm_module", bench)
    spec.loader.exec_module(importlib.util.module_from_spec(spec))
    assert os.environ[gemm.AUTOTUNE_ENV_VAR] == "1"

    prefix, tokenizer = text_prefix
    flags = [*LLAMA_FLAGS, "--num-layers", "1", "--hidden-size", "64", "--num-attention-heads", "4",
             "--seq-length", "32", "--micro-batch-size", "2", "--global-batch-size", "2", "--lr", "1e-3",
             "--train-iters", "1", "--eval-iters", "0", "--fp8-format", "hybrid", "--data-path", prefix,
             "--tokenizer-model", tokenizer]
    monkeypatch.delenv(gemm.AUTOTUNE_ENV_VAR)
    assert pretrain.main(flags) == 0
    assert gemm.AUTOTUNE_ENV_VAR not in os.environ  # a plain run launches the default config
    assert pretrain.main([*flags, "--fp8-gemm-autotune"]) == 0
    assert os.environ[gemm.AUTOTUNE_ENV_VAR] == "1"
