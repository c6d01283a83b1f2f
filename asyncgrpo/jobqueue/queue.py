"""The job queue protocol: write, claim, complete (fenced), collect, consume, archive, recover.

One ``JobQueue`` per process over one run directory. Every state change is a single
no-clobber move done by ``fileops``; every file that leaves ``queue/`` is archived in
``done/`` with a reason, never deleted (temp files excepted). The protocol and why each
step is safe are in docs/design.md, "The file protocol".

The PS calls ``put_job``, ``collect``, ``consume``/``archive`` and ``recover``; a worker
calls ``claim``, then ``complete``, ``fail`` (thrown again, or reported to the PS as failed) or
``release``. Recovery (``recover``, ``archive_leftovers``) is in recovery.py; these methods delegate to it.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from asyncgrpo.events import EventLog
from asyncgrpo.jobqueue import recovery
from asyncgrpo.jobqueue.handoff import FailureReport, JobData
from asyncgrpo.jobqueue.names import (
    ArchiveReason,
    JobState,
    QueueName,
    done_name,
    is_job_id,
    parse_done_name,
    parse_queue_name,
)
from asyncgrpo.jobqueue.recovery import RecoveryAction
from asyncgrpo.run import fileops
from asyncgrpo.run.liveness import DEFAULT_LEASE_S
from asyncgrpo.run.rundir import RunDir, WorkerId

SCHEMA_VERSION = 1
DEFAULT_MAX_ATTEMPTS = 3  # a job recovered this many times is archived `orphaned`
DEFAULT_JOB_TIMEOUT_S = 1800.0  # --job_timeout_s: generous for long completions on a GPU (worker/deadline.py)

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


@dataclass
class ClaimedJob:
    name: QueueName  # its processing name
    path: Path
    payload: dict
    claimed_at: float
    job_data: JobData | None = None  # its data as the worker read it (JobData.from_dict)
    claimed_mono: float = field(default_factory=time.monotonic)  # the claim on this process's monotonic clock
    claimed_by: object = field(default=None, repr=False, compare=False)  # the JobQueue that claimed it

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
        # The jobs this process claimed and has not yet ended (published, failed, given back): what a worker's
        # deadline (worker/deadline.py) looks at, from a thread of its own. A thread ends a job only once it has
        # taken it out of here (``_take``): of two threads ending one job, one does, the other is told it lost it.
        self._held: dict[str, ClaimedJob] = {}
        self._held_lock = threading.Lock()
        self._claims_closed = False  # close_claims: a worker about to exit claims no more

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

    def was_archived(self, job_id: str, reasons: tuple[ArchiveReason, ...], attempts: int) -> bool:
        """Whether done/ holds a result of ``job_id`` archived for one of ``reasons``, at any attempt up to
        ``attempts`` or the most any PS of the run allowed (a few exact names, never a listing of done/)."""
        status = self.run.read_ps_status()  # (its most_attempts: an earlier PS's --max_attempts may have been larger)
        most = max(attempts, status.most_attempts if status and isinstance(status.most_attempts, int) else 0)
        return any(os.path.lexists(self.run.done / done_name(job_id, reason, attempt))
                   for reason in reasons for attempt in range(1, most + 1))

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
            job = ClaimedJob(name=name, path=self.path(name), payload=payload, claimed_at=claimed_at, claimed_by=self)
            with self._held_lock:
                if not self._claims_closed:
                    self._held[name.filename] = job
                    return job
            self._give_back(job)  # claims closed while this one was made
            return None

    def held(self) -> list[ClaimedJob]:
        """The jobs this process claimed and has not ended yet, oldest claim first."""
        with self._held_lock:
            return sorted(self._held.values(), key=lambda job: job.claimed_mono)

    def close_claims(self) -> list[ClaimedJob]:
        """No claim succeeds from now on (one under way gives its job back); returns the jobs held."""
        with self._held_lock:
            self._claims_closed = True
        return self.held()

    def _take(self, job: ClaimedJob) -> bool:
        """Whether this thread may end ``job``: it was held, and now is not (another thread ending it is told no).
        A job another JobQueue claimed is left to the fence."""
        with self._held_lock:
            return self._held.pop(job.name.filename, None) is not None or job.claimed_by is not self

    def _hold_again(self, job: ClaimedJob) -> None:
        with self._held_lock:
            self._held[job.name.filename] = job

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
        """A job whose generation or scoring raised: ``error`` (handoff.ERROR_KEYS) is added to the
        ``errors`` of its payload, and the job goes back to pending as attempt + 1, or, after its
        ``max_attempts``-th attempt, to the PS as a *failure report*: a result whose data holds
        ``errors`` and ``job`` (the job's data) instead of a batch; the PS archives it ``failed``.
        The attempt's own job file is archived ``retried`` (or ``processed`` with the report).
        Fenced like complete(): False if the job was recovered from this worker meanwhile."""
        errors = [*job.payload.get("errors", []), error]
        if job.attempt >= max_attempts:
            return self.complete(job, FailureReport(errors, job.data).to_dict(), weights_version=weights_version)
        again = job.name.moved_to(JobState.PENDING, attempt=job.attempt + 1)
        return self._fenced_publish(job, {**job.payload, "errors": errors}, again, ArchiveReason.RETRIED)

    def _fenced_publish(self, job: ClaimedJob, payload: dict, target: QueueName, fenced_as: ArchiveReason) -> bool:
        """Stages ``payload``, fences the job (processing -> committing), links the payload to ``target``
        and archives the fenced file as ``fenced_as``. False when the fence fails (the job was recovered), or
        another thread of this process ended the job first (a worker's deadline)."""
        device = job.name.device
        if not self._take(job):
            log.warning("[queue] job %s was ended by another thread of dev%s meanwhile (its deadline?); dropping "
                        "this outcome", job.name.filename, device)
            return False
        try:
            tmp = fileops.stage_bytes(self.run.tmp, fileops.serialize(payload), fsync=self.fsync)
        except fileops.QueueWriteError:
            self._hold_again(job)  # ours still, to give back
            raise
        fence = job.name.moved_to(JobState.COMMITTING, device)
        try:
            fileops.move(job.path, self.path(fence))
        except (FileNotFoundError, FileExistsError):  # (FileExistsError: where a rename without replace is a link)
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
                self._hold_again(job)
            except (FileNotFoundError, FileExistsError):
                pass  # recovered meanwhile
            raise
        self.archive_if_present(self.path(fence), job.job_id, fenced_as, job.attempt)
        return True

    def release(self, job: ClaimedJob) -> bool:
        """Gives an unfinished job back (same attempt), e.g. on SIGTERM."""
        return self._take(job) and self._give_back(job)

    def _give_back(self, job: ClaimedJob) -> bool:
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
            if os.path.lexists(collected) and not os.path.samefile(entry.path, collected):
                # A second result of the job, collected after it was consumed; the PS died before archiving it
                # duplicate (collect). It goes now, and the consumed one back, to be trained again.
                self.archive_if_present(collected, job_id, ArchiveReason.DUPLICATE)
            try:
                fileops.move_to_other_dir(entry.path, collected, fsync=self.fsync)
                self.events.emit("result_rolled_back", job_id=job_id)
                log.debug("[queue] %s was consumed after the checkpoint: back in the queue", job_id)
            except FileExistsError:
                fileops.unlink_second_name(entry.path)  # an earlier PS died inside consume()'s link + unlink
                self.events.emit("result_rolled_back", job_id=job_id)
                log.debug("[queue] %s: its archiving as consumed was cut short; back in the queue", job_id)
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

    # ---------------------------------------------------------------- recovery (recovery.py)

    def recover(self, *, lease_s: float = DEFAULT_LEASE_S, max_attempts: int = DEFAULT_MAX_ATTEMPTS,
                dry_run: bool = False, own_device: WorkerId | None = None, requeue: bool = True,
                job_timeout_s: float | None = None) -> list[RecoveryAction]:
        """Recovers the jobs of dead or silent workers, reaps old temp files, archives junk: recovery.recover."""
        return recovery.recover(self, lease_s=lease_s, max_attempts=max_attempts, dry_run=dry_run,
                                own_device=own_device, requeue=requeue, job_timeout_s=job_timeout_s)

    def archive_leftovers(self, dry_run: bool = False,
                          states: tuple[JobState, ...] = recovery.LEFTOVER_STATES) -> list[RecoveryAction]:
        """After training is over: every pending job and result left in queue/ archived ``unused``:
        recovery.archive_leftovers."""
        return recovery.archive_leftovers(self, dry_run=dry_run, states=states)
