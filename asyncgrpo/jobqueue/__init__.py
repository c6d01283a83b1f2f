"""The file-system job queue (docs/design.md, "The file protocol"), built on the run directory
layer (asyncgrpo/run/).

    names     the file-name grammar and the enums of states and archive reasons
    queue     JobQueue: put, claim, complete, fail (retry), collect, consume, archive, recover
    handoff   what the files carry: the job's data, the result's, a failure report (and its errors)
    recovery  recover (JobQueue.recover): stale jobs back to pending or archived, temp files reaped
    watcher   wake on inotify events, with a rescan safety net
    retention archive retention: bounds done/'s bytes, names (the ledger) kept
"""

from asyncgrpo.jobqueue.handoff import describe_error
from asyncgrpo.jobqueue.names import ArchiveReason, JobState, QueueName, make_job_id, parse_queue_name
from asyncgrpo.jobqueue.queue import (
    DEFAULT_MAX_ATTEMPTS,
    SCHEMA_VERSION,
    AlreadyConsumed,
    ClaimedJob,
    CollectedResult,
    JobQueue,
)
from asyncgrpo.jobqueue.recovery import RecoveryAction
from asyncgrpo.jobqueue.watcher import QueueWatcher

__all__ = [
    "AlreadyConsumed", "ArchiveReason", "ClaimedJob", "CollectedResult", "DEFAULT_MAX_ATTEMPTS", "JobQueue",
    "JobState", "QueueName", "QueueWatcher", "RecoveryAction", "SCHEMA_VERSION", "describe_error",
    "make_job_id", "parse_queue_name",
]
