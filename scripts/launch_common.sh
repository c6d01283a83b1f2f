# What launch.sh and scripts/join.sh share (sourced, not run): the device, and the workers' supervision.
# Expects VENV_PY and die; the supervision also WORKER_PID and WORKER_LOG (associative arrays: worker
# number -> pid, log file), start_worker N and say.

# The interpreter that runs the project's modules: the environment's; scripts/forked_python once
# start_fork_server has started a fork server; ASYNCGRPO_PYTHON where it names another (the test suite's, a client
# of the suite's own fork server).
PY="${ASYNCGRPO_PYTHON:-$VENV_PY}"

# start_fork_server DEVICE: where no GPU is seen (or DEVICE is cpu), one interpreter imports torch, transformers and
# TRL while the launch goes on, and every Python process the launch starts after is a fork of it
# (asyncgrpo/forkserver.py): seconds of CPU less for each. It ends after this script and the processes it forked,
# and outlives the signals they get (Ctrl-C, a closed terminal, a scheduler's SIGTERM to every process). On a GPU
# machine (CUDA cannot be initialised in a process that then forks), with ASYNCGRPO_PYTHON set, or with
# ASYNCGRPO_FORK=0, each process starts as a new interpreter.
start_fork_server() {
    [ -z "${ASYNCGRPO_PYTHON:-}" ] && [ "${ASYNCGRPO_FORK:-1}" != 0 ] || return 0
    if [ "$1" != cpu ] && { compgen -G '/dev/nvidia[0-9]*' > /dev/null || [ -e /dev/kfd ] || [ -e /dev/dxg ]; }; then
        return 0
    fi
    local folder
    folder=$(mktemp -d "${TMPDIR:-/tmp}/asyncgrpo-forks.XXXXXX") || return 0
    # (named for its protocol: forkserver.py's SOCKET_SUFFIX)
    "$VENV_PY" "$REPO_ROOT/asyncgrpo/forkserver.py" "$folder/server.v2.sock" < /dev/null 9>&- &
    FORK_FOLDER=$folder
    export ASYNCGRPO_FORK_SERVER="$folder/server.v2.sock" ASYNCGRPO_FORK_PYTHON="$VENV_PY"
    PY="$REPO_ROOT/scripts/forked_python"
}
end_fork_server() {  # (at the script's exit: the server's folder, which it removes itself unless it was killed)
    [ -n "${FORK_FOLDER:-}" ] && rm -rf "$FORK_FOLDER"
    return 0
}

# checked_inputs CHECK_OUTPUT: what `python -m ps --check_only` printed, the one interpreter a launch runs before
# its processes: sets RUN_DIR, DEVICE (auto resolved: cuda or cpu), NGPU (GPUs torch sees on cuda, else 0) and
# GPU_IDS (their CUDA_VISIBLE_DEVICES names: those of a CUDA_VISIBLE_DEVICES set before the launch, as a scheduler
# sets it for the GPUs it gave the job, else 0..NGPU-1). The processes' own CUDA_VISIBLE_DEVICES are picked from
# GPU_IDS.
checked_inputs() {
    { read -r RUN_DIR; read -r DEVICE NGPU; } <<< "$1"
    GPU_IDS=()
    [ "$DEVICE" = cuda ] && [ "$NGPU" -eq 0 ] && die "--device cuda, but torch sees no GPU"
    if [ "$NGPU" -gt 0 ]; then
        if [ -n "${CUDA_VISIBLE_DEVICES:-}" ]; then IFS=, read -r -a GPU_IDS <<< "$CUDA_VISIBLE_DEVICES"
        else GPU_IDS=($(seq 0 $(( NGPU - 1 )))); fi
        GPU_IDS=("${GPU_IDS[@]:0:$NGPU}")  # (torch stops at the first id it cannot use)
    fi
    return 0
}

gpu_env() {  # gpu_env I: launch.sh's CUDA_VISIBLE_DEVICES for worker I (0: the PS; launch.sh's header says
    # where each runs), from GPU_IDS; expects NGPU, GPU_IDS and PS_PROCS
    if [ "$NGPU" -eq 0 ]; then echo ""; return; fi
    local first="${GPU_IDS[0]}"
    if [ "$PS_PROCS" -gt 1 ]; then  # the PS's GPUs are 0..K-1; the workers' the others (GPU 0 when none is left)
        if [ "$1" -eq 0 ]; then local ps_gpus=("${GPU_IDS[@]:0:$PS_PROCS}"); (IFS=,; echo "${ps_gpus[*]}"); return; fi
        if [ "$NGPU" -eq "$PS_PROCS" ]; then echo "$first"; return; fi
        echo "${GPU_IDS[$(( PS_PROCS + ($1 - 1) % (NGPU - PS_PROCS) ))]},$first"; return
    fi
    local gpu=$(( $1 % NGPU ))
    if [ "$gpu" -eq 0 ]; then echo "$first"; else echo "${GPU_IDS[$gpu]},$first"; fi
}

