"""setup.py's extras_require, read without running setup(): which packages `pip install -e ".[extra]"` brings."""
import ast
from pathlib import Path

SETUP = Path(__file__).resolve().parents[1] / "setup.py"


def extras_packages() -> dict[str, list[str]]:
    call = next(node for node in ast.walk(ast.parse(SETUP.read_text())) if isinstance(node, ast.Call)
                and getattr(node.func, "id", None) == "setup")
    extras = next(keyword.value for keyword in call.keywords if keyword.arg == "extras_require")
    return ast.literal_eval(extras)
