#!/usr/bin/env bash
# The install-and-test command: `bash scripts/test.sh [pytest args]`.
# Installs the project into .venv on first use (scripts/bootstrap.sh), then runs pytest.
set -euo pipefail
REPO_ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
source "$REPO_ROOT/scripts/bootstrap.sh" || { echo "test.sh: could not install the environment (see above)" >&2; exit 1; }
cd "$REPO_ROOT"
exec "$VENV_PY" -m pytest "$@"
