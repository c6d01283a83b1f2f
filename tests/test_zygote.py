"""The suite's python for launch.sh (scripts/forked_python, a client of asyncgrpo/forkserver.py): a process forked
from the fork server stands in for a new interpreter only if the script that started it cannot tell the difference:
its output, exit status, signals, ignored signals and death, and a new interpreter where a fork could not be one."""

from __future__ import annotations

import json
import os
import select
import signal
import socket
import subprocess
import threading
import time

import pytest
from helpers import (
    CLOCK_SKEW_DIR,
    PROCESS_ENV,
    as_other_host,
    other_host_unavailable,
    pid_alive,
    process_state,
    start_zygote,
    wait_for,
)
from zygote import CLIENT, FORK

from asyncgrpo import forkserver

pytestmark = [pytest.mark.process, pytest.mark.skipif(not FORK, reason="ASYNCGRPO_TEST_FORK=0: no zygote")]

# What the child tells: whether the libraries were imported before its first line (a fork of the zygote), its
# parent, its argv, and how SIGINT is handled.
REPORT = """import json, os, signal, socket, sys
print(json.dumps({"forked": "torch" in sys.modules, "parent": os.getppid(), "argv": sys.argv,
                  "host": socket.gethostname(), "shm": sorted(os.listdir("/dev/shm")),
                  "sigint_ignored": signal.getsignal(signal.SIGINT) is signal.SIG_IGN, "pid": os.getpid()}),
      flush=True)
"""


def client(code: str, *args: str, env: dict | None = None, other_host: bool = False, **popen) -> subprocess.Popen:
    start_zygote()
    argv = [CLIENT, "-c", code, *args]
    return subprocess.Popen(as_other_host(argv) if other_host else argv, env={**PROCESS_ENV, **(env or {})},
                            stdout=subprocess.PIPE, text=True, **popen)


def test_a_forked_child_has_the_clients_arguments_output_and_exit_status():
    proc = client(REPORT + "sys.exit(3)", "a", "b")
    report = json.loads(proc.stdout.readline())
    assert proc.wait(timeout=60) == 3
    assert report["forked"] and report["parent"] != proc.pid and report["argv"] == ["-c", "a", "b"]


def test_signals_reach_the_child_and_its_death_by_one_is_the_clients():
    handled = client("import signal, sys\nsignal.signal(signal.SIGTERM, lambda *_: sys.exit(7))\n" + REPORT
                     + "signal.pause()")  # (its handler set before it says it is ready)
    json.loads(handled.stdout.readline())
    handled.terminate()
    assert handled.wait(timeout=60) == 7  # the child's handler ran
    unhandled = client(REPORT + "signal.pause()")
    json.loads(unhandled.stdout.readline())
    unhandled.send_signal(signal.SIGUSR1)
    assert unhandled.wait(timeout=60) == -signal.SIGUSR1


def test_a_child_killed_by_sigpipe_has_its_client_killed_by_sigpipe_though_python_ignores_it():
    proc = client("import os, signal\nsignal.signal(signal.SIGPIPE, signal.SIG_DFL)\nos.kill(os.getpid(), 13)")
    assert proc.wait(timeout=60) == -signal.SIGPIPE


def test_a_request_that_fails_leaves_the_server_serving_the_others():
    """A client that dies before its answer, and one that sends what is no request: the server says so in its log
    and forks the next as before (in a launch, every running process is its child)."""
    start_zygote()
    for garbage in (b"", b"not a request\n", b'{"module": "ps"}\n'):
        conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        conn.connect(PROCESS_ENV["ASYNCGRPO_FORK_SERVER"])
        conn.sendall(garbage)
        conn.close()
    proc = client(REPORT)
    assert json.loads(proc.stdout.readline())["forked"]
    assert proc.wait(timeout=60) == 0


def test_a_client_started_with_its_server_waits_for_its_socket(tmp_path):
    """launch.sh starts the server and, at once, the check: a client that finds the server's folder but not yet its
    socket waits for it (a new interpreter would cost as much as every import again); without a folder, it does
    not wait."""
    path = tmp_path / "server.sock"
    threading.Timer(0.3, path.touch).start()
    started = time.monotonic()
    forkserver._wait_for_socket(str(path))
    assert path.exists() and 0.25 < time.monotonic() - started < forkserver.SOCKET_WAIT_S
    started = time.monotonic()
    forkserver._wait_for_socket(str(tmp_path / "no folder" / "server.sock"))
    assert time.monotonic() - started < 0.1


