"""Worker liveness: an flock held for the worker's whole life, plus a heartbeat file.

Which rule applies depends on the heartbeat's ``host_id`` (hosts.py: hostname, boot id and
PID namespace). On the same host, "the lock is free" means "the worker is dead" with no false
positive: the kernel drops an flock when its process dies, whatever killed it. A worker on
another host (or in another container or PID namespace) is never judged by its pid or its
lock, which mean nothing here: it is alive while its heartbeat's mtime is younger than the
lease, measured against a probe file touched on the same filesystem (never the local clock,
which may disagree with the file server's). A worker that is alive but stopped (SIGSTOP, a
hung host) keeps its lock but stops beating; recovery treats a heartbeat older than the
lease as stale too.

Every timestamp recovery compares is the file server's: a heartbeat is stamped with
``os.utime(path, None)`` after it is written (and so are claims and fences, queue.py), so a
worker whose clock is off loses nothing to recovery.

The heartbeat also says which safetensors snapshot the worker is reading, if any
(``announce_read``): the PS keeps a snapshot a live worker names (weights/snapshot.py); and the
delta it found bad on disk, if it waits for a newer anchor past it (``announce_bad_delta``): the PS
then publishes one without waiting longer.

The PS holds a lock of its own (``PSRunLock``): one PS per run directory.

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
from dataclasses import dataclass, field

from asyncgrpo.messages import join_or_report, log_once
from asyncgrpo.run import fileops
from asyncgrpo.run.hosts import HOST_ID, same_host
from asyncgrpo.run.rundir import WORKER_ID, PSStatus, RunDir, WorkerId, parse_worker_id

HEARTBEAT_INTERVAL_S = 1.0  # well under any sensible lease, cheap (one small file replace)
DEFAULT_LEASE_S = 30.0  # a worker silent this long has its jobs recovered (30 heartbeats missed)
_LOCK_RETRY_S = 1.0  # a recovery probe holds a free lock for microseconds; ride over it

log = logging.getLogger("asyncgrpo.queue")
_HEARTBEAT_RE = re.compile(rf"^dev({WORKER_ID})\.json$")
CLOCK_SKEW_WARN_S = 1.0  # a worker whose clock is further off than this says so once


def pid_alive(pid: object, host: object, host_id: object = None) -> bool:
    """False only when ``pid`` is certainly dead on this host (another host: unknown, True).
    ``host_id`` decides when given; ``host`` (a hostname) only for records without one."""
    if not same_host({"host": host} if host_id is None else {"host_id": host_id}):
        return True
    if not isinstance(pid, int) or pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # alive, owned by another user
    return not _is_zombie(pid)


def ps_may_run(run: RunDir, status: PSStatus | None) -> bool:
    """Whether the PS that wrote ``status`` (ps.json's) may be running: not when there is none, when another PS has
    taken the run's lock since (it writes itself into RUN/ps.lock at once, its ps.json seconds later: readable from
    any host), when it is certainly dead on this host, or, on another host, when its heartbeat stands still until it
    is ``PS_SILENT_S`` old (which takes up to that long to see: ask after a cheaper question). An interrupted PS's
    status says it trains until the relaunched PS writes its own: the workers started beside that one, here or on a
    joined host, must not take the dead PS's flags for the run's."""
    if status is None or not _holds_the_lock(run, status):
        return False
    if status.host_id is not None and not same_host({"host_id": status.host_id}):
        # (the lock read again after: a heartbeat that moves may be a relaunched PS's, which takes the lock first)
        return ps_heartbeat_moves(run) and _holds_the_lock(run, status)
    return status.host_id is None or pid_alive(status.pid, status.host, status.host_id)


def _holds_the_lock(run: RunDir, status: PSStatus) -> bool:
    """Whether RUN/ps.lock names the PS that wrote ``status`` (or none: a PS of an older version wrote no name)."""
    try:
        holder = run.ps_lock_file.read_text(errors="replace").splitlines()
    except OSError:
        holder = []
    if not holder:
        return True
    if holder[0].strip() != f"pid {status.pid} on {status.host}":
        return False
    # (a PS relaunched in a new container may have the pid and hostname of the one before: not its host id)
    return len(holder) < 2 or status.host_id is None or holder[1].strip() == f"host id {status.host_id}"


PS_SILENT_S = 10 * HEARTBEAT_INTERVAL_S  # a PS whose heartbeat is this old is not running


def ps_heartbeat_moves(run: RunDir, silent_s: float = PS_SILENT_S) -> bool:
    """Whether the PS's heartbeat (RUN/ps.heartbeat, touched every second) moves before it is ``silent_s`` old on the
    filesystem's clock, which takes up to ``silent_s`` to see: the pid of a PS on another host means nothing here,
    and an age alone cannot tell a PS that died a second ago from one that beats. Read through an open: on NFS a
    stat alone may return the attributes it cached seconds ago."""
    def mtime() -> float | None:
        try:
            with open(run.ps_heartbeat_file, "rb") as f:
                return os.fstat(f.fileno()).st_mtime
        except OSError:
            return None

    first, deadline = mtime(), time.monotonic() + silent_s
    if first is None:
        return False
    while fs_now(run) - first < silent_s and time.monotonic() < deadline:
        time.sleep(HEARTBEAT_INTERVAL_S / 4)
        if mtime() != first:
            return True
    return False


def _is_zombie(pid: int) -> bool:
    """A process that exited and was not reaped yet still answers kill(pid, 0): it is dead all the same."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            return f.read().rsplit(b")", 1)[1].split()[0] == b"Z"  # the name in parentheses may hold spaces
    except (OSError, IndexError):
        return False  # no /proc (not Linux): kill's answer stands


