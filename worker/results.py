"""What a worker does with a job once it is generated and scored: publishes its result, throws it again or reports
it failed, or gives it back. Both ways a worker generates (worker/generation.py: a
batch of one call, continuous batching's scoring thread) end a job here.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

from asyncgrpo.config import AsyncGRPOConfig
from asyncgrpo.events import EventLog
from asyncgrpo.jobqueue import ClaimedJob, JobQueue, describe_error
from asyncgrpo.jobqueue.handoff import REWARDS_KEY, ResultData, oldest_version
from asyncgrpo.run import QueueWriteError
from worker import tools
from worker.generate import JOB_FAILURES, Generated, error_record

log = logging.getLogger("asyncgrpo.worker")


@dataclass
class Timing:
    """When a job's generation went: claimed (time.monotonic()), generation started and done (time.time()), the
    jobs that shared its generation, and the graphs compiled after the warm-up so far."""

    claimed: float
    started: float
    done: float
    jobs_in_call: int = 1
    recompiles: int = 0


def publish(cfg: AsyncGRPOConfig, queue: JobQueue, job: ClaimedJob, outcome: Generated | Exception, version: int,
            events: EventLog, timing: Timing) -> bool:
    """Publishes ``outcome`` as the job's result, or fails the job (it raised) or gives it back (cut short by a
    stop); True when a result was written. ``version``: the weights the job was generated with, unless its
    outcome says which versions sampled its tokens."""
    device = job.name.device
    if isinstance(outcome, tools.WorkerStopping):  # cut short: given back as it was, for a worker that goes on
        queue.release(job)
        events.emit("job_released", job_id=job.job_id)
        log.info("[queue] dev%s gave job=%s back: %s", device, job.job_id, outcome)
        return False
    if isinstance(outcome, Exception):
        fail(cfg, queue, job, outcome, version, events)
        return False
    batch, metrics = outcome.batch, outcome.metrics
    # outcome.logs: the PS prints TRL's completions table from these
    data = ResultData({k: v for k, v in batch.items() if k != REWARDS_KEY}, batch.get(REWARDS_KEY), metrics,
                      job.job_data.rows, outcome.logs, outcome.token_versions).to_dict()
    runs = outcome.token_versions  # a row's each
    oldest = oldest_version(runs) if runs else version
    try:
        published = queue.complete(
            job, data, weights_version=oldest, queue_time=job.claimed_at - job.payload["created_at"],
            processing_time=timing.done - timing.started, job_age=timing.done - job.payload["created_at"])
    except QueueWriteError as err:
        release_unwritable(queue, job, err, events)
        return False
    events.emit("result_written", job_id=job.job_id, weights_version=oldest, published=published,
                dur_ms=(time.monotonic() - timing.claimed) * 1e3, samples=int(batch["advantages"].numel()),
                tokens=int(batch["completion_mask"].sum()), jobs_in_call=timing.jobs_in_call,
                recompiles=timing.recompiles)
    newest = max(row[-1][1] for row in runs) if runs else version
    newest = f" newest_token_version={newest}" if newest != oldest else ""
    log.info("[gen] dev%s job=%s weights_version=%d dur_ms=%.0f reward=%.3f published=%s%s%s", device,
             job.job_id, oldest, (timing.done - timing.started) * 1e3, metrics.get("reward", float("nan")), published,
             f" jobs_in_call={timing.jobs_in_call}" if timing.jobs_in_call > 1 else "", newest)
    return True


def fail(cfg: AsyncGRPOConfig, queue: JobQueue, job: ClaimedJob, err: Exception, version: int,
         events: EventLog) -> None:
    """The job raised: thrown again as its next attempt, or reported to the PS as failed after ``max_attempts``."""
    device = job.name.device
    error = {**error_record(err), "attempt": job.attempt, "worker_device": device, "weights_version": version}
    given_up = job.attempt >= cfg.max_attempts
    what = describe_error(error)
    outcome = "reported to the PS as failed" if given_up else f"thrown again as attempt {job.attempt + 1}"
    # Each failure is a line in the worker's log; the first of its kind also brings its traceback there.
    first = JOB_FAILURES.failed(f"a job failed: {what}")
    traceback = "\n" + error["traceback"].rstrip() if first else ""
    log.error("[gen] dev%s job=%s attempt %d/%d failed: %s; %s%s", device, job.job_id, job.attempt, cfg.max_attempts,
              what, outcome, traceback)
    events.emit("job_failed", job_id=job.job_id, attempt=job.attempt, error=what[:500], given_up=given_up)
    try:
        queue.fail(job, error, max_attempts=cfg.max_attempts, weights_version=version)
    except QueueWriteError as write_error:
        release_unwritable(queue, job, write_error, events)


def release_unwritable(queue: JobQueue, job: ClaimedJob, err: QueueWriteError, events: EventLog) -> None:
    log.error("[queue] dev%s cannot write the outcome of %s: %s; giving the job back", job.name.device,
              job.job_id, err)
    queue.release(job)
    events.emit("job_released", job_id=job.job_id)