def test_a_client_waiting_for_its_server_to_be_ready_ends_at_a_signal_and_leaves_its_output_to_nobody(tmp_path):
    """A server still importing the libraries (seconds) is not ready: a Ctrl-C then (launch.sh's input check runs as
    a client, its output read by the shell) ends the client at once, and nothing else holds its output open, so
    the shell reading it goes on."""
    server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    server.bind(str(tmp_path / f"server{forkserver.SOCKET_SUFFIX}"))
    server.listen(4)
    server.settimeout(60)
    env = {**PROCESS_ENV, "ASYNCGRPO_FORK_SERVER": str(tmp_path / f"server{forkserver.SOCKET_SUFFIX}")}
    proc = subprocess.Popen([CLIENT, "-c", "pass"], env=env, stdout=subprocess.PIPE, text=True)
    try:
        conn, _ = server.accept()  # (connected: its signal handlers are set) and never told it is ready
        wait_for(lambda: process_state(proc.pid) == "S", "the client to wait for its server", 60)
        proc.send_signal(signal.SIGINT)
        assert proc.wait(timeout=60) == -signal.SIGINT
        assert conn.recv(1, socket.MSG_DONTWAIT) == b""  # it sent nothing: no descriptor of its own in the queue
        assert select.select([proc.stdout], [], [], 60)[0] and proc.stdout.read() == ""  # closed everywhere
        conn.close()
    finally:
        proc.kill()
        server.close()


def test_a_client_given_a_server_of_another_protocol_starts_a_new_interpreter(tmp_path):
    """A server started before a `git pull` speaks the protocol before it (the request first, no READY): a client
    started after would wait on it forever. Its socket's name says so, and the client starts a new interpreter."""
    old = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    old.bind(str(tmp_path / "server.sock"))  # (the name before protocols were named)
    old.listen(4)
    env = {**PROCESS_ENV, "ASYNCGRPO_FORK_SERVER": str(tmp_path / "server.sock")}
    proc = subprocess.Popen([CLIENT, "-c", REPORT], env=env, stdout=subprocess.PIPE, text=True)
    try:
        assert proc.wait(timeout=60) == 0
        assert not json.loads(proc.stdout.readline())["forked"]
    finally:
        proc.kill()
        old.close()


def test_a_signal_ignored_by_the_client_is_ignored_by_the_child_as_bash_ignores_sigint_in_background_jobs():
    proc = client(REPORT, preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_IGN))
    assert json.loads(proc.stdout.readline())["sigint_ignored"]
    assert proc.wait(timeout=60) == 0


def test_a_killed_client_takes_its_child_and_a_killed_child_its_client():
    proc = client(REPORT + "signal.pause()")
    child = json.loads(proc.stdout.readline())["pid"]
    proc.kill()
    proc.wait(timeout=60)
    wait_for(lambda: not pid_alive(child), "the child of a killed client to be killed", 30)
    proc = client(REPORT + "signal.pause()")
    os.kill(json.loads(proc.stdout.readline())["pid"], signal.SIGKILL)
    assert proc.wait(timeout=60) == -signal.SIGKILL


def test_an_environment_a_fork_cannot_have_gets_a_new_interpreter(tmp_path):
    """A sitecustomize on the path runs when an interpreter starts, unless it says it works after the libraries'
    import too (it then runs in the fork); HF_HUB_OFFLINE is read at the hub library's import."""
    (tmp_path / "sitecustomize.py").write_text("import sys\nsys.ran_sitecustomize = True\n")
    for env in ({"PYTHONPATH": str(tmp_path)}, {"HF_HUB_OFFLINE": "1"}):
        proc = client(REPORT, env=env)
        assert not json.loads(proc.stdout.readline())["forked"], env
        assert proc.wait(timeout=120) == 0
    skewed = client("import time\n" + REPORT + "print(round(time.time() - time.monotonic()))",
                    env={"PYTHONPATH": str(CLOCK_SKEW_DIR), "ASYNCGRPO_TEST_CLOCK_OFFSET_S": "-3600"})
    plain = client("import time\n" + REPORT + "print(round(time.time() - time.monotonic()))")
    assert json.loads(skewed.stdout.readline())["forked"] and json.loads(plain.stdout.readline())["forked"]
    assert int(plain.stdout.read()) - int(skewed.stdout.read()) == 3600  # its sitecustomize ran in the fork
    assert skewed.wait(timeout=60) == plain.wait(timeout=60) == 0


def test_a_client_on_another_host_has_a_child_with_that_hosts_name_and_mounts():
    if why := other_host_unavailable():
        pytest.skip(why)
    proc = client(REPORT, other_host=True)
    report = json.loads(proc.stdout.readline())
    assert proc.wait(timeout=60) == 0
    assert report["forked"] and report["host"] == "otherhost" and report["shm"] == []  # its own, empty /dev/shm
