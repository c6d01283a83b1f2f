"""How a worker generates the jobs it claimed, behind the one interface its loop (worker/loop.py) drives: the loop
claims while ``wants_a_job()``, hands each job over with ``submit``, calls ``step()`` while the generation is not
``empty()``, and reads what each finished job came to from ``published()`` (True: a result was written), which
sets its back-off.

- ``BatchGeneration``: the jobs of one call (``--jobs_per_generate``, one where TRL generates turn by turn) are
  generated and scored together by the worker's decoder (TRL's generate, compiled, or the decoding graph); newer
  weights reach a call before it starts, and between its decoding steps with ``--in_flight_updates``.
- ``EngineGeneration``: continuous batching (worker/decoding/continuous.py). A job's rows join the engine's slots as
  they free up; each ``step()`` runs a few decoding steps, hands the jobs whose rows all ended to the ``Scorer``
  thread, which scores and publishes them while the slots keep decoding, and syncs newer weights between steps (a
  result's weights_version is its oldest token's). The engine stays on the thread that compiled it: CUDA graphs are
  recorded per thread, and in torch before 2.13 replaying them from another thread fails. Reward functions
  therefore run on the scoring thread, as in TRL's asynchronous trainer; TRL's own math rewards turn their
  signal-based timeouts off there.

A job whose floor (the oldest weights version that may generate it, ``--max_staleness``) is above the weights held
waits for them: a batch before it starts, the engine's job outside the slots while the others decode. On a stop
the loop claims nothing more: jobs not yet started are given back, the ones decoding are finished and published.
"""

from __future__ import annotations

import contextlib
import logging
import queue as queues
import sys
import threading
import time
from dataclasses import dataclass

import torch

from asyncgrpo.config import AsyncGRPOConfig
from asyncgrpo.events import EventLog
from asyncgrpo.jobqueue import ClaimedJob, JobQueue
from asyncgrpo.run import RunDir, WorkerPresence
from worker.deadline import ACTIVITY
from worker.decoding import Decoder
from worker.decoding.continuous import ContinuousDecoding
from worker.decoding.sequence import FinishedJob
from worker.generate import JOB_FAILURES, JobInput, generate_jobs, job_seed, prompt_ids_of, score_generated
from worker.in_flight import InFlightWeights
from worker.results import Timing, fail, publish

log = logging.getLogger("asyncgrpo.worker")
FLOOR_POLL_S = 0.005  # how often a job waiting for its floor looks for newer weights (synchronous mode)
# The scoring thread holds the GIL in Python for long stretches; the engine's host loop needs it for a few
# microseconds a step. Python hands it over every switch interval (5 ms by default: three decoding steps on a GPU).
SWITCH_INTERVAL_S = 0.0005


def sync_weights(subscriber, model, device, events: EventLog, in_flight: bool = False) -> int | None:
    """Newer weights into ``model`` if the PS published any; their version, or None."""
    start = time.monotonic()
    version = subscriber.sync(model)
    if version is not None:
        sync_ms = (time.monotonic() - start) * 1e3
        events.emit("weights_synced", weights_version=version, dur_ms=sync_ms, bytes=subscriber.synced_bytes,
                    **({"in_flight": True} if in_flight else {}))
        if not in_flight:
            log.info("[weights] dev%s synced version=%d sync_ms=%.1f", device, version, sync_ms)
    return version


