"""launch.sh's stop of its workers at the end of a run (scripts/launch_common.sh stop_workers): SIGTERM, then a
line saying what it waits for while a worker is still finishing its job in hand, then SIGKILL after 30 s."""

from __future__ import annotations

import subprocess

import pytest
from helpers import REPO

pytestmark = pytest.mark.process

SCRIPT = """
say() { echo "[launch] $*"; }
source "$REPO/scripts/launch_common.sh"
bash -c "$FINISHING" "$DONE" & finishing=$!
sleep 600 & quick=$!
declare -A WORKER_PID=([1]=$finishing [2]=$quick)
sleep 0.5  # (their traps set)
stop_workers
echo "stopped"
"""
# A worker that, told to stop, finishes its job in hand: here, until the test says the job is done.
FINISHING = 'trap "while [ ! -e \\"$0\\" ]; do sleep 0.05; done; exit 0" TERM; while true; do sleep 0.05; done'


def test_a_worker_still_finishing_its_job_after_the_stop_is_said_to_be_waited_for(tmp_path):
    done = tmp_path / "job-done"
    stop = subprocess.Popen(["bash", "-c", SCRIPT], env={"REPO": str(REPO), "FINISHING": FINISHING, "DONE": str(done),
                                                         "PATH": "/usr/bin:/bin"}, stdout=subprocess.PIPE, text=True)
    try:
        line = stop.stdout.readline()
        assert line == ("[launch] waiting for 1 worker(s) to finish or give back the job in hand (a generation or "
                        "reward in progress; at most 28 s more, then they are killed)\n"), line
        done.touch()  # its job is done: it exits
        assert stop.stdout.readline() == "stopped\n"
        assert stop.wait(timeout=30) == 0
    finally:
        if stop.poll() is None:
            stop.kill()


@pytest.mark.parametrize("script", ["launch.sh", "scripts/join.sh"])
def test_the_launch_scripts_are_read_whole_before_they_run(script):
    """bash reads a script as it runs it: a launch.sh edited or updated by a git pull while a run goes broke that run's
    ending (a syntax error at its last lines, exit 2, no "training finished"). The script's commands are one brace
    group, which bash reads to its end before running any."""
    from helpers import REPO

    lines = (REPO / script).read_text().splitlines()
    body = lines[lines.index("set -uo pipefail") + 1:]
    assert body[0].startswith("{  #") and body[-1] == "}", (body[0], body[-1])
    assert subprocess.run(["bash", "-n", str(REPO / script)]).returncode == 0


RESTART_SCRIPT = """
say() { echo "[launch] $*"; }
source "$REPO/scripts/launch_common.sh"
start_worker() { echo "started $1"; sleep 600 & WORKER_PID[$1]=$!; }
declare -A WORKER_PID WORKER_LOG=([1]="$LOG" [2]="$LOG2")
echo "worker: error: an earlier life's reason" > "$LOG"
WORKER_LOG_AT[1]=$(stat -c %s "$LOG")
bash -c 'echo "worker: error: no space left on the disk: [Errno 28] No space left on device" >> "$0"; exit 1' "$LOG" &
WORKER_PID[1]=$!
WORKER_LOG_AT[2]=$(stat -c %s "$LOG2")
bash -c 'exit 1' & WORKER_PID[2]=$!
while kill -0 "${WORKER_PID[1]}" 2>/dev/null || kill -0 "${WORKER_PID[2]}" 2>/dev/null; do sleep 0.05; done
restart_dead_workers
kill "${WORKER_PID[@]}"
"""


def test_a_worker_restarted_after_a_failure_has_its_reason_said_after_the_line_that_says_so(tmp_path):
    """A worker that exits 1 on a full disk is restarted (the disk may have room again), and its one-line reason,
    given since it was started, follows; a worker that gave none gets the exit line alone."""
    log, log2 = tmp_path / "log_worker_1.txt", tmp_path / "log_worker_2.txt"
    log2.write_text("worker: error: an earlier life's reason\n")
    out = subprocess.run(["bash", "-c", RESTART_SCRIPT], env={"REPO": str(REPO), "LOG": str(log), "LOG2": str(log2),
                                                            "PATH": "/usr/bin:/bin"},
                         capture_output=True, text=True, timeout=60).stdout.splitlines()
    one, two = out.index("started 1"), out.index("started 2")
    assert out[one - 2].startswith("[launch] worker 1 (pid ") and out[one - 2].endswith(
        "exited with status 1: restarting it (any job it held returns through recovery)")
    assert out[one - 1] == "[launch]   worker: error: no space left on the disk: [Errno 28] No space left on device"
    assert out[two - 1].startswith("[launch] worker 2 (pid ") and out[two - 1].endswith("exited with status 1: "
                                                                                     "restarting it (any job it held "
                                                                                     "returns through recovery)")
