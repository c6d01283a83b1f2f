"""The tests' processes: the repository's paths (REPO, TESTS) and the environment every process gets
(PROCESS_ENV: one thread each); starting the PS and workers as real processes (start_process, forked from the
zygote, tests/zygote.py, when it can; start_faulty_ps and faulty_ps_env for tests/processes/faulty_ps.py; start_ps_ranks
under torchrun; start_script; launch_sh from a user's folder; launch_in_group as a terminal runs it); waiting for
a condition (wait_for: bounded, and failing early when a process it depends on exits) or for a process to stop;
a run's PS and workers stopped however the test ends (RunProcesses) and a process's exit status checked with its
log's end (expect_exit, log_tail); and a process's state, liveness, heartbeat pid, a signalled launch.sh's status
(stopped_status) and the cleanup of a launch.sh run (kill_run).
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import zygote
from zygote import FORK, ForkedProcess

from asyncgrpo import forkserver

from .files import read_json

REPO = Path(__file__).resolve().parents[2]
TESTS = REPO / "tests"
PROCESSES = TESTS / "processes"  # what the tests run as processes: faulty PS and workers, rewards, tools
# One thread per process: the tests start several on a machine with few cores.
PROCESS_ENV = {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false", "PYTHONUNBUFFERED": "1"}
# What a test runs `python -m ps`, `python -c CODE` or a script with: a fork of the suite's zygote where it runs
# (tests/zygote.py), else a new interpreter. launch.sh and join.sh start their processes with it too.
PYTHON = zygote.CLIENT if FORK else sys.executable
if FORK:
    PROCESS_ENV.update(ASYNCGRPO_PYTHON=zygote.CLIENT, ASYNCGRPO_FORK_PYTHON=sys.executable,
                       ASYNCGRPO_FORK_SERVER=zygote.socket_path())
else:
    PROCESS_ENV.update(ASYNCGRPO_FORK="0")  # launch.sh too starts new interpreters


# A launch.sh's environment as a user's is: it runs a fork server of its own (asyncgrpo/forkserver.py) instead of
# forking from the suite's (where no GPU is seen; with --device cpu on a GPU machine too).
OWN_SERVER_ENV = {k: v for k, v in PROCESS_ENV.items()
                  if k not in ("ASYNCGRPO_PYTHON", "ASYNCGRPO_FORK_SERVER", "ASYNCGRPO_FORK_PYTHON", "ASYNCGRPO_FORK")}


def start_zygote() -> None:
    """Starts the suite's zygote now, when FORK (else nothing): a launch.sh started before it would start its
    processes as new interpreters."""
    if FORK:
        zygote.zygote_socket(REPO, PROCESS_ENV)


# ---------------------------------------------------------------------- waiting


def wait_for(condition, what: str, timeout: float = 60, *, procs=(), log=None, poll_s: float = 0.05):
    """Calls ``condition()`` every ``poll_s`` seconds until it returns something truthy, and returns that.

    Fails (AssertionError) naming ``what`` and the timeout after ``timeout`` seconds, and at once, with its
    exit status, when a process in ``procs`` (subprocess.Popen) has exited while the condition does not hold
    (it would never come true). ``log``: a file (a process's output) whose last 3000 characters end the message."""
    deadline = time.monotonic() + timeout
    while True:
        value = condition()
        if value:
            return value
        exited = [proc for proc in procs if proc.poll() is not None]
        if exited or time.monotonic() >= deadline:
            why = "; ".join(f"{_process_name(p)} (pid {p.pid}) exited with status {p.returncode}" for p in exited)
            message = f"{why} while waiting for {what}" if why else f"waited {timeout:g} s for {what}"
            if log is not None and Path(log).exists():
                message += "\n" + log_tail(log)
            raise AssertionError(message)
        time.sleep(poll_s)


def log_tail(path, chars: int = 3000) -> str:
    """The last ``chars`` characters of a process's log: what a failed assertion about the process shows."""
    path = Path(path)
    return path.read_text(errors="replace")[-chars:] if path.exists() else f"({path} was never written)"


def expect_exit(proc, status: int, log, timeout: float = 600) -> None:
    """Waits for ``proc`` to exit; fails unless it exits with ``status``, with the end of its ``log``."""
    try:
        code = proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        raise AssertionError(f"{_process_name(proc)} still running after {timeout:g} s; {log} ends:\n"
                             + log_tail(log)) from None
    assert code == status, f"{_process_name(proc)} exited with status {code}, not {status}; {log} ends:\n" + (
        log_tail(log))


def _process_name(proc: subprocess.Popen) -> str:
    args = [proc.args] if isinstance(proc.args, (str, bytes, os.PathLike)) else list(proc.args)
    return " ".join(os.path.basename(str(a)) if i == 0 else str(a) for i, a in enumerate(args[:3]))


def _stat_fields(pid: int) -> list[str] | None:
    """``pid``'s /proc stat fields after its command's name (state, parent, ...), or None when it is gone."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except (FileNotFoundError, ProcessLookupError):
        return None


def process_state(pid: int) -> str | None:
    """The state letter of ``pid`` in /proc (R, S, T stopped, Z zombie, ...), or None when it is gone."""
    fields = _stat_fields(pid)
    return fields[0] if fields else None


def parent_of(pid: int) -> int | None:
    """``pid``'s parent, or None when it is gone."""
    fields = _stat_fields(pid)
    return int(fields[1]) if fields else None


def wait_until_stopped(proc: subprocess.Popen, timeout: float, poll_s: float = 0.01) -> None:
    """Waits until ``proc`` is stopped (SIGSTOP: state T); fails if it exits first."""
    wait_for(lambda: process_state(proc.pid) == "T", f"{_process_name(proc)} (pid {proc.pid}) to stop (SIGSTOP)",
             timeout, procs=(proc,), poll_s=poll_s)


# ---------------------------------------------------------------------- processes


def start_process(run_root, log_path, module: str, *args: str, env: dict | None = None):
    """``python -m module --run_dir RUN args...`` from the repository, its output appended to ``log_path``;
    ``env`` defaults to PROCESS_ENV. Forked from the zygote (tests/zygote.py: the libraries already imported) where
    ``env`` only adds to the suite's environment variables read at run time; else a new interpreter
    (subprocess.Popen)."""
    argv = ["--run_dir", str(run_root), *args]
    env = PROCESS_ENV if env is None else env
    if FORK and set(env) >= set(PROCESS_ENV) and forkserver.why_not_forked(env, PROCESS_ENV) is None:
        added = {k: v for k, v in env.items() if PROCESS_ENV.get(k) != v}
        return ForkedProcess(module, argv, log_path, cwd=REPO, env=PROCESS_ENV, extra_env=added)
    with open(log_path, "ab") as log:
        return subprocess.Popen([sys.executable, "-m", module, *argv], cwd=REPO, env=env, stdout=log,
                                stderr=subprocess.STDOUT)


class RunProcesses:
    """A run's PS and workers as real processes, each logging into the folder that holds the run directory, and
    stopped however the test ends: SIGTERM to those still running on leaving the ``with`` block (a worker finishes
    or gives back the job in hand), SIGKILL to any still running two minutes later.

        with RunProcesses(tmp_path / "run", *flags) as run:
            run.ps("--max_steps", "14")
            run.workers(1, 2)
            run.expect_ps_exit(0)        # else fails with the end of ps.log
    """

    def __init__(self, root, *flags: str):
        self.root, self.flags = Path(root), flags
        self.logs = self.root.parent
        self.procs: list = []

    def ps(self, *args: str, log: str = "ps.log", env: dict | None = None):
        self.ps_proc = self.add(start_process(self.root, self.logs / log, "ps", *self.flags, *args, env=env))
        self.ps_log = self.logs / log
        return self.ps_proc

    def worker(self, device, *args: str, log: str | None = None, env: dict | None = None):
        log_path = self.logs / (log or f"w{device}.log")
        return self.add(start_process(self.root, log_path, "worker", "--device", str(device), *self.flags, *args,
                                      env=env))

    def workers(self, *devices) -> list:
        return [self.worker(device) for device in devices]

    def add(self, proc):
        """``proc`` (a process of this run started otherwise) is stopped with the others."""
        self.procs.append(proc)
        return proc

    def expect_ps_exit(self, status: int = 0, timeout: float = 600) -> None:
        expect_exit(self.ps_proc, status, self.ps_log, timeout)

    def stop(self, procs=None) -> list[int]:
        """SIGTERM to each of ``procs`` (default: every process of the run) still running; their exit statuses."""
        procs = self.procs if procs is None else procs
        for proc in procs:
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        codes = []
        for proc in procs:
            try:
                codes.append(proc.wait(timeout=120))
            except subprocess.TimeoutExpired:
                proc.kill()
                codes.append(proc.wait())
        return codes

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.stop()


def faulty_ps_env(fault: str, arg: int) -> dict:
    """The environment of ``python -m faulty_ps``: the PS with ``fault`` injected (tests/processes/faulty_ps.py says
    which: "kill-mid-save", "full-metrics", ...)."""
    return {**PROCESS_ENV, "PS_FAULT": f"{fault} {arg}",
            "PYTHONPATH": os.pathsep.join(p for p in (str(PROCESSES), str(REPO), PROCESS_ENV.get("PYTHONPATH")) if p)}


def start_faulty_ps(run_root, log_path, fault: str, arg: int, *args: str):
    return start_process(run_root, log_path, "faulty_ps", *args, env=faulty_ps_env(fault, arg))


def start_faulty_worker(run_root, log_path, fault: str, *args: str, extra_env: dict | None = None):
    """``python -m faulty_worker`` (tests/processes/faulty_worker.py says which faults), ``extra_env`` added to its
    environment."""
    env = {**faulty_ps_env("none", 0), "WORKER_FAULT": fault, **(extra_env or {})}
    return start_process(run_root, log_path, "faulty_worker", *args, env=env)


def start_ps_ranks(run_root, log_path, processes: int, *args: str, env: dict | None = None) -> subprocess.Popen:
    """The PS as ``processes`` data-parallel ranks: ``torchrun --standalone --nproc_per_node N -m ps`` (gloo on
    CPU), with --ps_processes N; its output appended to ``log_path``; ``env`` defaults to PROCESS_ENV."""
    with open(log_path, "ab") as log:
        return subprocess.Popen([PYTHON, "-m", "torch.distributed.run", "--standalone",
                                 "--nproc_per_node", str(processes), "--log-dir",
                                 str(Path(log_path).parent / "torchrun"), "--no-python", PYTHON, "-m", "ps",
                                 "--run_dir", str(run_root), "--ps_processes", str(processes), *args],
                                cwd=REPO, env=PROCESS_ENV if env is None else env, stdout=log,
                                stderr=subprocess.STDOUT)


def start_script(script, *args: str, env: dict | None = None, **popen) -> subprocess.Popen:
    """``python script args...`` (a test file that is also its subprocesses' script, ...), stdout piped as text.
    PROCESS_ENV plus ``env``; tests/ and the repository on the path, so the script imports helpers and
    asyncgrpo as a test does. ``env`` values of None remove a variable."""
    env = {**PROCESS_ENV, **(env or {})}
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(TESTS), str(REPO), env.get("PYTHONPATH")) if p)
    env = {k: v for k, v in env.items() if v is not None}
    return subprocess.Popen([sys.executable, str(script), *args], stdout=subprocess.PIPE, text=True, env=env, **popen)


