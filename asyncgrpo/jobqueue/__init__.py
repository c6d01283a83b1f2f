"""The file-system job queue (docs/design.md, "The file protocol").

    names     the file-name grammar and the enums of states and archive reasons
    fileops   every rename, link, fsync and scan; payload load/save
    rundir    the run directory's layout
    liveness  a worker's lock and heartbeat; is a worker alive
    queue     JobQueue: put, claim, complete, fail (retry), collect, consume, archive, recover
    watcher   wake on inotify events, with a rescan safety net
    retention archive retention: bounds done/'s bytes, names (the ledger) kept
"""

from asyncgrpo.jobqueue.fileops import PayloadLoadError, QueueWriteError
from asyncgrpo.jobqueue.liveness import WorkerAlreadyRunning, WorkerPresence, list_workers, worker_status
from asyncgrpo.jobqueue.names import ArchiveReason, JobState, QueueName, make_job_id, parse_queue_name
from asyncgrpo.jobqueue.queue import (
                                      DEFAULT_LEASE_S,
                                      DEFAULT_MAX_ATTEMPTS,
                                      SCHEMA_VERSION,
                                      AlreadyConsumed,
                                      ClaimedJob,
                                      CollectedResult,
                                      JobQueue,
                                      RecoveryAction,
                                      describe_error,
                                      is_failure_report,
)
from asyncgrpo.jobqueue.rundir import RunDir, RunDirError, latest_run, runs_dir
from asyncgrpo.jobqueue.watcher import QueueWatcher

__all__ = [
    "AlreadyConsumed", "ArchiveReason", "ClaimedJob", "CollectedResult", "DEFAULT_LEASE_S",
    "DEFAULT_MAX_ATTEMPTS", "JobQueue", "JobState", "PayloadLoadError",
    "QueueName", "QueueWatcher", "QueueWriteError", "RecoveryAction", "RunDir", "RunDirError",
    "SCHEMA_VERSION", "WorkerAlreadyRunning", "WorkerPresence", "latest_run", "list_workers",
    "describe_error", "is_failure_report", "make_job_id", "parse_queue_name", "runs_dir", "worker_status",
]
