"""One interpreter imports torch, transformers and TRL; a launch's Python processes are its forks.

An interpreter spends seconds of CPU importing those libraries (about 5 s on a 2-core machine), and a launch
starts several at once: the input check, the PS, each worker. launch.sh runs this fork server (``serve``) on a
machine without GPUs, and starts every Python process through ``scripts/forked_python``, whose ``client`` stands
in for the interpreter: it hands the server its standard input, output and error, its folder and its whole
environment; the server forks a child that runs ``python -m MODULE ARGS`` (``-c CODE ARGS``, ``SCRIPT ARGS``) as a
new interpreter would, with only the libraries imported already (the project's own modules are imported afresh in
each child). The client forwards the signals it gets to the child and exits as the child did; a killed client's
child is killed.

A fork could not stand in for a new interpreter, and the client starts one (``why_not_forked``), where the
environment sets a variable that the libraries read at their import otherwise than the server's, or a sitecustomize
on the path would run at an interpreter's start (unless it carries the line ``RUNS_IN_A_FORK``: the fork runs it
then). A client that finds no server, or one that died before forking, starts a new interpreter too.

CUDA cannot be initialised in a process that then forks, and the server never touches it; launch.sh runs it only
where no GPU is seen (or with --device cpu): each process on a GPU machine is its own interpreter.

Protocol, over a Unix socket, one connection per child: the server says ``READY`` once the libraries are imported,
then the client sends one JSON line (``request``) with its three standard file descriptors (SCM_RIGHTS: sent
earlier, they would wait in the connection's queue, and a client killed meanwhile would leave its output open
until the server read them: a shell reading that output would wait for the imports). The server answers
{"pid": N}, then {"status": S} (os.waitpid's) when the child has ended, or at once {"exec": WHY} when the client is
to start a new interpreter. The connection closed while the child runs means the client was killed: so is its
child. The server listens from its start; it ends when the process that started it has, and its children have.
"""

from __future__ import annotations

import contextlib
import json
import os
import selectors
import signal
import socket
import sys
import time

SERVER_ENV = "ASYNCGRPO_FORK_SERVER"  # the server's socket, for the client
# The signals a client passes on to its child (SIGKILL and SIGSTOP cannot be: a killed client's child is killed).
FORWARDED = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGQUIT, signal.SIGUSR1, signal.SIGUSR2)
# Variables that a library the server imported read at its import: a client's environment that sets them otherwise
# than the server's gets a new interpreter ...
READ_AT_IMPORT = ("PYTHON", "HF_", "TRANSFORMERS_", "TORCH", "PYTORCH_", "TRL_", "ACCELERATE_", "MKL_", "KMP_",
                  "OMP_", "CUDA_", "NCCL_", "LD_")
# ... but for these (names or their beginnings), read when used (torchrun's for its ranks among them) or applied
# to the child (its path, its threads).
SET_IN_CHILD = ("PYTHONPATH", "PYTHONSAFEPATH", "OMP_NUM_THREADS", "MKL_NUM_THREADS", "CUDA_VISIBLE_DEVICES",
                "TORCHDYNAMO_DISABLE", "TORCHELASTIC_", "TORCH_ELASTIC_", "TORCH_NCCL_")
# The line a sitecustomize carries that does what it must after the libraries' import too: a fork runs it, as an
# interpreter would at its start. (Without it, a sitecustomize on the path gets a new interpreter.)
RUNS_IN_A_FORK = "# asyncgrpo.forkserver: runs in a fork too"
PRELOAD = ("torch", "transformers", "trl", "trl.trainer.grpo_trainer", "safetensors.torch", "watchdog.observers",
           "filelock", "accelerate")
NAMESPACES = ("uts", "mnt")  # a client in a container or `unshare` of its own: its child joins them
POLL_S = 0.02  # how often the server reaps its children when no request comes
READY = b"ready\n"  # the server's first line to a client: the libraries are imported, send the request
# A server's socket is named for the protocol it speaks: a client (started from the repository after a `git pull`
# during a run) that finds a server of another protocol starts a new interpreter rather than wait on it forever.
SOCKET_SUFFIX = ".v2.sock"
SOCKET_WAIT_S = 5.0