def launch_sh(cwd, *args: str, timeout: float = 600, env: dict | None = None) -> subprocess.CompletedProcess:
    """``bash launch.sh args...`` run from ``cwd`` (as a user runs it from their folder), to its end; PROCESS_ENV
    plus ``env``."""
    return subprocess.run(["bash", str(REPO / "launch.sh"), *args], cwd=cwd, env={**PROCESS_ENV, **(env or {})},
                          capture_output=True, text=True, timeout=timeout)


def launch_in_group(run_root, *args, nohup: bool = False, cwd=REPO, env: dict = PROCESS_ENV):
    """launch.sh as the leader of its own process group, as a terminal runs a command from ``cwd``: SIGHUP not
    ignored (also when the suite runs under nohup), or ignored as ``nohup`` runs it."""
    sighup = signal.SIG_IGN if nohup else signal.SIG_DFL
    return subprocess.Popen(["bash", str(REPO / "launch.sh"), "--run-dir", str(run_root), *args], cwd=cwd,
                            env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True, preexec_fn=lambda: signal.signal(signal.SIGHUP, sighup))


def stopped_status(proc, run_root, timeout: float = 120) -> int:
    """launch.sh's exit status once a signal stopped the run. Past ``timeout`` the test fails with the PS's log
    end, where SIGUSR1 has it print each thread's stack (faulthandler): where its stop hangs."""
    try:
        return proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        log = run_root / "logs" / "log_parameter_server.txt"
        with contextlib.suppress(OSError, ValueError, KeyError, AssertionError):  # (the stacks are a bonus)
            os.kill(json.loads((run_root / "ps.json").read_text())["pid"], signal.SIGUSR1)
            wait_for(lambda: "most recent call first" in log.read_text(), "the PS stacks", timeout=10)
        pytest.fail(f"launch.sh still runs {timeout} s after the signal; the PS's log ends:\n"
                    f"{log.read_text()[-8000:]}")


