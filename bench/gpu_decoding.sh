#!/usr/bin/env bash
# The decoding figures on one GPU, in one invocation (docs/performance.md, "Generation speed on a worker"
# and "Throughput on one GPU"), in their order of priority:
#
#   bash bench/gpu_decoding.sh [OUT_DIR]
#
#   1. engine_gpu        the gpu test of continuous batching (CUDA graphs; log-probs within bf16 of TRL's)
#   2. long_tail_05b      continuous batching, then the fixed-batch step, at Qwen2.5-0.5B's shape, 4 jobs' rows
#                         (128), a stream of 16 jobs, completions capped at 512, long-tail lengths; then the
#                         decision for --worker_decoding auto on this GPU (auto_decision.txt: continuous where its
#                         samples/s are at least graph's and its job latency p50 no worse)
#   3. fixed_05b          the same with fixed lengths (a process of its own: inductor's cache of the first's graphs)
#   4. warm_up_05b        the engine's warm-up at 0.5B's shape, cap 512, in a fresh process, cold then warm
#                         (bench/warm_up.py)
#   5. long_prompts_05b   long-tail lengths with prompts of 128-256 tokens: a group's rows copying one prefill
#                         against every row prefilled (continuous-unshared)
#   6. long_tail_05b_32   long-tail lengths with one job's rows (32)
#   7. pytest             the gpu tests of the worker's decoding and of CUDA IPC under MPS
#   8. generation_05b_1024  the step with 1024-token completions, 32 rows: its attention over the whole cache
#                         (graph-wholecache), then over the written columns only (graph)
#   9. generation_05b     the step at 32 rows, 64-token completions: as it was before the kernel levers
#                         (graph-nolevers), with chunked sampling only (graph-nofuse), and with fused projections too
#                         (graph), with --profile
#  10. generation_05b_128 the step at 128 rows (4 jobs a call)
#  11. gpu_vs_trl         TRL, then asyncgrpo with 2 workers decoding with the graph, under NVIDIA MPS when
#                         nvidia-cuda-mps-control is here
#  12. generation_15b     the step at 1.5B's shape
#
# (On the H200, 2026-11-26: a generation_bench setting took 50-100 s, compilation included; TRL's run in
# gpu_vs_trl 72 s, and the asyncgrpo run after it did not finish in the 138 s it had left. 2026-11-28: engine_gpu
# 84 s; graph's warm-up at 0.5B's shape with a cap of 512, 131 s, and the engine's more than the 135 s it had left.)
#
# The long_tail parts run the engine first (the fixed-batch step's figures are known) and log torch's recompiles,
# why a graph was not recorded, and each CUDA graph recorded, recorded again, or run eagerly instead (TORCH_LOGS;
# `grep -c "Re-recording\|Running eager" OUT/long_tail_05b.log`).
# GPU_DECODING_PARTS="engine_gpu long_tail_05b" runs only the parts named (a device's time can take two calls).
#
# Parts 1 and 2 (the engine's tests, its long-tail figures against the fixed batch, and the decision for auto) fit
# in 8 minutes with the installs and warm-ups, if graph's warm-up is still the 131 s of 2026-11-28; a part 2 cut
# short keeps the rows it measured (OUT/long_tail_05b.json is written after each).
# Each part has its share of GPU_DECODING_BUDGET_S (default 540 s) and writes what it printed to OUT_DIR/NAME.log
# (default a /tmp folder) as it goes, so a part cut short still leaves the others' figures. Needs what
# scripts/gpu_check.sh needs (the wheels of .whl/ are installed the same way, into /tmp/site). The decoders call
# transformers' models with the keywords of the transformers `.venv` has (5.24), so bring that one: on a machine with
# torch, transformers, pyarrow and pandas of its own (the lent H200), fetch the wheels with
#   GPU_WHEELS_SKIP="pyarrow pandas python-dateutil tzdata xxhash pytest pluggy iniconfig" \
#   GPU_WHEELS_EXTRA="transformers==5.24.0 tokenizers==0.23.3" bash scripts/fetch_gpu_wheels.sh
set -uo pipefail
REPO_ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$REPO_ROOT"
OUT="${1:-$(mktemp -d /tmp/gpu-decoding.XXXXXX)}"
mkdir -p "$OUT"
PY="$(command -v "${PYTHON:-python3}")"
BUDGET_S="${GPU_DECODING_BUDGET_S:-540}"
left() { echo $(( BUDGET_S - SECONDS )); }
part() {  # part NAME SECONDS CMD...: runs CMD with at most SECONDS (or what is left), stdout and stderr to OUT/NAME.log
    local name="$1" want="$2" l; shift 2
    if [ -n "${GPU_DECODING_PARTS:-}" ] && [[ " $GPU_DECODING_PARTS " != *" $name "* ]]; then return; fi
    l=$(left); [ "$l" -lt "$want" ] && want="$l"
    if [ "$want" -lt 20 ]; then echo "[gpu_decoding] $name: skipped, the budget is spent" | tee -a "$OUT/summary.txt"; return; fi
    echo "[gpu_decoding] $name (at most $want s): $*"
    local t0=$SECONDS
    timeout -k 10 "$want" "$@" > "$OUT/$name.log" 2>&1
    local rc=$?
    echo "[gpu_decoding] $name: exit $rc in $(( SECONDS - t0 )) s" | tee -a "$OUT/summary.txt"
    # What failed, on the terminal too (the files may not reach whoever reads this).
    [ "$rc" -ne 0 ] && grep -vE "Warning|warnings.warn|^\s*$" "$OUT/$name.log" | tail -n 25
    return 0
}

