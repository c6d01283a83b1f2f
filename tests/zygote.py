"""Faster process starts for the test suite: `python -m ps` and `python -m worker` forked from one process that
has already imported torch, transformers and TRL, instead of a new interpreter each (an interpreter spends
about 8 s of CPU importing them on the 2-core machine; the suite starts well over a hundred).

A forked child is a real process (its own pid, files, locks, signals and exit status) running what
`python -m MODULE ARGS` from the repository runs, with the suite's environment: only the libraries are
imported already; the project's own modules are imported afresh in each child. helpers.start_process uses it
(ForkedProcess, below) where the environment only adds variables read at run time; ASYNCGRPO_TEST_FORK=0 turns
the zygote off.

Other starts go through tests/zygote_python (helpers.PYTHON; $ASYNCGRPO_PYTHON, with which launch.sh and
scripts/join.sh start their Python processes), whose client (``client``, below) stands in for the interpreter: the
tests' `python -m`, `-c` and scripts, torchrun and its ranks, launch.sh's processes. It hands the zygote its
standard input, output and error, its folder and its whole environment, forwards the signals it gets to the forked
child, and exits as the child did; killed outright, its child is killed too. A client on a test's other host has
its child join its host name and mount namespaces. An environment that would change what an interpreter does
before the first line of the module (a sitecustomize on the path, a library's variable read at import) gets a new
interpreter instead.

Protocol, over a Unix socket, one connection per child: the test sends one JSON line {"module", "args", "cwd",
"log", "env"} (the client: {"module", "code" or "script", "args", "cwd", "environ", "ignored", "namespaces",
"pid"} with its three standard file descriptors); the zygote forks and answers {"pid": N}, then {"status": S}
(os.waitpid's) when the child has ended, or at once {"exec": WHY} when the client is to start a new interpreter.
The test's side is ForkedProcess, below; the launch scripts' side, client(); the zygote's, serve().
"""

from __future__ import annotations

import atexit
import contextlib
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

ZYGOTE_ENV = "ASYNCGRPO_TEST_ZYGOTE"  # the zygote's socket, for the client
CLIENT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "zygote_python")  # $ASYNCGRPO_PYTHON in the suite
# The signals a client passes on to its child (SIGKILL and SIGSTOP cannot be: a killed client's child is killed).
FORWARDED = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGQUIT, signal.SIGUSR1, signal.SIGUSR2)
# Variables that a library already imported in the zygote read at its import: a client's environment that sets
# them otherwise than the zygote's gets a new interpreter ...
READ_AT_IMPORT = ("PYTHON", "HF_", "TRANSFORMERS_", "TORCH", "PYTORCH_", "TRL_", "ACCELERATE_", "MKL_", "KMP_",
                  "OMP_", "CUDA_", "NCCL_", "LD_")
# ... but for these (names or their beginnings), read when used (torchrun's for its ranks among them) or applied
# to the child (its path, its threads).
SET_IN_CHILD = ("PYTHONPATH", "PYTHONSAFEPATH", "OMP_NUM_THREADS", "MKL_NUM_THREADS", "CUDA_VISIBLE_DEVICES",
                "TORCHDYNAMO_DISABLE", "TORCHELASTIC_", "TORCH_ELASTIC_", "TORCH_NCCL_")

# The line a sitecustomize carries that does what it must after the libraries' import too: a fork runs it, as an
# interpreter would at its start. (Without it, a sitecustomize on the path gets a new interpreter.)
RUNS_IN_A_FORK = "# tests/zygote.py: runs in a fork too"
PRELOAD = ("torch", "transformers", "trl", "trl.trainer.grpo_trainer", "safetensors.torch", "watchdog.observers",
           "filelock", "accelerate")
POLL_S = 0.02  # how often the zygote reaps its children when no request comes


# ---------------------------------------------------------------------- the tests' side

FORK = os.environ.get("ASYNCGRPO_TEST_FORK", "1") != "0"
START_TIMEOUT_S = 300  # importing the libraries takes a few seconds on an idle machine
_zygote: dict = {}


def socket_path() -> str:
    """Where this test session's zygote listens (named before it starts: the launch scripts' environment names
    it)."""
    return os.path.join(tempfile.gettempdir(), f"asyncgrpo-zygote-{os.getpid()}", "zygote.sock")


def zygote_socket(cwd, env: dict) -> str:
    """The zygote's socket, started on first use with the suite's environment; it ends with the test session."""
    if "socket" not in _zygote:
        path = socket_path()
        folder = os.path.dirname(path)
        log_path = os.path.join(folder, "zygote.log")
        shutil.rmtree(folder, ignore_errors=True)  # (a session of the same pid before)
        os.makedirs(folder, mode=0o700)
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
        self._conn.connect(zygote_socket(cwd, env))
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


# ---------------------------------------------------------------------- the launch scripts' side


