#!/usr/bin/env bash
# usage: bash launch.sh [--workers N] [--ps-procs K] [--run-dir DIR] [--max-steps N] [--device cpu|cuda|auto] [flags...]
#
# Starts a parameter server (PS) and N workers on one run directory, supervises them, and
# stops them cleanly. With no model, dataset or reward flag: the built-in demo task (a tiny
# Llama made offline learns to repeat a digit).
#
#   --workers N     worker processes (default 3); a worker that exits is restarted. 0: the PS alone, its
#                   workers joining from other hosts (--join)
#   --ps-procs K    the PS as K data-parallel processes (torchrun; default 1): on CPU K gloo
#                   processes, on GPU one GPU each (GPUs 0..K-1), the workers on the others
#   --run-dir DIR   the run directory (default $ASYNCGRPO_RUNS/<date-time>, ASYNCGRPO_RUNS
#                   defaulting to ~/asyncgrpo-runs); relaunching on it resumes from its newest checkpoint
#   --max-steps N   the same as --max_steps
#   --device D      cpu, cuda or auto (default: cuda when torch sees a GPU)
#   --mps M         auto, on or off (default auto): NVIDIA MPS, so that processes sharing a GPU run their
#                   kernels at once instead of taking turns; auto starts it when a GPU holds more than one
#                   process and nvidia-cuda-mps-control exists; stopped when the run ends, however it ends
#   --join RUN      workers only, against RUN whose PS runs on another host (bash launch.sh --join RUN --help)
#   -h, --help      this help
#
# Every other flag goes to the PS and the workers unchanged: TRL's GRPOConfig, ModelConfig
# and ScriptArguments flags with TRL's meaning (--learning_rate, --dtype, --dataset_name,
# --reward_funcs, --output_dir, ...), --config run.yaml, and asyncgrpo's own; the repository's
# `.venv/bin/python -m ps --help` lists them all. Paths are relative to the folder you run
# launch.sh from. The final model is saved to --output_dir, else to RUN/final_model. Logs:
# RUN/logs/.

# Placement (gpu_env in scripts/launch_common.sh), with G GPUs and --ps-procs 1 (K > 1: the PS sees GPUs 0..K-1, worker
# i runs on GPU K + (i-1) mod (G-K) with CUDA_VISIBLE_DEVICES="that,0", or on GPU 0 when G = K): the PS sees GPU 0 only; worker i runs on GPU
# i mod G with CUDA_VISIBLE_DEVICES="i mod G,0" (its cuda:0 is its own GPU, cuda:1 the PS's,
# for CUDA IPC); a worker whose i mod G is 0 sees GPU 0 only and shares it with the PS (all
# workers when G is 1; worker G, 2G, ... otherwise). GPU numbers count the GPUs launch.sh may use: a
# CUDA_VISIBLE_DEVICES set before launch.sh (as a scheduler sets it) names them, else all of the machine's. A worker that exits
# with status 3 had a GPU failure (a CUDA error). Every process runs in the folder launch.sh
# was started from, with this repository's code first on the path (PYTHONSAFEPATH: a ps.py
# there does not shadow it); reward modules there import as with `python`.
set -uo pipefail
{  # (read whole before it runs: an edit or a git pull while a run goes does not change that run's script)
REPO_ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
# --join RUN: workers only, on another host than the PS's (scripts/join.sh says how).
for arg in "$@"; do [ "$arg" = --join ] && exec bash "$REPO_ROOT/scripts/join.sh" "$@"; done
die() { echo "launch.sh: error: $*" >&2; exit 2; }
say() { echo "[launch] $*"; [ -n "${LOGS:-}" ] && echo "$(date '+%F %T') $*" >> "$LOGS/launch.txt"; return 0; }

# ---- 1. arguments ------------------------------------------------------------------------
WORKERS=3 PS_PROCS=1 RUN_DIR="" RUN_DIR_GIVEN="" DEVICE=auto MPS=auto PASS=()
while [ $# -gt 0 ]; do
    case "$1" in
        --workers)   [ $# -ge 2 ] || die "--workers needs a value"; WORKERS="$2"; shift 2 ;;
        --ps-procs)  [ $# -ge 2 ] || die "--ps-procs needs a value"; PS_PROCS="$2"; shift 2 ;;
        --run-dir|--run_dir) [ $# -ge 2 ] || die "$1 needs a value"; RUN_DIR="$2"; RUN_DIR_GIVEN=1; shift 2 ;;
        --run-dir=*|--run_dir=*) RUN_DIR="${1#*=}"; RUN_DIR_GIVEN=1; shift ;;
        --max-steps) [ $# -ge 2 ] || die "--max-steps needs a value"; PASS+=(--max_steps "$2"); shift 2 ;;
        --device)    [ $# -ge 2 ] || die "--device needs a value"; DEVICE="$2"; shift 2 ;;
        --mps)       [ $# -ge 2 ] || die "--mps needs a value"; MPS="$2"; shift 2 ;;
        -h|--help)   awk 'NR > 1 && /^#/ { sub(/^# ?/, ""); print; next } NR > 1 { exit }' "$0"; exit 0 ;;
        *)           PASS+=("$1"); shift ;;
    esac
