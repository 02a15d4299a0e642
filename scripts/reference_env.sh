#!/usr/bin/env bash
# Creates .venv-ref: Python 3.11 with torch (CPU) and transformers, the independent reference that
# tests/test_hf_reference.py checks meshkit's Hugging Face import and export against.
# torch is installed from a CPU wheel on this machine's disk only (never from an index: that pulls a
# multi-GB CUDA build); set MESHKIT_TORCH_WHEEL to its path where it lies elsewhere.
# Idempotent: does nothing when .venv-ref already matches this script. Cost: about 2.5 min and 1.1 GB once.
set -euo pipefail
cd "$(dirname "$0")/.."

venv=.venv-ref
stamp="$venv/.meshkit-stamp"
want=$(sha256sum scripts/reference_env.sh | cut -d' ' -f1)
if [ -x "$venv/bin/python" ] && [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ]; then
  exit 0
fi
wheel=${MESHKIT_TORCH_WHEEL:-$(ls /opt/wheels/torch-2.13.0+cpu-cp311-*.whl 2>/dev/null | head -1)}
if [ -z "$wheel" ] || [ ! -f "$wheel" ]; then
  echo "error: no torch 2.13.0+cpu wheel for Python 3.11 found (looked in /opt/wheels): set MESHKIT_TORCH_WHEEL=/path/to/torch-2.13.0+cpu-cp311-...whl" >&2
  exit 2
fi
py=""
for c in python3.11 "$(command -v pyenv >/dev/null 2>&1 && echo "$(pyenv root)/versions/3.11"*/bin/python3)" \
         "${PYENV_ROOT:-$HOME/.pyenv}"/versions/3.11*/bin/python3; do
  [ -n "$c" ] && command -v "$c" >/dev/null 2>&1 && { py=$(command -v "$c"); break; }
done
if [ -z "$py" ]; then
  echo "error: the reference needs Python 3.11 (torch's CPU wheel is cp311): install one, e.g. 'pyenv install 3.11'" >&2
  exit 2
fi
echo "meshkit reference: $py with $(basename "$wheel") and transformers 4.57.6"
rm -rf "$venv"
"$py" -m venv "$venv"
"$venv/bin/python" -m pip install --quiet --disable-pip-version-check "$wheel" transformers==4.57.6
echo "$want" > "$stamp"
echo "meshkit reference: done ($venv/bin/python)"