def client(argv: list[str]) -> None:
    """``python -m MODULE ARGS``, ``python -c CODE ARGS`` or ``python SCRIPT ARGS`` as a child of the zygote named by
    $ASYNCGRPO_TEST_ZYGOTE, this process standing in for it; else, or when the zygote says so, a new interpreter."""
    path = os.environ.get(ZYGOTE_ENV, "")
    if argv[:1] in (["-m"], ["-c"]) and len(argv) >= 2:
        what, target, args = {"-m": "module", "-c": "code"}[argv[0]], argv[1], argv[2:]
    elif argv and not argv[0].startswith("-"):
        what, target, args = "script", os.path.abspath(argv[0]), argv[1:]
    else:
        _new_interpreter(argv)
    if not os.path.exists(path):
        _new_interpreter(argv)
    inherited = {sig: signal.getsignal(sig) for sig in FORWARDED}
    ignored = [int(sig) for sig, handler in inherited.items() if handler is signal.SIG_IGN]  # as a child inherits
    child: dict = {}
    pending: list[int] = []

    def new_interpreter():  # as this process was started: its signals as it inherited them, those it got since
        for sig, handler in inherited.items():
            signal.signal(sig, handler)
        for signum in pending:
            os.kill(os.getpid(), signum)
        _new_interpreter(argv)

    def forward(signum, _frame):
        if "pid" not in child:
            pending.append(signum)
        elif "status" not in child:
            with contextlib.suppress(ProcessLookupError):  # (it ended; its status is on the way)
                os.kill(child["pid"], signum)

    for sig in FORWARDED:
        signal.signal(sig, forward)
    conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        conn.connect(path)
    except OSError:
        new_interpreter()  # the suite that started the zygote is ending
    request = {what: target, "args": args, "cwd": os.getcwd(), "environ": dict(os.environ), "ignored": ignored,
               "namespaces": _namespaces(), "pid": os.getpid()}
    socket.send_fds(conn, [json.dumps(request).encode() + b"\n"], [0, 1, 2])
    lines = conn.makefile("rb")
    reply = json.loads(lines.readline())
    if "exec" in reply:
        new_interpreter()
    child["pid"] = reply["pid"]
    for signum in pending:
        forward(signum, None)
    line = lines.readline()
    if not line:
        raise SystemExit(f"zygote_python: the test zygote died while it ran {target}")
    status = child["status"] = json.loads(line)["status"]
    if os.WIFSIGNALED(status):  # die of the same signal, as the child did
        if os.WTERMSIG(status) in FORWARDED:
            signal.signal(os.WTERMSIG(status), signal.SIG_DFL)
        os.kill(os.getpid(), os.WTERMSIG(status))
    os._exit(os.waitstatus_to_exitcode(status))


NAMESPACES = ("uts", "mnt")  # a test's other host (helpers.as_other_host, unshare) has its own host name and mounts


def _namespaces() -> list[str]:
    return [os.readlink(f"/proc/self/ns/{kind}") for kind in NAMESPACES]


def _join_namespaces(pid: int) -> None:
    """This process into the host name and mount namespaces of ``pid`` (setns: a process of one thread, as a child
    just forked is, may join a mount namespace)."""
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)
    for kind in NAMESPACES:
        fd = os.open(f"/proc/{pid}/ns/{kind}", os.O_RDONLY)
        try:
            if libc.setns(fd, 0) != 0:
                raise OSError(ctypes.get_errno(), f"setns into the {kind} namespace of pid {pid}")
        finally:
            os.close(fd)


def _new_interpreter(argv: list[str]) -> None:
    os.execv(sys.executable, [sys.executable, *argv])


# ---------------------------------------------------------------------- the zygote's side


def serve(socket_path: str) -> None:
    import importlib

    started_with = dict(os.environ)  # (importing the libraries may add to it: inductor names its cache folder)
    for module in PRELOAD:
        importlib.import_module(module)
    library_path = _library_path()
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(socket_path + ".tmp")
    listener.listen(64)
    os.rename(socket_path + ".tmp", socket_path)  # ready: the tests wait for this name
    selector = selectors.DefaultSelector()
    selector.register(listener, selectors.EVENT_READ)
    children: dict[int, socket.socket] = {}
    clients: dict[socket.socket, int] = {}  # a client's connection, open while its child runs: EOF = it was killed
    parent = os.getppid()
    while os.getppid() == parent:  # the test session ended (or was killed): so do we
        for key, _ in selector.select(timeout=POLL_S):
            if key.fileobj is not listener:  # a client gone while its child runs: killed, so is the child
                selector.unregister(key.fileobj)
                os.kill(clients.pop(key.fileobj), signal.SIGKILL)
                continue
            conn, _ = listener.accept()
            request, fds = _read_request(conn)
            # (A client on a test's other host is forked too: its child joins the client's namespaces.)
            if "environ" in request and (why := why_not_forked(request["environ"], started_with)):
                conn.sendall(json.dumps({"exec": why}).encode() + b"\n")
                conn.close()
                for fd in fds:
                    os.close(fd)
                continue
            sys.stdout.flush()
            sys.stderr.flush()
            pid = os.fork()
            if pid == 0:
                listener.close()
                for other in (conn, *children.values()):
                    other.close()
                _run_child(request, fds, library_path)  # never returns
            for fd in fds:
                os.close(fd)
            conn.sendall(json.dumps({"pid": pid}).encode() + b"\n")
            children[pid] = conn
            if "environ" in request:
                clients[conn] = pid
                selector.register(conn, selectors.EVENT_READ)
        while children:
            pid, status = os.waitpid(-1, os.WNOHANG)
            if pid == 0:
                break
            conn = children.pop(pid, None)
            if conn is not None:
                if clients.pop(conn, None) is not None:
                    selector.unregister(conn)
                try:
                    conn.sendall(json.dumps({"status": status}).encode() + b"\n")
                except OSError:
                    pass  # the test is gone
                conn.close()


