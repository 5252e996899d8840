"""docs/training.md's flag tables are tools/print_flags.py's output, i.e. the parser's own help strings (one
source for --help, print_flags and the docs), and tools/print_flags.py lists exactly the parser's flags (so a
flag added to megafp8/training/arguments.py without help, or a docs table left stale, fails here)."""
import re
import subprocess
import sys
from pathlib import Path

from megafp8.training.arguments import build_parser

REPO = Path(__file__).resolve().parents[1]


def _parser_flags() -> set[str]:
    return {a.option_strings[0] for a in build_parser()._actions if a.dest != "help"}


def test_training_md_flag_tables_are_the_parsers_help():
    sys.path.insert(0, str(REPO / "tools"))
    from print_flags import flag_groups, table

    text = (REPO / "docs" / "training.md").read_text()
    for title, actions in flag_groups().items():
        section = text[text.index(f"\n### {title}\n"):]
        start = section.index("| flag | values | default | what it does |")
        rows = section[start:].split("\n\n")[0].splitlines()
        assert rows == table(actions), (f"docs/training.md '### {title}' is not the parser's help: paste the output "
                                        f"of python tools/print_flags.py --group \"{title}\"")
    assert all(a.help for a in build_parser()._actions), "every flag needs one line of help"


def test_every_flag_is_described_in_training_md():
    text = (REPO / "docs" / "training.md").read_text()
    # A flag counts as described when it opens a table row (`| `--flag` |` or a row listing it with others).
    described = {flag for row in re.findall(r"^\| (`--[^|]*)\|", text, re.MULTILINE)
                 for flag in re.findall(r"`(--[a-z0-9-]+)`", row)}
    missing = sorted(_parser_flags() - described)
    assert not missing, f"flags of megafp8.training.arguments not described in docs/training.md: {missing}"
    assert not sorted(described - _parser_flags()), "docs/training.md describes flags the parser does not have"


def test_print_flags_lists_every_parser_flag_by_group():
    result = subprocess.run([sys.executable, "tools/print_flags.py"], cwd=REPO, capture_output=True, text=True,
                            timeout=60)
    assert result.returncode == 0, result.stderr
    listed = re.findall(r"^\| `(--[a-z0-9-]+)` \|", result.stdout, re.MULTILINE)
    assert sorted(listed) == sorted(_parser_flags())
    titles = re.findall(r"^### (.+)$", result.stdout, re.MULTILINE)
    assert titles == ["model", "parallelism", "precision and FP8", "optimizer and schedule", "training and data",
                      "checkpoints", "logging", "compile and CUDA graphs", "microscaling and FP4",
                      "mixture of experts", "suspicious steps (result checks and re-runs)",
                      "Megatron-LM implementation choices (accepted)"]
    assert "| `--fp8-recipe` | delayed \\| tensorwise \\| rowwise \\| static \\| blockwise \\| mxfp8 | `delayed` |" in \
        result.stdout
    assert "| `--no-fp8-saturation-guard` | switch |  | turn the saturation guard off" in result.stdout  # no "True"
    assert "| `--fp8-self-check` | switch |" in result.stdout
    bad = subprocess.run([sys.executable, "tools/print_flags.py", "--group", "nope"], cwd=REPO, capture_output=True,
                         text=True, timeout=60)
    assert bad.returncode == 2 and "--group 'nope' is not one of" in bad.stderr
