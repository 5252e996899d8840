"""Every ```python and ```bash block of README.md and docs/*.md runs, so the docs cannot rot.

A document is one script: its blocks run in order in one scratch directory (where `tools/`, `examples/`,
`megafp8/` and `kernels/` are links into the repository), so a later block may use what an earlier one
wrote. Blocks without a language (sample output, pictures) are not run. A block that cannot run here
(a GPU benchmark, a multi-node launch, the install commands CI itself runs) is preceded by a line
`<!-- doc-test: skip REASON -->`, and the reason is part of the document's source.
"""
from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
DOCUMENTS = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
BLOCK = re.compile(r"(?P<marker><!-- doc-test: skip [^>]+-->\s*\n)?^```(?P<lang>python|bash)\n(?P<code>.*?)^```",
                   re.MULTILINE | re.DOTALL)
LINKED = ("tools", "examples", "megafp8", "kernels")


def runnable_blocks(document: Path) -> list[tuple[str, str]]:
    return [(m["lang"], m["code"]) for m in BLOCK.finditer(document.read_text()) if not m["marker"]]


def _run(lang: str, code: str, cwd: Path, document: Path) -> None:
    command = [sys.executable, "-c", code] if lang == "python" else ["bash", "-euo", "pipefail", "-c", code]
    env = {**os.environ, "PYTHONPATH": str(REPO), "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}"}
    result = subprocess.run(command, cwd=cwd, env=env, capture_output=True, text=True, timeout=900)
    assert result.returncode == 0, (f"{document.name}: this {lang} block failed (exit {result.returncode}):\n{code}\n"
                                    f"--- stdout ---\n{result.stdout[-3000:]}\n--- stderr ---\n{result.stderr[-3000:]}")


@pytest.mark.parametrize("document", [d for d in DOCUMENTS if runnable_blocks(d)], ids=lambda d: d.name)
def test_document_code_blocks_run(document: Path, tmp_path: Path):
    for name in LINKED:
        (tmp_path / name).symlink_to(REPO / name)
    for lang, code in runnable_blocks(document):
        _run(lang, code, tmp_path, document)


def test_skip_markers_give_a_reason():
    for document in DOCUMENTS:
        for marker in re.findall(r"<!-- doc-test: skip(.*?)-->", document.read_text()):
            assert marker.strip(), f"{document.name}: a doc-test skip marker without a reason"