def _read_request(conn: socket.socket) -> tuple[dict, list[int]]:
    """A request's line and the file descriptors that came with it (a client's standard three)."""
    data, fds, _, _ = socket.recv_fds(conn, 1 << 20, 3)
    while not data.endswith(b"\n"):
        chunk = conn.recv(1 << 20)
        if not chunk:
            raise ConnectionError("the connection closed before a whole line")
        data += chunk
    return json.loads(data), fds


def _library_path() -> list[str]:
    """This interpreter's path without what PYTHONPATH and the script's folder put first: the libraries'."""
    added = {os.path.abspath(p) for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p}
    added.add(os.path.dirname(os.path.abspath(__file__)))
    return [p for p in sys.path if p and os.path.abspath(p) not in added]


def why_not_forked(environ: dict, own: dict) -> str | None:
    """Why a process with ``environ`` cannot be a fork of one started with ``own``: a variable read at the
    libraries' import set otherwise, or a sitecustomize on its path (an interpreter runs it at start)."""
    for name in sorted(set(environ) | set(own)):
        if (name.startswith(READ_AT_IMPORT) and not name.startswith(SET_IN_CHILD)
                and environ.get(name) != own.get(name)):
            return f"{name} differs"
    site = _sitecustomize(environ.get("PYTHONPATH", ""))
    if site is not None and RUNS_IN_A_FORK not in open(site).read():
        return site
    return None


def _sitecustomize(pythonpath: str) -> str | None:
    """The sitecustomize.py an interpreter with this PYTHONPATH would run at its start."""
    folders = [folder for folder in pythonpath.split(os.pathsep) if folder]
    return next((os.path.join(f, "sitecustomize.py") for f in folders
                 if os.path.exists(os.path.join(f, "sitecustomize.py"))), None)


def _run_child(request: dict, fds: list[int], library_path: list[str]) -> None:
    """What `python -m MODULE ARGS` (`-c CODE ARGS`, `SCRIPT ARGS`) in ``cwd`` does, its output appended to ``log``
    or on the client's descriptors; ends the process."""
    import atexit
    import random
    import runpy
    import threading
    import traceback

    if fds:  # a client's: its standard input, output and error
        for target, fd in enumerate(fds):
            os.dup2(fd, target)
            os.close(fd)
    else:
        log = os.open(request["log"], os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        null = os.open(os.devnull, os.O_RDONLY)
        os.dup2(null, 0)
        os.dup2(log, 1)
        os.dup2(log, 2)
        os.close(log)
        os.close(null)
    if "environ" in request and request["namespaces"] != _namespaces():
        _join_namespaces(request["pid"])
    os.chdir(request["cwd"])
    if "environ" in request:  # a client's whole environment, its path and signals as an interpreter would have them
        os.environ.clear()
        os.environ.update(request["environ"])
        pythonpath = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
        first = os.path.dirname(request["script"]) if "script" in request else request["cwd"]
        sys.path[:] = ([] if os.environ.get("PYTHONSAFEPATH") else [first]) + pythonpath + library_path
        for sig in FORWARDED:
            ignored = int(sig) in request["ignored"]
            default = signal.default_int_handler if sig == signal.SIGINT else signal.SIG_DFL
            signal.signal(sig, signal.SIG_IGN if ignored else default)
        if threads := os.environ.get("OMP_NUM_THREADS"):
            import torch

            torch.set_num_threads(int(threads))
    else:
        sys.path[0] = request["cwd"]  # as `python -m` puts the current folder first
        os.environ.update(request["env"])  # variables read at run time only (a test's fault to inject)
        if request["env"]:
            sys.path.insert(1, os.path.dirname(os.path.abspath(__file__)))  # tests/: the test's own modules
        sys.path[1:1] = [p for p in request["env"].get("PYTHONPATH", "").split(os.pathsep) if p]
    if site := _sitecustomize(os.environ.get("PYTHONPATH", "")):
        runpy.run_path(site, run_name="sitecustomize")
    sys.argv = [request.get("module") or request.get("script") or "-c", *request["args"]]
    random.seed()  # a new interpreter's, not the zygote's sequence shared by every child
    code = 0
    interrupted = False
    try:
        if "code" in request:
            exec(compile(request["code"], "<string>", "exec"), {"__name__": "__main__"})
        elif "script" in request:
            runpy.run_path(request["script"], run_name="__main__")
        else:
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
    if sys.argv[1] == "--client":
        client(sys.argv[2:])
    else:
        serve(sys.argv[1])
