"""The worker loop with continuous batching (``--worker_decoding continuous``, worker/decoding/continuous.py).

The worker's main thread runs the engine: it claims a job when a slot is free and no row waits for one (never
earlier: a claimed job ages), its rows joining as slots free up; it launches decoding steps, and every few steps
(CHECK_EVERY of worker/decoding/continuous.py) collects the jobs whose rows have all ended and syncs newer weights.
A finished job is scored and published by the ``Scorer`` thread, while the slots keep decoding. (The engine stays
on the thread that compiled it: CUDA graphs are recorded per thread, and in torch before 2.13 replaying them from
another thread fails. Reward functions therefore run on the scoring thread, as in TRL's asynchronous trainer;
TRL's own math rewards turn their signal-based timeouts off there.)

Weights are synced in place between decoding steps, and each row records which versions sampled its tokens (as
with --in_flight_updates); a result's weights_version is its oldest token's. Exactly once holds as for any job:
each result is published through the fenced ``JobQueue.complete``; a worker that dies with jobs in its slots loses
each to recovery. On a stop the worker claims nothing more, finishes the jobs in its slots (at most
``max_completion_length`` steps), publishes them and returns.
"""

from __future__ import annotations

import logging
import queue as queues
import sys
import threading
import time
from dataclasses import dataclass

import torch

from asyncgrpo.config import AsyncGRPOConfig, ConfigError
from asyncgrpo.events import EventLog
from asyncgrpo.jobqueue import ClaimedJob, JobQueue, QueueWatcher
from asyncgrpo.jobqueue.handoff import JobData
from asyncgrpo.run import RunDir, WorkerPresence
from worker.deadline import ACTIVITY
from worker.decoding.continuous import ContinuousDecoding
from worker.decoding.sequence import FinishedJob
from worker.generate import JOB_FAILURES, JobInput, job_seed, prompt_ids_of, score_generated
from worker.results import Timing, fail, publish

log = logging.getLogger("asyncgrpo.worker")
IDLE_WAIT_S = 1.0  # how often an idle worker looks for work or a stop without an event
# The scoring thread holds the GIL in Python for long stretches; the engine's host loop needs it for a few
# microseconds a step. Python hands it over every switch interval (5 ms by default: three decoding steps on a GPU).
SWITCH_INTERVAL_S = 0.0005


@dataclass
class _Held:
    job: ClaimedJob
    prompt_ids: list[list[int]]
    claimed: float  # time.monotonic()
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
                    self._publish(entry, finished)
                with self._lock:
                    del self._in_hand[id(entry)]
            except BaseException as err:  # the main thread raises it (check); the jobs held return by recovery
                self._error = self._error or err

    def _publish(self, entry: _Held, finished: FinishedJob) -> None:
        job, trainer = entry.job, self.trainer
        oldest = finished.weights_version
        self.events.emit("generate_end", job_id=job.job_id, weights_version=oldest, dur_ms=finished.decode_s * 1e3)
        inputs = JobInput(job.job_data.rows, job_seed(trainer.args.seed, job.job_id), job.payload["created_step"],
                          {"job_id": job.job_id, "weights_version": oldest})
        outcome = score_generated(trainer, inputs, finished.prompt_ids, finished.completion_ids, finished.tokens,
                                  finished.logps, self.events, with_logs=self.cfg.log_completions,
                                  token_versions=finished.token_versions)
        publish(self.cfg, self.queue, job, outcome, oldest, self.events,
                Timing(entry.claimed, entry.started, time.time(), recompiles=self.engine.recompiles()))
        JOB_FAILURES.flush()


def serve_continuously(cfg: AsyncGRPOConfig, run: RunDir, queue: JobQueue, trainer, engine: ContinuousDecoding,
                       subscriber, version: int, watcher: QueueWatcher, presence: WorkerPresence,
                       stop: threading.Event, events: EventLog, waiting) -> None:
    """The worker's loop once it holds the PS's first weights (``version``); returns after a stop, its jobs done."""
    engine.version = version
    sys.setswitchinterval(SWITCH_INTERVAL_S)
    scorer = Scorer(cfg, queue, trainer, engine, events)
    finished_cleanly = False
    try:
        with torch.no_grad(), trainer.accelerator.autocast():
            finished_cleanly = _decode(cfg, run, queue, trainer, engine, subscriber, watcher, presence, stop, events,
                                       waiting, scorer)
    finally:
        # After an error the jobs it was handed are not waited for long: they return through recovery.
        scorer.close(None if finished_cleanly else 5.0)
    scorer.check()


