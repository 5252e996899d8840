#!/usr/bin/env bash
# Side venv with another Triton release (default 3.6.0, what torch 2.11 + CUDA 13 pins on the GPU image) for the
# offline sm_90a audit: only triton is installed into it; torch, numpy and the editable megafp8 come from the base
# interpreter's site-packages through a .pth file processed *after* the venv's own site-packages, so its triton
# wins over the base venv's. Compile-only on CPU (kernel_audit.py's stand-in driver); nothing launches.
#
#   bash tools/bench/triton_side_venv.sh [--version 3.6.0] [--dir .venv-triton36] [--python PY]
#   .venv-triton36/bin/python tools/bench/kernel_audit.py --quick   # or: kernel_audit.py --quick --triton 3.6.0
#
# Idempotent: an existing venv that already imports the requested triton is kept. Prints the venv's python; exits 3
# when the triton wheel cannot be downloaded (registry unreachable), 1 on any other failure.
set -euo pipefail

repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
version="3.6.0"
dir=""
base_python="${repo}/.venv/bin/python"
[[ -x "$base_python" ]] || base_python="$(command -v python3)"
while [[ $# -gt 0 ]]; do
  case "$1" in
    --version) version="$2"; shift 2 ;;
    --dir) dir="$2"; shift 2 ;;
    --python) base_python="$2"; shift 2 ;;
    -h|--help) sed -n '2,11p' "$0"; exit 0 ;;
    *) echo "triton_side_venv.sh: unknown argument $1" >&2; exit 1 ;;
  esac
done
if [[ -z "$dir" ]]; then
  short="$(echo "$version" | cut -d. -f1,2 | tr -d .)"  # 3.6.0 -> 36
  dir="${repo}/.venv-triton${short}"
fi
py="${dir}/bin/python"

ready() {  # the venv imports the requested triton, and torch through the base site-packages
  [[ -x "$py" ]] && [[ "$("$py" -c 'import torch, triton; print(triton.__version__)' 2>/dev/null)" == "$version" ]]
}
if ready; then
  echo "$py"
  exit 0
fi
# One maker at a time (e.g. two test processes): the second waits, then finds the venv ready.
mkdir -p "$(dirname "$dir")"
exec 9>"${dir}.lock"
flock 9
if ready; then
  echo "$py"
  exit 0
fi

# The base interpreter's site-packages (torch, numpy, the editable megafp8_kernels). A venv made by a venv's python
# is based on the same Python installation, so torch's compiled extensions load in it.
base_site="$("$base_python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"
"$base_python" -m venv --clear "$dir"
side_site="$("$py" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"
# addsitedir also runs the base site-packages' own .pth files (the editable megafp8 finder); appended to sys.path,
# after this venv's site-packages, so the triton installed here is the one imported.
echo "import site; site.addsitedir('${base_site}')" > "${side_site}/_megafp8_base_site.pth"

# --no-deps: triton's wheel needs nothing else at compile time, and torch must stay the base venv's. Few retries and a
# short timeout, so that an unreachable registry fails in seconds rather than minutes.
if ! "$py" -m pip install --quiet --no-deps --retries 2 --timeout 60 "triton==${version}" 2>"${dir}/pip-error.log"; then
  cat "${dir}/pip-error.log" >&2
  unreachable="NewConnectionError|Failed to establish|name resolution|Name or service not known|Network is unreachable"
  unreachable+="|timed out|Max retries exceeded|ProxyError|ConnectTimeout|ReadTimeout|SSLError"
  if grep -qiE "$unreachable" "${dir}/pip-error.log"; then
    rm -rf "$dir"  # unreachable registry: nothing half-made is left to be mistaken for a venv
    exit 3
  fi
  exit 1
fi
got="$("$py" -c 'import triton, torch; print(triton.__version__)')"
if [[ "$got" != "$version" ]]; then
  echo "triton_side_venv.sh: the venv imports triton ${got}, not ${version}" >&2
  exit 1
fi
echo "$py"
