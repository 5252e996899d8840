"""tools/bench/bench_pipeline_bubble.py's replay against the closed forms: a GPipe-style 1F1B order at unit costs
idles (PP - 1) / (m + PP - 1) on every rank (F=1, full backward=2), and an order it cannot run is refused."""
import os
import sys

import pytest

from data_fixtures import REPO_ROOT

sys.path.insert(0, os.path.join(REPO_ROOT, "tools", "bench"))
from bench_pipeline_bubble import UNIT, replay  # noqa: E402


def _one_f_one_b(pp: int, m: int) -> list[list[tuple]]:
    orders = []
    for rank in range(pp):
        warmup = min(pp - 1 - rank, m)
        order = [("F", rank, i) for i in range(warmup)]
        for i in range(m - warmup):
            order += [("F", rank, warmup + i), ("BW", rank, i)]
        order += [("BW", rank, i) for i in range(m - warmup, m)]
        orders.append(order)
    return orders


@pytest.mark.parametrize("pp,m", [(2, 4), (4, 8)])
def test_1f1b_unit_cost_bubble_is_the_closed_form(pp, m):
    idle = replay(_one_f_one_b(pp, m), lambda kind, stage: UNIT[kind])
    assert idle == pytest.approx([(pp - 1) / (m + pp - 1)] * pp)


def test_backward_before_its_forward_is_refused():
    with pytest.raises(RuntimeError, match="deadlocked"):
        replay([[("BW", 0, 0), ("F", 0, 0)]], lambda kind, stage: 1.0)
