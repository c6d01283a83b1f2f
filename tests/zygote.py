"""Faster process starts for the test suite: every Python process a test starts is forked from the suite's fork
server (asyncgrpo/forkserver.py, which launch.sh runs for its own processes on CPU), started once, instead of a new
interpreter each (an interpreter spends about 8 s of CPU importing torch, transformers and TRL on the 2-core machine;
the suite starts well over a hundred).

helpers.start_process forks (ForkedProcess, below: the subprocess.Popen methods the tests use) where the environment
only adds variables read at run time. Other starts go through scripts/forked_python (helpers.PYTHON; the suite's
$ASYNCGRPO_PYTHON, with which launch.sh and scripts/join.sh start their processes instead of running a server of
their own): the tests' `python -m`, `-c` and scripts, torchrun and its ranks, launch.sh's processes. A client on a
test's other host has its child join its host name and mount namespaces. ASYNCGRPO_TEST_FORK=0 starts every
process as a new interpreter.
"""

from __future__ import annotations

import atexit
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time

from asyncgrpo import forkserver

CLIENT = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "scripts", "forked_python")

FORK = os.environ.get("ASYNCGRPO_TEST_FORK", "1") != "0"
START_TIMEOUT_S = 300  # importing the libraries takes a few seconds on an idle machine
_zygote: dict = {}


def socket_path() -> str:
    """Where this test session's fork server listens (named before it starts: the launch scripts' environment
    names it)."""
    return os.path.join(tempfile.gettempdir(), f"asyncgrpo-zygote-{os.getpid()}", f"zygote{forkserver.SOCKET_SUFFIX}")


def zygote_socket(cwd, env: dict) -> str:
    """The fork server's socket, started on first use with the suite's environment; it ends with the test
    session. (It answers a request once it has imported the libraries.)"""
    if "socket" not in _zygote:
        path = socket_path()
        folder = os.path.dirname(path)
        log_path = os.path.join(folder, "zygote.log")
        shutil.rmtree(folder, ignore_errors=True)  # (a session of the same pid before)
        os.makedirs(folder, mode=0o700)
        with open(log_path, "ab") as log:
            proc = subprocess.Popen([sys.executable, forkserver.__file__, path], cwd=cwd, env=env,
                                    stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT)
        _zygote.update(proc=proc, folder=folder)
        atexit.register(_stop_zygote)
        deadline = time.monotonic() + START_TIMEOUT_S
        while not os.path.exists(path):  # (bound before the imports: a first request waits for them)
            if proc.poll() is not None or time.monotonic() > deadline:
                with open(log_path, errors="replace") as f:
                    raise RuntimeError(f"the test zygote did not start:\n{f.read()[-3000:]}")
            time.sleep(0.01)
        _zygote["socket"] = path
    return _zygote["socket"]


def _stop_zygote() -> None:
    _zygote["proc"].terminate()  # (it ends once its children have)
    try:
        _zygote["proc"].wait(timeout=60)
    except subprocess.TimeoutExpired:
        _zygote["proc"].kill()
        _zygote["proc"].wait()
    shutil.rmtree(_zygote["folder"], ignore_errors=True)


class ForkedProcess:
    """``python -m module args`` in ``cwd``, forked from the fork server (started with ``env``, the suite's
    environment; ``extra_env``: variables added, read at run time only), its output appended to ``log_path``.
    It has the subprocess.Popen methods the tests use: poll, wait, send_signal, terminate, kill, pid, returncode,
    args. (Dropped unwaited, its connection closes and the server kills it, as it kills a killed client's.)"""

    def __init__(self, module: str, args: list[str], log_path, *, cwd, env: dict, extra_env: dict | None = None):
        self.args = [sys.executable, "-m", module, *args]
        self.returncode: int | None = None
        self._conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self._conn.connect(zygote_socket(cwd, env))
        with open(os.devnull, "rb") as null, open(log_path, "ab") as log:
            forkserver.send_request(self._conn, {"module": module}, args, str(cwd), {**env, **(extra_env or {})},
                                    [null.fileno(), log.fileno(), log.fileno()])
        self._buffer = b""
        reply = self._message(None)
        if "exec" in reply:
            raise RuntimeError(f"the fork server cannot fork {module} ({reply['exec']}): start_process checks first")
        self.pid = reply["pid"]

    def _message(self, timeout: float | None) -> dict:
        self._conn.settimeout(timeout)
        while b"\n" not in self._buffer:
            chunk = self._conn.recv(4096)
            if not chunk:
                raise ConnectionError(f"the test zygote died (its log: {_zygote['folder']}/zygote.log)")
            self._buffer += chunk
        line, self._buffer = self._buffer.split(b"\n", 1)
        return json.loads(line)

    def wait(self, timeout: float | None = None) -> int:
        if self.returncode is None:
            try:
                status = self._message(timeout)["status"]
            except (TimeoutError, BlockingIOError):
                raise subprocess.TimeoutExpired(self.args, timeout) from None
            self.returncode = os.waitstatus_to_exitcode(status)
            self._conn.close()
        return self.returncode

    def poll(self) -> int | None:
        try:
            return self.wait(timeout=0)
        except subprocess.TimeoutExpired:
            return None

    def send_signal(self, sig: int) -> None:
        if self.poll() is None:  # as Popen: never signal a pid that may have been reused
            os.kill(self.pid, sig)

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)
