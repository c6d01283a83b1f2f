"""The file-name grammar of the job queue: a file's name is its state.

Active files live in ``RUN/queue/``::

    {job_id}_pending[_a{k}].pt                   written by the PS, waiting for a worker
    {job_id}_processing_by_dev{W}[_a{k}].pt      claimed by worker W
    {job_id}_committing_by_dev{W}[_a{k}].pt      worker W fenced it and is publishing its result
    {job_id}_complete_from_dev{W}.pt             worker W's result, waiting for the PS
    {job_id}_collected.pt                        claimed by the PS collector

``job_id`` is ``{created_step:06d}_{job_index:03d}``. A worker id ``W`` is its device number
``N`` (an int), or ``N.{host id}`` (a str) for a worker that joined from another host
(``launch.sh --join``): two hosts' worker 1 are ``dev1`` and ``dev1.3f9a2c1d``, never one name.
``_a{k}`` is the attempt number and only appears from the second attempt on (a job
requeued by recovery), so a first attempt has exactly the names above. Archived files live
in ``RUN/done/`` as ``{job_id}_{reason}[_a{k}][.{n}].pt`` (``.{n}`` only when an earlier
file of the same job and reason is already there). The states and their transitions: docs/design.md, "File
names and states".

A name that does not match is never parsed further: ``parse_queue_name`` returns None.
"""

from __future__ import annotations

import enum
import functools
import re
from dataclasses import dataclass

from asyncgrpo.run.rundir import WORKER_ID, WorkerId, parse_worker_id

JOB_ID_RE = re.compile(r"^\d{6}_\d{3}$")


class JobState(str, enum.Enum):
    PENDING = "pending"
    PROCESSING = "processing"
    COMMITTING = "committing"
    COMPLETE = "complete"
    COLLECTED = "collected"


def depth_line(counts: dict[str, int], every_state: bool = False) -> str:
    """The queue's depth (JobQueue.counts) as the PS's [train] lines show it, ``pending:P processing:R complete:C``
    (a result being committed counts as processing, one collected as complete), or with ``every_state`` each
    state's count, as `queue_tools ls` shows it."""
    if every_state:
        shown = {state.value: counts[state.value] for state in JobState}
    else:
        shown = {"pending": counts["pending"], "processing": counts["processing"] + counts["committing"],
                 "complete": counts["complete"] + counts["collected"]}
    return " ".join(f"{state}:{n}" for state, n in shown.items())


class ArchiveReason(str, enum.Enum):
    CONSUMED = "consumed"  # trained on, exactly once
    PROCESSED = "processed"  # a worker's job file once its result is published
    FAILED_LOAD = "failed_load"  # bad name, symlink, corrupt or hostile payload
    DUPLICATE = "duplicate"  # a second result (or file) for a job id already handled
    STALE = "stale"  # a result generated with weights too old to train on
    ORPHANED = "orphaned"  # recovered max_attempts times without a result
    RETRIED = "retried"  # an attempt that raised; the job went back to pending as attempt + 1, its errors inside
    FAILED = "failed"  # raised on each of its max_attempts attempts: never trained on (the errors are inside)
    UNUSED = "unused"  # thrown, or even generated, but training ended before it was needed
    FILTERED = "filtered"  # groups dynamic sampling dropped (rewards without spread): a whole result, or a record


# States whose files carry an owning device, and the word between state and device.
_DEVICE_WORD = {JobState.PROCESSING: "by", JobState.COMMITTING: "by", JobState.COMPLETE: "from"}
# States that recovery can requeue, so their names carry the attempt number.
_HAS_ATTEMPT = {JobState.PENDING, JobState.PROCESSING, JobState.COMMITTING}

# Attempt 1 has no suffix and "_a0"/"_a1" are rejected, so each job state has one spelling.
_ATTEMPT = r"[2-9]|[1-9]\d{1,2}"
_QUEUE_NAME_RE = re.compile(
    r"^(?P<job_id>\d{6}_\d{3})_(?:"
    rf"pending(?:_a(?P<pending_attempt>{_ATTEMPT}))?"
    rf"|(?P<owned>processing|committing)_by_dev(?P<owner>{WORKER_ID})(?:_a(?P<owned_attempt>{_ATTEMPT}))?"
    rf"|complete_from_dev(?P<producer>{WORKER_ID})"
    r"|(?P<collected>collected)"
    r")\.pt$"
)
_DONE_NAME_RE = re.compile(
    r"^(?P<job_id>\d{6}_\d{3}|invalid_[A-Za-z0-9_.-]{1,80})_"
    r"(?P<reason>" + "|".join(r.value for r in ArchiveReason) + r")"
    r"(?:_a\d{1,3})?(?:\.\d{1,6})?\.pt$"
)