shopt -s nullglob
WHEELS=(.whl/*.whl)
if [ "${#WHEELS[@]}" -gt 0 ]; then
    "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
        "${WHEELS[@]}" > "$OUT/pip.log" 2>&1 || echo "[gpu_decoding] wheels: pip failed (see $OUT/pip.log)"
    export PYTHONPATH="/tmp/site${PYTHONPATH:+:$PYTHONPATH}"
fi
export PYTHONPATH="$REPO_ROOT${PYTHONPATH:+:$PYTHONPATH}" TOKENIZERS_PARALLELISM=false PYTHONUNBUFFERED=1
"$PY" -c 'import torch, transformers, trl; print(torch.cuda.get_device_name(), torch.__version__,
transformers.__version__, trl.__version__)' | tee "$OUT/machine.txt"
MPS_CONFIG=""
command -v nvidia-cuda-mps-control > /dev/null && MPS_CONFIG=",async2_graph_mps"
echo "nvidia-cuda-mps-control: $(command -v nvidia-cuda-mps-control || echo 'not on PATH')" | tee -a "$OUT/machine.txt"

part engine_gpu 150 "$PY" -m pytest -v -rs -p no:cacheprovider -m gpu --durations=3 tests/worker/test_continuous.py
part long_tail_05b 330 env TORCH_LOGS=recompiles,perf_hints,cudagraphs "$PY" bench/long_tail.py --shapes qwen0.5b --settings continuous,graph \
    --lengths long-tail --jobs 4 --stream 16 --completion 512 --out "$OUT/long_tail_05b.json"
if [ -s "$OUT/long_tail_05b.json" ]; then
    "$PY" - "$OUT/long_tail_05b.json" <<'EOF' | tee "$OUT/auto_decision.txt"
import json, sys
rows = {r["decoding"]: r for r in json.load(open(sys.argv[1]))["results"]}
missing = [name for name in ("continuous", "graph") if name not in rows]
if missing:  # (on stdout: auto_decision.txt keeps it)
    print(f"[gpu_decoding] auto on this GPU: undecided, no {' or '.join(missing)} row (cut short?)")
    sys.exit(0)
engine, graph = rows["continuous"], rows["graph"]
wins = engine["samples_per_s"] >= graph["samples_per_s"] and engine["latency_p50_s"] <= graph["latency_p50_s"]
print(f"[gpu_decoding] auto on this GPU: {'continuous' if wins else 'graph'} (long tail at 0.5B: continuous "
      f"{engine['samples_per_s']} samples/s, p50 {engine['latency_p50_s']} s, warm-up {engine['warm_up_s']} s; "
      f"graph {graph['samples_per_s']}, p50 {graph['latency_p50_s']} s, warm-up {graph['warm_up_s']} s)")
EOF
fi
part fixed_05b 300 env TORCH_LOGS=recompiles,perf_hints,cudagraphs "$PY" bench/long_tail.py --shapes qwen0.5b --settings continuous,graph \
    --lengths fixed --jobs 4 --stream 16 --completion 512
part warm_up_05b 240 "$PY" bench/warm_up.py --shape qwen0.5b --completion 512 --device cuda
part long_prompts_05b 300 "$PY" bench/long_tail.py --shapes qwen0.5b --settings continuous,continuous-unshared \
    --lengths long-tail --jobs 4 --stream 16 --completion 512 --prompt-tokens 128-256
part long_tail_05b_32 300 env TORCH_LOGS=recompiles,perf_hints,cudagraphs "$PY" bench/long_tail.py --shapes qwen0.5b --settings continuous,graph \
    --lengths long-tail --jobs 1 --stream 16 --completion 512
part pytest 100 "$PY" -m pytest -q -rs -p no:cacheprovider -m gpu --durations=5 tests/worker --ignore tests/worker/test_continuous.py \
    "tests/asyncgrpo/weights/test_gpu_path.py::test_cuda_ipc_weights_are_exact_between_mps_clients"
part generation_05b_1024 120 "$PY" bench/generation_bench.py --shapes qwen0.5b --settings graph-wholecache,graph \
    --jobs 1 --reps 2 --completion 1024
part generation_05b 200 "$PY" bench/generation_bench.py --shapes qwen0.5b --settings graph-nolevers,graph-nofuse,graph \
    --jobs 1 --reps 3 --profile
part generation_05b_128 80 "$PY" bench/generation_bench.py --shapes qwen0.5b --settings graph --jobs 4 --reps 3
part gpu_vs_trl 240 "$PY" bench/gpu_vs_trl.py --configs "trl,async2_graph$MPS_CONFIG" --steps 20 --warmup 6
part generation_15b 80 "$PY" bench/generation_bench.py --shapes qwen1.5b --settings graph --jobs 1 --reps 3
echo "[gpu_decoding] figures in $OUT"
