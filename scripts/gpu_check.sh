#!/usr/bin/env bash
# Verifies the GPU path in one command, on a machine with an NVIDIA GPU and PyTorch:
#
#   bash scripts/gpu_check.sh
#
#   1. pytest -m gpu      the CUDA IPC tests (tests/ files with gpu-marked tests)
#   2. weights bench      bench/weights_bench.py --gpu: sync of a 1.5B bf16 model through CUDA
#                         IPC against a raw device-to-device copy of the same bytes, and publish
#   3. launch.sh          bash launch.sh --workers 2 --device cuda, a short demo run with the PS and both
#                         workers on GPU 0 (NVIDIA MPS started if nvidia-cuda-mps-control is here; the
#                         summary says whether it ran); each worker decodes with its own decoding graph,
#                         the default on CUDA: it must compile at start and not after
#
# then one summary block (each part PASS/FAIL and its figures). Exit status 0 when every part
# passed, 1 when one failed, 2 when there is no GPU here. The whole run fits in about 10
# minutes (GPU_CHECK_BUDGET_S, default 570 s); logs stay in a /tmp folder it names.
#
# No internet needed. The machine needs python3 with torch (CUDA), transformers, accelerate;
# what else asyncgrpo needs (trl, datasets, watchdog, pytest, ...) comes from .whl/ in the
# repository if it is there (scripts/fetch_gpu_wheels.sh fills it where pip has an index):
# the wheels of packages this Python does not already have go to /tmp/site
# (GPU_CHECK_WHEELS=all: every wheel, overriding the machine's own). asyncgrpo itself is
# not installed: the repository goes on PYTHONPATH. PYTHON=... picks the interpreter.
set -uo pipefail
REPO_ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$REPO_ROOT"
PY="$(command -v "${PYTHON:-python3}")" || { echo "gpu_check: error: no ${PYTHON:-python3} on PATH" >&2; exit 2; }
BUDGET_S="${GPU_CHECK_BUDGET_S:-570}"
SITE=/tmp/site
STEPS=30

# ---- 0. is there a GPU? ---------------------------------------------------------------------
if ! MACHINE=$("$PY" - 2>&1 <<'EOF'
import sys
import torch
if not torch.cuda.is_available():
    sys.exit(f"PyTorch {torch.__version__} (CUDA build: {torch.version.cuda or 'none'}) sees no CUDA GPU")
names = sorted({torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())})
print(f"{torch.cuda.device_count()} x {', '.join(names)}; torch {torch.__version__} (CUDA {torch.version.cuda}); "
      f"Python {sys.version.split()[0]}")
EOF
); then
    echo "gpu_check: no GPU to check: ${MACHINE##*$'\n'}." >&2
    echo "gpu_check: run this on a machine with an NVIDIA GPU and a CUDA build of PyTorch (nothing was run)." >&2
    exit 2
fi
WORK="$(mktemp -d /tmp/asyncgrpo-gpu-check.XXXXXX)"
echo "[gpu_check] $MACHINE; logs in $WORK"
left() { echo $(( BUDGET_S - SECONDS )); }
cap() {  # cap WANT: WANT seconds, or what is left of the budget (at least 10)
    local l; l=$(left); [ "$l" -lt "$1" ] && { [ "$l" -gt 10 ] && echo "$l" || echo 10; } || echo "$1"
}

