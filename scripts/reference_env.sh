#!/usr/bin/env bash
# Creates the independent references that the Hugging Face tests (pytest -m reference) check meshkit's
# import and export against: Python 3.11 with torch (CPU) and one transformers release each,
#   .venv-ref   transformers 4.57.6 (the last 4.x), and TRL for the preference references
#               (tests/test_dpo_reference.py: DPO sigmoid/ipo and CPO simpo losses, tests/reference/trl_preference.py);
#               trl 0.25.1 is the last release with CPOTrainer outside trl.experimental; datasets 5.0.1 is the last
#               that takes huggingface-hub<1.0 (as transformers 4.x needs), and it caps fsspec at 2026.6.0
#   .venv-ref5  transformers 5.x (5.x writes config.json otherwise: rope_parameters, dtype)
# `reference_env.sh` makes both; `reference_env.sh .venv-ref5` one of them.
# torch is installed from a CPU wheel on this machine's disk only (never from an index: that pulls a
# multi-GB CUDA build); set MESHKIT_TORCH_WHEEL to its path where it lies elsewhere.
# Idempotent: each venv's stamp is what was installed into it (Python, the wheel, the pins), so a venv
# is made again only when those change. Cost, once per machine: about 40 s of CPU and 1.2 GB each (most
# of it unpacking torch); .venv-ref5 took 39 s with pip's cache warm, 217 s without it at load 16 on 2 cores.
set -euo pipefail
cd "$(dirname "$0")/.."

declare -A PINS=(
  [.venv-ref]="transformers==4.57.6 trl==0.25.1 accelerate==1.16.0 datasets==5.0.1 fsspec==2026.6.0"
  [.venv-ref5]="transformers==5.25.0 huggingface-hub==2.4.0 tokenizers==0.23.3 safetensors==0.8.0 kernels==0.19.1"
)

find_python() {
  local c
  for c in python3.11 "$(command -v pyenv >/dev/null 2>&1 && echo "$(pyenv root)/versions/3.11"*/bin/python3)" \
           "${PYENV_ROOT:-$HOME/.pyenv}"/versions/3.11*/bin/python3; do
    [ -n "$c" ] && command -v "$c" >/dev/null 2>&1 && { command -v "$c"; return 0; }
  done
  return 1
}

wheel=${MESHKIT_TORCH_WHEEL:-$(ls /opt/wheels/torch-2.13.0+cpu-cp311-*.whl 2>/dev/null | head -1)}

build() {  # build VENV: make it unless its stamp says it holds what PINS names
  local venv=$1 pins=${PINS[$1]} want
  want="python3.11 $(basename "${wheel:-none}") $pins"
  if [ -x "$venv/bin/python" ] && [ -f "$venv/.meshkit-stamp" ] && [ "$(cat "$venv/.meshkit-stamp")" = "$want" ]; then
    return 0
  fi
  if [ -z "$wheel" ] || [ ! -f "$wheel" ]; then
    echo "error: no torch 2.13.0+cpu wheel for Python 3.11 found (looked in /opt/wheels): set MESHKIT_TORCH_WHEEL=/path/to/torch-2.13.0+cpu-cp311-...whl" >&2
    exit 2
  fi
  local py
  py=$(find_python) || {
    echo "error: the reference needs Python 3.11 (torch's CPU wheel is cp311): install one, e.g. 'pyenv install 3.11'" >&2
    exit 2
  }
  echo "meshkit reference: $venv: $py with $(basename "$wheel") and $pins"
  local start=$SECONDS
  rm -rf "$venv"
  "$py" -m venv "$venv"
  "$venv/bin/python" -m pip install --quiet --disable-pip-version-check "$wheel" $pins
  echo "$want" > "$venv/.meshkit-stamp"
  echo "meshkit reference: $venv done in $((SECONDS - start)) s ($venv/bin/python)"
}

venvs=("$@")
[ ${#venvs[@]} -gt 0 ] || venvs=(.venv-ref .venv-ref5)
for v in "${venvs[@]}"; do
  [ -n "${PINS[$v]:-}" ] || { echo "error: no reference environment '$v': give one of ${!PINS[*]}" >&2; exit 2; }
  build "$v"
done