def dead_pid() -> int:
    """The pid of a process that has exited (and was reaped)."""
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()
    return child.pid


def pid_alive(pid: int) -> bool:
    """True while ``pid`` runs (a zombie counts as gone)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return process_state(pid) not in (None, "Z")


def heartbeat_pid(run_root, device, timeout: float, not_pid: int | None = None, procs=()) -> int:
    """The pid in worker ``device``'s heartbeat (RUN/workers/devN.json), once it beats with one (other than
    ``not_pid``: a restarted worker beats with its own); ``procs`` as for wait_for."""
    path = Path(run_root) / "workers" / f"dev{device}.json"

    def beating_pid():
        pid = read_json(path).get("pid")
        return pid if pid and pid != not_pid else None

    return wait_for(beating_pid, f"worker {device} to beat" + (f" with a pid other than {not_pid}" if not_pid else ""),
                    timeout, procs=procs, poll_s=0.1)


def kill_run(run_root, launcher: subprocess.Popen) -> None:
    """Cleanup after a launch.sh test: SIGKILLing bash would leave its children running."""
    launcher.kill()
    for path in [Path(run_root) / "ps.json", *Path(run_root).glob("workers/dev*.json")]:
        pid = read_json(path).get("pid")
        if pid and pid_alive(pid):
            os.kill(pid, signal.SIGKILL)