done
[[ "$WORKERS" =~ ^(0|[1-9][0-9]*)$ ]] || die "--workers needs a number (0: workers join from other hosts), got '$WORKERS'"
[[ "$PS_PROCS" =~ ^[1-9][0-9]*$ ]] || die "--ps-procs needs a positive integer, got '$PS_PROCS'"
[[ "$DEVICE" =~ ^(auto|cpu|cuda)$ ]] || die "--device must be cpu, cuda or auto, got '$DEVICE'"
[[ "$MPS" =~ ^(auto|on|off)$ ]] || die "--mps must be auto, on or off, got '$MPS'"
# (an unset variable, --run-dir "$RUN": not a new run under the default folder, unseen)
[ -z "$RUN_DIR_GIVEN" ] || [ -n "$RUN_DIR" ] || die "--run-dir is empty: give the run's folder, or leave the flag" \
    "out for a new run under ${ASYNCGRPO_RUNS:-$HOME/asyncgrpo-runs}"

# ---- 2. environment (created on first use) and input checks, before any process starts -----
source "$REPO_ROOT/scripts/bootstrap.sh" || die "could not install the environment (see above)"
export PYTHONPATH="$REPO_ROOT${PYTHONPATH:+:$PYTHONPATH}" PYTHONSAFEPATH=1 PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
source "$REPO_ROOT/scripts/launch_common.sh"  # checked_inputs, gpu_env, claim_run, stop_workers, restart_dead_workers
[ -n "$RUN_DIR" ] || RUN_DIR="${ASYNCGRPO_RUNS:-$HOME/asyncgrpo-runs}/$(date +%Y%m%d-%H%M%S)"
# What the first line says the folder is: a mistyped --run-dir shows there as a new run.
if [ -d "$RUN_DIR/queue" ]; then RUN_KIND="an existing run"
elif [ -n "$(ls -A "$RUN_DIR" 2>/dev/null)" ]; then RUN_KIND="a new run, in a folder holding other files"
else RUN_KIND="a new run"; fi
set_file_modes "${PASS[@]}"
# The run folder is claimed first, before the checks' imports (seconds): a second launch.sh on it is refused at
# once. Until the checks pass, an exit takes back what the claim made (the folder, its launch.lock).
CLAIMED="$RUN_DIR" NEW_TOP="" NEW_LOCK=""
d="$CLAIMED"; while [ ! -e "$d" ]; do NEW_TOP="$d"; d=$(dirname "$d"); done  # the folders the claim makes
[ -e "$CLAIMED/launch.lock" ] || NEW_LOCK=1
unclaim() {
    [ -n "$NEW_LOCK" ] && rm -f "$CLAIMED/launch.lock"
    local d="$CLAIMED"
    while [ -n "$NEW_TOP" ] && rmdir "$d" 2>/dev/null && [ "$d" != "$NEW_TOP" ]; do d=$(dirname "$d"); done
    return 0
}
claim_run "$RUN_DIR"
trap 'unclaim; end_fork_server' EXIT
# A signal during the checks (seconds: its processes end at once) says so; the folders the claim made go (EXIT).
stopped_early() { say "$1 before the run started (while its inputs were checked): nothing was started"; exit "$2"; }
trap 'stopped_early interrupted 130' INT
trap 'stopped_early "stopped by SIGTERM" 143' TERM
trap 'stopped_early "stopped by SIGHUP" 129' HUP
# A flag that is not one, refused at once where an earlier launch recorded the flags (asyncgrpo/flag_check.py).
"$PY" -m asyncgrpo.flag_check "${PASS[@]}" 9>&- || exit $?
start_fork_server "$DEVICE"  # (the check below is its first fork)
ARGS=(--run_dir "$RUN_DIR" --device_type "$DEVICE" --disable_tqdm true --ps_processes "$PS_PROCS" "${PASS[@]}")  # progress: [train] lines
CHECKED=$("$PY" -m ps --check_only "${ARGS[@]}" 9>&-) || exit $?  # it printed the one-line reason (2 bad input, 3 a PS runs)
checked_inputs "$CHECKED"
[ "$DEVICE" = cuda ] && [ "$NGPU" -lt "$PS_PROCS" ] && die "--ps-procs $PS_PROCS, but torch sees $NGPU GPU(s)"
trap end_fork_server EXIT
trap - INT TERM HUP  # (checked: the handlers of a started run come below, before its PS starts)
ARGS[1]="$RUN_DIR" ARGS[3]="$DEVICE"
LOGS="$RUN_DIR/logs"
mkdir -p "$LOGS" || die "cannot create $LOGS"

