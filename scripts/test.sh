#!/usr/bin/env bash
# The install-and-test command: `bash scripts/test.sh [--fast] [pytest args]`.
# Installs the project into .venv on first use (scripts/bootstrap.sh), then runs pytest: the whole suite, or with
# --fast the tests that start no process and compile nothing (about a minute; tests/conftest.py keeps it so, failing
# in every run a test without the process mark that starts a process or compiles).
set -euo pipefail
REPO_ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
source "$REPO_ROOT/scripts/bootstrap.sh" || { echo "test.sh: could not install the environment (see above)" >&2; exit 1; }
cd "$REPO_ROOT"
if [[ "${1:-}" == "--fast" ]]; then
    shift
    exec "$VENV_PY" -m pytest -m "not process and not slow" "$@"
fi
exec "$VENV_PY" -m pytest "$@"
