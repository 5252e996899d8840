"""megafp8.pretrain with the grouped FP8 GEMM calls counted: each rank writes its counts to
``<--log-dir>/grouped_gemm_calls.<rank>.json`` when training returns (tests/test_moe_training.py: the grouped path ran).
"""
import json
import os
import sys
from pathlib import Path

import megafp8.fp8.grouped_linear_function as grouped
import megafp8.training.run as training

counts = {"grouped_fp8_gemm": 0, "grouped_fp8_wgrad": 0}
for name in counts:
    def counted(*args, real=getattr(grouped, name), name=name, **kwargs):
        counts[name] += 1
        return real(*args, **kwargs)
    setattr(grouped, name, counted)


def run_and_write_counts(args, *rest):
    status = real_run(args, *rest)  # megafp8.pretrain leaves with os._exit after it: no atexit
    (Path(args.log_dir) / f"grouped_gemm_calls.{os.environ.get('RANK', '0')}.json").write_text(json.dumps(counts))
    return status


real_run, training.run = training.run, run_and_write_counts

from megafp8 import pretrain  # noqa: E402

sys.exit(pretrain.main())
