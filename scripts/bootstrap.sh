#!/usr/bin/env bash
# Creates .venv with a Python >= 3.12 and installs meshkit (editable) with its pinned dependencies.
# Idempotent: does nothing when .venv already matches pyproject.toml.
set -euo pipefail
cd "$(dirname "$0")/.."

venv=.venv
stamp="$venv/.meshkit-stamp"
want=$(cat pyproject.toml scripts/bootstrap.sh | sha256sum | cut -d' ' -f1)
if [ -x "$venv/bin/meshkit" ] && [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ]; then
  exit 0
fi

ok() { "$1" -c 'import sys, venv; sys.exit(sys.version_info < (3, 12))' >/dev/null 2>&1; }

find_python() {
  local c
  for c in "${MESHKIT_PYTHON:-}" python3.13 python3.12 python3 python; do
    [ -n "$c" ] || continue
    c=$(command -v "$c" 2>/dev/null) || continue
    ok "$c" && { echo "$c"; return 0; }
  done
  local roots=()
  command -v pyenv >/dev/null 2>&1 && roots+=("$(pyenv root)")
  roots+=("${PYENV_ROOT:-$HOME/.pyenv}" /usr/local /usr /opt/python)
  for r in "${roots[@]}"; do
    for c in $(ls -d "$r"/versions/3.1[2-9]*/bin/python3 "$r"/bin/python3.1[2-9] 2>/dev/null | sort -rV); do
      ok "$c" && { echo "$c"; return 0; }
    done
  done
  if command -v uv >/dev/null 2>&1; then
    c=$(uv python find '>=3.12' 2>/dev/null) && ok "$c" && { echo "$c"; return 0; }
  fi
  return 1
}

py=$(find_python) || {
  echo "error: meshkit needs Python >= 3.12 (JAX 0.12 requires it) and none was found; install one (e.g. 'pyenv install 3.12') or set MESHKIT_PYTHON=/path/to/python3.12" >&2
  exit 2
}
echo "meshkit setup: using $py ($("$py" -c 'import sys; print(sys.version.split()[0])'))"
if [ -d "$venv" ] && ! ok "$venv/bin/python"; then rm -rf "$venv"; fi
[ -x "$venv/bin/python" ] || "$py" -m venv "$venv"
"$venv/bin/python" -m pip install --quiet --disable-pip-version-check --upgrade pip
"$venv/bin/python" -m pip install --quiet --disable-pip-version-check -e '.[dev]'
echo "$want" > "$stamp"
echo "meshkit setup: done ($venv/bin/meshkit)"
