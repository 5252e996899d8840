"""Embedded corpus: real text already on every machine (the Python standard library's sources) as jsonl.

The quickstart and the tests use it so that nothing has to be downloaded. Files are visited in sorted
order and each becomes one document ``{"text": ..., "path": <path relative to the stdlib>}``, so the
corpus is identical for a given Python build.
"""
from __future__ import annotations

import ast
import io
import json
import os
import sysconfig
import tokenize
from dataclasses import dataclass
from typing import Iterator

from tqdm import tqdm

CONTENT_KINDS = ("source", "docstrings")
# Third-party packages installed into the interpreter are not "the standard library" and vary by machine.
_SKIPPED_DIRS = {"site-packages", "dist-packages", "__pycache__"}


@dataclass
class CorpusStats:
    documents: int = 0
    bytes: int = 0
    skipped_undecodable: int = 0
    skipped_empty: int = 0


def stdlib_root() -> str:
    return sysconfig.get_paths()["stdlib"]


def iter_python_files(root: str) -> Iterator[str]:
    """Relative paths of the ``.py`` files under ``root``, in a deterministic (sorted) order."""
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if d not in _SKIPPED_DIRS)
        for name in sorted(filenames):
            if name.endswith(".py"):
                yield os.path.relpath(os.path.join(dirpath, name), root)


def read_python_source(path: str) -> str | None:
    """Decode a source file honouring its PEP 263 coding line; None if it cannot be decoded."""
    with open(path, "rb") as f:
        data = f.read()
    try:
        encoding, _ = tokenize.detect_encoding(io.BytesIO(data).readline)
        return data.decode(encoding)
    except (SyntaxError, UnicodeDecodeError, LookupError):
        # The stdlib's test suite ships deliberately mis-encoded files; they are not text to learn from.
        return None


def docstrings_of(source: str) -> str:
    """The module, class and function docstrings of a source file, separated by blank lines."""
    try:
        tree = ast.parse(source)
    except (SyntaxError, ValueError):
        return ""
    nodes = [tree] + [
        n for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef))
    ]
    docs = (ast.get_docstring(n) for n in nodes)
    return "\n\n".join(d for d in docs if d)


def build_corpus(
    output: str,
    content: str = "source",
    max_docs: int | None = None,
    max_bytes: int | None = None,
    root: str | None = None,
    progress: bool = True,
) -> CorpusStats:
    """Write the jsonl corpus to ``output`` (via a temporary name, renamed when complete)."""
    if content not in CONTENT_KINDS:
        raise ValueError(f"--content {content!r}: choose one of {', '.join(CONTENT_KINDS)}")
    root = root or stdlib_root()
    if not os.path.isdir(root):
        raise ValueError(f"--root {root}: not a directory")
    paths = list(iter_python_files(root))
    stats = CorpusStats()
    os.makedirs(os.path.dirname(os.path.abspath(output)), exist_ok=True)
    tmp = output + ".tmp"
    bar = tqdm(total=max_docs or len(paths), unit="doc", desc="corpus", disable=not progress)
    try:
        with open(tmp, "w", encoding="utf-8") as out:
            for rel in paths:
                if (max_docs is not None and stats.documents >= max_docs) or (
                    max_bytes is not None and stats.bytes >= max_bytes
                ):
                    break
                text = read_python_source(os.path.join(root, rel))
                if text is None:
                    stats.skipped_undecodable += 1
                    continue
                if content == "docstrings":
                    text = docstrings_of(text)
                if not text.strip():
                    stats.skipped_empty += 1
                    continue
                # ensure_ascii=False keeps the file readable and its byte count close to the text's.
                line = json.dumps({"text": text, "path": rel.replace(os.sep, "/")}, ensure_ascii=False)
                out.write(line + "\n")
                stats.documents += 1
                stats.bytes += len(text.encode("utf-8"))
                bar.update(1)
        os.replace(tmp, output)
    except BaseException:
        if os.path.exists(tmp):
            os.remove(tmp)
        raise
    finally:
        bar.close()
    return stats