class BatchGeneration:
    """The jobs of one decoder call, claimed together (only jobs already pending: a job in hand never waits for
    another), generated, scored and published in ``step``."""

    def __init__(self, cfg: AsyncGRPOConfig, run: RunDir, queue: JobQueue, trainer, decoding: Decoder, subscriber,
                 events: EventLog, presence: WorkerPresence, stop: threading.Event, waiting,
                 in_flight: InFlightWeights | None, jobs_per_call: int):
        self.cfg, self.run, self.queue, self.trainer, self.decoding = cfg, run, queue, trainer, decoding
        self.subscriber, self.events, self.presence = subscriber, events, presence
        self.stop, self.waiting = stop, waiting
        self.in_flight, self.jobs_per_call = in_flight, jobs_per_call
        self.version: int | None = None  # of the weights the model holds (None: none of the PS's yet)
        self._jobs: list[ClaimedJob] = []
        self._floor = 0
        self._claimed = 0.0
        self._published: list[bool] = []

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        pass

    def wants_a_job(self) -> bool:
        return len(self._jobs) < self.jobs_per_call

    def submit(self, job: ClaimedJob, floor: int) -> None:
        if not self._jobs:
            self._claimed = time.monotonic()
        self._jobs.append(job)
        self._floor = max(self._floor, floor)

    def empty(self) -> bool:
        return not self._jobs

    def job_ids(self) -> list[str]:
        return [j.job_id for j in self._jobs]

    def sync(self) -> None:
        self.version = _newer(sync_weights(self.subscriber, self.trainer.model, self.presence.device, self.events),
                              self.version)

    def give_back(self) -> None:
        for job in self._jobs:
            self.queue.release(job)
            self.events.emit("job_released", job_id=job.job_id)
        self._jobs, self._floor = [], 0

    def published(self) -> list[bool]:
        done, self._published = self._published, []
        return done

    def step(self) -> None:
        jobs = self._jobs
        self.sync()
        if self.version < self._floor:
            waited_from = time.monotonic()
            while self.version < self._floor and not self.stop.is_set():
                self.waiting.waiting_for(f"weights version {self._floor} (the job's floor: its step less "
                                         "--max_staleness)")
                time.sleep(FLOOR_POLL_S)  # synchronous mode: only the newest weights may generate this job
                self.sync()
                self._floor = version_floor(jobs, self.run.read_ps_status())  # (a PS relaunched meanwhile)
            self.events.emit("weights_wait", job_id=jobs[0].job_id, weights_version=self.version,
                             dur_ms=(time.monotonic() - waited_from) * 1e3)
            if self.version < self._floor:  # stopped while waiting
                self.give_back()
                return
        self.presence.update(weights_version=self.version)
        started = time.time()
        inputs = [JobInput(job.job_data.rows, job_seed(self.trainer.args.seed, job.job_id),
                           job.payload["created_step"], {"job_id": job.job_id, "weights_version": self.version})
                  for job in jobs]
        if self.in_flight is not None:
            self.in_flight.version = self.version
        # A bad prompt or reward function fails its job, not the worker (an error of a broken device is raised).
        outcomes = generate_jobs(self.trainer, inputs, self.events, self.decoding, with_logs=self.cfg.log_completions,
                                 in_flight=self.in_flight)
        timing = Timing(self._claimed, started, time.time(), len(jobs), self.decoding.recompiles())
        published = [publish(self.cfg, self.queue, job, outcome, self.version, self.events, timing)
                     for job, outcome in zip(jobs, outcomes, strict=True)]
        if self.in_flight is not None:  # the weights it synced between decoding steps are the model's now
            self.version = self.in_flight.version
        self._jobs, self._floor = [], 0
        self._published.append(all(published))  # one call, one outcome: the back-off counts calls that failed

    def check(self) -> None:
        pass


@dataclass
class _Held:
    job: ClaimedJob
    prompt_ids: list[list[int]]
    claimed: float  # time.monotonic()
    floor: int = 0
    waits_from: float | None = None  # time.monotonic() when it began to wait for its floor
    started: float = 0.0  # time.time() when it joined the slots


