"""Worker liveness: an flock held for the worker's whole life, plus a heartbeat file.

On one host "the lock is free" means "the worker is dead" with no false positive: the
kernel drops an flock when its process dies, whatever killed it. A worker on another
host is judged by its heartbeat's mtime, compared with a probe file touched on the same
filesystem (never with the local clock, which may disagree with the file server's).
A worker that is alive but stopped (SIGSTOP, a hung host) keeps its lock but stops
beating; recovery treats a heartbeat older than the lease as stale too.

``pid_alive`` is the same question for processes that record a pid and host instead of
holding a lock (the PS's weight publishers, their /dev/shm buffer folders).
"""

from __future__ import annotations

import fcntl
import logging
import os
import re
import socket
import threading
import time
from dataclasses import dataclass

from asyncgrpo.jobqueue import fileops
from asyncgrpo.jobqueue.rundir import RunDir

HEARTBEAT_INTERVAL_S = 1.0  # well under any sensible lease, cheap (one small file replace)
_LOCK_RETRY_S = 1.0  # a recovery probe holds a free lock for microseconds; ride over it

log = logging.getLogger("asyncgrpo.queue")
_HEARTBEAT_RE = re.compile(r"^dev(0|[1-9]\d{0,2})\.json$")


def pid_alive(pid: object, host: object) -> bool:
    """False only when ``pid`` is certainly dead on this host (another host: unknown, True)."""
    if host != socket.gethostname():
        return True
    if not isinstance(pid, int) or pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # alive, owned by another user
    return True


class WorkerAlreadyRunning(RuntimeError):
    pass


def lock_path(run: RunDir, device: int):
    return run.workers / f"dev{device}.lock"


def heartbeat_path(run: RunDir, device: int):
    return run.workers / f"dev{device}.json"


def fs_now(run: RunDir) -> float:
    """The run filesystem's idea of now (mtime of a freshly touched probe); the local
    clock where the run directory is read-only."""
    try:
        return fileops.touch(run.workers / ".clock_probe")
    except OSError:
        return time.time()


class WorkerPresence:
    """Held by a worker process: the liveness lock and a heartbeat thread.

    ``update(job_id=..., weights_version=...)`` records what the worker is doing; the
    next beat (within ``interval_s``) writes it. Writing on every update would cost a
    file replace per job state change on the hot path, and recovery only needs the job
    id to be right within the lease, which is many intervals long.
    """

    def __init__(self, run: RunDir, device: int, interval_s: float = HEARTBEAT_INTERVAL_S):
        self.run, self.device, self.interval_s = run, device, interval_s
        self._fields = {"device": device, "pid": os.getpid(), "host": socket.gethostname(),
                        "job_id": None, "weights_version": None, "state": "starting",
                        "started_at": time.time()}
        self._lock_fd: int | None = None
        self._stop = threading.Event()
        self._mutex = threading.Lock()
        self._thread: threading.Thread | None = None

    def start(self) -> WorkerPresence:
        fd = os.open(lock_path(self.run, self.device), os.O_RDWR | os.O_CREAT, 0o644)
        deadline = time.monotonic() + _LOCK_RETRY_S
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() > deadline:
                    os.close(fd)
                    other = fileops.read_json(heartbeat_path(self.run, self.device)) or {}
                    raise WorkerAlreadyRunning(
                        f"worker dev{self.device} is already running on {self.run.root} "
                        f"(pid {other.get('pid', '?')} on {other.get('host', '?')})") from None
                time.sleep(0.01)
        self._lock_fd = fd
        self.update(state="idle")
        self.beat()
        self._thread = threading.Thread(target=self._beat_forever, name=f"heartbeat-dev{self.device}", daemon=True)
        self._thread.start()
        return self

    def update(self, **fields) -> None:
        with self._mutex:
            self._fields.update(fields)

    def beat(self) -> None:
        """Writes the heartbeat now."""
        with self._mutex:
            self._fields["last_beat"] = time.time()
            fileops.write_json(heartbeat_path(self.run, self.device), self._fields)

    def _beat_forever(self) -> None:
        while not self._stop.wait(self.interval_s):
            try:
                self.beat()
            except OSError as err:  # a full disk must not kill the worker; the lease will tell
                log.warning("[queue] dev%d heartbeat failed: %s", self.device, err)

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        if self._lock_fd is not None:
            self.update(state="stopped", job_id=None)
            self.beat()
            os.close(self._lock_fd)  # releases the flock
            self._lock_fd = None


@dataclass
class WorkerStatus:
    device: int
    alive: bool
    pid: int | None
    host: str | None
    state: str | None
    job_id: str | None
    weights_version: int | None
    heartbeat_age_s: float | None  # None: never beat

    def as_dict(self) -> dict:
        return dict(self.__dict__)


def _lock_is_held(path) -> bool:
    try:
        fd = os.open(path, os.O_RDONLY)
    except FileNotFoundError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return True
    finally:
        os.close(fd)  # closing also drops the lock if we took it
    return False


def worker_status(run: RunDir, device: int, now: float, lease_s: float) -> WorkerStatus:
    hb_path = heartbeat_path(run, device)
    heartbeat = fileops.read_json(hb_path) or {}
    try:
        age = round(max(0.0, now - os.stat(hb_path).st_mtime), 3)
    except FileNotFoundError:
        age = None
    host = heartbeat.get("host")
    if host is None or host == socket.gethostname():
        alive = _lock_is_held(lock_path(run, device))
    else:
        alive = age is not None and age <= lease_s and heartbeat.get("state") != "stopped"
    return WorkerStatus(device=device, alive=alive, pid=heartbeat.get("pid"), host=host,
                        state=heartbeat.get("state") if alive or heartbeat.get("state") == "stopped" else "dead",
                        job_id=heartbeat.get("job_id") if alive else None,
                        weights_version=heartbeat.get("weights_version"), heartbeat_age_s=age)


def list_workers(run: RunDir, now: float, lease_s: float) -> list[WorkerStatus]:
    devices = sorted(int(m[1]) for e in fileops.scan(run.workers) if (m := _HEARTBEAT_RE.match(e.name)))
    return [worker_status(run, d, now, lease_s) for d in devices]
