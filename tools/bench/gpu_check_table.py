"""gpu_check.sh's one table: each step's status and time against its budget, then the benchmark tables, in $OUT/summary.md.

    python tools/bench/gpu_check_table.py OUT_DIR
    python tools/bench/gpu_check_table.py --shard-seconds OUT_DIR   # the precompile shards' seconds vs the budget

Reads OUT_DIR/steps.tsv (one `name<TAB>exit status<TAB>seconds<TAB>budget seconds<TAB>output file[<TAB>kernels
compiled]` line per step, written by gpu_check.sh as each step ends) and appends the markdown tables found in each
step's output. --shard-seconds reads the precompile step's audit<I>.json reports (kernel_audit.py --json).
"""
from __future__ import annotations

import json
import sys
from pathlib import Path


def status(rc: int) -> str:
    return {0: "passed", 124: "timed out", 137: "killed (timeout or memory)"}.get(rc, f"failed (exit {rc})")


def summary(out_dir: Path) -> str:
    steps = [line.split("\t") for line in (out_dir / "steps.tsv").read_text().splitlines() if line.strip()]
    compiled = any(len(s) > 5 for s in steps)  # gpu_check.sh counts each step's new cubins
    lines = ["| step | result | seconds | budget s | output |" + (" kernels compiled |" if compiled else ""),
             "|---|---|---|---|---|" + ("---|" if compiled else "")]
    for name, rc, seconds, budget, output, *count in steps:
        lines.append(f"| {name} | {status(int(rc))} | {seconds} | {budget} | {output} |"
                     + (f" {count[0] if count else ''} |" if compiled else ""))
    total = sum(int(s[2]) for s in steps)
    lines.append(f"| total | {sum(int(s[1]) == 0 for s in steps)}/{len(steps)} passed | {total} | "
                 f"{sum(int(s[3]) for s in steps)} | |" + (f" {sum(int(s[5]) for s in steps if len(s) > 5)} |"
                                                           if compiled else ""))
    for name, _, _, _, output, *_ in steps:
        path = out_dir / output
        table = [line for line in path.read_text(errors="replace").splitlines() if line.startswith("|")] \
            if path.is_file() else []
        if table:
            lines += ["", f"### {name}", "", *table]
    return "\n".join(lines) + "\n"


def shard_seconds(out_dir: Path) -> str:
    """One row per precompile shard (audit<I>.json): its rows, failures and known spills, wall seconds and CPU seconds
    (what one dedicated core takes: the GPU host gives each of the 8 shards its own)."""
    lines = ["| shard | rows | failures | known spills | wall seconds | CPU seconds |", "|---|---|---|---|---|---|"]
    for path in sorted(out_dir.glob("audit*.json")):
        report = json.loads(path.read_text())
        lines.append(f"| {report.get('shard', path.stem)} | {len(report['rows'])} | {len(report['failures'])} | "
                     f"{len(report.get('known_spills', []))} | {report.get('wall_seconds', 'n/a')} | "
                     f"{report.get('cpu_seconds', 'n/a')} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str]) -> int:
    shards = argv[:1] == ["--shard-seconds"]
    argv = argv[1:] if shards else argv
    if len(argv) != 1 or not (Path(argv[0]) / "steps.tsv").is_file():
        print("usage: python tools/bench/gpu_check_table.py [--shard-seconds] OUT_DIR (a folder holding gpu_check.sh's "
              "steps.tsv)", file=sys.stderr)
        return 2
    if shards:
        print(shard_seconds(Path(argv[0])), end="")
        return 0
    text = summary(Path(argv[0]))
    (Path(argv[0]) / "summary.md").write_text(text)
    print(text, end="")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
