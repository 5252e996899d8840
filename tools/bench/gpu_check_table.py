"""gpu_check.sh's one table: each step's status and time against its budget, then the benchmark tables, in $OUT/summary.md.

    python tools/bench/gpu_check_table.py OUT_DIR

Reads OUT_DIR/steps.tsv (one `name<TAB>exit status<TAB>seconds<TAB>budget seconds<TAB>output file` line per
step, written by gpu_check.sh as each step ends) and appends the markdown tables found in each step's output.
"""
from __future__ import annotations

import sys
from pathlib import Path


def status(rc: int) -> str:
    return {0: "passed", 124: "timed out", 137: "killed (timeout or memory)"}.get(rc, f"failed (exit {rc})")


def summary(out_dir: Path) -> str:
    steps = [line.split("\t") for line in (out_dir / "steps.tsv").read_text().splitlines() if line.strip()]
    lines = ["| step | result | seconds | budget s | output |", "|---|---|---|---|---|"]
    for name, rc, seconds, budget, output in steps:
        lines.append(f"| {name} | {status(int(rc))} | {seconds} | {budget} | {output} |")
    total = sum(int(s[2]) for s in steps)
    lines.append(f"| total | {sum(int(s[1]) == 0 for s in steps)}/{len(steps)} passed | {total} | "
                 f"{sum(int(s[3]) for s in steps)} | |")
    for name, _, _, _, output in steps:
        path = out_dir / output
        table = [line for line in path.read_text(errors="replace").splitlines() if line.startswith("|")] \
            if path.is_file() else []
        if table:
            lines += ["", f"### {name}", "", *table]
    return "\n".join(lines) + "\n"


def main(argv: list[str]) -> int:
    if len(argv) != 1 or not (Path(argv[0]) / "steps.tsv").is_file():
        print("usage: python tools/bench/gpu_check_table.py OUT_DIR (a folder holding gpu_check.sh's steps.tsv)",
              file=sys.stderr)
        return 2
    text = summary(Path(argv[0]))
    (Path(argv[0]) / "summary.md").write_text(text)
    print(text, end="")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