@functools.total_ordering
@dataclass(frozen=True)
class QueueName:
    """One parsed active-queue file name. Sorting orders by job id, then attempt (FIFO)."""

    job_id: str
    attempt: int = 1
    state: JobState = JobState.PENDING
    device: WorkerId | None = None

    def __lt__(self, other: QueueName) -> bool:
        # Worker ids mix ints and strs: compare them as text (they only break ties).
        return ((self.job_id, self.attempt, self.state.value, str(self.device))
                < (other.job_id, other.attempt, other.state.value, str(other.device)))

    @property
    def filename(self) -> str:
        name = f"{self.job_id}_{self.state.value}"
        if self.state in _DEVICE_WORD:
            name += f"_{_DEVICE_WORD[self.state]}_dev{self.device}"
        if self.state in _HAS_ATTEMPT and self.attempt > 1:
            name += f"_a{self.attempt}"
        return name + ".pt"

    def moved_to(self, state: JobState, device: WorkerId | None = None, attempt: int | None = None) -> QueueName:
        return QueueName(
            job_id=self.job_id,
            attempt=self.attempt if attempt is None else attempt,
            state=state,
            device=device if state in _DEVICE_WORD else None,
        )


def parse_queue_name(name: str) -> QueueName | None:
    """The parsed name, or None for anything outside the grammar (dot-files included)."""
    m = _QUEUE_NAME_RE.fullmatch(name)
    if m is None:
        return None
    job_id = m["job_id"]
    if m["owned"]:
        return QueueName(job_id, int(m["owned_attempt"] or 1), JobState(m["owned"]), parse_worker_id(m["owner"]))
    if m["producer"] is not None:
        return QueueName(job_id, 1, JobState.COMPLETE, parse_worker_id(m["producer"]))
    if m["collected"]:
        return QueueName(job_id, 1, JobState.COLLECTED)
    return QueueName(job_id, int(m["pending_attempt"] or 1), JobState.PENDING)


def make_job_id(created_step: int, job_index: int) -> str:
    if not (0 <= created_step < 1_000_000 and 0 <= job_index < 1000):
        raise ValueError(f"job id out of range: created_step={created_step} job_index={job_index}")
    return f"{created_step:06d}_{job_index:03d}"


def next_job_id(last: str | None, step: int) -> str:
    """The id of a job created at ``step`` after job ``last``: ids only grow (also across a PS restart), so at
    or before ``last``'s step it is ``last``'s next index."""
    if last is not None:
        last_step, last_index = (int(part) for part in last.split("_"))
        if step <= last_step:
            return make_job_id(last_step, last_index + 1) if last_index < 999 else make_job_id(last_step + 1, 0)
    return make_job_id(step, 0)


def is_job_id(value: object) -> bool:
    return isinstance(value, str) and JOB_ID_RE.fullmatch(value) is not None


def done_name(job_id: str, reason: ArchiveReason, attempt: int = 1, collision: int = 0) -> str:
    name = f"{job_id}_{reason.value}"
    if attempt > 1:
        name += f"_a{attempt}"
    if collision:
        name += f".{collision}"
    return name + ".pt"


def parse_done_name(name: str) -> tuple[str, ArchiveReason] | None:
    """``(job id, reason)`` of a ``done/`` file name (the job id may be an ``invalid_...`` stand-in), or None
    for foreign files."""
    m = _DONE_NAME_RE.fullmatch(name)
    return (m["job_id"], ArchiveReason(m["reason"])) if m else None


def done_reason(name: str) -> ArchiveReason | None:
    """The archive reason encoded in a ``done/`` file name, or None for foreign files."""
    parsed = parse_done_name(name)
    return parsed[1] if parsed else None


def shown_name(name: str) -> str:
    """A file name as a line of a log or of the terminal shows it: escaped where it holds a newline, another control
    character or bytes that are not UTF-8 (read as surrogates), so that the line stays one line that any log file or
    terminal takes."""
    return name if name.isprintable() else ascii(name)


def invalid_name_stem(name: str) -> str:
    """A safe stand-in for a job id when archiving a file whose name is outside the grammar."""
    return "invalid_" + (re.sub(r"[^A-Za-z0-9_.-]", "_", name).lstrip(".") or "x")[:80]
