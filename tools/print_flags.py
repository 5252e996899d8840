"""Print every flag of the training entry (`megafp8.pretrain`) by group, as markdown tables: flag,
accepted values, default and the parser's help, straight from megafp8.training.arguments.build_parser
(the one source of `--help` and of docs/training.md's flag tables, which tests/test_training_docs.py checks).

    python tools/print_flags.py                  # all groups
    python tools/print_flags.py --group "precision and FP8"
    python tools/print_flags.py --megatron       # Megatron-LM's flags / refused / megafp8's own (docs/training.md)
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


def megatron_groups() -> str:
    """Every flag megafp8 knows in three tables: Megatron-LM's with its meaning (refused values named), Megatron-LM's
    refused outright (with the reason), megafp8's own (docs/training.md "Megatron-LM's flags" embeds this output)."""
    from megafp8.training.megatron_flags import DEFAULTS_THAT_DIFFER, MEGAFP8_ONLY, REFUSED_FLAGS, REFUSED_VALUES

    actions = [a for a in build_parser()._actions if a.dest != "help"]
    same = [a for a in actions if a.option_strings[0] not in MEGAFP8_ONLY | REFUSED_FLAGS.keys()]

    def note(flag: str) -> str:
        parts = [f"refused: {REFUSED_VALUES[flag]}"] if flag in REFUSED_VALUES else []
        parts += [f"default differs: {DEFAULTS_THAT_DIFFER[flag]}"] if flag in DEFAULTS_THAT_DIFFER else []
        return "; ".join(parts)

    lines = ["#### Same meaning as in Megatron-LM, defaults included", "",
             "| flag | default | notes |", "|---|---|---|"]
    lines += [f"| `{a.option_strings[0]}` | {_default(a)} | {note(a.option_strings[0])} |" for a in same]
    lines += ["", "#### Megatron-LM's, refused with the reason", "", "| flag | why |", "|---|---|"]
    lines += [f"| `{flag}` | {why} |" for flag, why in REFUSED_FLAGS.items()]
    lines += ["", "#### megafp8's own (not in Megatron-LM)", "", "| flag |", "|---|"]
    lines += [f"| `{a.option_strings[0]}` |" for a in actions if a.option_strings[0] in MEGAFP8_ONLY]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--group", default=None, help="print only this group (its title in --help)")
    parser.add_argument("--megatron", action="store_true",
                        help="print the flags as Megatron-LM's (same meaning) / Megatron-LM's refused / megafp8's own")
    args = parser.parse_args(argv)
    if args.megatron:
        print(megatron_groups(), end="")
        return 0
    groups = flag_groups()
    if args.group is not None:
        if args.group not in groups:
            parser.error(f"--group {args.group!r} is not one of: {', '.join(groups)}")
        groups = {args.group: groups[args.group]}
    print(markdown(groups))
    return 0


if __name__ == "__main__":
    sys.exit(main())