# ---- 1. the missing packages, from .whl/ ----------------------------------------------------
export PYTHONPATH="$REPO_ROOT${PYTHONPATH:+:$PYTHONPATH}"
WHEELS_NOTE="no .whl/ folder: using what this Python has"
shopt -s nullglob
ALL_WHEELS=(.whl/*.whl)
if [ "${#ALL_WHEELS[@]}" -gt 0 ]; then
    if [ "${GPU_CHECK_WHEELS:-missing}" = all ]; then
        mapfile -t TO_INSTALL < <(printf '%s\n' "${ALL_WHEELS[@]}")
    else  # a wheel's distribution name is what its file name has before the first '-'
        mapfile -t TO_INSTALL < <("$PY" - "${ALL_WHEELS[@]}" <<'EOF'
import importlib.metadata as md
import sys
for path in sys.argv[1:]:
    try:
        md.version(path.rsplit("/", 1)[-1].split("-")[0])
    except md.PackageNotFoundError:
        print(path)
EOF
)
    fi
    WHEELS_NOTE="${#TO_INSTALL[@]} of ${#ALL_WHEELS[@]} wheels from .whl/ into $SITE (the others are installed here)"
    if [ "${#TO_INSTALL[@]}" -gt 0 ]; then
        if ! "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$SITE" \
                "${TO_INSTALL[@]}" > "$WORK/pip.log" 2>&1; then
            WHEELS_NOTE="FAILED to install wheels from .whl/ (see $WORK/pip.log)"
        fi
    fi
    export PYTHONPATH="$SITE:$PYTHONPATH"
fi
echo "[gpu_check] $WHEELS_NOTE"
MISSING=$("$PY" -c '
import importlib.util as u
print(" ".join(m for m in ("pytest", "watchdog", "trl", "datasets", "transformers") if u.find_spec(m) is None))')
[ -n "$MISSING" ] && echo "[gpu_check] not importable: $MISSING (bring them with scripts/fetch_gpu_wheels.sh)"

# ---- 2. pytest -m gpu -------------------------------------------------------------------------
mapfile -t GPU_TEST_FILES < <(grep -rl --include="test_*.py" "pytest.mark.gpu" tests | sort)
echo "[gpu_check] pytest -m gpu ${GPU_TEST_FILES[*]}"
t0=$SECONDS
timeout -k 20 "$(cap 270)" "$PY" -m pytest -m gpu -q -rs -p no:cacheprovider "${GPU_TEST_FILES[@]}" \
    > "$WORK/pytest.log" 2>&1
PYTEST_RC=$?
PYTEST_S=$(( SECONDS - t0 ))
tail -n 3 "$WORK/pytest.log"

# ---- 3. bench/weights_bench.py --gpu ----------------------------------------------------------
echo "[gpu_check] python bench/weights_bench.py --gpu --iters 20"
t0=$SECONDS
timeout -k 20 "$(cap 150)" "$PY" bench/weights_bench.py --gpu --iters 20 > "$WORK/bench.json" 2> "$WORK/bench.log"
BENCH_RC=$?
BENCH_S=$(( SECONDS - t0 ))

# ---- 4. launch.sh, one worker, a short demo run ------------------------------------------------
# launch.sh sources scripts/bootstrap.sh, which would create .venv and pip-install into it (no
# internet here). Hand it an "environment" that is this Python with PYTHONPATH as set above,
# and bootstrap's own stamp saying it is installed, so it installs nothing.
VENV="$WORK/venv"
mkdir -p "$VENV/bin"
printf '#!/bin/sh\nexec "%s" "$@"\n' "$PY" > "$VENV/bin/python"
chmod +x "$VENV/bin/python"
echo "$(sha256sum < "$REPO_ROOT/pyproject.toml" | cut -c1-16) ${ASYNCGRPO_TORCH_SPEC:-torch==2.13.0}" \
    > "$VENV/.asyncgrpo-installed"
echo "[gpu_check] bash launch.sh --workers 2 --device cuda --max-steps $STEPS"
t0=$SECONDS
ASYNCGRPO_VENV="$VENV" timeout -k 30 "$(cap 170)" bash launch.sh --workers 2 --device cuda --max-steps "$STEPS" \
    --run-dir "$WORK/run" > "$WORK/launch.log" 2>&1
LAUNCH_RC=$?
LAUNCH_S=$(( SECONDS - t0 ))

# ---- 5. one summary block ---------------------------------------------------------------------
"$PY" - "$WORK" "$MACHINE" "$WHEELS_NOTE" "$PYTEST_RC" "$PYTEST_S" "$BENCH_RC" "$BENCH_S" "$LAUNCH_RC" \
    "$LAUNCH_S" "$STEPS" "$SECONDS" <<'EOF'
import json
import re
import statistics
import sys
from pathlib import Path

from asyncgrpo.run.metrics import read_lines as read_metrics  # (run from the repository's root)

work, machine, wheels = Path(sys.argv[1]), sys.argv[2], sys.argv[3]
pytest_rc, pytest_s, bench_rc, bench_s, launch_rc, launch_s, steps, wall = map(int, sys.argv[4:])
rows = []


def read(name):
    try:
        return (work / name).read_text(errors="replace")
    except OSError:
        return ""


def timed_out(rc):
    return " (timed out)" if rc in (124, 137) else ""


# pytest: its last summary line, e.g. "12 passed, 4 skipped in 61.2s"
log = read("pytest.log")
# pytest's summary line ("10 passed, 1 skipped, 27 deselected in 76.42s"); other output (a CUDA IPC warning
# printed at interpreter exit, say) may follow it
summary = next((line for line in reversed(log.splitlines()) if re.search(r"\d+ (passed|failed|errors?) ", line)
                or re.search(r" in [\d.]+s", line)), "")
counts = {k: int(n) for n, k in re.findall(r"(\d+) (passed|failed|skipped|errors?|deselected)", summary)}
ok = pytest_rc == 0 and counts.get("passed", 0) > 0
rows.append(("pytest -m gpu", ok, f"{counts.get('passed', 0)} passed, {counts.get('failed', 0)} failed, "
             f"{counts.get('error', 0) + counts.get('errors', 0)} errors, {counts.get('skipped', 0)} skipped in "
             f"{pytest_s} s{timed_out(pytest_rc)}" + ("" if ok or counts.get("passed") else f"; see {work}/pytest.log")))

# bench: its JSON
try:
    b = json.loads(read("bench.json"))
    ok = bench_rc == 0 and b["all_syncs_correct"]
    rows.append(("weights bench", ok,
                 f"{b['params'] / 1e9:.2f}B bf16 ({b['bytes'] / 1e9:.2f} GB): sync {b['sync']['median_ms']} ms median "
                 f"vs raw d2d copy {b['memcpy_d2d']['median_ms']} ms (x{b['sync_over_memcpy']}); publish "
                 f"{b['publish']['median_ms']} ms (x{b['publish_over_memcpy']}); first sync (opens handles) "
                 f"{b['first_sync_ms (opens handles)']} ms; goal sync <= 10 ms: {'met' if b['goal_met'] else 'NOT met'}; "
                 f"syncs correct: {b['all_syncs_correct']}"))
except (ValueError, KeyError):
    tail = read("bench.log").strip().splitlines()[-1:] or ["no output"]
    rows.append(("weights bench", False, f"exit {bench_rc}{timed_out(bench_rc)}: {tail[0][:200]}"))

# launch.sh: steps in metrics.jsonl, the transport, the worker's syncs, restarts
run = work / "run"
lines = read_metrics(run / "metrics.jsonl")
done = lines[-1]["step"] if lines else 0
try:
    transport = json.loads((run / "weights" / "published_version.json").read_text())["transport"]
except (OSError, ValueError, KeyError):
    transport = "?"
syncs = [float(x) for x in re.findall(r"synced version=\d+ sync_ms=([\d.]+)", read("run/logs/log_worker_1.txt"))]
restarts = read("run/logs/launch.txt").count("exited with status")
compiled = re.search(r"decoding compiled in ([\d.]+) s \((\w+)\)", read("run/logs/log_worker_1.txt"))
try:
    mps = json.loads((run / "ps.json").read_text()).get("mps") or "?"
except (OSError, ValueError):
    mps = "?"
recompiles = max([json.loads(x).get("recompiles", 0) for x in read("run/logs/events-worker-dev1.jsonl").splitlines()
                  if '"result_written"' in x] or [0])
ok = (launch_rc == 0 and done == steps and transport == "cuda_ipc" and restarts == 0 and compiled
      and compiled[2] == "graph" and recompiles == 0)
rows.append(("launch.sh", ok, f"{done}/{steps} steps in {launch_s} s{timed_out(launch_rc)}, exit {launch_rc}, "
             f"transport {transport}, {len(syncs)} worker syncs"
             + (f" (median {statistics.median(syncs):.1f} ms)" if syncs else "") + f", {restarts} worker restarts"
             + (f", decoding ({compiled[2]}) compiled in {compiled[1]} s, {recompiles} recompiles" if compiled else
                ", decoding NOT compiled") + f", NVIDIA MPS {mps}"
             + ("" if ok else f"; see {work}/launch.log and {run}/logs/")))

print()
print("=" * 30 + " asyncgrpo GPU check " + "=" * 30)
print(f"machine: {machine}")
print(f"wheels:  {wheels}")
for name, ok, text in rows:
    print(f"{name:<15} {'PASS' if ok else 'FAIL'}  {text}")
verdict = all(ok for _, ok, _ in rows)
print(f"overall: {'PASS' if verdict else 'FAIL'} ({wall} s; logs in {work})")
print("=" * 81)
sys.exit(0 if verdict else 1)
EOF