class Scorer:
    """Scores finished jobs with TRL and publishes them, on a thread of its own, in the order they finished. An
    error it meets is raised on the main thread by ``check``."""

    def __init__(self, cfg: AsyncGRPOConfig, queue: JobQueue, trainer, engine: ContinuousDecoding, events: EventLog):
        self.cfg, self.queue, self.trainer, self.engine, self.events = cfg, queue, trainer, engine, events
        self._jobs: queues.Queue = queues.Queue()
        # By the entry, not the job id: a job thrown again by its failure here may be claimed, decoded and handed
        # over again (its next attempt, the same id) while this thread still ends the first.
        self._in_hand: dict[int, _Held] = {}
        self._published: list[bool] = []
        self._lock = threading.Lock()
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="scoring", daemon=True)
        self._thread.start()

    def submit(self, entry: _Held, finished: FinishedJob) -> None:
        with self._lock:
            self._in_hand[id(entry)] = entry
        self._jobs.put((entry, finished))

    def in_hand(self) -> list[str]:
        with self._lock:
            return [entry.job.job_id for entry in self._in_hand.values()]

    def published(self) -> list[bool]:
        with self._lock:
            done, self._published = self._published, []
        return done

    def check(self) -> None:
        if self._error is not None:
            raise self._error

    def close(self, timeout_s: float | None = None) -> None:
        """Ends the thread once the jobs handed to it are published (or after ``timeout_s``: a daemon thread, whose
        jobs return through recovery)."""
        self._jobs.put(None)
        self._thread.join(timeout_s)

    def _run(self) -> None:
        while (item := self._jobs.get()) is not None:
            entry, finished = item
            try:
                if self._error is None:
                    written = self._publish(entry, finished)
                    with self._lock:
                        self._published.append(written)
                with self._lock:
                    del self._in_hand[id(entry)]
            except BaseException as err:  # the main thread raises it (check); the jobs held return by recovery
                self._error = self._error or err

    def _publish(self, entry: _Held, finished: FinishedJob) -> bool:
        job, trainer = entry.job, self.trainer
        oldest = finished.weights_version
        self.events.emit("generate_end", job_id=job.job_id, weights_version=oldest, dur_ms=finished.decode_s * 1e3)
        inputs = JobInput(job.job_data.rows, job_seed(trainer.args.seed, job.job_id), job.payload["created_step"],
                          {"job_id": job.job_id, "weights_version": oldest})
        outcome = score_generated(trainer, inputs, finished.prompt_ids, finished.completion_ids, finished.tokens,
                                  finished.logps, self.events, with_logs=self.cfg.log_completions,
                                  token_versions=finished.token_versions)
        written = publish(self.cfg, self.queue, job, outcome, oldest, self.events,
                          Timing(entry.claimed, entry.started, time.time(), recompiles=self.engine.recompiles()))
        JOB_FAILURES.flush()
        return written