# On CPU the processes share the cores: one thread each avoids oversubscription.
if [ "$DEVICE" = cpu ]; then
    THREADS=$(( $(nproc) / (WORKERS + PS_PROCS) )); [ "$THREADS" -ge 1 ] || THREADS=1
    export OMP_NUM_THREADS=$THREADS MKL_NUM_THREADS=$THREADS
fi
# The processes started below stop when this script is gone, however it goes (asyncgrpo/supervisor.py).
export ASYNCGRPO_SUPERVISOR_PID=$$
trap 'stop_mps; end_fork_server' EXIT
start_mps "$([ "$DEVICE" = cuda ] && [ $(( WORKERS + PS_PROCS )) -gt "$NGPU" ] && echo 1)" "$MPS" "$RUN_DIR"

# ---- 3. start the PS and the workers -------------------------------------------------------
declare -A WORKER_PID WORKER_LOG WORKER_STARTED WORKER_BEAT
start_worker() {
    WORKER_LOG[$1]="$LOGS/log_worker_$1.txt"
    WORKER_LOG_AT[$1]=$(stat -c %s "${WORKER_LOG[$1]}" 2>/dev/null || echo 0)  # (worker_error reads from here)
    WORKER_STARTED[$1]=$(date +%s.%N) WORKER_BEAT[$1]="$RUN_DIR/workers/dev$1.json"  # (scripts/launch_common.sh)
    CUDA_VISIBLE_DEVICES=$(gpu_env "$1") "$PY" -m worker --device "$1" "${ARGS[@]}" >> "${WORKER_LOG[$1]}" 2>&1 9>&- &
    WORKER_PID[$1]=$!
}
# Ctrl-C from here on stops what started; a second one kills it. (Set before the PS starts: an interrupt in its
# first seconds leaves no folder behind that only looks like a run.)
PS_PID="" TAIL_PID=""
STOP_STATUS=130  # 128 + the signal that stopped the run: SIGINT (Ctrl-C), SIGTERM (a scheduler, kill), SIGHUP
on_interrupt() {
    STOP_STATUS=$1
    trap on_second_interrupt INT TERM HUP
    if [ "$1" -eq 130 ]; then say "interrupted: stopping the parameter server and the workers (Ctrl-C again: kill them now)"
    else say "got $2: stopping the parameter server and the workers (a second signal kills them now)"; fi
    [ -n "$PS_PID" ] && { kill -TERM "$PS_PID"; wait "$PS_PID"; } 2>/dev/null
    stop_workers; [ -n "$TAIL_PID" ] && wait "$TAIL_PID" 2>/dev/null
    after_interrupt
}
on_second_interrupt() {
    kill_now $PS_PID "${WORKER_PID[@]}" $TAIL_PID  # (unquoted: not started yet, nothing)
    after_interrupt
}
after_interrupt() {
    rm -f "$PS_STATUS_FILE"
    if [ -d "$RUN_DIR/queue" ]; then
        free_dead_weight_buffers "$RUN_DIR"
    elif [ -n "$NEW_LOCK" ]; then  # stopped before its PS made the run: no folder is left that only looks like one
        rm -rf "$LOGS"; unclaim
        if [ -e "$RUN_DIR" ]; then say "the run had not started: its logs and launch.lock removed from $RUN_DIR"
        else say "the run had not started: $RUN_DIR removed"; fi
    fi
    exit "$STOP_STATUS"
}
trap 'on_interrupt 130 SIGINT' INT
trap 'on_interrupt 143 SIGTERM' TERM
trap 'on_interrupt 129 SIGHUP' HUP  # the terminal closed (an ssh session dropped): stop as on Ctrl-C
say "run directory $RUN_DIR, $RUN_KIND ($DEVICE, $WORKERS worker(s), $PS_PROCS PS process(es)); logs in $LOGS"
PS_CMD=("$PY" -m ps)  # K > 1: torchrun starts K ranks (gloo on CPU, NCCL on GPU) and stops them together
# (--log-dir: torchrun's own folder in the run's logs, not a torchelastic_* folder left in /tmp; --no-python: each
# rank is "$PY" -m ps, as the PS alone is)
[ "$PS_PROCS" -gt 1 ] && PS_CMD=("$PY" -m torch.distributed.run --standalone --nproc_per_node "$PS_PROCS"
                                 --log-dir "$LOGS/torchrun" --no-python "$PY" -m ps)