class ClientGone(ConnectionError):
    """A client that ended before it sent its request (a Ctrl-C while the server imported): nothing to say."""


# ---------------------------------------------------------------------- the client's side


def client(argv: list[str]) -> None:
    """``python -m MODULE ARGS``, ``python -c CODE ARGS`` or ``python SCRIPT ARGS`` as a child of the server named by
    $ASYNCGRPO_FORK_SERVER, this process standing in for it; else, or when the server says so, a new interpreter."""
    if argv[:1] in (["-m"], ["-c"]) and len(argv) >= 2:
        what, target, args = {"-m": "module", "-c": "code"}[argv[0]], argv[1], argv[2:]
    elif argv and not argv[0].startswith("-"):
        what, target, args = "script", os.path.abspath(argv[0]), argv[1:]
    else:
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
        if "sent" not in child and inherited[signum] is not signal.SIG_IGN:
            # Before its request is sent (the server still importing: seconds), a signal ends this process at once,
            # as it ends an interpreter still importing: a Ctrl-C during launch.sh's input check is not a wait.
            # After, the child is milliseconds away and gets it.
            signal.signal(signum, signal.SIG_DFL)
            os.kill(os.getpid(), signum)
        elif "pid" not in child:
            pending.append(signum)
        elif "status" not in child and child["pidfd"] is not None:  # (a pidfd: never a reused pid)
            with contextlib.suppress(ProcessLookupError):  # (it ended; its status is on the way)
                signal.pidfd_send_signal(child["pidfd"], signum)

    for sig in FORWARDED:
        signal.signal(sig, forward)
    path = os.environ.get(SERVER_ENV, "")
    if not path.endswith(SOCKET_SUFFIX):  # (no server, or one of another protocol)
        new_interpreter()
    conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        _wait_for_socket(path)
        conn.connect(path)
        send_request(conn, {what: target}, args, os.getcwd(), dict(os.environ), [0, 1, 2], ignored)
        child["sent"] = True
        lines = conn.makefile("rb")
        reply = json.loads(lines.readline() or b'{"exec": "the fork server ended"}')
    except OSError:  # no server (not started, or ended)
        new_interpreter()
    if "exec" in reply:
        new_interpreter()
    try:
        child["pidfd"] = os.pidfd_open(reply["pid"])
    except ProcessLookupError:  # (it ended already: its status is on the way)
        child["pidfd"] = None
    child["pid"] = reply["pid"]
    for signum in pending:
        forward(signum, None)
    line = lines.readline()
    if not line:  # the server was killed: its child would run on unseen
        if child["pidfd"] is not None:
            with contextlib.suppress(ProcessLookupError):
                signal.pidfd_send_signal(child["pidfd"], signal.SIGKILL)
        print(f"forked_python: the fork server died while it ran {target}: its process killed", file=sys.stderr)
        status = signal.SIGKILL  # (a wait status: killed by SIGKILL)
    else:
        status = json.loads(line)["status"]
    child["status"] = status
    if os.WIFSIGNALED(status):  # die of the same signal, as the child did (SIGPIPE too, which Python ignores)
        with contextlib.suppress(OSError, ValueError):
            signal.signal(os.WTERMSIG(status), signal.SIG_DFL)
        os.kill(os.getpid(), os.WTERMSIG(status))
    os._exit(os.waitstatus_to_exitcode(status))


def _wait_for_socket(path: str) -> None:
    """A server that launch.sh has just started binds its socket in a few tens of milliseconds: a client started
    meanwhile waits for it (at most SOCKET_WAIT_S) rather than start a new interpreter."""
    deadline = time.monotonic() + SOCKET_WAIT_S
    while path and not os.path.exists(path) and os.path.isdir(os.path.dirname(path)) and time.monotonic() < deadline:
        time.sleep(0.005)