class WorkerAlreadyRunning(RuntimeError):
    pass


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

    ``start`` refuses (WorkerAlreadyRunning) when the lock is held, or when the heartbeat
    of this worker id is fresh and written on another host: an flock need not reach across
    hosts, so two hosts started with the same id would otherwise share every name.
    """

    def __init__(self, run: RunDir, device: WorkerId, interval_s: float = HEARTBEAT_INTERVAL_S,
                 lease_s: float = DEFAULT_LEASE_S):
        self.run, self.device, self.interval_s, self.lease_s = run, device, interval_s, lease_s
        self._fields = {"device": device, "pid": os.getpid(), "host": socket.gethostname(), "host_id": HOST_ID,
                        "job_id": None, "job_ids": [], "weights_version": None, "reading": None, "bad_delta": None,
                        "state": "starting",
                        "started_at": time.time()}
        self._lock_fd: int | None = None
        self._stop = threading.Event()
        self._mutex = threading.Lock()
        self._thread: threading.Thread | None = None

    def start(self) -> WorkerPresence:
        fd = os.open(self.run.worker_lock_file(self.device), os.O_RDWR | os.O_CREAT, 0o666)
        deadline = time.monotonic() + _LOCK_RETRY_S
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() > deadline:
                    os.close(fd)
                    other = fileops.read_json(self.run.heartbeat_file(self.device)) or {}
                    raise WorkerAlreadyRunning(
                        f"worker dev{self.device} is already running on {self.run.root} "
                        f"(pid {other.get('pid', '?')} on {other.get('host', '?')})") from None
                time.sleep(0.01)
        try:
            now = fs_now(self.run)
            self._refuse_if_live_elsewhere(now)
        except BaseException:
            os.close(fd)
            raise
        skew = now - time.time()
        if abs(skew) > CLOCK_SKEW_WARN_S:
            log.warning("[queue] dev%s: this host's clock is %.1f s %s the run directory's filesystem; leases are "
                        "timed on the filesystem's clock, only the times in logs and events are off", self.device,
                        abs(skew), "behind" if skew > 0 else "ahead of")
        self._lock_fd = fd
        self.beat()  # ("starting" until the worker has set up: the PS's waiting line says which workers load)
        self._thread = threading.Thread(target=self._beat_forever, name=f"heartbeat-dev{self.device}", daemon=True)
        self._thread.start()
        return self

    def _refuse_if_live_elsewhere(self, now: float) -> None:
        path = self.run.heartbeat_file(self.device)
        other = fileops.read_json(path)
        if other is None or same_host(other) or other.get("state") == "stopped":
            return
        try:
            age = now - os.stat(path).st_mtime
        except FileNotFoundError:
            return
        if age <= self.lease_s:
            raise WorkerAlreadyRunning(
                f"worker dev{self.device} is already running on {self.run.root} from host {other.get('host', '?')} "
                f"(host id {other.get('host_id', '?')}, heartbeat {age:.0f}s ago); workers on other hosts join "
                "with launch.sh --join, which gives them names of their own")

    def update(self, **fields) -> None:
        with self._mutex:
            self._fields.update(fields)

    def get(self, name: str):
        """What ``update`` recorded last for ``name``."""
        with self._mutex:
            return self._fields.get(name)

    def beat(self) -> None:
        """Writes the heartbeat now, stamped with the file server's time."""
        with self._mutex:
            self._fields["last_beat"] = time.time()
            path = self.run.heartbeat_file(self.device)
            fileops.write_json(path, self._fields)
            fileops.stamp_now(path)

    def announce_read(self, snapshot: tuple[str, int] | None) -> None:
        """``(publisher_id, version)``: this worker is about to read that weights snapshot
        (written at once: the PS keeps a snapshot a live worker names). None: it is done
        (written with the next beat; keeping it a second longer costs nothing)."""
        self.update(reading=None if snapshot is None else list(snapshot))
        if snapshot is not None:
            self.beat()

    def announce_bad_delta(self, delta: tuple[str, int] | None) -> None:
        """``(publisher_id, version)``: this worker keeps its weights until an anchor newer than that delta, which it
        found bad on disk (written at once: the PS waits for results meanwhile). None: it is past it."""
        if self._fields.get("bad_delta") != (None if delta is None else list(delta)):
            self.update(bad_delta=None if delta is None else list(delta))
            self.beat()

    def _beat_forever(self) -> None:
        while not self._stop.wait(self.interval_s):
            try:
                self.beat()
            except OSError as err:  # a full disk must not kill the worker; the lease will tell
                log.warning("[queue] dev%s heartbeat failed: %s", self.device, err)

    def stop(self) -> None:
        self._stop.set()
        stuck = False
        if self._thread is not None:
            join_or_report(self._thread, f"[queue] dev{self.device}'s heartbeat", log)
            stuck = self._thread.is_alive()  # in a write that never returns (a hung network filesystem)
        if self._lock_fd is not None:
            if not stuck:  # (the last beat would wait for that write: the heartbeat's age tells the rest)
                self.update(state="stopped", job_id=None, reading=None)
                self.beat()
            os.close(self._lock_fd)  # releases the flock
            self._lock_fd = None


