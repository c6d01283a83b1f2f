#!/usr/bin/env bash
# Creates (once) the project's virtual environment and installs asyncgrpo into it.
# Sourced by scripts/test.sh and launch.sh; afterwards $VENV_PY is the interpreter.
#
# torch is installed first and pinned (torch==2.13.0 resolves to a local CPU build on
# the project's machines); installed later without a pin, pip would fetch the newest
# release with several GB of CUDA packages.
set -euo pipefail
REPO_ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="${ASYNCGRPO_VENV:-$REPO_ROOT/.venv}"
TORCH_SPEC="${ASYNCGRPO_TORCH_SPEC:-torch==2.13.0}"
VENV_PY="$VENV/bin/python"
stamp="$VENV/.asyncgrpo-installed"
want="$(cat "$REPO_ROOT/pyproject.toml" | sha256sum | cut -c1-16) $TORCH_SPEC"

if [ ! -x "$VENV_PY" ]; then
    echo "[bootstrap] creating virtual environment $VENV" >&2
    python3 -m venv "$VENV"
fi
if [ "$(cat "$stamp" 2>/dev/null)" != "$want" ]; then
    echo "[bootstrap] installing $TORCH_SPEC and asyncgrpo[dev] into $VENV (first run takes a minute or two)" >&2
    "$VENV_PY" -m pip install --quiet --upgrade pip >&2
    "$VENV_PY" -m pip install --quiet "$TORCH_SPEC" >&2
    "$VENV_PY" -m pip install --quiet -e "$REPO_ROOT[dev]" >&2
    echo "$want" > "$stamp"
fi
export VENV_PY
