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
    said = next(line for line in lines if WAITING in line)
    assert said.rstrip().endswith("Ctrl-C to stop them"), said  # said at the join: no "(for 0 min)"


def test_joining_a_run_whose_launch_is_still_starting_its_ps_waits_for_it(finished_demo_run, tmp_path):
    """A second host's join 12 s after the PS's launch, before the PS made queue/ and done/: it says what it waits
    for and goes on once they are there. A folder whose launch stopped before that is refused at once."""
    root = tmp_path / "run"
    shutil.copytree(finished_demo_run, root, ignore=shutil.ignore_patterns("report"))
    aside = tmp_path / "aside"
    aside.mkdir()
    for name in ("queue", "done"):
        (root / name).rename(aside / name)
    (root / "launch.lock").write_text("pid 4242 on the-ps-host\n")
    refused = subprocess.run(["bash", str(REPO / "launch.sh"), "--join", str(root)], cwd=tmp_path, env=PROCESS_ENV,
                             capture_output=True, text=True, timeout=120)
    assert refused.returncode == 2
    assert refused.stderr.strip().splitlines()[-1] == (
        f"launch.sh: error: {root} is not an asyncgrpo run directory (no queue/ and done/ inside): a launch.sh "
        "started there (pid 4242 on the-ps-host) but its parameter server never made them")
    launch = subprocess.Popen(["flock", str(root / "launch.lock"), "sleep", "600"])  # (its launch.sh, starting)
    join = subprocess.Popen(["bash", str(REPO / "launch.sh"), "--join", str(root), "--workers", "1"], cwd=tmp_path,
                            env=PROCESS_ENV, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        first = join.stdout.readline()
        assert first == (f"[launch --join] {root} is not a run yet: its launch.sh (pid 4242 on the-ps-host) is "
                         "starting its parameter server; waiting for it to make RUN/queue and RUN/done (at most "
                         "600 s)\n"), first
        for name in ("queue", "done"):  # the PS made them
            (aside / name).rename(root / name)
        lines, deadline = [first], time.monotonic() + TIMEOUT_S
        while not any(WAITING in line for line in lines):
            line = join.stdout.readline()
            assert line or join.poll() is None, "".join(lines)
            assert time.monotonic() < deadline, "".join(lines)
            lines.append(line)
        join.send_signal(signal.SIGINT)
        assert join.wait(timeout=120) == 130
    finally:
        launch.kill()
        kill_run(root, join)