# Two launches on one run folder at the same moment both pass `ps --check_only` (no PS runs yet): claim_run RUN
# takes an exclusive lock on RUN/launch.lock for the shell's life (fd 9, which the processes it starts must not
# inherit: `9>&-`), and writes its holder into it; the second launch exits 3 naming the holder, having started
# and written nothing.
claim_run() {
    local why
    [ -e "$1" ] && [ ! -d "$1" ] && die "--run-dir $1: not a folder (a file of that name is there)"
    why=$(mkdir -p "$1" 2>&1) || die "--run-dir $1: cannot create it: ${why##*: }"
    if ! command -v flock > /dev/null; then  # (util-linux's; the PS's own lock still keeps a second PS off)
        say "flock is not installed: a second launch.sh at the same moment on $1 would not be refused"
        return 0
    fi
    { exec 9<> "$1/launch.lock"; } 2> /dev/null || die "--run-dir $1: not writable (cannot create launch.lock in it)"
    if ! flock -n 9; then
        local holder="" _
        for _ in $(seq 1 20); do  # the holder writes itself right after it takes the lock
            holder=$(cat "$1/launch.lock" 2>/dev/null); [ -n "$holder" ] && break; sleep 0.1
        done
        echo "launch.sh: error: another launch.sh is running on $1 (${holder:-its pid not written}); nothing started" >&2
        exit 3
    fi
    echo "pid $$ on $(hostname)" > "$1/launch.lock"
}

set_file_modes() {  # set_file_modes FLAG...: what launch.sh creates (logs) is as private as the PS's files
    umask 077
    local i value
    for ((i = 1; i <= $#; i++)); do
        case "${!i}" in
            --share_with_group) value="${@:i+1:1}"; [[ "$value" =~ ^(false|False|no|n|f|0)$ ]] || umask 007 ;;
            --share_with_group=*) [[ "${!i#*=}" =~ ^(false|False|no|n|f|0)$ ]] || umask 007 ;;
        esac
    done
}

free_dead_weight_buffers() {  # free_dead_weight_buffers RUN: a PS that was killed cannot free its own
    "$PY" -c 'import sys
from asyncgrpo.run import RunDir
from asyncgrpo.weights.buffer_folders import SHM_ROOT, remove_dead_folders
run = RunDir.open(sys.argv[1])
for dead in remove_dead_folders(run, (SHM_ROOT, run.weights)):
    print(f"[launch] freed {dead.nbytes / 1e6:.1f} MB of weight buffers the parameter server left in {dead.path}")
' "$1" || true
}

STOP_SAY_AFTER=20  # tenths of a second: a worker still running this long after SIGTERM is said to be waited for
stop_workers() {  # SIGTERM: each finishes, or gives back, the job in hand; SIGKILL after 30 s
    local pids=("${WORKER_PID[@]}") tick running
    [ "${#pids[@]}" -gt 0 ] || return 0
    kill -TERM "${pids[@]}" 2>/dev/null
    for tick in $(seq 1 300); do
        running=0
        for pid in "${pids[@]}"; do kill -0 "$pid" 2>/dev/null && running=$(( running + 1 )); done
        [ "$running" -gt 0 ] || break
        [ "$tick" -eq "$STOP_SAY_AFTER" ] && say "waiting for $running worker(s) to finish or give back the job" \
            "in hand (a generation or reward in progress; at most $(( (300 - tick) / 10 )) s more, then they are killed)"
        sleep 0.1
    done
    kill -KILL "${pids[@]}" 2>/dev/null
    wait "${pids[@]}" 2>/dev/null
}

# A second Ctrl-C while the first one's stop still waits: SIGKILL now. Nothing is lost: a job in hand is recovered
# at the next start, and a checkpoint cut short is ignored (its ledger is written last).
kill_now() {  # kill_now PID...
    say "interrupted again: killing them now (a job in hand goes back to the queue at the next launch)"
    kill -KILL "$@" 2>/dev/null
    wait "$@" 2>/dev/null
}

