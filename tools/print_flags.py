"""Print every flag of the training entry (`megafp8.pretrain`) by group, as markdown tables: flag,
accepted values, default and the parser's help, straight from megafp8.training.arguments.build_parser
(the one source of `--help` and of docs/training.md's flag tables, which tests/test_training_docs.py checks).

    python tools/print_flags.py                  # all groups
    python tools/print_flags.py --group "precision and FP8"
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from megafp8.training.arguments import build_parser  # noqa: E402


def flag_groups() -> dict[str, list[argparse.Action]]:
    """{group title: its flags}, in --help order (argparse's own -h left out)."""
    return {group.title: [a for a in group._group_actions if a.dest != "help"]
            for group in build_parser()._action_groups if any(a.dest != "help" for a in group._group_actions)}


def _values(action: argparse.Action) -> str:
    if action.choices:
        return " \\| ".join(str(c) for c in action.choices)
    if action.nargs == 0:
        return "switch"
    kind = getattr(action.type, "__name__", "str")
    return f"{kind} ..." if action.nargs == "+" else kind + (" (optional)" if action.nargs == "?" else "")


def _default(action: argparse.Action) -> str:
    # A switch's default is "off" by construction (for --no-... flags the stored True would read backwards);
    # None means derived from other flags, which the help says.
    if action.nargs == 0 or action.default is None:
        return ""
    return f"`{action.default}`"


def table(actions: list[argparse.Action]) -> list[str]:
    """One group's flags as a markdown table (docs/training.md embeds these tables verbatim)."""
    return ["| flag | values | default | what it does |", "|---|---|---|---|"] + [
        f"| `{a.option_strings[0]}` | {_values(a)} | {_default(a)} | {a.help or ''} |" for a in actions]


def markdown(groups: dict[str, list[argparse.Action]]) -> str:
    lines = []
    for title, actions in groups.items():
        lines += [f"### {title}", "", *table(actions), ""]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--group", default=None, help="print only this group (its title in --help)")
    args = parser.parse_args(argv)
    groups = flag_groups()
    if args.group is not None:
        if args.group not in groups:
            parser.error(f"--group {args.group!r} is not one of: {', '.join(groups)}")
        groups = {args.group: groups[args.group]}
    print(markdown(groups))
    return 0


if __name__ == "__main__":
    sys.exit(main())
