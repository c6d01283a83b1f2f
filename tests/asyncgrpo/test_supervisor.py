"""A process started under a supervisor (launch.sh, join.sh: ASYNCGRPO_SUPERVISOR_PID) gets SIGTERM once the
supervisor is gone, however it went; one started by hand watches nothing. Real processes."""

import signal
import subprocess
import sys

import pytest
from helpers import PROCESS_ENV, REPO

pytestmark = pytest.mark.process

CHILD = """
import signal, sys, time
from asyncgrpo.supervisor import watch_supervisor
signal.signal(signal.SIGTERM, lambda *_: (print("SIGTERM", flush=True), sys.exit(0)))
print("watching", watch_supervisor("test"), flush=True)
time.sleep(60)
print("not stopped", flush=True)
"""


def start_child(env: dict) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", CHILD], cwd=REPO, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)


def test_a_supervised_process_gets_sigterm_when_its_supervisor_is_killed_outright():
    supervisor = subprocess.Popen(["sleep", "60"])
    child = start_child({**PROCESS_ENV, "ASYNCGRPO_SUPERVISOR_PID": str(supervisor.pid)})
    try:
        assert child.stdout.readline().strip() == f"watching {supervisor.pid}"
        supervisor.send_signal(signal.SIGKILL)
        supervisor.wait()
        out, _ = child.communicate(timeout=30)
    finally:
        for proc in (supervisor, child):
            proc.kill()
    assert child.returncode == 0 and "SIGTERM" in out, out
    assert f"its supervisor (launch.sh or join.sh, pid {supervisor.pid}) is gone: stopping as on SIGTERM" in out


def test_a_process_started_by_hand_watches_nothing():
    env = {k: v for k, v in PROCESS_ENV.items() if k != "ASYNCGRPO_SUPERVISOR_PID"}
    child = start_child(env)
    try:
        assert child.stdout.readline().strip() == "watching None"
    finally:
        child.kill()
        child.wait()
