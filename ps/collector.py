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

import torch

from asyncgrpo.config import AsyncGRPOConfig
from asyncgrpo.jobqueue import CollectedResult, JobQueue, JobState, QueueWatcher, is_failure_report
from asyncgrpo.jobqueue.retention import ArchiveRetention
from ps.background import WatchedThread
from ps.failures import FailedJobs

log = logging.getLogger("asyncgrpo.ps")

# The contract between worker and PS: TRL's result dict, plus behaviour log-probs.
PER_SEQUENCE = ("advantages",)
PER_PROMPT_TOKEN = ("prompt_ids", "prompt_mask")
PER_COMPLETION_TOKEN = ("completion_ids", "completion_mask")
BEHAVIOUR_KEY = "old_per_token_logps"  # optional: absent when the worker generated with the newest weights
REWARDS_KEY = "rewards"  # per completion, the weighted sum TRL normalises (worker/generate.py); dynamic sampling's


def validate_result(payload: dict, rows_per_job: int) -> None:
    """Raises ValueError unless the result's batch has the keys and shapes the trainer needs (or, for a
    failure report, unless it holds its errors and the job's rows)."""
    version = payload["weights_version"]
    if type(version) is not int or version < 0:
        raise ValueError(f"weights_version {str(version)[:40]!r} is not a non-negative integer")
    data = payload["data"]
    if is_failure_report(payload):
        errors, job = data["errors"], data.get("job")
        if not isinstance(errors, list) or not errors or not all(isinstance(e, dict) for e in errors):
            raise ValueError("a failure report's errors must be a non-empty list of dicts")
        if not isinstance(job, dict) or not isinstance(job.get("rows"), list):
            raise ValueError("a failure report must hold the job's data with its rows")
        return
    if not isinstance(data, dict) or not isinstance(data.get("batch"), dict) or "rows" not in data:
        raise ValueError("result data must hold 'batch', 'metrics' and 'rows'")
    if not isinstance(data.get("logs", {}), dict):
        raise ValueError("result data's 'logs' (the completions table rows) must be a dict")
    batch = data["batch"]
    for key in PER_SEQUENCE + PER_PROMPT_TOKEN + PER_COMPLETION_TOKEN:
        if not isinstance(batch.get(key), torch.Tensor):
            raise ValueError(f"batch[{key!r}] is missing or not a tensor")
    n = batch["advantages"].shape[0]
    if n != rows_per_job or batch["advantages"].dim() != 1:
        raise ValueError(f"advantages has shape {tuple(batch['advantages'].shape)}, expected ({rows_per_job},)")
    rewards = batch.get(REWARDS_KEY)
    if rewards is not None and (not isinstance(rewards, torch.Tensor) or tuple(rewards.shape) != (n,)
                                or not rewards.is_floating_point()):
        raise ValueError(f"batch[{REWARDS_KEY!r}] must be a float tensor of shape ({n},)")
    completion_keys = PER_COMPLETION_TOKEN + ((BEHAVIOUR_KEY,) if BEHAVIOUR_KEY in batch else ())
    if BEHAVIOUR_KEY in batch and not isinstance(batch[BEHAVIOUR_KEY], torch.Tensor):
        raise ValueError(f"batch[{BEHAVIOUR_KEY!r}] is not a tensor")
    for group in (PER_PROMPT_TOKEN, completion_keys):
        shapes = {tuple(batch[key].shape) for key in group}
        if len(shapes) != 1 or next(iter(shapes))[0] != n or len(next(iter(shapes))) != 2:
            raise ValueError(f"inconsistent shapes for {group}: {[tuple(batch[k].shape) for k in group]}")


def _intern_metric_names(data: dict) -> None:
    """The worker's metric names come out of torch.load as new strings in every result, and
    TRL's log history keeps each logged step's keys: one shared string per name, not one per step."""
    metrics = data.get("metrics")
    if isinstance(metrics, dict):
        data["metrics"] = {sys.intern(k) if type(k) is str else k: v for k, v in metrics.items()}


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
        results = self.queue.collect(lambda payload: validate_result(payload, rows), readopt=readopt)
        now = time.time()
        cached = 0
        for result in results:
            if is_failure_report(result.payload):
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
                                                               max_attempts=self.cfg.max_attempts))
                self.retention.maybe_compact()  # done/'s bytes: one pass per new checkpoint, when enabled
                next_recovery = time.monotonic() + self.cfg.lease_s / 4
            self.watcher.wait()
