"""However the parameter server ends, its weight buffers in /dev/shm go: Ctrl-C in a terminal (SIGINT to the
whole process group, then launch.sh's SIGTERM on top), and a PS killed outright (launch.sh frees what it
left). Real processes, started as a user starts them."""

import json
import os
import signal
import subprocess
import time
from pathlib import Path

from helpers import PROCESS_ENV, REPO, kill_run, metrics

from asyncgrpo.run import fileops

TIMEOUT_S = 300


def buffers_of(run_root: Path) -> list[Path]:
    root = str(run_root.resolve())
    return [d for d in Path("/dev/shm").glob("asyncgrpo-weights-*")
            if (fileops.read_json(d / "owner.json") or {}).get("run") == root]


def launch_in_a_terminal(run_root: Path, *args: str) -> subprocess.Popen:
    """launch.sh as the leader of its own process group, as a terminal runs a command."""
    return subprocess.Popen(["bash", str(REPO / "launch.sh"), "--run-dir", str(run_root), *args], cwd=REPO,
                            env=PROCESS_ENV, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)


def wait_for_training(run_root: Path, proc: subprocess.Popen) -> None:
    deadline = time.monotonic() + TIMEOUT_S
    while len(metrics(run_root)) < 3 or not buffers_of(run_root):
        assert proc.poll() is None, proc.stdout.read()[-3000:]
        assert time.monotonic() < deadline, "no training steps"
        time.sleep(0.1)


def test_ctrl_c_in_a_terminal_frees_the_weight_buffers(tmp_path):
    run_root = tmp_path / "run"
    proc = launch_in_a_terminal(run_root, "--workers", "2", "--max-steps", "100000")
    try:
        wait_for_training(run_root, proc)
        os.killpg(proc.pid, signal.SIGINT)  # what Ctrl-C sends: every process of the group, the PS too
        assert proc.wait(timeout=120) == 130
    finally:
        kill_run(run_root, proc)
    assert "interrupted: stopping" in proc.stdout.read()
    assert buffers_of(run_root) == []


def test_a_killed_ps_leaves_no_weight_buffers_behind(tmp_path):
    run_root = tmp_path / "run"
    proc = launch_in_a_terminal(run_root, "--workers", "2", "--max-steps", "100000")
    try:
        wait_for_training(run_root, proc)
        [folder] = buffers_of(run_root)
        os.kill(json.loads((run_root / "ps.json").read_text())["pid"], signal.SIGKILL)  # it cannot free them itself
        assert proc.wait(timeout=180) != 0
    finally:
        kill_run(run_root, proc)
    out = proc.stdout.read()
    assert "the parameter server exited with status 137" in out
    assert "Killed" not in out  # bash's own job line ("launch.sh: line N: PID Killed ...") is not shown
    assert f"of weight buffers the parameter server left in {folder}" in out
    assert buffers_of(run_root) == []
