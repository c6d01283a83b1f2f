#!/usr/bin/env bash
# The Slurm batch script on a real Slurm: bash scripts/slurm_check.sh [--keep]
#
# Installs Slurm and MUNGE from the distribution's packages where they are missing (as root: apt-get), starts a
# private cluster of two nodes on this machine (slurmctld and one slurmd per node, its own MUNGE daemon, config,
# ports and state in a temporary folder; nothing of the machine's own is used or changed), and on CPU:
#   1. submits scripts/slurm/asyncgrpo.sbatch: 2 nodes x 2 tasks (the PS and a worker on the first node, two
#      workers on the second), the demo task from a user's folder outside the repository;
#   2. adds a job array of 2 workers (--join RUN) mid-run, and cancels one element (scancel) while it works;
#   3. requeues the main job mid-run (scontrol requeue: SIGTERM to every process, then the job starts again);
# and checks that the run finishes, that the requeued PS saved a checkpoint and resumed from it, that the array's
# workers trained jobs and the cancelled one lost none, and that every job was trained exactly once. One line
# PASS/FAIL per check; exit status 0 when all pass. --keep leaves the cluster's folder (logs, the run) behind.
set -uo pipefail
REPO_ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
KEEP=""; [ "${1:-}" = --keep ] && KEEP=1
STEPS=3000  # the demo trains ~40 steps/s on 2 cores: long enough for the array and the requeue to land mid-run
FAILED=0
say() { echo "[slurm_check] $(date +%T) $*"; }
check() {  # check NAME CONDITION-COMMAND...: PASS or FAIL
    local name="$1"; shift
    if "$@"; then echo "PASS  $name"; else echo "FAIL  $name"; FAILED=$((FAILED + 1)); fi
}
die() { echo "FAIL  $*"; exit 1; }

# ---- 1. Slurm and MUNGE ---------------------------------------------------------------------------------------
if ! command -v slurmctld > /dev/null || ! command -v slurmd > /dev/null || ! command -v sbatch > /dev/null ||
        ! command -v munged > /dev/null; then
    [ "$(id -u)" -eq 0 ] || die "Slurm or MUNGE is missing, and installing them needs root (apt-get)"
    say "installing slurmctld, slurmd, slurm-client and munge (apt-get)"
    { apt-get update -q && DEBIAN_FRONTEND=noninteractive apt-get install -y -q slurmctld slurmd slurm-client munge; } \
        > /tmp/slurm_check_apt.txt 2>&1 || die "apt-get could not install Slurm (see /tmp/slurm_check_apt.txt)"
fi
source "$REPO_ROOT/scripts/bootstrap.sh" || die "could not install the project's environment"

