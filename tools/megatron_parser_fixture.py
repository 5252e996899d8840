"""Snapshot Megatron-LM's training flags (name, dest, default, choices, nargs) and its example launch scripts into
tests/fixtures/megatron_lm/, so the compatibility tests run offline against a named Megatron-LM commit.

    python tools/megatron_parser_fixture.py /path/to/Megatron-LM   # a checkout (or `git archive` of one)

Megatron's parser is imported from that tree (it needs torch; Python 3.12's typing.override is shimmed on 3.11).
"""
from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import typing
from pathlib import Path

FIXTURES = Path(__file__).resolve().parents[1] / "tests" / "fixtures" / "megatron_lm"
SCRIPTS = ("examples/llama/train_llama3_8b_h100_fp8.sh", "examples/gpt3/train_gpt3_175b_distributed.sh")


def _plain(value):
    """A default or choice as JSON: enums by name, tuples as lists, anything else exotic by repr."""
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    return getattr(value, "name", repr(value))


def megatron_flags(tree: Path) -> dict[str, dict]:
    sys.path.insert(0, str(tree))
    if not hasattr(typing, "override"):
        typing.override = lambda f: f
    from megatron.training.arguments import add_megatron_arguments

    parser = argparse.ArgumentParser(allow_abbrev=False)
    parser = add_megatron_arguments(parser) or parser
    flags = {}
    for action in parser._actions:
        for option in action.option_strings:
            if option.startswith("--") and option != "--help":
                flags[option] = {"dest": action.dest, "default": _plain(action.default), "nargs": _plain(action.nargs),
                                 "choices": _plain(action.choices) if action.choices is not None else None}
    return flags


def main() -> int:
    tree = Path(sys.argv[1]).resolve()
    commit = subprocess.run(["git", "-C", str(tree), "rev-parse", "HEAD"], capture_output=True, text=True).stdout.strip()
    if len(sys.argv) > 2:  # a `git archive` copy has no .git: name its commit
        commit = sys.argv[2]
    FIXTURES.mkdir(parents=True, exist_ok=True)
    record = {"megatron_lm_commit": commit, "flags": megatron_flags(tree)}
    (FIXTURES / "parser.json").write_text(json.dumps(record, indent=1, sort_keys=True) + "\n")
    for script in SCRIPTS:
        shutil.copyfile(tree / script, FIXTURES / Path(script).name)
    print(f"{len(record['flags'])} flags and {len(SCRIPTS)} scripts of Megatron-LM {commit} -> {FIXTURES}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