# torchrun exits 1 whatever status a rank exits with: the first rank writes its own here (ps/__main__.py).
PS_STATUS_FILE=$(mktemp)
CUDA_VISIBLE_DEVICES=$(gpu_env 0) ASYNCGRPO_PS_STATUS_FILE="$PS_STATUS_FILE" "${PS_CMD[@]}" "${ARGS[@]}" \
    >> "$LOGS/log_parameter_server.txt" 2>&1 9>&- &
PS_PID=$!
for i in $(seq 1 "$WORKERS"); do start_worker "$i"; done
[ "$WORKERS" -eq 0 ] && say "no worker on this host (--workers 0): training starts once workers join, from other" \
    "hosts: bash launch.sh --join $RUN_DIR --workers N (docs/hosts.md)"
# Progress on the terminal: the PS's [train] and [eval] lines and its one-line reason if it stops on an
# error ("ps: error: ..."; the same reason logged at ERROR level is not shown twice), how a worker decodes and
# why (--worker_decoding auto's choice, a fallback), its compiling (a minute on a CPU, while the PS waits) and when
# that is done or failed, the workers' failed tool calls and jobs ([tools] and [jobs] lines, rate-limited by the
# workers; a job past its deadline, once), the jobs recovery takes back from a worker gone or silent past the lease.
# tail ends when the PS does; neither Ctrl-C nor a SIGTERM to the whole process group (a scheduler's) stops it, so
# that the PS's last lines (its "interrupted" line, the checkpoint it saved on SIGTERM) still show.
{ trap '' INT TERM; tail --pid="$PS_PID" -q -n0 -F "$LOGS/log_parameter_server.txt" "${WORKER_LOG[@]}" 2>/dev/null |
    grep --line-buffered -E ' (INFO|WARNING) \[(train|eval)\]|^ps: error: | (WARNING|ERROR) \[(tools|jobs)\] | WARNING \[queue\] recover: | WARNING \[weights\] worker \S+ found | INFO \[gen\] dev\S+ (compiling|decodes|decoding compiled) | ERROR \[gen\] dev\S+ \S+ decoding failed '; } 9>&- &
TAIL_PID=$!

# ---- 4. supervise: restart dead workers until the PS exits -----------------------------------
# The loop's stderr is /dev/null: bash prints its own "line N: PID Killed ..." there when a process dies of a
# signal, and our lines name the process instead. What must reach the terminal's stderr goes to fd 3.
exec 3>&2
while kill -0 "$PS_PID" 2>/dev/null; do
    restart_dead_workers
    if [ "$WORKERS" -gt 0 ] && [ "${#WORKER_PID[@]}" -eq 0 ]; then  # each exited with bad input: none would generate
        say "no worker left (each exited with bad input): stopping the parameter server"
        kill -TERM "$PS_PID" 2>/dev/null; wait "$PS_PID" 2>/dev/null; wait "$TAIL_PID" 2>/dev/null
        stop_workers; free_dead_weight_buffers "$RUN_DIR"
        rm -f "$PS_STATUS_FILE"
        echo "$WORKER_ERROR" >&3
        exit 2
    fi
    sleep 1