# Worker N's own pid, as its heartbeat and queue_tools ls show it: a forked worker is not the process launch.sh
# started (that one is the fork server's client). The heartbeat's, when this start of the worker wrote it (its
# started_at after the start); else the process started.
worker_pid() {  # worker_pid N
    local pid
    pid=$(awk -v since="${WORKER_STARTED[$1]:-0}" '
        match($0, /"pid": *[0-9]+/) { pid = substr($0, RSTART, RLENGTH); sub(/.*: */, "", pid) }
        match($0, /"started_at": *[0-9.]+/) { at = substr($0, RSTART, RLENGTH); sub(/.*: */, "", at) }
        END { if (pid != "" && at + 0 > since + 0) print pid }' "${WORKER_BEAT[$1]:-/dev/null}" 2>/dev/null)
    echo "${pid:-${WORKER_PID[$1]}}"
}

# A worker's last "worker: error:" line since it was last started (WORKER_LOG_AT: its log's size then), if any.
worker_error() {
    tail -c +"$(( ${WORKER_LOG_AT[$1]:-0} + 1 ))" "${WORKER_LOG[$1]}" 2>/dev/null | grep -a '^worker: error: ' | tail -n 1
}

# One pass: a worker that exited is started again (its job returns through recovery), unless it exited 2:
# bad input (a flag, a reward module it cannot import, a model that is not the PS's) that a restart would
# only repeat. It is then dropped from WORKER_PID, and WORKER_ERROR keeps its one-line reason (said when the
# launcher stops); a restarted worker's reason, where it gave one (a full disk), follows the line that says it exited.
restart_dead_workers() {
    local i status why pid error
    for i in "${!WORKER_PID[@]}"; do
        if ! kill -0 "${WORKER_PID[$i]}" 2>/dev/null; then
            wait "${WORKER_PID[$i]}" 2>/dev/null; status=$?  # (not bash's "Killed" line: ours names the worker)
            pid=$(worker_pid "$i")
            error=$(worker_error "$i")
            if [ "$status" -eq 2 ]; then
                WORKER_ERROR=${error:-"worker: error: worker $i exited with status 2 (see ${WORKER_LOG[$i]})"}
                say "worker $i (pid $pid) exited with status 2, bad input: not restarted"
                unset "WORKER_PID[$i]"
                continue
            fi
            why=""; jobs="any job it held returns through recovery"
            [ "$status" -eq 3 ] && why=", its GPU failed"  # worker.loop.EXIT_DEVICE_BROKEN
            if [ "$status" -eq 4 ]; then  # worker.deadline.EXIT_JOB_DEADLINE
                why=", a job ran past --job_timeout_s"; jobs="that job failed as its attempt, its others given back"
            fi
            say "worker $i (pid $pid) exited with status $status$why: restarting it ($jobs)"
            [ -n "$error" ] && say "  $error"
            start_worker "$i"
        fi
    done
}

# NVIDIA MPS (--mps auto|on|off): without it, a GPU runs one process's kernels at a time, so the PS and the workers
# sharing a GPU take turns. start_mps SHARED MODE RUN: SHARED is 1 when a GPU holds more than one of the run's
# processes (auto starts MPS only then). The daemon runs as the user, its pipe and log folders in RUN/mps, and is
# tried with one CUDA call before any process relies on it: where it cannot start, one line says why and the run
# goes on without it. On a GPU, exports ASYNCGRPO_MPS ("on", or "off: why": ps.json and queue_tools ls show it);
# MPS_STARTED=1 when stop_mps has a daemon to stop.
start_mps() {
    local shared="$1" mode="$2" run="$3" why=""
    MPS_STARTED=""
    [ "$DEVICE" = cuda ] || return 0  # nothing to say on CPU
    if [ "$mode" = off ]; then why="--mps off"
    elif [ "$mode" = auto ] && [ "$shared" != 1 ]; then why="no GPU is shared by two processes"
    elif ! command -v nvidia-cuda-mps-control > /dev/null; then why="nvidia-cuda-mps-control is not on PATH"
    fi
    if [ -z "$why" ]; then
        export CUDA_MPS_PIPE_DIRECTORY="$run/mps/pipe" CUDA_MPS_LOG_DIRECTORY="$run/mps/log"
        mkdir -p "$CUDA_MPS_PIPE_DIRECTORY" "$CUDA_MPS_LOG_DIRECTORY"
        if ! nvidia-cuda-mps-control -d > "$CUDA_MPS_LOG_DIRECTORY/start.txt" 2>&1 9>&-; then
            why="nvidia-cuda-mps-control -d failed: $(tail -n 1 "$CUDA_MPS_LOG_DIRECTORY/start.txt")"
        else
            MPS_STARTED=1
            if ! timeout 120 "$VENV_PY" -c 'import torch; torch.ones(1, device="cuda").sum().item()' \
                    > "$CUDA_MPS_LOG_DIRECTORY/probe.txt" 2>&1; then
                why="a CUDA call under MPS failed: $(tail -n 1 "$CUDA_MPS_LOG_DIRECTORY/probe.txt")"
                stop_mps
            fi
        fi
        [ -n "$why" ] && unset CUDA_MPS_PIPE_DIRECTORY CUDA_MPS_LOG_DIRECTORY
    fi
    if [ -n "$why" ]; then
        export ASYNCGRPO_MPS="off: $why"
        if [ "$mode" = on ] || [ "$shared" = 1 ]; then
            say "NVIDIA MPS off ($why): the processes sharing a GPU take turns on it"
        fi
    else
        export ASYNCGRPO_MPS=on
        say "NVIDIA MPS on (control daemon in $CUDA_MPS_PIPE_DIRECTORY): the processes sharing a GPU run at once"
    fi
    return 0
}

stop_mps() {  # however the run ends (launch.sh's EXIT trap)
    [ -n "${MPS_STARTED:-}" ] || return 0
    echo quit | nvidia-cuda-mps-control > /dev/null 2>&1
    MPS_STARTED=""
    return 0
}
