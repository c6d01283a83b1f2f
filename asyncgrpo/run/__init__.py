"""The run directory and the primitives every process uses on it (docs/design.md, "The run directory").

    rundir       every path in the run directory, the typed contents of its small files, worker ids
    fileops      every rename, link, fsync and scan; payload load/save
    checkpoints  the checkpoint folders and the ledger in each; the newest complete checkpoint
    metrics      RUN/metrics.jsonl: a logged step's line; append, read, truncate on resume
    hosts        this host's id; is a path on a network filesystem
    liveness     a worker's lock and heartbeat; is a worker alive

The job queue (asyncgrpo/jobqueue/) and the weight transports (asyncgrpo/weights/) are built on
this layer; it imports neither.
"""

from asyncgrpo.run.fileops import PayloadLoadError, QueueWriteError
from asyncgrpo.run.liveness import DEFAULT_LEASE_S, WorkerAlreadyRunning, WorkerPresence, list_workers, worker_status
from asyncgrpo.run.rundir import RunDir, RunDirError, latest_run, runs_dir

__all__ = [
    "DEFAULT_LEASE_S", "PayloadLoadError", "QueueWriteError", "RunDir", "RunDirError", "WorkerAlreadyRunning",
    "WorkerPresence", "latest_run", "list_workers", "runs_dir", "worker_status",
]
