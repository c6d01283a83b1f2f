"""The job queue protocol: write, claim, complete (fenced), collect, consume, archive, recover.

One ``JobQueue`` per process over one run directory. Every state change is a single
no-clobber move done by ``fileops``; every file that leaves ``queue/`` is archived in
``done/`` with a reason, never deleted (temp files excepted). The protocol and why each
step is safe are in docs/design.md, "The file protocol".

The PS calls ``put_job``, ``collect``, ``consume``/``archive`` and ``recover``; a worker
calls ``claim``, then ``complete``, ``fail`` (thrown again, or reported to the PS as failed) or
``release``.
"""

from __future__ import annotations

import logging
import os
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from asyncgrpo.events import EventLog
from asyncgrpo.jobqueue.names import (
    ArchiveReason,
    JobState,
    QueueName,
    done_name,
    invalid_name_stem,
    is_job_id,
    parse_done_name,
    parse_queue_name,
)
from asyncgrpo.run import fileops
from asyncgrpo.run.liveness import DEFAULT_LEASE_S, fs_now, worker_status
from asyncgrpo.run.rundir import RunDir, WorkerId

SCHEMA_VERSION = 1
DEFAULT_MAX_ATTEMPTS = 3  # a job recovered this many times is archived `orphaned`

JOB_KEYS = ("schema", "kind", "job_id", "created_step", "created_at", "data")
RESULT_KEYS = ("schema", "kind", "job_id", "attempt", "worker_device", "weights_version",
               "claimed_at", "completed_at", "data")

log = logging.getLogger("asyncgrpo.queue")


class AlreadyConsumed(Exception):
    """A job id that was consumed before; its result was archived as a duplicate."""


def validate_payload(payload: dict, kind: str, job_id: str) -> None:
    """Raises ValueError unless ``payload`` is a ``kind`` payload of schema SCHEMA_VERSION for ``job_id``."""
    if payload.get("schema") != SCHEMA_VERSION:
        raise ValueError(f"schema {payload.get('schema')!r} is not {SCHEMA_VERSION}")
    if payload.get("kind") != kind:
        raise ValueError(f"kind {payload.get('kind')!r} is not {kind!r}")
    keys = JOB_KEYS if kind == "job" else RESULT_KEYS
    missing = [k for k in keys if k not in payload]
    if missing:
        raise ValueError(f"missing keys {missing}")
    if not is_job_id(payload["job_id"]) or payload["job_id"] != job_id:
        raise ValueError(f"payload job_id {str(payload['job_id'])[:40]!r} does not match file name job id {job_id}")


def describe_error(error: dict) -> str:
    """One line for one of a job's ``errors``: "reward function 'f' raised ValueError: ..." (or "generation
    raised ..."). A record holds ``type``, ``message``, ``reward_function`` (None outside one), ``stage``
    ("generation" or "scoring"), ``traceback``, ``attempt``, ``worker_device``, ``weights_version``, ``time``."""
    where = f"reward function {error['reward_function']!r}" if error.get("reward_function") else error.get("stage")
    lines = str(error.get("message", "")).strip().splitlines() or [""]
    message = lines[0][:300] + (" ..." if len(lines) > 1 or len(lines[0]) > 300 else "")
    return f"{where or 'the job'} raised {error.get('type', 'an exception')}: {message}"


def is_failure_report(payload: dict) -> bool:
    """A result that reports a job given up after its last attempt (JobQueue.fail), not a generated batch."""
    return isinstance(payload.get("data"), dict) and "errors" in payload["data"]


@dataclass
class ClaimedJob:
    name: QueueName  # its processing name
    path: Path
    payload: dict
    claimed_at: float

    @property
    def job_id(self) -> str:
        return self.name.job_id

    @property
    def attempt(self) -> int:
        return self.name.attempt

    @property
    def data(self):
        return self.payload["data"]


@dataclass
class CollectedResult:
    job_id: str
    path: Path  # its collected file, archived by consume() or archive()
    payload: dict

    @property
    def attempt(self) -> int:
        return self.payload["attempt"]

    @property
    def data(self):
        return self.payload["data"]


