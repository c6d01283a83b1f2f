"""Queue recovery: taking back the jobs of dead or silent workers, reaping old temp files, archiving
junk, and, once training is over, archiving the leftovers. The rules and why each move is safe are in
docs/design.md, "Liveness, leases and recovery".

A processing or committing file is stale when its worker is dead (its lock is free, or on another
host its heartbeat is older than the lease: liveness.py), when the worker's heartbeat is older than
the lease (stopped, hung), when the worker has moved on to another job and the file is older than
the lease, or when it is older than the job's deadline (``--job_timeout_s``) and the lease together,
whatever the heartbeat says: a worker acts on its own deadline (worker/deadline.py), and this is the
backstop for one that cannot. A stale job whose result exists is archived ``processed`` (the result wins): in the
queue, or taken by the PS, at any attempt up to max_attempts, the job's latest or the most any PS of the run allowed
(ps.json) (consumed; archived stale or
filtered: a stale result's prompts are thrown again in new jobs, so its job going back to pending would train them
twice; or a failure report archived failed).
One whose job is already in the queue as a later attempt (its worker threw it again, then died) is archived
``duplicate``; else it goes back to pending with attempt + 1, or to done/ as ``orphaned`` after ``max_attempts``. Temp
files are reaped when older than the lease, or at once when their writer (a process of this host) is
dead. Files outside the queue's name grammar are archived ``failed_load``.

Idempotent, and safe next to running workers: every move is no-clobber.

``JobQueue.recover`` and ``JobQueue.archive_leftovers`` (queue.py, with the defaults) call these
functions with the queue; queue.py imports this module, so this one takes the queue as an argument and
imports nothing from queue.py (that would be an import circle).
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from pathlib import Path

from asyncgrpo.jobqueue.names import ArchiveReason, JobState, QueueName, done_name, invalid_name_stem, shown_name
from asyncgrpo.run import fileops
from asyncgrpo.run.liveness import fs_now, worker_status
from asyncgrpo.run.rundir import WorkerId

log = logging.getLogger("asyncgrpo.queue")


@dataclass
class RecoveryAction:
    what: str  # requeue | archive | reap
    src: str
    dst: str | None
    why: str
    job_id: str | None = None  # set when a job's file was recovered (not for temp files or junk)

    def line(self) -> str:
        return f"{self.what} {shown_name(self.src)} -> {self.dst or '(removed)'}: {self.why}"


def recover(queue, *, lease_s: float, max_attempts: int, dry_run: bool, own_device: WorkerId | None,
            requeue: bool, job_timeout_s: float | None = None) -> list[RecoveryAction]:
    """Recovers ``queue``'s stale jobs, reaps its old temp files and archives its junk (see the module).

    ``own_device``: a worker starting up recovers every file left under its device number, since the
    process that left them is gone. ``requeue=False`` (the PS's end of training): a stale job without a
    result is archived ``unused`` instead of going back to pending, where a worker would take it.
    ``job_timeout_s`` (``--job_timeout_s``): a job held past it and the lease is stale whatever its worker's
    heartbeat says (a worker that could not act on its own deadline).
    """
    now = fs_now(queue.run)
    names, junk = queue.scan()
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
        path = queue.path(name)
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
                statuses[name.device] = worker_status(queue.run, name.device, now, lease_s)
            why = _stale_reason(statuses[name.device], name, file_age, lease_s, job_timeout_s)
            if why is None:
                continue
        reason = None  # requeue
        attempts = max(max_attempts, latest_attempt[name.job_id])
        if name.job_id in with_result or _result_taken(queue, name.job_id, attempts):
            reason, why = ArchiveReason.PROCESSED, why + "; its result exists"
        elif name.attempt < latest_attempt[name.job_id]:  # its worker threw it again and died right after
            reason, why = ArchiveReason.DUPLICATE, why + f"; attempt {latest_attempt[name.job_id]} is in the queue"
        elif name.attempt >= max_attempts:
            reason, why = ArchiveReason.ORPHANED, why + f"; attempt {name.attempt} of {max_attempts}"
        elif not requeue:
            reason, why = ArchiveReason.UNUSED, why + "; training is over"
        actions.append(_recovery_move(queue, path, name, reason, why, dry_run))
    actions += _reap_temp_files(queue, now, lease_s, dry_run)
    for entry in junk:
        actions.append(_recovery_move(queue, Path(entry.path), None, ArchiveReason.FAILED_LOAD,
                                      "name outside the queue grammar", dry_run))
    if not dry_run:
        for action in actions:
            log.warning("[queue] recover: %s", action.line())
    return actions


def _result_taken(queue, job_id: str, attempts: int) -> bool:
    """Whether the PS took a result of this job, of any attempt (a later attempt's result may have been taken
    before recovery looks at this one: its worker threw the job again and died before archiving this file): trained
    on it (consumed), archived it stale (its prompts thrown again in new jobs), filtered (every group dropped), or
    failed (the report of its last attempt, its drop counted once)."""
    return queue.was_consumed(job_id) or queue.was_archived(
        job_id, (ArchiveReason.STALE, ArchiveReason.FILTERED, ArchiveReason.FAILED), attempts)


LEFTOVER_STATES = (JobState.PENDING, JobState.COMPLETE, JobState.COLLECTED)


def archive_leftovers(queue, *, dry_run: bool, states=LEFTOVER_STATES) -> list[RecoveryAction]:
    """After training is over: each pending job and each result still in ``queue`` archived ``unused`` (no PS will
    train on them; pending, a worker would only take them). ``states``: those of them to archive (the PS's end of
    training leaves complete results for its next pass: it reads them first, to record failure reports)."""
    actions = []
    for name in sorted(queue.scan()[0]):
        if name.state in states:
            actions.append(_recovery_move(queue, queue.path(name), name, ArchiveReason.UNUSED,
                                          f"{name.state.value} after training was over", dry_run))
    return actions


def _recovery_move(queue, path: Path, name: QueueName | None, reason: ArchiveReason | None,
                   why: str, dry_run: bool) -> RecoveryAction:
    if reason is None:  # requeue
        target = queue.path(name.moved_to(JobState.PENDING, attempt=name.attempt + 1))
        action = RecoveryAction("requeue", path.name, target.name, why, name.job_id)
        if not dry_run:
            try:
                fileops.move(path, target)
            except FileExistsError:
                why += "; already requeued"
                action = _recovery_move(queue, path, name, ArchiveReason.DUPLICATE, why, dry_run)
            except FileNotFoundError:
                action.why += " (someone else moved it first)"
        return action
    job_id = name.job_id if name else invalid_name_stem(path.name)
    attempt = name.attempt if name else 1
    if dry_run:
        return RecoveryAction("archive", path.name, "done/" + done_name(job_id, reason, attempt), why,
                              name and name.job_id)
    archived = queue.archive_if_present(path, job_id, reason, attempt)
    return RecoveryAction("archive", path.name, f"done/{archived.name}" if archived else None,
                          why if archived else why + " (someone else moved it first)", name and name.job_id)


def _reap_temp_files(queue, now: float, lease_s: float, dry_run: bool) -> list[RecoveryAction]:
    actions = []
    for entry in fileops.scan(queue.run.tmp):
        try:
            age = now - entry.stat(follow_symlinks=False).st_mtime
        except FileNotFoundError:
            continue  # its writer just published it
        alive = fileops.temp_writer_alive(entry.name)
        writer_dead = alive is False
        if alive or (age <= lease_s and not writer_dead):
            continue  # possibly still being written: never reap the file of a live writer, nor a young one's
        if not dry_run:
            try:
                fileops.remove_temp(entry.path)
            except FileNotFoundError:
                continue
        actions.append(RecoveryAction("reap", f".tmp/{entry.name}", None,
                                      "temp file of a dead process" if writer_dead else
                                      f"temp file {age:.0f}s old (lease {lease_s:g}s)"))
    return actions


def _stale_reason(status, name: QueueName, file_age: float, lease_s: float,
                  job_timeout_s: float | None = None) -> str | None:
    if not status.alive and status.remote and status.state != "stopped":
        return (f"worker dev{name.device} on host {status.host} went silent: heartbeat "
                f"{status.heartbeat_age_s or 0:.0f}s old (lease {lease_s:g}s)")
    if not status.alive:
        return f"worker dev{name.device} is dead"
    if status.heartbeat_age_s is not None and status.heartbeat_age_s > lease_s:
        return f"worker dev{name.device} heartbeat is {status.heartbeat_age_s:.0f}s old (lease {lease_s:g}s)"
    if job_timeout_s and file_age > job_timeout_s + lease_s:
        return (f"worker dev{name.device} has held it {file_age:.0f}s, past its deadline (--job_timeout_s "
                f"{job_timeout_s:g}) and the lease ({lease_s:g}s): stuck where it cannot act on its deadline")
    if not status.holds(name.job_id) and file_age > lease_s:
        return f"worker dev{name.device} moved on to {status.job_id} and this file is {file_age:.0f}s old"
    return None
