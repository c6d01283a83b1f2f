"""The PS's job pipeline: everything between the trainer and the queue, in one object.

    pipeline = JobPipeline(cfg, run, queue, dataset)
    pipeline.start(checkpoint_state, published_version=step)   # re-adopt, then feed and collect
    taken = pipeline.next_batch(step)                          # blocks; raises PipelineError
    pipeline.on_step_end(step)                                 # after the weights of step are published
    pipeline.in_training                                       # the batch whose steps are being trained
    state = pipeline.state_dict(final=False)                   # saved in each checkpoint
    pipeline.finish()                                          # end of training: archive what is left

It owns the job producer and the result collector threads (ps/producer.py, ps/collector.py),
the staleness and re-throw policy, the ledger (ps/ledger.py), the re-adoption of results after
a restart, and the count of jobs dropped after failing (ps/failures.py). An exception in
either thread, or failures that are systematic, are re-raised by ``next_batch`` as a
PipelineError, so training stops with it instead of waiting forever.

A batch is one generation batch: one result's groups, or with ``--dynamic_sampling`` the next
informative groups of one or more results (ps/groups.py). It trains ``steps_per_job``
optimizer steps (more than one with ``--num_iterations`` or ``--steps_per_generation``). The
staleness bound applies when a result is first taken; later steps, and a result's groups left
over for the next batch, are trained against the proximal policy (ps/offpolicy.py), each
group's staleness counted from its own result's weights version.

The pipeline tells the ledger when a batch's last step has trained and which groups dynamic sampling dropped,
and asks it which results are consumed or partly done.

Admission counts the expected yield: the fraction of groups found informative over the last
results (1 without dynamic sampling), so the producer throws more jobs when most are dropped.

Consumption order ``ready`` takes the cached result with the lowest weights version (the one
closest to going stale), then the lowest job id; ``fifo`` takes results in job order.
"""

from __future__ import annotations

import functools
import logging
import threading
import time
from collections import Counter, deque
from collections.abc import Callable
from dataclasses import dataclass

import torch

from asyncgrpo.config import AsyncGRPOConfig
from asyncgrpo.jobqueue import ArchiveReason, CollectedResult, JobQueue, JobState
from asyncgrpo.jobqueue.handoff import FailureReport, read_result_payload
from asyncgrpo.jobqueue.names import depth_line
from asyncgrpo.run import RunDir, list_workers
from asyncgrpo.run.liveness import fs_now
from asyncgrpo.run.metrics import NO_SPREAD_WARN_STEPS
from ps.collector import ResultCache, ResultCollector
from ps.failures import FailedJobs
from ps.groups import assemble, group_reward_std, group_rows, merge_logs, slice_logs
from ps.learning_signal import FlatGroups
from ps.ledger import GroupsTaken, Ledger
from ps.producer import JobProducer, TrainingProgress

log = logging.getLogger("asyncgrpo.ps")
TRAINER_WAIT_REPORT_S = 30.0  # how often a trainer waiting for results says so in the log
TRAINER_WAIT_POLL_S = 2.0  # how often it calls ``while_waiting`` meanwhile
ZERO_STD = 1e-6  # a spread below this is none (float sums of equal rewards), whatever the threshold
DROP_REASON = "reward std at most dynamic_sampling_max_std"
YIELD_OF_LAST = 50  # results the expected yield of informative groups is measured over
MIN_YIELD = 0.1  # admission never counts on fewer informative groups per result than this fraction


class PipelineError(RuntimeError):
    """A pipeline thread failed, or every job fails; training cannot go on."""


class StopRequested(Exception):
    """A request to save a checkpoint and stop (``stop_at_boundary``) met the trainer between batches, where the
    weights, the optimizer and the ledger agree on a step: the trainer saves there and stops."""


@dataclass
class BatchInTraining:
    """The batch whose steps are being trained: groups of one result (or, with dynamic sampling, of several).
    The pipeline's (on the first rank) is the one that counts for the ledger; under --ps-procs every other rank
    keeps the copy broadcast with its batch (ps/trainer.py), counted down the same way."""

    parts: list[GroupsTaken]
    metrics: dict  # the workers' TRL metrics (reward, ...), logged once per step the batch trains
    steps_left: int
    groups_dropped: int = 0  # by dynamic sampling while it was assembled

    def trained_one_step(self) -> bool:
        """Counts a trained step; True when it was the batch's last."""
        self.steps_left -= 1
        return self.steps_left == 0


