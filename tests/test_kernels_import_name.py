"""The kernel folder never shadows PyPI's `kernels`: a Python started at the repository root (python -c, python -m,
a tool that puts the checkout on sys.path) gets the installed `kernels` that transformers imports, builds an HF Llama,
and still imports megafp8_kernels; and CI's test command is the README's, installing pinned peers."""
import re
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]

BOTH_PACKAGES = """
import os, sys
import transformers
from transformers import LlamaConfig, LlamaForCausalLM
import kernels, megafp8_kernels
assert "site-packages" in kernels.__file__, kernels.__file__
assert hasattr(kernels, "CUDAProperties"), "not PyPI's kernels"
assert os.path.dirname(megafp8_kernels.__file__) == os.path.join(sys.argv[1], "kernels"), megafp8_kernels.__file__
model = LlamaForCausalLM(LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                                     num_key_value_heads=2, vocab_size=64))
import torch
x = torch.randn(4, 128)
q = megafp8_kernels.quantize(x, torch.float8_e4m3fn, "tensorwise")
print("ok", type(model).__name__, q.data.dtype)
"""


# The other ways of starting Python need only the name resolution (the full check above runs once: CI time).
RESOLUTION = """
import os, sys
import kernels, megafp8_kernels
assert "site-packages" in kernels.__file__, kernels.__file__
assert hasattr(kernels, "CUDAProperties"), "not PyPI's kernels"
assert os.path.dirname(megafp8_kernels.__file__) == os.path.join(sys.argv[1], "kernels"), megafp8_kernels.__file__
print("ok")
"""


def _run(args, cwd):
    return subprocess.run(args, capture_output=True, text=True, cwd=cwd, timeout=300)


@pytest.fixture(scope="module")
def pypi_kernels():
    return pytest.importorskip("kernels", reason="PyPI's kernels package is not installed")


def test_python_c_at_repo_root_gets_pypi_kernels(pypi_kernels):
    result = _run([sys.executable, "-c", BOTH_PACKAGES, str(REPO)], cwd=REPO)
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.split()[:2] == ["ok", "LlamaForCausalLM"]


def test_python_m_at_repo_root_gets_pypi_kernels(pypi_kernels, tmp_path):
    # python -m puts the working directory first on sys.path, as `python -m pytest` does.
    (tmp_path / "both_packages.py").write_text(RESOLUTION)
    result = _run([sys.executable, "-c", f"import runpy, sys; sys.path.insert(0, {str(REPO)!r}); "
                   f"sys.argv = ['x', {str(REPO)!r}]; runpy.run_path({str(tmp_path / 'both_packages.py')!r})"],
                  cwd=REPO)
    assert result.returncode == 0, result.stderr[-3000:]


def test_a_tool_that_puts_the_checkout_first_gets_pypi_kernels(pypi_kernels, tmp_path):
    script = tmp_path / "tool.py"
    script.write_text(f"import sys\nsys.path.insert(0, {str(REPO)!r})\n" + RESOLUTION)
    result = _run([sys.executable, str(script), str(REPO)], cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]


def test_bare_kernels_without_pypi_is_not_found(tmp_path):
    # -S: no site-packages, so no installed `kernels`; the folder must not stand in for it.
    code = ("import sys\ntry:\n    import kernels\nexcept ModuleNotFoundError as e:\n    print('missing', e.name)\n"
            "else:\n    print('found', kernels.__file__)\nprint('kernels' in sys.modules)")
    result = _run([sys.executable, "-S", "-c", code], cwd=REPO)
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == ["missing", "kernels", "False"]


def test_ci_runs_the_readme_test_command_with_pinned_peers():
    readme = (REPO / "README.md").read_text()
    command = re.search(r"\*\*Run the tests\*\*.*?```bash\n(.*?)\n```", readme, re.S).group(1)
    assert command in (REPO / ".ci" / "run").read_text().splitlines()
    assert "-c tests/constraints.txt" in command
    pins = dict(line.split("==") for line in (REPO / "tests" / "constraints.txt").read_text().splitlines()
                if line and not line.startswith("#"))
    for peer in ("transformers", "megatron-core", "torchao", "safetensors", "sentencepiece", "kernels", "numpy"):
        assert peer in pins, peer


def test_a_link_to_the_kernel_folder_gets_pypi_kernels(pypi_kernels, tmp_path):
    # The docs test runs its blocks in a scratch directory whose kernels/ is a link into the repository.
    (tmp_path / "kernels").symlink_to(REPO / "kernels")
    result = _run([sys.executable, "-c", RESOLUTION, str(REPO)], cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
