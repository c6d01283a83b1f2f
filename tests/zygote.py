"""Faster process starts for the test suite: `python -m ps` and `python -m worker` forked from one process that
has already imported torch, transformers and TRL, instead of a new interpreter each (an interpreter spends
about 8 s of CPU importing them on the 2-core machine; the suite starts well over a hundred).

A forked child is a real process (its own pid, files, locks, signals and exit status) running what
`python -m MODULE ARGS` from the repository runs, with the suite's environment: only the libraries are
imported already; the project's own modules are imported afresh in each child. helpers.start_process uses it
for processes started with the suite's environment; one given its own environment (a clock offset, a fault),
launch.sh and torchrun start real interpreters, and ASYNCGRPO_TEST_FORK=0 turns the zygote off.

Protocol, over a Unix socket, one connection per child: the test sends one JSON line {"module", "args", "cwd",
"log", "env"}; the zygote forks and answers {"pid": N}, then {"status": S} (os.waitpid's) when the child has
ended. The test's side is ForkedProcess, below; the zygote's, serve().
"""

from __future__ import annotations

import atexit
import json
import os
import selectors
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time

PRELOAD = ("torch", "transformers", "trl", "trl.trainer.grpo_trainer", "safetensors.torch", "watchdog.observers",
           "filelock", "accelerate")
POLL_S = 0.02  # how often the zygote reaps its children when no request comes

# ---------------------------------------------------------------------- the tests' side

FORK = os.environ.get("ASYNCGRPO_TEST_FORK", "1") != "0"
START_TIMEOUT_S = 300  # importing the libraries takes a few seconds on an idle machine
_zygote: dict = {}


def _zygote_socket(cwd, env: dict) -> str:
    """The zygote's socket, started on first use with the suite's environment; it ends with the test session."""
    if "socket" not in _zygote:
        folder = tempfile.mkdtemp(prefix="asyncgrpo-zygote-")
        path, log_path = os.path.join(folder, "zygote.sock"), os.path.join(folder, "zygote.log")
        with open(log_path, "ab") as log:
            proc = subprocess.Popen([sys.executable, os.path.abspath(__file__), path], cwd=cwd, env=env,
                                    stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT)
        _zygote.update(proc=proc, folder=folder)
        atexit.register(_stop_zygote)
        deadline = time.monotonic() + START_TIMEOUT_S
        while not os.path.exists(path):
            if proc.poll() is not None or time.monotonic() > deadline:
                with open(log_path, errors="replace") as f:
                    raise RuntimeError(f"the test zygote did not start:\n{f.read()[-3000:]}")
            time.sleep(0.05)
        _zygote["socket"] = path
    return _zygote["socket"]


def _stop_zygote() -> None:
    _zygote["proc"].terminate()
    _zygote["proc"].wait(timeout=60)
    shutil.rmtree(_zygote["folder"], ignore_errors=True)


class ForkedProcess:
    """``python -m module args`` in ``cwd``, forked from the zygote (started with ``env``, the suite's
    environment; ``extra_env``: variables the child sets, read at run time only), its output appended to
    ``log_path``. It has the subprocess.Popen methods the tests use: poll, wait, send_signal, terminate, kill,
    pid, returncode, args."""

    def __init__(self, module: str, args: list[str], log_path, *, cwd, env: dict, extra_env: dict | None = None):
        self.args = [sys.executable, "-m", module, *args]
        self.returncode: int | None = None
        self._conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self._conn.connect(_zygote_socket(cwd, env))
        self._conn.sendall(json.dumps({"module": module, "args": args, "cwd": str(cwd), "log": str(log_path),
                                       "env": extra_env or {}}).encode() + b"\n")
        self._buffer = b""
        self.pid = self._message(None)["pid"]

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


# ---------------------------------------------------------------------- the zygote's side


def serve(socket_path: str) -> None:
    import importlib

    for module in PRELOAD:
        importlib.import_module(module)
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(socket_path + ".tmp")
    listener.listen(64)
    os.rename(socket_path + ".tmp", socket_path)  # ready: the tests wait for this name
    selector = selectors.DefaultSelector()
    selector.register(listener, selectors.EVENT_READ)
    children: dict[int, socket.socket] = {}
    parent = os.getppid()
    while os.getppid() == parent:  # the test session ended (or was killed): so do we
        if selector.select(timeout=POLL_S):
            conn, _ = listener.accept()
            request = json.loads(_read_line(conn))
            sys.stdout.flush()
            sys.stderr.flush()
            pid = os.fork()
            if pid == 0:
                listener.close()
                for other in (conn, *children.values()):
                    other.close()
                _run_child(request)  # never returns
            conn.sendall(json.dumps({"pid": pid}).encode() + b"\n")
            children[pid] = conn
        while children:
            pid, status = os.waitpid(-1, os.WNOHANG)
            if pid == 0:
                break
            conn = children.pop(pid, None)
            if conn is not None:
                try:
                    conn.sendall(json.dumps({"status": status}).encode() + b"\n")
                except OSError:
                    pass  # the test is gone
                conn.close()


def _read_line(conn: socket.socket) -> bytes:
    data = b""
    while not data.endswith(b"\n"):
        chunk = conn.recv(65536)
        if not chunk:
            raise ConnectionError("the connection closed before a whole line")
        data += chunk
    return data


def _run_child(request: dict) -> None:
    """What `python -m MODULE ARGS` in ``cwd`` does, output appended to ``log``; ends the process."""
    import atexit
    import random
    import runpy
    import threading
    import traceback

    log = os.open(request["log"], os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)
    os.dup2(log, 1)
    os.dup2(log, 2)
    os.close(log)
    os.close(null)
    os.chdir(request["cwd"])
    sys.path[0] = request["cwd"]  # as `python -m` puts the current folder first
    os.environ.update(request["env"])  # variables read at run time only (a test's fault to inject)
    if request["env"]:
        sys.path.insert(1, os.path.dirname(os.path.abspath(__file__)))  # tests/: the test's own modules
    sys.argv = [request["module"], *request["args"]]
    random.seed()  # a new interpreter's, not the zygote's sequence shared by every child
    code = 0
    interrupted = False
    try:
        runpy.run_module(request["module"], run_name="__main__", alter_sys=True)
    except SystemExit as exit_:
        if exit_.code is None or isinstance(exit_.code, int):
            code = exit_.code or 0
        else:
            print(exit_.code, file=sys.stderr)
            code = 1
    except KeyboardInterrupt:
        traceback.print_exc()
        interrupted = True
    except BaseException:  # noqa: BLE001 (an interpreter prints any uncaught error and exits 1)
        traceback.print_exc()
        code = 1
    # An interpreter's end: wait for non-daemon threads, run atexit, flush.
    threading._shutdown()
    atexit._run_exitfuncs()
    sys.stdout.flush()
    sys.stderr.flush()
    if interrupted:  # as Python ends on an uncaught KeyboardInterrupt: killed by SIGINT
        signal.signal(signal.SIGINT, signal.SIG_DFL)
        os.kill(os.getpid(), signal.SIGINT)
    os._exit(code)


if __name__ == "__main__":
    serve(sys.argv[1])