# ---- 2. a private two-node cluster ----------------------------------------------------------------------------
CLUSTER=$(mktemp -d /tmp/asyncgrpo-slurm-check.XXXXXX)
chmod 755 "$CLUSTER"
mkdir -p "$CLUSTER"/{state,spool,log,user}
stop_cluster() {
    [ -f "$CLUSTER/slurm.conf" ] && SLURM_CONF="$CLUSTER/slurm.conf" scancel --user "$(id -un)" 2> /dev/null
    sleep 1
    for pid_file in "$CLUSTER"/*.pid; do [ -f "$pid_file" ] && kill "$(cat "$pid_file")" 2> /dev/null; done
    # A job's processes that outlive their slurmd (none should) would hold the run's files.
    pkill -f "$CLUSTER/run" 2> /dev/null
    if [ -n "$KEEP" ]; then say "kept $CLUSTER"; else rm -rf "$CLUSTER"; fi
}
trap stop_cluster EXIT
read -r CTLD_PORT SLURMD_PORT NODE1_PORT NODE2_PORT < <("$VENV_PY" -c '
import socket
sockets = [socket.socket() for _ in range(4)]
for s in sockets:
    s.bind(("127.0.0.1", 0))
print(*(s.getsockname()[1] for s in sockets))')
mungekey --create --keyfile="$CLUSTER/munge.key" > /dev/null 2>&1 ||
    dd if=/dev/urandom of="$CLUSTER/munge.key" bs=1024 count=1 2> /dev/null
chmod 600 "$CLUSTER/munge.key"
munged --force --socket="$CLUSTER/munge.sock" --key-file="$CLUSTER/munge.key" --pid-file="$CLUSTER/munged.pid" \
    --log-file="$CLUSTER/log/munged.log" --seed-file="$CLUSTER/munged.seed" || die "munged did not start"
NODE_CPUS=8  # (more than the machine has: SlurmdParameters=config_overrides; the checks need slots, not speed)
cat > "$CLUSTER/slurm.conf" <<EOF
ClusterName=asyncgrpocheck
SlurmctldHost=localhost
SlurmUser=$(id -un)
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket=$CLUSTER/munge.sock
StateSaveLocation=$CLUSTER/state
SlurmdSpoolDir=$CLUSTER/spool/%n
SlurmctldPidFile=$CLUSTER/slurmctld.pid
SlurmdPidFile=$CLUSTER/slurmd-%n.pid
SlurmctldLogFile=$CLUSTER/log/slurmctld.log
SlurmdLogFile=$CLUSTER/log/slurmd-%n.log
SlurmctldPort=$CTLD_PORT
SlurmdPort=$SLURMD_PORT
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
SlurmdParameters=config_overrides
ReturnToService=2
MpiDefault=none
KillWait=60
MinJobAge=3600
NodeName=node1 NodeHostname=localhost Port=$NODE1_PORT CPUs=$NODE_CPUS RealMemory=2000 State=UNKNOWN
NodeName=node2 NodeHostname=localhost Port=$NODE2_PORT CPUs=$NODE_CPUS RealMemory=2000 State=UNKNOWN
PartitionName=check Nodes=node1,node2 Default=YES MaxTime=INFINITE State=UP
EOF
export SLURM_CONF="$CLUSTER/slurm.conf"
slurmctld -i || die "slurmctld did not start (see $CLUSTER/log/slurmctld.log)"
for node in node1 node2; do slurmd -N "$node" || die "slurmd $node did not start (see $CLUSTER/log)"; done
for _ in $(seq 1 60); do [ "$(sinfo -h -t idle -o %D 2> /dev/null)" = 2 ] && break; sleep 1; done
[ "$(sinfo -h -t idle -o %D)" = 2 ] || die "the cluster's two nodes did not come up: $(sinfo 2>&1 | tail -n 2)"
say "cluster up: $(sinfo -h -o '%P %D nodes %t %N') (Slurm $(sinfo -V | cut -d' ' -f2))"

# ---- 3. the run ---------------------------------------------------------------------------------------------
RUN="$CLUSTER/run"
FLAGS=(--max-steps "$STEPS" --save_steps 700 --lease_s 5 --seed 0)
SBATCH="$REPO_ROOT/scripts/slurm/asyncgrpo.sbatch"
cd "$CLUSTER/user"  # a user's folder: the jobs' output files land here
step() { cat "$RUN/global_step.txt" 2> /dev/null || echo 0; }
job_field() { scontrol show job "$1" 2> /dev/null | grep -o "$2=[^ ]*" | head -n 1 | cut -d= -f2; }
wait_until() {  # wait_until SECONDS WHAT COMMAND...
    local deadline=$((SECONDS + $1)) what="$2"; shift 2
    until "$@"; do
        [ "$SECONDS" -lt "$deadline" ] || { say "gave up waiting for $what"; return 1; }
        sleep 0.5
    done
}
reached() { [ "$(step)" -ge "$1" ]; }
MAIN=$(sbatch --parsable --nodes 2 --ntasks-per-node 2 "$SBATCH" --run-dir "$RUN" "${FLAGS[@]}") ||
    die "sbatch of the main job failed"
say "main job $MAIN: the PS and a worker on node1, two workers on node2"
wait_until 300 "training to reach step 100" reached 100 || die "the run did not train (see $CLUSTER/user/asyncgrpo-$MAIN.out)"

ARRAY=$(sbatch --parsable --array 0-1 --nodes 1 --ntasks-per-node 1 "$SBATCH" --join "$RUN" "${FLAGS[@]}") ||
    die "sbatch of the worker array failed"
both_running() { [ "$(squeue -h -j "$ARRAY" -t RUNNING -o %i | wc -l)" -eq 2 ]; }
wait_until 120 "the array's two jobs to start" both_running || die "the worker array did not start: $(squeue 2>&1)"
ELEMENT0=$(job_field "${ARRAY}_0" JobId) ELEMENT1=$(job_field "${ARRAY}_1" JobId)
say "worker array $ARRAY (jobs $ELEMENT0 and $ELEMENT1) submitted at step $(step)"
host_of() { grep -ao 'host id [0-9a-f]*' "asyncgrpo-$1.out" 2> /dev/null | head -n 1 | cut -d' ' -f3; }
claimed_by() { local h; h=$(host_of "$1"); [ -n "$h" ] && grep -aq '"job_claimed"' "$RUN/logs/events-worker-dev1.$h.jsonl" 2> /dev/null; }
wait_until 240 "the array's workers to claim jobs" claimed_by "$ELEMENT0" && wait_until 60 "" claimed_by "$ELEMENT1"
ARRAY_HOSTS=("$(host_of "$ELEMENT0")" "$(host_of "$ELEMENT1")")
scancel "${ARRAY}_1"  # (by array index: the array's first job id names the whole array)
say "cancelled array job ${ARRAY}_1 = $ELEMENT1 (worker dev1.${ARRAY_HOSTS[1]}) at step $(step)"

wait_until 300 "step $((STEPS / 2))" reached $((STEPS / 2))
REQUEUED_AT=$(step)
scontrol requeue "$MAIN" || die "scontrol requeue $MAIN failed"
say "requeued main job $MAIN at step $REQUEUED_AT"
# Slurm holds a requeued job for a while (its BeginTime); the check releases it once it is pending again.
pending() { [ "$(job_field "$MAIN" JobState)" = PENDING ]; }
wait_until 120 "the requeued job to be pending" pending && scontrol update JobId="$MAIN" StartTime=now
finished() { [ "$(job_field "$MAIN" JobState)" = COMPLETED ]; }
ended() { case "$(job_field "$1" JobState)" in COMPLETED|FAILED|CANCELLED|TIMEOUT|NODE_FAIL|OUT_OF_MEMORY) return 0 ;; esac; return 1; }
wait_until 900 "the main job to complete" finished
wait_until 120 "the array job to leave" ended "$ELEMENT0"
say "main job $MAIN: $(job_field "$MAIN" JobState), restarts $(job_field "$MAIN" Restarts); array job $ELEMENT0: $(job_field "$ELEMENT0" JobState)"

# ---- 4. checks ----------------------------------------------------------------------------------------------
PS_LOG="$RUN/logs/log_parameter_server.txt"
# (a SIGTERM that comes right after a save_steps checkpoint finds it saved already)
SAVED=$(grep -aoE 'stopped after step [0-9]+ on SIGTERM, its checkpoint (saved|was saved already)' "$PS_LOG" |
        head -n 1 | grep -o '[0-9]*')
check "the run finished: $STEPS steps, final model saved" \
    grep -q "\"state\": \"finished\"" "$RUN/ps.json"
check "the main job completed after one requeue (exit 0)" \
    test "$(job_field "$MAIN" JobState) $(job_field "$MAIN" Restarts) $(job_field "$MAIN" ExitCode)" = "COMPLETED 1 0:0"
check "the requeued PS saved a checkpoint on SIGTERM (step ${SAVED:-none}, requeued at step $REQUEUED_AT)" \
    test -n "$SAVED"
check "the requeued job resumed from that checkpoint" \
    grep -q "resuming from $RUN/checkpoints/checkpoint-${SAVED:-none}\$" "$PS_LOG"
check "each array worker trained jobs (dev1.${ARRAY_HOSTS[0]}, dev1.${ARRAY_HOSTS[1]})" \
    "$VENV_PY" - "$RUN" "${ARRAY_HOSTS[@]}" <<'EOF'
import json, sys
from pathlib import Path
run, hosts = Path(sys.argv[1]), sys.argv[2:]
done = {json.loads(line)["job_id"] for line in (run / "logs" / "events-ps.jsonl").open()
        if '"result_consumed"' in line}
for host in hosts:
    mine = {json.loads(line)["job_id"] for line in (run / "logs" / f"events-worker-dev1.{host}.jsonl").open()
            if '"job_claimed"' in line}
    if not mine & done:
        sys.exit(f"worker dev1.{host}: none of its {len(mine)} claimed jobs was trained")
EOF
check "the cancelled array job ended and the other left when the run finished" \
    test "$(job_field "$ELEMENT1" JobState) $(job_field "$ELEMENT0" JobState)" = "CANCELLED COMPLETED"
check "every job trained exactly once (ledger = done/ consumed, none twice, none lost)" \
    "$VENV_PY" - "$RUN" "$STEPS" <<'EOF'
import json, os, re, sys
from collections import Counter
from pathlib import Path
from asyncgrpo.run.checkpoints import LEDGER_FILE, newest_complete_checkpoint
run, steps = Path(sys.argv[1]), int(sys.argv[2])
ledger = json.loads((newest_complete_checkpoint(run / "checkpoints") / LEDGER_FILE).read_text())["consumed"]
consumed = [m[1] for name in os.listdir(run / "done")
            if (m := re.match(r"^(\d{6}_\d{3})_consumed(?:_a\d+)?(?:\.\d+)?\.pt$", name))]
created = [json.loads(line)["job_id"] for line in (run / "logs" / "events-ps.jsonl").open() if '"job_created"' in line]
twice = {name: [k for k, n in Counter(ids).items() if n > 1] for name, ids in
         (("ledger", ledger), ("done/", consumed), ("thrown", created))}
problems = [f"twice in {name}: {ids[:5]}" for name, ids in twice.items() if ids]
if len(ledger) != steps:
    problems.append(f"the ledger holds {len(ledger)} jobs, not {steps}")
if sorted(ledger) != sorted(consumed):
    problems.append(f"ledger and done/ differ: {sorted(set(ledger) ^ set(consumed))[:5]}")
if not set(ledger) <= set(created):
    problems.append("consumed jobs that were never thrown")
leftover = [p.name for p in (run / "queue").iterdir() if p.name.endswith(".pt")]
if leftover:
    problems.append(f"jobs left in queue/: {leftover[:5]}")
sys.exit("; ".join(problems) or None)
EOF
echo "$([ "$FAILED" -eq 0 ] && echo "all checks passed" || echo "$FAILED check(s) failed")$([ -n "$KEEP" ] &&
    echo ": logs in $RUN/logs and $CLUSTER/user" || echo " (--keep keeps the cluster's logs and the run)")"
[ "$FAILED" -eq 0 ]