@dataclass
class TrainingBatch:
    """What next_batch hands the trainer: TRL's batch dict and the completions-table rows of its groups."""

    tensors: dict
    logs: dict | None
    in_training: BatchInTraining


class JobPipeline:
    def __init__(self, cfg: AsyncGRPOConfig, run: RunDir, queue: JobQueue, dataset, pad_token_id: int = 0,
                 stop_at_boundary: threading.Event | None = None, interrupted: threading.Event | None = None):
        self.cfg, self.run, self.queue = cfg, run, queue
        # Set (by a signal handler) to stop at the next batch boundary: next_batch raises StopRequested there
        # instead of taking a batch, even while it waits for results (within a second: see ResultCache.take).
        self.stop_at_boundary = stop_at_boundary or threading.Event()
        # Set by the signal that interrupts training (ps/__main__.py), which raises KeyboardInterrupt itself; should
        # training go on all the same, the trainer raises it here: when it asks for a batch, within a second while
        # it waits for one, and after each step.
        self.interrupted = interrupted or threading.Event()
        self.pad_token_id = pad_token_id  # the tokenizer's: assembled batches pad their ids with it
        self.ledger = Ledger()  # groups of the batch in training enter it when its last step has trained
        self.leftover: tuple[CollectedResult, list[int]] | None = None  # a result's groups left for the next batch
        self.in_training: BatchInTraining | None = None
        self.progress = TrainingProgress()  # what the producer's admission reads
        self.failure: PipelineError | None = None  # raised by next_batch
        self.informative = deque(maxlen=YIELD_OF_LAST)  # (informative groups, groups judged) of the last results
        self.flat_groups = FlatGroups(NO_SPREAD_WARN_STEPS * cfg.generation_batch_size // cfg.num_generations)
        self.cache = ResultCache()
        # Called every TRAINER_WAIT_POLL_S while the trainer waits for results: True at each "has waited" line.
        self.while_waiting: Callable[[bool], None] | None = None
        self.failed = FailedJobs(cfg, queue, self._stop_training)
        self.collector = ResultCollector(cfg, queue, self.cache, self.failed, self._thread_failed)
        self.producer = JobProducer(cfg, queue, dataset, self.progress, self.cache, self._thread_failed)

    # ------------------------------------------------------------------ lifecycle

    def start(self, state: dict | None, published_version: int) -> None:
        """Resumes from a checkpoint's ``state`` (None: a fresh run), re-adopts the results in
        the run directory, and starts feeding and collecting."""
        self.load_state_dict(state or {})
        self.progress.published_version = self.progress.next_take_step = published_version
        if rolled_back := self.queue.roll_back_consumed(self.ledger.consumed):
            log.info("[queue] %d result(s) consumed after the checkpoint back in the queue, to be trained again",
                     len(rolled_back))
        readopted = self.collector.collect_now(readopt=True)
        if readopted:
            log.info("[queue] re-adopted %d result(s) from the run directory", readopted)
        self.collector.start()
        self.producer.start()

    def state_dict(self, final: bool = False) -> dict:
        """The ledger and the producer's journal, between batches. In the final checkpoint the batch cut short by
        max_steps, and a result whose groups are split across batches, count as consumed (Ledger.state_dict)."""
        cut_short = set()
        if final:
            cut_short = {part.job_id for part in self.in_training.parts} if self.in_training else set()
            cut_short |= {self.leftover[0].job_id} if self.leftover else set()
        return {**self.ledger.state_dict(cut_short), "producer": self.producer.state_dict(),
                "dropped": {"jobs": self.failed.jobs, "prompts": self.failed.prompts}}

    def consume_leftover(self) -> None:
        """At the end of training: the result whose groups are split across batches is archived consumed, as the
        final checkpoint counts it (before that checkpoint's ledger is written: a PS killed in between finds it
        consumed and not in the ledger of the checkpoint it resumes from, and trains its rest again)."""
        if self.leftover is not None:
            self.queue.consume(self.leftover[0])
            self.leftover = None

    def load_state_dict(self, state: dict) -> None:
        self.ledger.load_state_dict(state)
        self.producer.load_state(state.get("producer"))
        self.failed.resume(state.get("dropped") or {})

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

    def _raise_if_interrupted(self) -> None:
        if self.interrupted.is_set():
            raise KeyboardInterrupt("interrupted (a signal), training had gone on")

    # ------------------------------------------------------------------ the trainer's side

    def next_batch(self, step: int) -> TrainingBatch:
        """The batch to train steps ``step + 1`` .. ``step + steps_per_job`` on: one result, or with dynamic
        sampling the next informative groups of as many results as it takes (a result's groups left over go
        first into the next batch). Blocks for results; stale and duplicate ones are archived on the way (a stale
        one's rows are thrown again), and so are results whose every group is dropped."""
        if self.in_training is not None:
            raise PipelineError(f"a batch was asked for at step {step} while the one in training has "
                                f"{self.in_training.steps_left} step(s) left to train")
        self._raise_if_interrupted()
        if self.stop_at_boundary.is_set():
            raise StopRequested(f"stop requested before step {step + 1}")
        groups_per_batch = self.cfg.generation_batch_size // self.cfg.num_generations
        parts: list[tuple[CollectedResult, list[int]]] = []
        dropped = 0
        started = time.monotonic()
        while (room := groups_per_batch - sum(len(groups) for _, groups in parts)) > 0:
            if self.leftover is None:
                result = self._next_result(step, started, stoppable=not parts)
                partly_done = self.ledger.is_partly_done(result.job_id)
                informative, dropped_now = self._informative_groups(result)
                dropped += dropped_now
                if not informative:
                    self._close_untrained(result, partly_done)
                    continue
                self.leftover = (result, informative)
            result, groups = self.leftover
            self.leftover = (result, groups[room:]) if groups[room:] else None
            if self.leftover is None and not self.queue.consume(result):  # a duplicate, archived as such
                parts = [(r, g) for r, g in parts if r.job_id != result.job_id]
                continue
            parts.append((result, groups[:room]))
        G = self.cfg.num_generations
        in_training = BatchInTraining([_groups_taken(r, g, G) for r, g in parts], _weighted_metrics(parts),
                                      self.cfg.steps_per_job, dropped)
        self.in_training = in_training
        self.progress.next_take_step = step + self.cfg.steps_per_job
        self.producer.wake()
        tensors = assemble([(r.data.batch, g) for r, g in parts],
                           G, self.pad_token_id)
        logs = [slice_logs(r.data.logs, group_rows(g, G)) for r, g in parts]
        return TrainingBatch(tensors, merge_logs(logs), in_training)

    def _next_result(self, step: int, started: float, stoppable: bool) -> CollectedResult:
        """The next result to take groups from; stale and duplicate results are archived on the way. While
        ``stoppable`` (no result taken into this batch yet: the state is the last step's), a stop request raises
        StopRequested; a batch half assembled (dynamic sampling) is completed first."""
        pick = self._pick_unless_stopping if stoppable else self.pick
        report_at = time.monotonic() + TRAINER_WAIT_REPORT_S
        while True:
            self._raise_failure()
            result = self.cache.take(pick, timeout=TRAINER_WAIT_POLL_S)
            if result is None:
                waited_long = time.monotonic() >= report_at
                if waited_long:
                    log.warning("[train] step=%d has waited %.0fs for a result; queue=%s%s%s (what each worker holds: "
                                "queue_tools ls %s)", step + 1, time.monotonic() - started,
                                depth_line(self.queue.counts()), self.failed.summary(),
                                workers_line(self.run, self.cfg.lease_s), self.run.root)
                    report_at = time.monotonic() + TRAINER_WAIT_REPORT_S
                if self.while_waiting is not None:
                    self.while_waiting(waited_long)
                continue
            try:
                if self._accept(result, step):
                    return result
            finally:
                self.progress.judging = None

    def _pick_unless_stopping(self, cached: dict) -> str | None:
        if self.stop_at_boundary.is_set():  # raised inside take: the cache stays as it was
            raise StopRequested("stop requested while waiting for a result")
        return self.pick(cached)

    def _accept(self, result: CollectedResult, step: int) -> bool:
        """True: groups of ``result`` train from step ``step + 1`` on; False: archived stale or duplicate. The
        staleness bound applies when a result is first taken (a result partly trained before a restart has passed
        it)."""
        if self.ledger.is_consumed(result.job_id):  # in the checkpoint's ledger, though not archived so
            self.queue.archive_if_present(result.path, result.job_id, ArchiveReason.DUPLICATE, result.attempt)
            return False
        if self.queue.was_archived(result.job_id, (ArchiveReason.STALE,), max(self.cfg.max_attempts, result.attempt)):
            log.warning("[queue] %s: another result of this job was archived stale and its prompts thrown again; "
                        "this one is a duplicate", result.job_id)  # (two results: a worker silent past its lease)
            self.queue.archive_if_present(result.path, result.job_id, ArchiveReason.DUPLICATE, result.attempt)
            return False
        staleness = step - result.payload["weights_version"]
        if staleness > self.cfg.max_staleness and not self.ledger.is_partly_done(result.job_id):
            log.info("[queue] %s is %d steps stale (max %d): archived, prompts thrown again",
                     result.job_id, staleness, self.cfg.max_staleness)
            self.producer.owe(result.job_id, result.data.rows, archive=functools.partial(
                self.queue.archive_if_present, result.path, result.job_id, ArchiveReason.STALE, result.attempt))
            return False
        return True

    def _informative_groups(self, result: CollectedResult) -> tuple[list[int], int]:
        """The groups of ``result`` to train (those not done before a restart), and how many were dropped: with
        dynamic sampling, those whose rewards spread no more than the threshold. Dropped groups are done. Each
        group's outcome feeds difficulty filtering (the producer's settled prompts)."""
        G = self.cfg.num_generations
        done = self.ledger.groups_done_of(result.job_id)
        todo = [g for g in range(result.data.completions // G) if g not in done]
        if not (self.cfg.dynamic_sampling or self.cfg.difficulty_filter):
            return todo, 0
        rewards = result.data.rewards  # its shape checked on collection (asyncgrpo/jobqueue/handoff.py)
        if rewards is None:
            raise PipelineError(f"result {result.job_id} carries no rewards per completion, which dynamic sampling "
                                "and difficulty filtering need: its worker runs an older asyncgrpo")
        spread = group_reward_std(rewards, G)
        flat = [g for g in todo if spread[g] <= max(self.cfg.dynamic_sampling_max_std, ZERO_STD)]
        for g in todo:
            self.producer.settled.record(result.data.rows[g * G], g in flat)
        if not self.cfg.dynamic_sampling:
            return todo, 0
        if flat:
            self.ledger.drop(result.job_id, flat)
            self._record_dropped(result, flat, spread)
        self.informative.append((len(todo) - len(flat), len(todo)))
        self.flat_groups.observe(kept=len(todo) - len(flat), dropped=len(flat))
        kept, judged = (sum(column) for column in zip(*self.informative, strict=True))
        self.progress.expected_yield = max(kept / max(judged, 1), MIN_YIELD)
        return [g for g in todo if g not in flat], len(flat)

    def _record_dropped(self, result: CollectedResult, groups: list[int], spread: torch.Tensor) -> None:
        """The dropped groups' rows and rewards go to done/ as ``{job}_filtered`` (the whole result when every
        group is dropped: _close_untrained)."""
        G = self.cfg.num_generations
        stds = [round(float(spread[g]), 6) for g in groups]
        self.queue.events.emit("groups_dropped", job_id=result.job_id, groups=groups, reward_std=stds,
                               reason=DROP_REASON)
        log.debug("[train] %s: groups %s dropped (%s)", result.job_id, groups, DROP_REASON)
        if len(groups) * G == result.data.completions:
            return
        rows = group_rows(groups, G)
        record = {"job_id": result.job_id, "groups": groups, "reason": DROP_REASON, "reward_std": stds,
                  "rows": [result.data.rows[i] for i in rows], "rewards": result.data.rewards[rows].tolist()}
        self.queue.archive_record(result.job_id, ArchiveReason.FILTERED, record)

    def _close_untrained(self, result: CollectedResult, partly_done: bool) -> None:
        """Every group of ``result`` left is dropped: archived ``filtered``, or ``consumed`` when groups of it were
        done before a restart (some may have trained)."""
        if not partly_done:
            self.queue.archive_if_present(result.path, result.job_id, ArchiveReason.FILTERED, result.attempt)
        self.ledger.close(result.job_id, consumed=partly_done and self.queue.consume(result))

    def pick(self, cached: dict[str, CollectedResult]) -> str | None:
        """Which cached result to take next (``--consume_order``), or None to wait; raises a pipeline failure, or
        KeyboardInterrupt once interrupted."""
        self._raise_if_interrupted()
        self._raise_failure()
        if not cached:
            return None
        if self.cfg.consume_order == "fifo":
            oldest = min(cached)
            coming = self.queue.active_job_ids() - cached.keys()
            picked = None if coming and min(coming) < oldest else oldest  # an older job is still on its way
        else:  # a result partly trained before a restart first: it has passed the staleness bound already
            picked = min(cached, key=lambda job_id: (not self.ledger.is_partly_done(job_id),
                                                     cached[job_id].payload["weights_version"], job_id))
        self.progress.judging = picked  # under the cache's lock: never out of the cache and out of judging at once
        return picked

    def on_step_end(self, step: int) -> None:
        """Step ``step`` has trained and its weights are published."""
        if self.in_training is not None and self.in_training.trained_one_step():
            self.ledger.trained(self.in_training.parts)
            self.in_training = None
        self.progress.published_version = step
        self.producer.wake()
        self._raise_if_interrupted()

    # ------------------------------------------------------------------ end of training

    def finish(self) -> None:
        """Every job and result left in queue/ is archived 'unused' (a result whose groups were split across
        batches 'consumed': the final checkpoint counts it so); failure reports are recorded (archived 'failed').

        Jobs in workers' hands are waited for (at most a lease) and their results archived.
        Nothing goes back to pending (a worker would take it with no one left to collect), and
        the loop repeats until queue/ is empty: a worker relaunched now may release a job."""
        self.stop()
        self.consume_leftover()
        self.cache.drain()  # its results are in queue/ as collected: archived below
        read = functools.partial(read_result_payload, rows_per_job=self.cfg.generation_batch_size)
        deadline = time.monotonic() + self.cfg.lease_s
        while True:
            self.queue.recover(lease_s=self.cfg.lease_s, max_attempts=self.cfg.max_attempts, requeue=False,
                               job_timeout_s=self.cfg.job_timeout_s or None)
            for result in self.queue.collect(read, readopt=True):
                if isinstance(result.data, FailureReport):
                    self.failed.record(result)  # archived failed, with its errors
            # Results completed since collect are left for the next pass, which records a failure report among them.
            self.queue.archive_leftovers(states=(JobState.PENDING, JobState.COLLECTED))
            if not self.queue.scan()[0]:
                break
            if time.monotonic() > deadline:
                log.warning("[queue] finishing with files still in queue/ after %gs: %s", self.cfg.lease_s,
                            self.queue.counts())
                break
            time.sleep(0.05)  # workers finish the job in hand, far sooner than a lease expires
        log.info("[queue] finished: %s", self.queue.counts())


def workers_line(run: RunDir, lease_s: float) -> str:
    """What the workers are doing, from their heartbeats: "; workers: 2 compiling, 1 busy" ("" when none beats)."""
    states = Counter(w.state for w in list_workers(run, fs_now(run), lease_s) if w.alive)
    return "; workers: " + ", ".join(f"{n} {state}" for state, n in sorted(states.items())) if states else ""


def _groups_taken(result: CollectedResult, groups: list[int], num_generations: int) -> GroupsTaken:
    batch = result.data.batch
    rows = group_rows(groups, num_generations)
    version = result.payload["weights_version"]
    by_version = result.data.tokens_by_version(rows, version)  # its completion tokens, by the version sampling them
    return GroupsTaken(result.job_id, version, groups, batch["advantages"].size(0) // num_generations, len(rows),
                       sum(by_version.values()), by_version)


def _weighted_metrics(parts: list[tuple[CollectedResult, list[int]]]) -> dict:
    """The workers' TRL metrics of the results a batch takes groups from, each weighted by the groups it gives."""
    totals, weights = {}, {}
    for result, groups in parts:
        for name, value in result.data.metrics.items():
            totals[name] = totals.get(name, 0.0) + value * len(groups)
            weights[name] = weights.get(name, 0) + len(groups)
    return {name: totals[name] / weights[name] for name in totals}

