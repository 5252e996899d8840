"""FP8 bits frozen: a 3D FP8 run (TP2 x PP2 x DP2 + SP, ZeRO with FP8 param gather and FP8 grad reduce) through
the real entry gives the golden losses, grad norms and checkpoint bytes of tests/golden/fp8_3d_fingerprint.json,
bit for bit (tools/fp8_bits_fingerprint.py says how the golden was made and how to regenerate it on purpose).

A failure means a change moved FP8 numerics; the message names the first differing key (a recipe's iteration
loss or grad norm, or a checkpoint tensor). A refactor must not do that; a deliberate numerics change
regenerates the golden with `--write-golden` and says so. The blockwise recipe (the most code paths: 1x128 and
128x128 scales, K of one and of two scale groups) runs by default; every other --fp8-recipe choice and the
default recipe run as slow tests."""
from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

from data_fixtures import REPO_ROOT

_spec = importlib.util.spec_from_file_location("fp8_bits_fingerprint", Path(REPO_ROOT) / "tools" / "fp8_bits_fingerprint.py")
fingerprint_tool = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(fingerprint_tool)

SLOW_RECIPES = [recipe for recipe in fingerprint_tool.all_recipes() if recipe != "blockwise"]


def _assert_frozen(recipe: str, work_dir: Path) -> None:
    golden = json.loads(fingerprint_tool.GOLDEN.read_text())[recipe]
    fresh = fingerprint_tool.fingerprint(recipe, work_dir)
    difference = fingerprint_tool.first_difference(golden, fresh)
    assert difference is None, f"{recipe}: FP8 bits changed at {difference}"


def test_blockwise_3d_run_is_bit_identical_to_the_golden(tmp_path):
    _assert_frozen("blockwise", tmp_path)


@pytest.mark.slow
@pytest.mark.parametrize("recipe", SLOW_RECIPES)
def test_every_recipe_3d_run_is_bit_identical_to_the_golden(recipe, tmp_path):
    _assert_frozen(recipe, tmp_path)


def test_the_golden_covers_every_recipe_and_the_comparison_names_the_first_difference():
    golden = json.loads(fingerprint_tool.GOLDEN.read_text())
    assert sorted(golden) == sorted(fingerprint_tool.all_recipes())
    assert golden["default"] == golden["delayed"]  # --fp8-recipe's default is delayed
    changed = json.loads(json.dumps(golden["blockwise"]))
    nudged = float.fromhex(changed["iterations"]["2"]["grad_norm"]) + 1e-12
    changed["iterations"]["2"]["grad_norm"] = nudged.hex()
    assert fingerprint_tool.first_difference(golden["blockwise"], changed).startswith("iterations/2/grad_norm: ")