def send_request(conn: socket.socket, target: dict, args: list[str], cwd: str, environ: dict, fds: list[int],
                 ignored: list[int] | None = None) -> None:
    """Asks the server for a child: ``target`` is {"module": M}, {"code": C} or {"script": PATH}; ``fds`` its
    standard input, output and error; ``ignored`` the signals it starts ignoring (default: those this process
    ignores, as a child it started would)."""
    if ignored is None:
        ignored = [int(sig) for sig in FORWARDED if signal.getsignal(sig) is signal.SIG_IGN]
    said = b""
    while len(said) < len(READY):
        chunk = conn.recv(len(READY) - len(said))
        if not chunk:
            raise ConnectionError("the fork server closed the connection before it was ready")
        said += chunk
    if said != READY:
        raise ConnectionError(f"the fork server said {said!r}, not {READY!r}")
    request = {**target, "args": args, "cwd": cwd, "environ": environ, "ignored": ignored,
               "namespaces": _namespaces(), "pid": os.getpid()}
    socket.send_fds(conn, [json.dumps(request).encode() + b"\n"], fds)


def _namespaces() -> list[str]:
    return [os.readlink(f"/proc/self/ns/{kind}") for kind in NAMESPACES]


def _new_interpreter(argv: list[str]) -> None:
    os.execv(sys.executable, [sys.executable, *argv])


# ---------------------------------------------------------------------- the server's side


def serve(socket_path: str) -> None:
    """Listens on ``socket_path`` at once, imports the libraries, then forks a child per request until the process
    that started it is gone, or it got SIGTERM, and its children have ended."""
    import importlib

    parent = os.getppid()  # (before the imports: a launch.sh killed meanwhile is gone after them)
    stopping: list[int] = []
    # The launch's process group gets the terminal's signals, and a scheduler's SIGTERM goes to every process: the
    # children stop as they do, and the server waits for them (each child resets these to its own: _run_child).
    for sig in FORWARDED:
        signal.signal(sig, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, lambda signum, _frame: stopping.append(signum))
    started_with = dict(os.environ)  # (importing the libraries may add to it: inductor names its cache folder)
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        listener.bind(socket_path)
    except FileNotFoundError:  # its folder gone: the launch that started it ended (a Ctrl-C) before it could serve
        return
    listener.listen(64)  # clients may connect now; they wait for their answer until the imports are done
    for module in PRELOAD:
        importlib.import_module(module)
    library_path = _library_path()
    selector = selectors.DefaultSelector()
    selector.register(listener, selectors.EVENT_READ)
    children: dict[int, socket.socket] = {}  # a child's pid -> its client's connection, open while it runs
    clients: dict[socket.socket, int] = {}
    try:
        # Once the process that started the server has ended (or was killed), so does the server, after its children
        # (those still running stop as their supervisor's end tells them to, and their clients wait for how).
        while (os.getppid() == parent and not stopping) or children:
            for key, _ in selector.select(timeout=POLL_S):
                if key.fileobj is not listener:  # a client gone while its child runs: killed, so is the child
                    selector.unregister(key.fileobj)
                    os.kill(clients.pop(key.fileobj), signal.SIGKILL)  # (not reaped yet: the pid is still its)
                    continue
                conn, _ = listener.accept()
                try:
                    pid = _answer(conn, started_with, library_path, listener, children)
                except ClientGone:
                    conn.close()
                    continue
                except (OSError, ValueError, LookupError, TypeError) as err:  # its client died, or sent no request
                    print(f"forkserver: a request failed: {err!r}", file=sys.stderr)
                    conn.close()
                    continue
                if pid is not None:
                    children[pid], clients[conn] = conn, pid
                    selector.register(conn, selectors.EVENT_READ)
            _reap(children, clients, selector)
    finally:
        with contextlib.suppress(OSError):
            os.unlink(socket_path)
            os.rmdir(os.path.dirname(socket_path))  # (launch.sh's folder for it; one with other files stays)