class PSAlreadyRunning(RuntimeError):
    pass


class PSRunLock:
    """One PS per run directory: an exclusive flock on ``RUN/ps.lock``, held until ``release`` or this process exits.
    The holder writes its pid and host into the lock file at once (its ps.json comes seconds later), so whoever is
    refused can name it (``record=False``: only trying the lock). PSAlreadyRunning when another PS holds it."""

    def __init__(self, run: RunDir, record: bool = True):
        fd = os.open(run.ps_lock_file, os.O_RDWR | os.O_CREAT, 0o666)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            holder = ps_lock_holder(run)
            raise PSAlreadyRunning(f"another parameter server is running on {run.root} ({holder})") from None
        if record:
            try:
                os.ftruncate(fd, 0)
                os.pwrite(fd, f"pid {os.getpid()} on {socket.gethostname()}\nhost id {HOST_ID}".encode(), 0)
            except OSError:  # a full disk: the lock is held all the same, and the disk check says what is wrong
                pass
        self._fd: int | None = fd

    def release(self) -> None:
        if self._fd is not None:
            os.close(self._fd)  # releases the flock
            self._fd = None

    @staticmethod
    def refuse_if_held(run: RunDir) -> None:
        """PSAlreadyRunning when a PS holds the run's lock now (launch.sh asks before it starts anything)."""
        if run.ps_lock_file.exists():
            PSRunLock(run, record=False).release()  # taken and given back at once


def ps_lock_holder(run: RunDir) -> str:
    """'pid P on HOST' of the PS holding the run's lock, waiting up to a second for it to write itself."""
    for _ in range(20):
        holder = run.ps_lock_file.read_text(errors="replace").strip()
        if holder:
            return holder.splitlines()[0]  # (the second line, its host id, is for ps_may_run)
        time.sleep(0.05)
    other = run.read_ps_status()  # a PS of an older version wrote itself only there
    return f"pid {other.pid} on {other.host}" if other else "its pid not written yet"


class PSHeartbeat:
    """The PS's heartbeat: a thread touching ``RUN/ps.heartbeat`` every ``interval_s``, so that `queue_tools ls`
    tells a PS that is stopped, swapped out or hung in the kernel (no thread runs) from one that waits for
    results. Started with ``with PSHeartbeat(run):``."""

    def __init__(self, run: RunDir, interval_s: float = HEARTBEAT_INTERVAL_S):
        self.run, self.interval_s = run, interval_s
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._beat_forever, name="ps-heartbeat", daemon=True)

    def _beat_forever(self) -> None:
        while True:
            try:
                fileops.touch(self.run.ps_heartbeat_file)
            except OSError as err:  # a full disk must not stop the PS; `ls` will say it is silent
                log_once(log, "[train] the PS heartbeat failed: %s", err, key="ps heartbeat", level=logging.WARNING)
            if self._stop.wait(self.interval_s):
                return

    def __enter__(self) -> PSHeartbeat:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        join_or_report(self._thread, "[train] the PS heartbeat", log)  # (a write hung on a network filesystem)


