"""The PS's job pipeline: everything between the trainer and the queue, in one object.

    pipeline = JobPipeline(cfg, run, queue, dataset)
    pipeline.start(checkpoint_state, published_version=step)   # re-adopt, then feed and collect
    result, staleness = pipeline.next_result(step)             # blocks; raises PipelineError
    pipeline.on_step_end(step)                                 # after the weights of step are published
    pipeline.in_training                                       # the job whose steps are being trained
    state = pipeline.state_dict()                              # saved in each checkpoint
    pipeline.finish()                                          # end of training: archive what is left

It owns the job producer and the result collector threads (ps/producer.py, ps/collector.py),
the staleness and re-throw policy, the consumed-job ledger, the re-adoption of results after
a restart, and the count of jobs dropped after failing (ps/failures.py). An exception in
either thread, or failures that are systematic, are re-raised by ``next_result`` as a
PipelineError, so training stops with it instead of waiting forever.

One job trains ``steps_per_job`` optimizer steps (more than one with ``--num_iterations``
or ``--steps_per_generation``). The staleness bound applies when its result is taken, at
its first step; its later steps are trained against the proximal policy (ps/offpolicy.py).
The job enters the ledger when its last step has trained; the trainer saves checkpoints
only between jobs, so a checkpoint's ledger never holds a job half trained (except the
final one, where a job cut short by ``max_steps`` counts as consumed).

Consumption order ``ready`` takes the cached result with the lowest weights version (the one
closest to going stale), then the lowest job id; ``fifo`` takes results in job order.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

from asyncgrpo.config import AsyncGRPOConfig
from asyncgrpo.jobqueue import ArchiveReason, CollectedResult, JobQueue, JobState, is_failure_report
from asyncgrpo.run import RunDir
from ps.collector import ResultCache, ResultCollector
from ps.failures import FailedJobs
from ps.producer import JobProducer, TrainingProgress

log = logging.getLogger("asyncgrpo.ps")
WAIT_REPORT_S = 30.0  # a trainer waiting this long for results says so in the log


class PipelineError(RuntimeError):
    """A pipeline thread failed, or every job fails; training cannot go on."""


@dataclass
class JobInTraining:
    """The job whose steps are being trained. The pipeline's (on the first rank) is the one that counts
    for the ledger; under --ps-procs every other rank keeps the copy broadcast with its batch
    (ps/trainer.py), counted down the same way."""

    job_id: str
    weights_version: int
    metrics: dict  # the worker's TRL metrics, logged once per step the job trains
    steps_left: int

    def trained_one_step(self) -> bool:
        """Counts a trained step; True when it was the job's last."""
        self.steps_left -= 1
        return self.steps_left == 0