@dataclass
class RecoveryAction:
    what: str  # requeue | archive | reap
    src: str
    dst: str | None
    why: str
    job_id: str | None = None  # set when a job's file was recovered (not for temp files or junk)

    def line(self) -> str:
        return f"{self.what} {self.src} -> {self.dst or '(removed)'}: {self.why}"


class JobQueue:
    def __init__(self, run: RunDir, *, fsync: bool = True, events: EventLog | None = None,
                 max_payload_bytes: int | None = None):
        self.run = run
        self.fsync = fsync
        # A job or result file larger than this is archived failed_load unread: one oversized file must not take
        # the PS's memory (at every restart: it stays collected until it is archived).
        self.max_payload_bytes = max_payload_bytes
        self.events = events or EventLog.off()  # every archive is a timeline event
        self._candidates: deque[QueueName] = deque()

    # ---------------------------------------------------------------- scanning

    def scan(self) -> tuple[list[QueueName], list[os.DirEntry]]:
        """Active files by parsed name, and entries outside the grammar (``.tmp`` excluded)."""
        names, junk = [], []
        for entry in fileops.scan(self.run.queue):
            name = parse_queue_name(entry.name)
            if name is not None:
                names.append(name)
            elif entry.name != ".tmp":
                junk.append(entry)
        return names, junk

    def counts(self) -> dict[str, int]:
        counts = {s.value: 0 for s in JobState}
        for name in self.scan()[0]:
            counts[name.state.value] += 1
        return counts

    def path(self, name: QueueName) -> Path:
        return self.run.queue / name.filename

    def was_consumed(self, job_id: str) -> bool:
        return os.path.lexists(self.run.done / done_name(job_id, ArchiveReason.CONSUMED))

    def active_job_ids(self) -> set[str]:
        """The jobs with a file in queue/, in any state: thrown and not yet archived."""
        return {name.job_id for name in self.scan()[0]}

    def has_files_of(self, job_id: str) -> bool:
        """Whether job ``job_id`` was ever written: a file of it is in queue/ or done/."""
        return job_id in self.active_job_ids() or any(
            (parsed := parse_done_name(entry.name)) and parsed[0] == job_id for entry in fileops.scan(self.run.done))

    # ---------------------------------------------------------------- PS: produce

    def put_job(self, job_id: str, data, *, created_step: int) -> Path:
        """Writes ``{job_id}_pending.pt`` (FileExistsError if that job id is already queued)."""
        if not is_job_id(job_id):
            raise ValueError(f"bad job id {job_id!r}")
        payload = {"schema": SCHEMA_VERSION, "kind": "job", "job_id": job_id,
                   "created_step": created_step, "created_at": time.time(), "data": data}
        path = self.path(QueueName(job_id))
        fileops.write_payload(self.run.tmp, path, payload, fsync=self.fsync)
        return path

    # ---------------------------------------------------------------- worker

    def claim(self, device: WorkerId) -> ClaimedJob | None:
        """Claims the oldest pending job for worker ``device``, or returns None if there is none.

        Candidates come from one sorted scan and are tried in order until that list is
        used up, so many workers racing over a long queue don't each rescan it per claim.
        """
        while True:
            if not self._candidates:
                self._candidates = deque(sorted(n for n in self.scan()[0] if n.state is JobState.PENDING))
                if not self._candidates:
                    return None
            pending = self._candidates.popleft()
            name = pending.moved_to(JobState.PROCESSING, device)
            try:
                fileops.move(self.path(pending), self.path(name))
            except FileNotFoundError:
                continue  # another worker won this one
            except FileExistsError:
                log.warning("[queue] %s: %s already exists", pending.filename, name.filename)
                self.archive_if_present(self.path(pending), pending.job_id, ArchiveReason.DUPLICATE, pending.attempt)
                continue
            claimed_at = time.time()
            try:
                fileops.stamp_now(self.path(name))  # the lease counts from the claim, on the file server's clock
            except FileNotFoundError:
                # Until this mtime is set the file keeps the job's creation time, and while our
                # heartbeat still names another job, recovery may take it as a leftover: it was
                # requeued (attempt + 1), someone will take it; we look for another.
                log.info("[queue] %s was recovered as it was being claimed", name.filename)
                continue
            try:
                payload = fileops.load_payload(self.path(name), self.max_payload_bytes)
                validate_payload(payload, "job", name.job_id)
            except (fileops.PayloadLoadError, ValueError, OSError) as err:
                log.error("[queue] job %s rejected: %s", name.filename, err)
                self.archive_if_present(self.path(name), name.job_id, ArchiveReason.FAILED_LOAD, name.attempt)
                continue
            return ClaimedJob(name=name, path=self.path(name), payload=payload, claimed_at=claimed_at)

    def complete(self, job: ClaimedJob, data, *, weights_version: int, **fields) -> bool:
        """Publishes a worker's result. False if the job was recovered from this worker
        meanwhile (the result is dropped: the job belongs to someone else now).

        Order: stage the result in .tmp, fence (rename our processing file to
        committing), link the result into place, archive the fenced file as processed.
        """
        payload = {"schema": SCHEMA_VERSION, "kind": "result", "job_id": job.job_id, "attempt": job.attempt,
                   "worker_device": job.name.device, "weights_version": weights_version,
                   "claimed_at": job.claimed_at, "completed_at": time.time(), "data": data, **fields}
        result = QueueName(job.job_id, state=JobState.COMPLETE, device=job.name.device)
        return self._fenced_publish(job, payload, result, ArchiveReason.PROCESSED)

    def fail(self, job: ClaimedJob, error: dict, *, max_attempts: int, weights_version: int) -> bool:
        """A job whose generation or scoring raised: ``error`` (see describe_error) is added to the
        ``errors`` of its payload, and the job goes back to pending as attempt + 1, or, after its
        ``max_attempts``-th attempt, to the PS as a *failure report*: a result whose data holds
        ``errors`` and ``job`` (the job's data) instead of a batch; the PS archives it ``failed``.
        The attempt's own job file is archived ``retried`` (or ``processed`` with the report).
        Fenced like complete(): False if the job was recovered from this worker meanwhile."""
        errors = [*job.payload.get("errors", []), error]
        if job.attempt >= max_attempts:
            return self.complete(job, {"errors": errors, "job": job.data}, weights_version=weights_version)
        again = job.name.moved_to(JobState.PENDING, attempt=job.attempt + 1)
        return self._fenced_publish(job, {**job.payload, "errors": errors}, again, ArchiveReason.RETRIED)

    def _fenced_publish(self, job: ClaimedJob, payload: dict, target: QueueName, fenced_as: ArchiveReason) -> bool:
        """Stages ``payload``, fences the job (processing -> committing), links the payload to ``target``
        and archives the fenced file as ``fenced_as``. False when the fence fails (the job was recovered)."""
        device = job.name.device
        tmp = fileops.stage_bytes(self.run.tmp, fileops.serialize(payload), fsync=self.fsync)
        fence = job.name.moved_to(JobState.COMMITTING, device)
        try:
            fileops.move(job.path, self.path(fence))
        except FileNotFoundError:
            fileops.remove_temp(tmp)
            log.warning("[queue] job %s was recovered from dev%s while it ran; dropping its result",
                        job.name.filename, device)
            return False
        try:
            fileops.stamp_now(self.path(fence))
        except FileNotFoundError:
            pass  # recovered after the fence: our result is published anyway; the PS keeps one per job
        try:
            fileops.publish(tmp, self.path(target), fsync=self.fsync)
        except FileExistsError:
            log.warning("[queue] %s already exists; archiving this one as a duplicate", target.filename)
            self.archive_if_present(tmp, job.job_id, ArchiveReason.DUPLICATE, job.attempt)
        except fileops.QueueWriteError:  # a full disk, say: undo the fence, the job is ours again to give back
            fileops.remove_temp(tmp)
            try:
                fileops.move(self.path(fence), job.path)
            except (FileNotFoundError, FileExistsError):
                pass  # recovered meanwhile
            raise
        self.archive_if_present(self.path(fence), job.job_id, fenced_as, job.attempt)
        return True

    def release(self, job: ClaimedJob) -> bool:
        """Gives an unfinished job back (same attempt), e.g. on SIGTERM."""
        try:
            fileops.move(job.path, self.path(job.name.moved_to(JobState.PENDING)))
        except (FileNotFoundError, FileExistsError):
            return False
        return True

    # ---------------------------------------------------------------- PS: collect and consume

    def collect(self, validate: Callable[[dict], None] | None = None, *,
                readopt: bool = False) -> list[CollectedResult]:
        """Claims every complete result, loads and validates it, and returns the good ones.

        Bad files go to done/ as failed_load, second results as duplicate. ``validate``
        may raise ValueError for payload contents (tensor shapes, ...). ``readopt=True``
        also loads ``collected`` files a previous PS left behind.
        """
        results = []
        names = sorted(self.scan()[0])
        for name in names:
            if name.state is JobState.COLLECTED and readopt:
                collected = name
            elif name.state is JobState.COMPLETE:
                collected = QueueName(name.job_id, state=JobState.COLLECTED)
                try:
                    fileops.move(self.path(name), self.path(collected))
                except FileNotFoundError:
                    continue
                except FileExistsError:
                    log.warning("[queue] %s: a result for this job is already collected; duplicate", name.filename)
                    self.archive_if_present(self.path(name), name.job_id, ArchiveReason.DUPLICATE)
                    continue
            else:
                continue
            try:
                payload = fileops.load_payload(self.path(collected), self.max_payload_bytes)
                validate_payload(payload, "result", name.job_id)
                if validate is not None:
                    validate(payload)
            except (fileops.PayloadLoadError, ValueError, OSError) as err:
                log.error("[queue] result %s rejected: %s", name.filename, err)
                self.archive_if_present(self.path(collected), name.job_id, ArchiveReason.FAILED_LOAD)
                continue
            if self.was_consumed(name.job_id):
                log.warning("[queue] result %s: job already consumed; duplicate", name.filename)
                self.archive_if_present(self.path(collected), name.job_id, ArchiveReason.DUPLICATE, payload["attempt"])
                continue
            results.append(CollectedResult(job_id=name.job_id, path=self.path(collected), payload=payload))
        return results

    def consume(self, result: CollectedResult) -> bool:
        """Marks a result as trained on: archives it as ``{job_id}_consumed.pt``.

        The no-clobber archive is the on-disk ledger: False (and the file archived as a
        duplicate) if that job id was consumed before.
        """
        try:
            self.archive(result.path, result.job_id, ArchiveReason.CONSUMED)
        except AlreadyConsumed:
            log.warning("[queue] job %s was consumed before; archived as duplicate", result.job_id)
            self.archive_if_present(result.path, result.job_id, ArchiveReason.DUPLICATE, result.attempt)
            return False
        return True

    def roll_back_consumed(self, ledger: set[str]) -> list[str]:
        """Results archived consumed whose job is not in ``ledger`` were trained into weights lost with an
        earlier PS (after the checkpoint this one resumes from): they go back to queue/ as collected, to be
        trained again. Returns their job ids."""
        back = []
        for entry in fileops.scan(self.run.done):
            parsed = parse_done_name(entry.name)
            if parsed is None or parsed[1] is not ArchiveReason.CONSUMED or parsed[0] in ledger:
                continue
            job_id = parsed[0]
            if entry.name != done_name(job_id, ArchiveReason.CONSUMED):  # a .{n} copy: consumed is unique
                continue
            collected = self.path(QueueName(job_id, state=JobState.COLLECTED))
            try:
                fileops.move_to_other_dir(entry.path, collected, fsync=self.fsync)
                log.info("[queue] %s was consumed after the checkpoint: back in the queue", job_id)
            except FileExistsError:
                if not os.path.samefile(entry.path, collected):
                    log.warning("[queue] %s: a collected copy already waits; keeping the archive", job_id)
                    continue
                fileops.unlink_second_name(entry.path)  # an earlier PS died inside consume()'s link + unlink
                log.info("[queue] %s: its archiving as consumed was cut short; back in the queue", job_id)
            back.append(job_id)
        return back

    def archive(self, path: str | os.PathLike, job_id: str, reason: ArchiveReason, attempt: int = 1) -> Path:
        """Moves ``path`` into done/ under its reason, never overwriting an archived file.

        Raises FileNotFoundError if ``path`` is gone and AlreadyConsumed if ``reason`` is
        CONSUMED and that job id was consumed before.
        """
        for collision in range(1_000_000):
            target = self.run.done / done_name(job_id, reason, attempt, collision)
            try:
                fileops.move_to_other_dir(path, target, fsync=self.fsync)
                self.events.emit("result_archived", job_id=job_id, reason=reason.value, attempt=attempt)
                return target
            except FileExistsError:
                if reason is ArchiveReason.CONSUMED:
                    raise AlreadyConsumed(job_id) from None
        raise RuntimeError(f"done/ holds a million {reason.value} files for job {job_id}")

    def archive_record(self, job_id: str, reason: ArchiveReason, data: dict) -> Path | None:
        """Writes ``data`` into done/ as ``{job_id}_{reason}.pt``: what became of part of a result whose file is
        archived later under another reason. None when the record is there already (written before a restart)."""
        target = self.run.done / done_name(job_id, reason)
        payload = {"schema": SCHEMA_VERSION, "kind": "record", "job_id": job_id, "data": data}
        try:
            fileops.write_payload(self.run.tmp, target, payload, fsync=self.fsync)
        except FileExistsError:
            return None
        self.events.emit("result_archived", job_id=job_id, reason=reason.value, attempt=1, record=True)
        return target

    def archive_if_present(self, path, job_id: str, reason: ArchiveReason, attempt: int = 1) -> Path | None:
        """archive(), where the file having been moved already by someone else is fine (returns None)."""
        try:
            return self.archive(path, job_id, reason, attempt)
        except FileNotFoundError:
            return None

    # ---------------------------------------------------------------- recovery

    def recover(self, *, lease_s: float = DEFAULT_LEASE_S, max_attempts: int = DEFAULT_MAX_ATTEMPTS,
                dry_run: bool = False, own_device: WorkerId | None = None,
                requeue: bool = True) -> list[RecoveryAction]:
        """Recovers the jobs of dead or silent workers, reaps old temp files, archives junk.

        A processing or committing file is stale when its worker is dead (its lock is
        free, or on another host its heartbeat is older than the lease: liveness.py), when the
        worker's heartbeat is older than the lease (stopped, hung), or when the worker
        has moved on to another job and the file is older than the lease. A stale job
        whose result exists is archived ``processed`` (the result wins), one whose job is
        already in the queue as a later attempt (its worker threw it again, then died)
        ``duplicate``; else it goes back to pending with attempt + 1, or to done/ as
        ``orphaned`` after ``max_attempts``. ``own_device``: a worker starting up recovers every file left
        under its device number, since the process that left them is gone.
        ``requeue=False`` (the PS's end of training): a stale job without a result is
        archived ``unused`` instead of going back to pending, where a worker would take it.
        Temp files are reaped when older than the lease, or at once when their writer (a
        process of this host) is dead.
        Idempotent, and safe next to running workers: every move is no-clobber.
        """
        now = fs_now(self.run)
        names, junk = self.scan()
        with_result = {n.job_id for n in names if n.state in (JobState.COMPLETE, JobState.COLLECTED)}
        latest_attempt: dict[str, int] = {}
        for n in names:
            if n.state in (JobState.PENDING, JobState.PROCESSING, JobState.COMMITTING):
                latest_attempt[n.job_id] = max(n.attempt, latest_attempt.get(n.job_id, 0))
        statuses = {}
        actions = []
        for name in sorted(names):
            if name.state not in (JobState.PROCESSING, JobState.COMMITTING):
                continue
            path = self.path(name)
            if own_device is not None:
                if name.device != own_device:
                    continue
                why = f"left by an earlier run of worker dev{own_device}"
            else:
                try:
                    file_age = now - os.lstat(path).st_mtime
                except FileNotFoundError:
                    continue
                if name.device not in statuses:
                    statuses[name.device] = worker_status(self.run, name.device, now, lease_s)
                why = _stale_reason(statuses[name.device], name, file_age, lease_s)
                if why is None:
                    continue
            reason = None  # requeue
            if name.job_id in with_result or self.was_consumed(name.job_id):
                reason, why = ArchiveReason.PROCESSED, why + "; its result exists"
            elif name.attempt < latest_attempt[name.job_id]:  # its worker threw it again and died right after
                reason, why = ArchiveReason.DUPLICATE, why + f"; attempt {latest_attempt[name.job_id]} is in the queue"
            elif name.attempt >= max_attempts:
                reason, why = ArchiveReason.ORPHANED, why + f"; attempt {name.attempt} of {max_attempts}"
            elif not requeue:
                reason, why = ArchiveReason.UNUSED, why + "; training is over"
            actions.append(self._recovery_move(path, name, reason, why, dry_run))
        actions += self._reap_temp_files(now, lease_s, dry_run)
        for entry in junk:
            actions.append(self._recovery_move(Path(entry.path), None, ArchiveReason.FAILED_LOAD,
                                               "name outside the queue grammar", dry_run))
        if not dry_run:
            for action in actions:
                log.warning("[queue] recover: %s", action.line())
        return actions

    def archive_leftovers(self, dry_run: bool = False) -> list[RecoveryAction]:
        """After training is over: each pending job and each result still in queue/ archived ``unused`` (no PS will
        train on them; pending, a worker would only take them)."""
        actions = []
        for name in sorted(self.scan()[0]):
            if name.state in (JobState.PENDING, JobState.COMPLETE, JobState.COLLECTED):
                actions.append(self._recovery_move(self.path(name), name, ArchiveReason.UNUSED,
                                                   f"{name.state.value} after training was over", dry_run))
        return actions

    def _recovery_move(self, path: Path, name: QueueName | None, reason: ArchiveReason | None,
                       why: str, dry_run: bool) -> RecoveryAction:
        if reason is None:  # requeue
            target = self.path(name.moved_to(JobState.PENDING, attempt=name.attempt + 1))
            action = RecoveryAction("requeue", path.name, target.name, why, name.job_id)
            if not dry_run:
                try:
                    fileops.move(path, target)
                except FileExistsError:
                    why += "; already requeued"
                    action = self._recovery_move(path, name, ArchiveReason.DUPLICATE, why, dry_run)
                except FileNotFoundError:
                    action.why += " (someone else moved it first)"
            return action
        job_id = name.job_id if name else invalid_name_stem(path.name)
        attempt = name.attempt if name else 1
        if dry_run:
            return RecoveryAction("archive", path.name, "done/" + done_name(job_id, reason, attempt), why,
                                  name and name.job_id)
        archived = self.archive_if_present(path, job_id, reason, attempt)
        return RecoveryAction("archive", path.name, f"done/{archived.name}" if archived else None,
                              why if archived else why + " (someone else moved it first)", name and name.job_id)

    def _reap_temp_files(self, now: float, lease_s: float, dry_run: bool) -> list[RecoveryAction]:
        actions = []
        for entry in fileops.scan(self.run.tmp):
            try:
                age = now - entry.stat(follow_symlinks=False).st_mtime
            except FileNotFoundError:
                continue  # its writer just published it
            writer_dead = fileops.temp_writer_is_dead(entry.name)
            if age <= lease_s and not writer_dead:
                continue  # possibly still being written: never reap a young temp file of a live writer
            if not dry_run:
                try:
                    fileops.remove_temp(entry.path)
                except FileNotFoundError:
                    continue
            actions.append(RecoveryAction("reap", f".tmp/{entry.name}", None,
                                          "temp file of a dead process" if writer_dead else
                                          f"temp file {age:.0f}s old (lease {lease_s:g}s)"))
        return actions


def _stale_reason(status, name: QueueName, file_age: float, lease_s: float) -> str | None:
    if not status.alive and status.remote and status.state != "stopped":
        return (f"worker dev{name.device} on host {status.host} went silent: heartbeat "
                f"{status.heartbeat_age_s or 0:.0f}s old (lease {lease_s:g}s)")
    if not status.alive:
        return f"worker dev{name.device} is dead"
    if status.heartbeat_age_s is not None and status.heartbeat_age_s > lease_s:
        return f"worker dev{name.device} heartbeat is {status.heartbeat_age_s:.0f}s old (lease {lease_s:g}s)"
    if not status.holds(name.job_id) and file_age > lease_s:
        return f"worker dev{name.device} moved on to {status.job_id} and this file is {file_age:.0f}s old"
    return None
