"""FP8 telemetry at the cast's cost: one Fp8Linear forward + backward (CPU, reference path) dispatches at most 2
more aten ops per quantized tensor with telemetry on than off (issue 19's budget; measured: 0, the counts come
out of megafp8::quantize itself), for every recipe, and no host read. Figures: tools/bench/bench_fp8_telemetry.py."""
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tools" / "bench"))
import bench_fp8_telemetry as bench  # noqa: E402

BUDGET_PER_TENSOR = 2


@pytest.mark.parametrize("recipe", list(bench.RECIPES))
def test_telemetry_adds_at_most_two_ops_per_quantized_tensor(recipe):
    off = bench.linear_ops(recipe, telemetry=False, tokens=64, features=128)
    on = bench.linear_ops(recipe, telemetry=True, tokens=64, features=128)
    assert on.quantizes == off.quantizes == 3  # input, weight, output gradient
    assert on.ops - off.ops <= BUDGET_PER_TENSOR * on.quantizes, (off.ops, on.ops)
    assert on.host_reads == 0