done 2>/dev/null
wait "$PS_PID" 2>/dev/null; PS_STATUS=$?
PS_REASON=""  # its one-line reason, where it wrote one (ps/__main__.py leave_status_for_the_launcher)
if [ "$PS_STATUS" -ne 0 ] && [ -s "$PS_STATUS_FILE" ]; then
    PS_STATUS=$(head -n 1 "$PS_STATUS_FILE"); PS_REASON=$(sed -n 2p "$PS_STATUS_FILE")
fi
rm -f "$PS_STATUS_FILE"

# ---- 5. stop the workers; report ------------------------------------------------------------
stop_workers
wait "$TAIL_PID" 2>/dev/null
free_dead_weight_buffers "$RUN_DIR"  # nothing to free unless the PS was killed (SIGKILL, out of memory)
if [ "$PS_STATUS" -ne 0 ]; then
    case "$PS_STATUS" in  # 128 + N: signal N
        130) HOW=" (interrupted: SIGINT, Ctrl-C)" ;;
        137) HOW=" (killed: SIGKILL, by kill -9 or the kernel's out-of-memory killer)" ;;
        143) HOW=" (stopped: SIGTERM)" ;;
        *)   HOW="" ;;
    esac
    # (a new interpreter, not the fork server's client: the server may be what died)
    SAVED=$("$VENV_PY" -c 'import sys; from asyncgrpo.run.checkpoints import newest_complete_checkpoint as newest
saved = newest(sys.argv[1]); print(saved.name if saved else "")' "$RUN_DIR/checkpoints" 2>/dev/null)
    if [ "$PS_STATUS" -eq 2 ] || [ "$PS_STATUS" -eq 3 ]; then  # bad input, another PS: a relaunch would stop again
        NEXT="Relaunch with --run-dir $RUN_DIR once what it names is fixed"
    elif [ -n "$SAVED" ]; then
        NEXT="Relaunch with --run-dir $RUN_DIR to resume from $SAVED"
    else
        NEXT="No checkpoint was saved: a relaunch with --run-dir $RUN_DIR starts from the beginning"
    fi
    say "the parameter server exited with status $PS_STATUS$HOW; workers stopped. $NEXT." \
        "Its log: $LOGS/log_parameter_server.txt"
    # Its last error, unless it ended with its one-line reason, already shown above (not its last lines: those
    # are often TRL's metric dictionaries).
    if [ "$PS_PROCS" -gt 1 ] && grep -aq 'Root Cause (first observed failure)' "$LOGS/log_parameter_server.txt"; then
        # torchrun's banner: the rank that failed first, its exit code and signal, in one line.
        awk '/Root Cause \(first observed failure\)/ { why = ""; on = 1; next }
             on && (/^ *(rank|exitcode) *:/ || /^ *traceback *: Signal/) {
                 sub(/^ +/, ""); sub(/ +$/, ""); gsub(/ +: /, ": "); why = why (why ? "; " : "") $0 }
             /^=+$/ { on = 0 }
             END { if (why) print "torchrun: the first PS rank to fail: " why }' "$LOGS/log_parameter_server.txt" >&2
    elif [ -n "$PS_REASON" ]; then  # shown above from its log, unless the log could not take it (a full disk)
        grep -qxF -- "$PS_REASON" "$LOGS/log_parameter_server.txt" 2>/dev/null || echo "$PS_REASON" >&2
    elif ! tail -n 1 "$LOGS/log_parameter_server.txt" | grep -q '^ps: error: '; then
        grep -aE ' ERROR |^[A-Za-z_.]*(Error|Exception|Interrupt)(: |$)' "$LOGS/log_parameter_server.txt" |
            tail -n 1 | cut -c1-500 >&2
    fi
    exit "$PS_STATUS"
fi
say "training finished. Metrics: $RUN_DIR/metrics.jsonl"
# A job a worker had in hand when it stopped (given back, or left by a worker killed after 30 s) is archived
# unused by cleanup on a finished run: nothing is left pending or processing.
"$PY" -m queue_tools cleanup "$RUN_DIR" | grep -v '^cleanup: nothing to do$' | while IFS= read -r line; do
    say "queue: $line"
done
"$PY" -m queue_tools ls "$RUN_DIR"
exit 0
}