@dataclass
class WorkerStatus:
    device: WorkerId
    alive: bool
    pid: int | None
    host: str | None
    state: str | None
    job_id: str | None
    weights_version: int | None
    heartbeat_age_s: float | None  # None: never beat
    remote: bool = False  # on another host: judged by its heartbeat's age alone
    reading: list | None = None  # [publisher_id, version] of the snapshot it reads, while alive
    bad_delta: list | None = None  # [publisher_id, version] of a delta bad on disk it waits past, while alive
    job_ids: list[str] = field(default_factory=list)  # every job in its hand (several per generate call)
    recompiles: int = 0  # compiled decoding's graphs made after its warm-up
    supervisor_pid: int | None = None  # the launch.sh or join.sh that started it (asyncgrpo/supervisor.py)

    def holds(self, job_id: str) -> bool:
        return job_id == self.job_id or job_id in self.job_ids

    def as_dict(self) -> dict:
        return dict(self.__dict__)


def _lock_is_held(path) -> bool | None:
    """True: a live process holds the lock; False: it is free (its worker is dead); None: this host cannot tell.

    The file is opened for writing where we may: on NFS, flock is emulated with POSIX locks, and an exclusive
    one on a file opened read-only fails with EBADF. Any other error of the probe (no lock manager, ...) is
    None too: the caller then judges the worker by its heartbeat's age, as a worker on another host."""
    try:
        fd = os.open(path, os.O_RDWR)
    except FileNotFoundError:
        return False
    except PermissionError:  # another user's lock file
        try:
            fd = os.open(path, os.O_RDONLY)
        except FileNotFoundError:
            return False
        except OSError as err:
            return _cannot_probe(path, err)
    except OSError as err:
        return _cannot_probe(path, err)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return True
    except OSError as err:
        return _cannot_probe(path, err)
    finally:
        os.close(fd)  # closing also drops the lock if we took it
    return False


def _cannot_probe(path, err: OSError) -> None:
    log_once(log, "[queue] cannot probe the worker lock %s (%s: %s); workers are judged by their heartbeats' age",
             path, type(err).__name__, err, key=f"lock probe {type(err).__name__}:{err.errno}", level=logging.WARNING)
    return None


def worker_status(run: RunDir, device: WorkerId, now: float, lease_s: float) -> WorkerStatus:
    """``now``: the filesystem's clock (``fs_now``), which heartbeat mtimes are stamped with."""
    hb_path = run.heartbeat_file(device)
    heartbeat = fileops.read_json(hb_path) or {}
    try:
        age = round(max(0.0, now - os.stat(hb_path).st_mtime), 3)
    except FileNotFoundError:
        age = None
    remote = bool(heartbeat) and not same_host(heartbeat)
    held = None if remote else _lock_is_held(run.worker_lock_file(device))  # another host's lock means nothing here
    if held is None:
        alive = age is not None and age <= lease_s and heartbeat.get("state") != "stopped"
    else:
        alive = held
    reading, bad_delta = heartbeat.get("reading"), heartbeat.get("bad_delta")
    return WorkerStatus(device=device, alive=alive, pid=heartbeat.get("pid"), host=heartbeat.get("host"),
                        state=heartbeat.get("state") if alive or heartbeat.get("state") == "stopped" else "dead",
                        job_id=heartbeat.get("job_id") if alive else None,
                        weights_version=heartbeat.get("weights_version"), heartbeat_age_s=age, remote=remote,
                        reading=reading if alive and isinstance(reading, list) and len(reading) == 2 else None,
                        bad_delta=bad_delta if alive and isinstance(bad_delta, list) and len(bad_delta) == 2 else None,
                        job_ids=[str(j) for j in heartbeat.get("job_ids") or []] if alive else [],
                        recompiles=int(heartbeat.get("recompiles") or 0),
                        supervisor_pid=heartbeat.get("supervisor_pid"))


def list_workers(run: RunDir, now: float, lease_s: float) -> list[WorkerStatus]:
    ids = [parse_worker_id(m[1]) for e in fileops.scan(run.workers) if (m := _HEARTBEAT_RE.fullmatch(e.name))]
    return [worker_status(run, w, now, lease_s) for w in sorted(ids, key=_by_host_then_number)]


def _by_host_then_number(worker: WorkerId) -> tuple[str, int]:
    number, _, host = str(worker).partition(".")
    return host, int(number)