def _decode(cfg, run, queue, trainer, engine, subscriber, watcher, presence, stop, events, waiting, scorer) -> bool:
    """The engine's loop; True when it returns after a stop with every job it held handed to the scorer."""
    device = presence.device
    held: dict[str, _Held] = {}  # in the engine's slots
    parked: _Held | None = None  # prompts longer than the cache holds: it joins once the slots drain
    while True:
        scorer.check()
        if parked is not None and engine.empty():
            log.info("[gen] dev%s a prompt of %d tokens: the decoding engine's cache grows (new graphs)", device,
                     max(len(ids) for ids in parked.prompt_ids))
            engine.reallocate(max(len(ids) for ids in parked.prompt_ids))
            held[parked.job.job_id], parked = _join(trainer, engine, parked, events, subscriber), None
        # Free slots take a job, unless finished jobs wait to be scored (a slow reward function): a worker takes no
        # more than it can score soon, and the other workers take the rest.
        while (parked is None and not stop.is_set() and engine.wants_a_job()
               and len(scorer.in_hand()) < engine.slots // engine.rows_per_job):
            job = queue.claim(device)
            if job is None:
                break
            entry = _read(cfg, run, queue, trainer, engine, job, events)
            if entry is None:
                continue
            if engine.fits(entry.prompt_ids):
                held[job.job_id] = _join(trainer, engine, entry, events, subscriber)
            else:
                parked = entry
        if stop.is_set() and parked is not None:
            queue.release(parked.job)  # given back as it was, for a worker that goes on
            events.emit("job_released", job_id=parked.job.job_id)
            parked = None
        presence.update(state="busy" if held else "idle", job_id=next(iter(held), None),
                        job_ids=list(held) + scorer.in_hand() + ([parked.job.job_id] if parked else []),
                        weights_version=engine.version,
                        recompiles=engine.recompiles())
        if engine.empty():
            _sync(subscriber, trainer.model, engine, events)  # the next job starts with the newest weights
            if stop.is_set():
                return True
            if parked is None:
                waiting.waiting_for("a job from the parameter server")
                watcher.wait(IDLE_WAIT_S)
            continue
        waiting.over()
        with ACTIVITY.doing("generation"):  # (what a job's deadline names, worker/deadline.py)
            engine.run(engine.check_every)
        for finished in engine.collect():
            scorer.submit(held.pop(finished.key), finished)
        _sync(subscriber, trainer.model, engine, events)


def _read(cfg: AsyncGRPOConfig, run: RunDir, queue: JobQueue, trainer, engine: ContinuousDecoding, job: ClaimedJob,
          events: EventLog) -> _Held | None:
    """A claimed job, read and tokenised as TRL would before it generates; None when it cannot be (it failed)."""
    device = job.name.device
    claimed = time.monotonic()
    queue_wait_ms = (job.claimed_at - job.payload["created_at"]) * 1e3
    events.emit("job_claimed", job_id=job.job_id, attempt=job.attempt, queue_wait_ms=queue_wait_ms)
    log.info("[queue] dev%s claimed job=%s attempt=%d queue_wait_ms=%.0f", device, job.job_id, job.attempt,
             queue_wait_ms)
    # The running PS's flags (a PS relaunched with other flags also trains the jobs it left in the queue).
    ps_flags = ps_status.generation if (ps_status := run.read_ps_status()) else None
    if mismatch := cfg.generation_mismatch(ps_flags):
        queue.release(job)  # for a worker started with the PS's flags
        raise ConfigError(mismatch)
    try:
        job.job_data = JobData.from_dict(job.data)
        prompt_ids = prompt_ids_of(trainer, job.job_data.rows)
        if prompt_ids is None:
            raise ValueError("prompts with images: the decoding engine generates from token ids only")
        if len(prompt_ids) != engine.rows_per_job:
            raise ValueError(f"a job of {len(prompt_ids)} rows, where the engine's jobs have {engine.rows_per_job}")
    except ValueError as err:
        fail(cfg, queue, job, err, engine.version, events)
        return None
    return _Held(job, prompt_ids, claimed)


def _join(trainer, engine: ContinuousDecoding, entry: _Held, events: EventLog, subscriber) -> _Held:
    """The job's rows into the slots, their first tokens sampled by the newest weights (synced first, as the other
    loop syncs before each job: a job that joined with the weights of the last look would be a step staler, and
    with 2 continuous workers on the demo 119 of 1,122 results went stale, against 3 with this sync)."""
    _sync(subscriber, trainer.model, engine, events)
    events.emit("generate_start", job_id=entry.job.job_id, weights_version=engine.version)
    engine.add(entry.job.job_id, entry.prompt_ids, job_seed(trainer.args.seed, entry.job.job_id))
    entry.started = time.time()
    return entry


def _sync(subscriber, model, engine: ContinuousDecoding, events: EventLog) -> None:
    started = time.monotonic()
    version = subscriber.sync(model)
    if version is None:
        return
    engine.weights_changed(version)
    events.emit("weights_synced", weights_version=version, dur_ms=(time.monotonic() - started) * 1e3,
                bytes=subscriber.synced_bytes, in_flight=True)
