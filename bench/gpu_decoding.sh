#!/usr/bin/env bash
# The decoding figures on one GPU, in one invocation (docs/performance.md, "Generation speed on a worker"
# and "Throughput on one GPU"):
#
#   bash bench/gpu_decoding.sh [OUT_DIR]
#
#   1. pytest             the gpu tests (pytest -m gpu)
#   2. generation_bench   Qwen2.5-0.5B's shape, 32 and 128 rows (1 and 4 jobs a call): compiled generate
#                         against the worker's own decoding graph, with --profile
#   3. gpu_vs_trl         TRL, then asyncgrpo with 2 workers decoding with the graph, without and (when
#                         nvidia-cuda-mps-control is here) with NVIDIA MPS, and 3 workers with MPS
#   4. generation_bench   the graph compiled with max-autotune (0.5B, 32 rows), then the graph at 1.5B's shape
#
# Each part has its share of GPU_DECODING_BUDGET_S (default 540 s) and writes what it measured to OUT_DIR
# (default a /tmp folder) as it goes, so a part cut short still leaves the others' figures. Needs what
# scripts/gpu_check.sh needs (the wheels of .whl/ are installed the same way, into /tmp/site).
set -uo pipefail
REPO_ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$REPO_ROOT"
OUT="${1:-$(mktemp -d /tmp/gpu-decoding.XXXXXX)}"
mkdir -p "$OUT"
PY="$(command -v "${PYTHON:-python3}")"
BUDGET_S="${GPU_DECODING_BUDGET_S:-540}"
left() { echo $(( BUDGET_S - SECONDS )); }
part() {  # part NAME SECONDS CMD...: runs CMD with at most SECONDS (or what is left), stdout/stderr to OUT/NAME.*
    local name="$1" want="$2" l; shift 2
    l=$(left); [ "$l" -lt "$want" ] && want="$l"
    if [ "$want" -lt 20 ]; then echo "[gpu_decoding] $name: skipped, the budget is spent" | tee -a "$OUT/summary.txt"; return; fi
    echo "[gpu_decoding] $name (at most $want s): $*"
    local t0=$SECONDS
    timeout -k 10 "$want" "$@" > "$OUT/$name.out" 2> "$OUT/$name.err"
    local rc=$?
    echo "[gpu_decoding] $name: exit $rc in $(( SECONDS - t0 )) s" | tee -a "$OUT/summary.txt"
    # What failed, on the terminal too (the files may not reach whoever reads this).
    [ "$rc" -ne 0 ] && grep -vE "Warning|warnings.warn|^\s*$" "$OUT/$name.out" "$OUT/$name.err" | tail -n 25
    return 0
}

shopt -s nullglob
WHEELS=(.whl/*.whl)
if [ "${#WHEELS[@]}" -gt 0 ]; then
    "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
        "${WHEELS[@]}" > "$OUT/pip.log" 2>&1 || echo "[gpu_decoding] wheels: pip failed (see $OUT/pip.log)"
    export PYTHONPATH="/tmp/site${PYTHONPATH:+:$PYTHONPATH}"
fi
export PYTHONPATH="$REPO_ROOT${PYTHONPATH:+:$PYTHONPATH}" TOKENIZERS_PARALLELISM=false
"$PY" -c 'import torch, transformers, trl; print(torch.cuda.get_device_name(), torch.__version__,
transformers.__version__, trl.__version__)' | tee "$OUT/machine.txt"
MPS_CONFIG=""
command -v nvidia-cuda-mps-control > /dev/null && MPS_CONFIG=",async2_graph_mps"
echo "nvidia-cuda-mps-control: $(command -v nvidia-cuda-mps-control || echo 'not on PATH')" | tee -a "$OUT/machine.txt"

part pytest 110 "$PY" -m pytest -q -rs -p no:cacheprovider -m gpu --durations=5 tests
part generation_05b 150 "$PY" bench/generation_bench.py --shapes qwen0.5b --settings compiled,graph --jobs 1,4 \
    --reps 3 --profile --out "$OUT/generation_05b.json"
part gpu_vs_trl 210 "$PY" bench/gpu_vs_trl.py --configs "trl,async2_graph$MPS_CONFIG${MPS_CONFIG:+,async3_graph_mps}" \
    --steps 20 --warmup 6 --out "$OUT/gpu_vs_trl.json"
part generation_autotune 100 "$PY" bench/generation_bench.py --shapes qwen0.5b --settings graph-autotune --jobs 1 \
    --reps 3 --profile --out "$OUT/generation_autotune.json"
part generation_15b 80 "$PY" bench/generation_bench.py --shapes qwen1.5b --settings graph --jobs 1 \
    --reps 3 --out "$OUT/generation_15b.json"
echo "[gpu_decoding] figures in $OUT"
