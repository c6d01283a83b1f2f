#!/usr/bin/env bash
# Start and supervise workers only, on a host other than the PS's, against a run directory
# this host mounts (NFS, ...). Run through launch.sh:
#
#   bash launch.sh --join RUN [--workers N] [--device cpu|cuda] [--exit-when-finished] [config flags, the same as the PS's]
#
# The PS must publish safetensors snapshots (start it with --weight_transport safetensors): a
# worker on another host cannot read the PS's /dev/shm buffers or GPU memory. Worker i is
# dev{i}.{host id} in the queue's file names (host id: asyncgrpo/run/hosts.py,
# $ASYNCGRPO_HOST_ID overrides it) and runs on GPU (i-1) mod G (of those a CUDA_VISIBLE_DEVICES set
# before names, else of all the host's). Logs: RUN/logs/
# log_worker_{i}.{host id}.txt and launch-{host id}.txt. A worker that exits is restarted (its
# job returns through recovery); when the PS finishes (RUN/ps.json says so), or on Ctrl-C,
# the workers are stopped: each finishes, or gives back, the job in hand. Joining a run whose PS
# has already finished, or has not started, waits for its next PS (a relaunch that trains
# further), saying so once a minute; with --exit-when-finished (what a scheduler's job array of
# workers passes: it must not hold its nodes) it stops as soon as RUN/ps.json says finished.
set -uo pipefail
{  # (read whole before it runs: an edit or a git pull while a run goes does not change that run's script)
REPO_ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
die() { echo "launch.sh: error: $*" >&2; exit 2; }
say() { echo "[launch --join] $*"; [ -n "${LOGS:-}" ] && echo "$(date '+%F %T') $*" >> "$LOGS/launch-$HOST_ID.txt"; return 0; }

# ---- 1. arguments ------------------------------------------------------------------------
for arg in "$@"; do  # (anywhere: `--join --help` too)
    [[ "$arg" =~ ^(-h|--help)$ ]] && { awk 'NR > 1 && /^#/ { sub(/^# ?/, ""); print; next } NR > 1 { exit }' "$0"; exit 0; }
done
RUN="" WORKERS=1 DEVICE=auto EXIT_WHEN_FINISHED="" PASS=()
while [ $# -gt 0 ]; do
    case "$1" in
        --join)      [ $# -ge 2 ] || die "--join needs a run directory"; RUN="$2"; shift 2 ;;
        --workers)   [ $# -ge 2 ] || die "--workers needs a value"; WORKERS="$2"; shift 2 ;;
        --device)    [ $# -ge 2 ] || die "--device needs a value"; DEVICE="$2"; shift 2 ;;
        --run-dir)   die "--run-dir: with --join the run directory is the one after --join" ;;
        --exit-when-finished) EXIT_WHEN_FINISHED=1; shift ;;
        --max-steps) [ $# -ge 2 ] || die "--max-steps needs a value"; PASS+=(--max_steps "$2"); shift 2 ;;
        *)           PASS+=("$1"); shift ;;
    esac
done
[[ "$WORKERS" =~ ^[1-9][0-9]{0,2}$ ]] || die "--workers needs an integer from 1 to 999, got '$WORKERS'"
[[ "$DEVICE" =~ ^(auto|cpu|cuda)$ ]] || die "--device must be cpu, cuda or auto, got '$DEVICE'"
[ -n "$RUN" ] || die "no run directory: bash launch.sh --join RUN [--workers N] [flags...] (--help says more)"
# A run whose launch.sh is still starting its PS (the PS makes queue/ and done/ once it has imported its libraries:
# 10-20 s) is waited for; a folder that is no run, or whose launch stopped before its PS made them, is refused.
LAUNCH_STARTING_WAIT_S=600
is_run() { [ -d "$RUN/queue" ] && [ -d "$RUN/done" ]; }
launch_running() { [ -f "$RUN/launch.lock" ] && command -v flock > /dev/null && ! flock -n "$RUN/launch.lock" true; }
if ! is_run && launch_running; then
    echo "[launch --join] $RUN is not a run yet: its launch.sh ($(cat "$RUN/launch.lock" 2>/dev/null)) is starting" \
         "its parameter server; waiting for it to make RUN/queue and RUN/done (at most $LAUNCH_STARTING_WAIT_S s)"
    STARTING_SINCE=$SECONDS
    while ! is_run && launch_running && [ $(( SECONDS - STARTING_SINCE )) -lt "$LAUNCH_STARTING_WAIT_S" ]; do
        sleep 0.5
    done
fi
if ! is_run; then
    [ -f "$RUN/launch.lock" ] && die "$RUN is not an asyncgrpo run directory (no queue/ and done/ inside): a" \
        "launch.sh started there ($(cat "$RUN/launch.lock" 2>/dev/null)) but its parameter server never made them"
    die "$RUN is not an asyncgrpo run directory (no queue/ and done/ inside)"
fi
RUN="$(cd "$RUN" && pwd)"