class JobPipeline:
    def __init__(self, cfg: AsyncGRPOConfig, run: RunDir, queue: JobQueue, dataset):
        self.cfg, self.run, self.queue = cfg, run, queue
        self.consumed: set[str] = set()  # the ledger: job ids trained into the weights
        self.in_training: JobInTraining | None = None
        self.progress = TrainingProgress()  # what the producer's admission reads
        self.failure: PipelineError | None = None  # raised by next_result
        self.cache = ResultCache()
        self.failed = FailedJobs(cfg, queue, self._stop_training)
        self.collector = ResultCollector(cfg, queue, self.cache, self.failed, self._thread_failed)
        self.producer = JobProducer(cfg, queue, dataset, self.progress, self.cache, self._thread_failed)

    # ------------------------------------------------------------------ lifecycle

    def start(self, state: dict | None, published_version: int) -> None:
        """Resumes from a checkpoint's ``state`` (None: a fresh run), re-adopts the results in
        the run directory, and starts feeding and collecting."""
        self.load_state_dict(state or {})
        self.progress.published_version = self.progress.next_take_step = published_version
        self.queue.roll_back_consumed(self.consumed)
        readopted = self.collector.collect_now(readopt=True)
        if readopted:
            log.info("[queue] re-adopted %d result(s) from the run directory", readopted)
        self.collector.start()
        self.producer.start()

    def state_dict(self) -> dict:
        """Between jobs, the ledger; at the end of training a job cut short by max_steps counts as consumed
        (its rows were trained on, and no later step will train the rest)."""
        consumed = self.consumed | ({self.in_training.job_id} if self.in_training else set())
        return {"consumed": sorted(consumed), "producer": self.producer.state_dict()}

    def load_state_dict(self, state: dict) -> None:
        self.consumed = set(state.get("consumed", []))
        self.producer.load_state(state.get("producer"))

    def stop(self) -> None:
        for part in (self.producer, self.collector):
            part.stop()

    def _thread_failed(self, name: str, err: BaseException) -> None:
        log.error("[queue] the %s stopped: %s: %s", name, type(err).__name__, err, exc_info=err)
        failure = PipelineError(f"the {name} stopped: {type(err).__name__}: {err}")
        failure.__cause__ = err
        self._stop_training(failure)

    def _stop_training(self, failure: PipelineError | str) -> None:
        """The trainer raises ``failure`` as soon as it asks for a result (or wakes up waiting for one)."""
        if self.failure is None:
            self.failure = failure if isinstance(failure, PipelineError) else PipelineError(failure)
        self.cache.notify()

    def _raise_failure(self) -> None:
        if self.failure is not None:
            raise self.failure

    # ------------------------------------------------------------------ the trainer's side

    def next_result(self, step: int) -> tuple[CollectedResult, int]:
        """The next result to train steps ``step + 1`` .. ``step + steps_per_job`` on, and its staleness;
        stale and duplicate results are archived on the way (a stale one's rows are thrown again)."""
        if self.in_training is not None:
            raise PipelineError(f"a result was asked for at step {step} while job {self.in_training.job_id} "
                                f"has {self.in_training.steps_left} step(s) left to train")
        started = time.monotonic()
        while True:
            self._raise_failure()
            result = self.cache.take(self._pick, timeout=WAIT_REPORT_S)
            if result is None:
                log.warning("[train] step=%d has waited %.0fs for a result; queue %s%s", step,
                            time.monotonic() - started, self.queue.counts(), self.failed.summary())
                continue
            try:
                if self._accept(result, step):
                    return result, step - result.payload["weights_version"]
            finally:
                self.progress.judging = None

    def _accept(self, result: CollectedResult, step: int) -> bool:
        """True: ``result`` trains from step ``step + 1`` on (consumed); False: archived stale or duplicate."""
        staleness = step - result.payload["weights_version"]
        if staleness > self.cfg.max_staleness:
            log.info("[queue] %s is %d steps stale (max %d): archived, prompts thrown again",
                     result.job_id, staleness, self.cfg.max_staleness)
            self.producer.owe(result.job_id, result.data["rows"])  # journal first: a crash loses no rows
            self.queue.archive_if_present(result.path, result.job_id, ArchiveReason.STALE, result.attempt)
            return False
        if result.job_id in self.consumed:  # in the checkpoint's ledger, though not archived so
            self.queue.archive_if_present(result.path, result.job_id, ArchiveReason.DUPLICATE, result.attempt)
            return False
        if not self.queue.consume(result):  # a duplicate, archived as such
            return False
        self.in_training = JobInTraining(result.job_id, result.payload["weights_version"], result.data["metrics"],
                                         self.cfg.steps_per_job)
        self.progress.next_take_step = step + self.cfg.steps_per_job  # before judging ends (TrainingProgress)
        self.producer.wake()
        return True

    def _pick(self, cached: dict[str, CollectedResult]) -> str | None:
        self._raise_failure()
        if not cached:
            return None
        if self.cfg.consume_order == "fifo":
            oldest = min(cached)
            coming = self.queue.active_job_ids() - cached.keys()
            picked = None if coming and min(coming) < oldest else oldest  # an older job is still on its way
        else:
            picked = min(cached, key=lambda job_id: (cached[job_id].payload["weights_version"], job_id))
        self.progress.judging = picked  # under the cache's lock: never out of the cache and out of judging at once
        return picked

    def on_step_end(self, step: int) -> None:
        """Step ``step`` has trained and its weights are published."""
        if self.in_training is not None and self.in_training.trained_one_step():
            self.consumed.add(self.in_training.job_id)
            self.in_training = None
        self.progress.published_version = step
        self.producer.wake()

    # ------------------------------------------------------------------ end of training

    def finish(self) -> None:
        """Every job and result left in queue/ is archived 'unused'.

        Jobs in workers' hands are waited for (at most a lease) and their results archived.
        Nothing goes back to pending (a worker would take it with no one left to collect), and
        the loop repeats until queue/ is empty: a worker relaunched now may release a job."""
        self.stop()
        deadline = time.monotonic() + self.cfg.lease_s
        while True:
            for name in self.queue.scan()[0]:
                if name.state is JobState.PENDING:
                    self.queue.archive_if_present(self.queue.path(name), name.job_id, ArchiveReason.UNUSED,
                                                  name.attempt)
            self.queue.recover(lease_s=self.cfg.lease_s, max_attempts=self.cfg.max_attempts, requeue=False)
            for result in self.queue.collect(readopt=True) + self.cache.drain():
                if is_failure_report(result.payload):
                    self.failed.record(result)  # archived failed, with its errors
                else:
                    self.queue.archive_if_present(result.path, result.job_id, ArchiveReason.UNUSED, result.attempt)
            if not self.queue.scan()[0]:
                break
            if time.monotonic() > deadline:
                log.warning("[queue] finishing with files still in queue/ after %gs: %s", self.cfg.lease_s,
                            self.queue.counts())
                break
            time.sleep(0.05)  # workers finish the job in hand, far sooner than a lease expires
        log.info("[queue] finished: %s", self.queue.counts())