def _answer(conn: socket.socket, started_with: dict, library_path: list[str], listener: socket.socket,
            children: dict) -> int | None:
    """Reads a request and forks its child (its pid), or tells the client to start a new interpreter (None)."""
    try:
        conn.sendall(READY)
    except (BrokenPipeError, ConnectionResetError) as err:
        raise ClientGone() from err
    request, fds = _read_request(conn)
    try:
        if why := why_not_forked(request["environ"], started_with):
            conn.sendall(json.dumps({"exec": why}).encode() + b"\n")
            conn.close()
            return None
        sys.stdout.flush()
        sys.stderr.flush()
        pid = os.fork()
        if pid == 0:
            try:
                listener.close()
                for other in (conn, *children.values()):
                    other.close()
                _run_child(request, fds, library_path)  # never returns
            finally:  # (an error setting the child up: never a second server)
                os._exit(1)
    finally:
        for fd in fds:
            os.close(fd)
    try:
        conn.sendall(json.dumps({"pid": pid}).encode() + b"\n")
    except OSError:  # its client is gone: so is the child (reaped with the others)
        os.kill(pid, signal.SIGKILL)
        raise
    return pid


def _reap(children: dict, clients: dict, selector) -> None:
    """Tells the clients of the children that ended how they ended."""
    while children:
        pid, status = os.waitpid(-1, os.WNOHANG)
        if pid == 0:
            return
        conn = children.pop(pid, None)
        if conn is None:
            continue
        if clients.pop(conn, None) is not None:
            selector.unregister(conn)
        with contextlib.suppress(OSError):  # (the client is gone)
            conn.sendall(json.dumps({"status": status}).encode() + b"\n")
        conn.close()


def _read_request(conn: socket.socket) -> tuple[dict, list[int]]:
    """A request's line and the file descriptors that came with it (the client's standard three)."""
    try:
        data, fds, _, _ = socket.recv_fds(conn, 1 << 20, 3)
    except ConnectionResetError as err:  # (killed with READY unread)
        raise ClientGone() from err
    if not data and not fds:
        raise ClientGone()
    try:
        while not data.endswith(b"\n"):
            chunk = conn.recv(1 << 20)
            if not chunk:
                raise ConnectionError("the connection closed before a whole line")
            data += chunk
        return json.loads(data), fds
    except BaseException:
        for fd in fds:
            os.close(fd)
        raise


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


def _run_child(request: dict, fds: list[int], library_path: list[str]) -> None:
    """What `python -m MODULE ARGS` (`-c CODE ARGS`, `SCRIPT ARGS`) in the client's folder, with its environment
    and standard files, does; ends the process."""
    import atexit
    import random
    import runpy
    import threading
    import traceback

    for target, fd in enumerate(fds):
        os.dup2(fd, target)
        os.close(fd)
    if request["namespaces"] != _namespaces():
        _join_namespaces(request["pid"])
    os.chdir(request["cwd"])
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
    if site := _sitecustomize(os.environ.get("PYTHONPATH", "")):
        runpy.run_path(site, run_name="sitecustomize")
    sys.argv = [request.get("module") or request.get("script") or "-c", *request["args"]]
    random.seed()  # a new interpreter's, not the server's sequence shared by every child
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
    if sys.argv[1:2] == ["--client"]:
        client(sys.argv[2:])
    else:  # the server: python forkserver.py SOCKET
        if sys.path[0] == os.path.dirname(os.path.abspath(__file__)):
            del sys.path[0]  # (asyncgrpo/ is no folder of top-level modules: its config.py must not shadow one)
        serve(sys.argv[1])
        # Without the interpreter's teardown of the libraries it imported: it outlived the launch by 2 s more on
        # the CPU machine (the server holds no files and starts no processes of its own).
        os._exit(0)