# ---- 2. environment and input checks, before any process starts -------------------------------
source "$REPO_ROOT/scripts/bootstrap.sh" || die "could not install the environment (see above)"
# As launch.sh: the processes run in this folder (relative paths, reward modules), the repository first on the path.
export PYTHONPATH="$REPO_ROOT${PYTHONPATH:+:$PYTHONPATH}" PYTHONSAFEPATH=1 PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
source "$REPO_ROOT/scripts/launch_common.sh"  # checked_inputs, stop_workers, restart_dead_workers
ARGS=(--run_dir "$RUN" --device_type "$DEVICE" --disable_tqdm true "${PASS[@]}")
start_fork_server "$DEVICE"  # (the check below is its first fork)
trap end_fork_server EXIT
CHECKED=$("$PY" -m ps --check_only --joining "${ARGS[@]}") || exit 2  # it printed the one-line reason
checked_inputs "$CHECKED"
ARGS[3]="$DEVICE"  # (auto resolved)
HOST_ID=$("$PY" -c 'from asyncgrpo.run.hosts import HOST_ID; print(HOST_ID)') || die "no host id"
LOGS="$RUN/logs"
set_file_modes "${PASS[@]}"

if [ "$DEVICE" = cpu ]; then
    THREADS=$(( $(nproc) / WORKERS )); [ "$THREADS" -ge 1 ] || THREADS=1
    export OMP_NUM_THREADS=$THREADS MKL_NUM_THREADS=$THREADS
fi
# The processes started below stop when this script is gone, however it goes (asyncgrpo/supervisor.py).
export ASYNCGRPO_SUPERVISOR_PID=$$

# ---- 3. start the workers -------------------------------------------------------------------
declare -A WORKER_PID WORKER_LOG WORKER_STARTED WORKER_BEAT
start_worker() {
    local gpus=""
    [ "$NGPU" -gt 0 ] && gpus=${GPU_IDS[$(( ($1 - 1) % NGPU ))]}
    WORKER_LOG[$1]="$LOGS/log_worker_$1.$HOST_ID.txt"
    WORKER_LOG_AT[$1]=$(stat -c %s "${WORKER_LOG[$1]}" 2>/dev/null || echo 0)  # (worker_error reads from here)
    WORKER_STARTED[$1]=$(date +%s.%N) WORKER_BEAT[$1]="$RUN/workers/dev$1.$HOST_ID.json"  # (launch_common.sh)
    CUDA_VISIBLE_DEVICES=$gpus "$PY" -m worker --join --device "$1" "${ARGS[@]}" >> "${WORKER_LOG[$1]}" 2>&1 &
    WORKER_PID[$1]=$!
}
# The PS finished when ps.json says so and is not the file we found at start (a finished run
# may be relaunched to train further: then its new PS rewrites ps.json).
PS_JSON_AT_START=$(cat "$RUN/ps.json" 2>/dev/null)
ps_finished() {
    local now
    now=$(cat "$RUN/ps.json" 2>/dev/null) || return 1
    { [ -n "$EXIT_WHEN_FINISHED" ] || [ "$now" != "$PS_JSON_AT_START" ]; } && [[ "$now" == *'"state": "finished"'* ]]
}
# What the workers wait for, when they wait for a PS (a line once a minute; empty while one trains).
waiting_for() {
    local now
    now=$(cat "$RUN/ps.json" 2>/dev/null) || { echo "its parameter server to start (no RUN/ps.json yet)"; return; }
    [ "$now" = "$PS_JSON_AT_START" ] && [[ "$now" == *'"state": "finished"'* ]] &&
        echo "its parameter server to be relaunched (it had finished when they joined); Ctrl-C to stop them"
}
say "joining $RUN from $(hostname) (host id $HOST_ID, $DEVICE, $WORKERS worker(s) dev1.$HOST_ID...); logs in $LOGS"
for i in $(seq 1 "$WORKERS"); do start_worker "$i"; done
JOINED_AT=$SECONDS NEXT_SAY=0

on_interrupt() {  # $1: 128 + the signal (exited with, as launch.sh does), $2: its name
    trap 'kill_now "${WORKER_PID[@]}"; exit '"$1" INT TERM HUP
    if [ "$1" -eq 130 ]; then say "interrupted: stopping the workers (Ctrl-C again: kill them now)"
    else say "got $2: stopping the workers (a second signal kills them now)"; fi
    stop_workers
    exit "$1"
}
trap 'on_interrupt 130 SIGINT' INT
trap 'on_interrupt 143 SIGTERM' TERM
trap 'on_interrupt 129 SIGHUP' HUP  # the terminal closed

# ---- 4. supervise: restart dead workers until the PS finishes -----------------------------------
exec 3>&2  # as in launch.sh: the loop's stderr is /dev/null (bash's own "Killed" lines), fd 3 the terminal's
while ! ps_finished; do
    if [ "$SECONDS" -ge "$NEXT_SAY" ]; then
        what=$(waiting_for)
        waited=$(( (SECONDS - JOINED_AT) / 60 ))  # (said first at the join, then once a minute)
        [ "$waited" -gt 0 ] && waited=" (for $waited min)" || waited=""
        [ -n "$what" ] && say "the workers wait for $what$waited"
        NEXT_SAY=$(( SECONDS + 60 ))
    fi
    restart_dead_workers
    if [ "${#WORKER_PID[@]}" -eq 0 ]; then  # every worker exited with bad input
        say "no worker left (each exited with bad input): this host stops; the run goes on with the others"
        echo "$WORKER_ERROR" >&3
        exit 2
    fi
    sleep 1
done 2>/dev/null
say "the parameter server finished: stopping the workers"
stop_workers
exit 0
}
