"""The result collector: a thread that claims complete results, validates them and caches them.

Part of the job pipeline (ps/pipeline.py). It wakes on queue events for complete files,
keeps a thread-safe cache the trainer takes from, hands failure reports (jobs given up after
their last attempt) to ps/failures.py, and runs queue recovery every ``lease_s / 4`` (dead
workers' jobs go back to pending), and with it archive retention (``archive_keep_files`` /
``archive_keep_mb``).
"""

from __future__ import annotations

import logging
import sys
import threading
import time

from asyncgrpo.config import AsyncGRPOConfig
from asyncgrpo.jobqueue import CollectedResult, JobQueue, JobState, QueueWatcher
from asyncgrpo.jobqueue.handoff import FailureReport, ResultData, read_result_payload
from asyncgrpo.jobqueue.retention import ArchiveRetention
from ps.background import WatchedThread
from ps.failures import FailedJobs

log = logging.getLogger("asyncgrpo.ps")


def _intern_metric_names(data: ResultData) -> None:
    """The worker's metric names come out of torch.load as new strings in every result, and
    TRL's log history keeps each logged step's keys: one shared string per name, not one per step."""
    data.metrics = {sys.intern(k) if type(k) is str else k: v for k, v in data.metrics.items()}


class ResultCache:
    """Collected results waiting for the trainer, by job id."""

    def __init__(self):
        self._results: dict[str, CollectedResult] = {}
        self._changed = threading.Condition()

    def add(self, result: CollectedResult) -> None:
        with self._changed:
            self._results[result.job_id] = result
            self._changed.notify_all()

    def __len__(self) -> int:
        with self._changed:
            return len(self._results)

    def versions(self) -> dict[str, int]:
        """The weights version of each cached result, by job id."""
        with self._changed:
            return {job_id: r.payload["weights_version"] for job_id, r in self._results.items()}

    def notify(self) -> None:
        """Wakes a waiting ``take`` to evaluate its ``pick`` again (which may raise)."""
        with self._changed:
            self._changed.notify_all()

    def take(self, pick, timeout: float) -> CollectedResult | None:
        """Removes and returns ``pick(cached results)`` once it is not None; None after ``timeout``.
        An exception raised by ``pick`` leaves the cache unchanged and propagates."""
        deadline = time.monotonic() + timeout
        with self._changed:
            while True:
                job_id = pick(self._results)
                if job_id is not None:
                    return self._results.pop(job_id)
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    return None
                self._changed.wait(min(remaining, 1.0))  # re-evaluate pick: the queue changes without us

    def drain(self) -> list[CollectedResult]:
        with self._changed:
            results, self._results = list(self._results.values()), {}
            return results


class ResultCollector(WatchedThread):
    def __init__(self, cfg: AsyncGRPOConfig, queue: JobQueue, cache: ResultCache, failed: FailedJobs, on_error):
        super().__init__("result collector", QueueWatcher(queue.run.queue, {JobState.COMPLETE},
                                                          use_events=not cfg.poll_only), on_error)
        self.cfg, self.queue, self.cache, self.failed = cfg, queue, cache, failed
        self.retention = ArchiveRetention(queue.run, cfg.archive_keep_files, cfg.archive_keep_mb)

    def collect_now(self, readopt: bool = False) -> int:
        """Collects what is complete (and with ``readopt`` what an earlier PS collected); the number of results
        cached for the trainer."""
        rows = self.cfg.generation_batch_size
        results = self.queue.collect(lambda payload: read_result_payload(payload, rows), readopt=readopt)
        now = time.time()
        cached = 0
        for result in results:
            if isinstance(result.data, FailureReport):
                self.failed.record(result)
                continue
            self.failed.result_arrived(result.job_id)
            self.queue.events.emit("result_collected", job_id=result.job_id,
                                   weights_version=result.payload["weights_version"],
                                   worker_device=result.payload["worker_device"],
                                   latency_ms=(now - result.payload["completed_at"]) * 1e3)
            _intern_metric_names(result.data)
            self.cache.add(result)
            cached += 1
        return cached

    def _loop(self) -> None:
        next_recovery = 0.0
        while not self.stop_event.is_set():
            self.collect_now()
            if time.monotonic() >= next_recovery:
                self.failed.record_recovery(self.queue.recover(lease_s=self.cfg.lease_s,
                                                               max_attempts=self.cfg.max_attempts,
                                                               job_timeout_s=self.cfg.job_timeout_s or None))
                self.retention.maybe_compact()  # done/'s bytes: one pass per new checkpoint, when enabled
                next_recovery = time.monotonic() + self.cfg.lease_s / 4
            self.watcher.wait()
