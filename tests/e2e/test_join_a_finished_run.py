"""`launch.sh --join` on a run whose PS has finished waits for the next PS (a relaunch that trains further), and
says so in its terminal once a minute; Ctrl-C stops its workers."""

import shutil
import signal
import subprocess
import time

from helpers import PROCESS_ENV, REPO, kill_run

TIMEOUT_S = 300
WAITING = "the workers wait for its parameter server to be relaunched (it had finished when they joined)"


def test_joining_a_finished_run_says_what_it_waits_for(finished_demo_run, tmp_path):
    root = tmp_path / "run"
    shutil.copytree(finished_demo_run, root, ignore=shutil.ignore_patterns("report"))
    join = subprocess.Popen(["bash", str(REPO / "launch.sh"), "--join", str(root), "--workers", "1"], cwd=tmp_path,
                            env=PROCESS_ENV, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        lines, deadline = [], time.monotonic() + TIMEOUT_S
        while not any(WAITING in line for line in lines):
            line = join.stdout.readline()
            assert line or join.poll() is None, "".join(lines)
            assert time.monotonic() < deadline, "".join(lines)
            lines.append(line)
        # The same line, dated, in launch-{host id}.txt (written just after the terminal's: wait for it).
        while not any(WAITING in p.read_text() for p in (root / "logs").glob("launch-*.txt")):
            assert time.monotonic() < deadline, "no waiting line in the launch log"
            time.sleep(0.05)
        join.send_signal(signal.SIGINT)  # Ctrl-C
        assert join.wait(timeout=120) == 130
    finally:
        kill_run(root, join)
    out = "".join(lines) + join.stdout.read()
    assert "interrupted: stopping the workers" in out