class EngineGeneration:
    """Continuous batching: jobs join the engine's slots as they free up; finished ones are scored and published by
    the ``Scorer`` thread."""

    def __init__(self, cfg: AsyncGRPOConfig, queue: JobQueue, trainer, engine: ContinuousDecoding, subscriber,
                 events: EventLog, presence: WorkerPresence, stop: threading.Event, waiting):
        self.cfg, self.queue, self.trainer, self.engine = cfg, queue, trainer, engine
        self.decoding = engine
        self.subscriber, self.events, self.presence = subscriber, events, presence
        self.stop, self.waiting = stop, waiting
        self._has_weights = False
        self.scorer: Scorer | None = None
        self._held: dict[str, _Held] = {}  # in the engine's slots
        # A job that cannot join yet: its prompt is longer than the cache holds (it joins once the slots drain, the
        # cache grown), or its floor is above the weights held (it joins once they arrive).
        self._waiting: _Held | None = None
        self._context = contextlib.ExitStack()

    @property
    def version(self) -> int | None:
        """Of the weights the model holds (None: none of the PS's yet)."""
        return self.engine.version if self._has_weights else None

    @version.setter
    def version(self, version: int | None) -> None:
        if version is not None:
            self.engine.version, self._has_weights = version, True

    def __enter__(self):
        self._switch_interval = sys.getswitchinterval()
        sys.setswitchinterval(SWITCH_INTERVAL_S)
        self._context.enter_context(torch.no_grad())
        self._context.enter_context(self.trainer.accelerator.autocast())
        self.scorer = Scorer(self.cfg, self.queue, self.trainer, self.engine, self.events)
        return self

    def __exit__(self, exc_type, *exc) -> None:
        self._context.close()
        sys.setswitchinterval(self._switch_interval)
        # After an error the jobs it was handed are not waited for long: they return through recovery.
        self.scorer.close(None if exc_type is None else 5.0)
        if exc_type is None:
            self.scorer.check()

    def wants_a_job(self) -> bool:
        # Free slots take a job, unless finished jobs wait to be scored (a slow reward function): a worker takes no
        # more than it can score soon, and the other workers take the rest.
        return (self._waiting is None and self.engine.wants_a_job()
                and len(self.scorer.in_hand()) < self.engine.slots // self.engine.rows_per_job)

    def submit(self, job: ClaimedJob, floor: int) -> None:
        try:
            prompt_ids = prompt_ids_of(self.trainer, job.job_data.rows)
            if prompt_ids is None:
                raise ValueError("prompts with images: the decoding engine generates from token ids only")
            if len(prompt_ids) != self.engine.rows_per_job:
                raise ValueError(f"a job of {len(prompt_ids)} rows, where the engine's jobs have "
                                 f"{self.engine.rows_per_job}")
        except ValueError as err:
            fail(self.cfg, self.queue, job, err, self.version, self.events)
            return
        entry = _Held(job, prompt_ids, time.monotonic(), floor)
        if floor > self.version:
            entry.waits_from = time.monotonic()
        elif self.engine.fits(prompt_ids):
            self._join(entry)
            return
        self._waiting = entry

    def empty(self) -> bool:
        return not self._held and self._waiting is None

    def job_ids(self) -> list[str]:
        return list(self._held) + self.scorer.in_hand() + ([self._waiting.job.job_id] if self._waiting else [])

    def sync(self) -> None:
        version = sync_weights(self.subscriber, self.trainer.model, self.presence.device, self.events, in_flight=True)
        if version is not None:
            self.engine.weights_changed(version)

    def give_back(self) -> None:
        if self._waiting is not None:  # given back as it was, for a worker that goes on
            self.queue.release(self._waiting.job)
            self.events.emit("job_released", job_id=self._waiting.job.job_id)
            self._waiting = None

    def published(self) -> list[bool]:
        return self.scorer.published()

    def check(self) -> None:
        self.scorer.check()

    def step(self) -> None:
        if self._waiting is not None:
            self._join_the_waiting()
        if not self._held:
            if self._waiting is not None:  # its floor: newer weights
                self.waiting.waiting_for(f"weights version {self._waiting.floor} (the job's floor: its step less "
                                         "--max_staleness)")
                time.sleep(FLOOR_POLL_S)
                self.sync()
            return
        with ACTIVITY.doing("generation"):  # (what a job's deadline names, worker/deadline.py)
            self.engine.run(self.engine.check_every)
        for finished in self.engine.collect():
            self.scorer.submit(self._held.pop(finished.key), finished)
        self.sync()

    def _join_the_waiting(self) -> None:
        entry = self._waiting
        if entry.floor > self.version:
            return
        if not self.engine.fits(entry.prompt_ids):
            if not self.engine.empty():
                return
            longest = max(len(ids) for ids in entry.prompt_ids)
            log.info("[gen] dev%s a prompt of %d tokens: the decoding engine's cache grows (new graphs)",
                     self.presence.device, longest)
            self.engine.reallocate(longest)
        self._waiting = None
        if entry.waits_from is not None:
            self.events.emit("weights_wait", job_id=entry.job.job_id, weights_version=self.version,
                             dur_ms=(time.monotonic() - entry.waits_from) * 1e3)
        self._join(entry)

    def _join(self, entry: _Held) -> None:
        """The job's rows into the slots, their first tokens sampled by the newest weights (synced first, as a batch
        syncs before it starts: a job that joined with the weights of the last look would be a step staler, and with
        2 continuous workers on the demo 119 of 1,122 results went stale, against 3 with this sync)."""
        self.sync()
        self.events.emit("generate_start", job_id=entry.job.job_id, weights_version=self.version)
        self.engine.add(entry.job.job_id, entry.prompt_ids, job_seed(self.trainer.args.seed, entry.job.job_id))
        entry.started = time.time()
        self._held[entry.job.job_id] = entry


def version_floor(jobs: list[ClaimedJob], ps_status) -> int:
    """The oldest weights version ``jobs`` may be generated with. A job thrown by an earlier PS of the run counts
    its floor in that PS's steps, which the running PS (relaunched without a checkpoint, or from an earlier one)
    may reach only by training on this very job: such a job takes the newest weights there are."""
    started = ps_status.started_at if ps_status is not None else float("-inf")
    return max((j.job_data.min_weights_version for j in jobs if j.payload["created_at"] >= started), default=0)


def _newer(synced: int | None, held: int) -> int:
    """The version the model holds after a sync that returned ``synced`` (None: nothing newer was published). A
    PS relaunched without a checkpoint publishes version 0 again: 0 is a version, not nothing."""
    return held if synced is None else synced
