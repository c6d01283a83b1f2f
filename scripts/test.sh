#!/usr/bin/env bash
# The install-and-test command: `bash scripts/test.sh [--fast] [pytest args]`.
# Installs the project into .venv on first use (scripts/bootstrap.sh), then runs pytest: the whole suite, or with
# --fast the tests that start no process and compile nothing (under a minute; tests/conftest.py keeps it so, failing
# in every run a test without the process mark that starts a process or compiles).
# Both run in parallel processes (pytest-xdist), one per core up to 4 ($ASYNCGRPO_TEST_WORKERS sets the number; an -n
# among the arguments overrides it, -n 0 runs one process), each taking a test file at a time, so that a file's
# fixtures (a finished run, compiled decoders) are made once, in the order tests/conftest.py gives them (the whole runs
# first): the tests that start processes leave the cores idle close to half of the time, waiting on leases, deadlines
# and signals.
set -euo pipefail
REPO_ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
source "$REPO_ROOT/scripts/bootstrap.sh" || { echo "test.sh: could not install the environment (see above)" >&2; exit 1; }
cd "$REPO_ROOT"
CORES="$(nproc)"
PARALLEL=(-n "${ASYNCGRPO_TEST_WORKERS:-$(( CORES < 4 ? CORES : 4 ))}" --dist loadfile --no-loadscope-reorder)
if [[ "${1:-}" == "--fast" ]]; then
    shift
    exec "$VENV_PY" -m pytest "${PARALLEL[@]}" -m "not process and not slow" "$@"
fi
exec "$VENV_PY" -m pytest "${PARALLEL[@]}" "$@"
