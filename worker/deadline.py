"""A deadline per job (``--job_timeout_s``): a job that never ends does not stall the run.

A reward function that never returns on some prompts, a tool or an environment past its own timeout's reach, a
device call that hangs, a deadlock: the worker's heartbeat stays fresh, so its lease never expires, and without a
deadline the job (and every job that shares its generate call) is held for good while the trainer waits.

``JobDeadline`` is a thread that looks once a second at the jobs the worker holds (``JobQueue.held``, from claim to
publish). When one has been held past ``--job_timeout_s`` the worker:

1. logs one line naming the job, the deadline and where it is stuck (``ACTIVITY``: a reward function, a tool,
   generation, scoring), then every thread's stack;
2. fails that attempt as any failure is failed (``JobQueue.fail``, fenced): thrown again as its next attempt, or
   after ``--max_attempts`` reported to the PS as failed, every attempt's reason kept; the other jobs it holds go
   back to pending as they were;
3. exits with EXIT_JOB_DEADLINE, which launch.sh, join.sh and the Slurm batch script restart: the stuck thread
   cannot be unwound from outside, and a new process is clean.

Should the stuck work end at the same moment, the fence decides: what it publishes after the failure is dropped
(and the other way round). A worker that cannot act on its deadline (its interpreter held by a C call) is caught
by recovery, which takes back a job held past its deadline and the lease whatever the heartbeat says
(asyncgrpo/jobqueue/recovery.py).
"""

from __future__ import annotations

import contextlib
import faulthandler
import logging
import os
import sys
import threading
import time
import traceback
from dataclasses import dataclass

from asyncgrpo.events import EventLog
from asyncgrpo.jobqueue import ClaimedJob, JobQueue

log = logging.getLogger("asyncgrpo.worker")

EXIT_JOB_DEADLINE = 4  # a job ran past --job_timeout_s: the worker exits to be restarted
CHECK_EVERY_S = 1.0


@dataclass(frozen=True)
class Doing:
    stage: str  # one of Activity.PRECEDENCE
    name: str | None  # the reward function's or tool's
    thread: int
    job_id: str | None  # the job being scored on that thread, where one is


class Activity:
    """What the worker's threads are doing, as the deadline names it: ``doing(stage, name, job_id)`` around a
    reward function's call, a tool call, a generate call, a job's scoring."""

    # Most telling first: a reward function or a tool stuck inside a generate-and-score call is the cause.
    # (Scoring before generation: with continuous batching the engine generates all the time beside the scorer.)
    PRECEDENCE = ("reward function", "tool", "scoring", "generation")

    def __init__(self):
        self._lock = threading.Lock()
        # Entries, not a stack per thread: async reward functions interleave on one event loop's thread.
        self._under_way: dict[object, Doing] = {}

    @contextlib.contextmanager
    def doing(self, stage: str, name: str | None = None, job_id: str | None = None):
        token = object()
        with self._lock:
            self._under_way[token] = Doing(stage, name, threading.get_ident(), job_id)
        try:
            yield
        finally:
            with self._lock:
                del self._under_way[token]

    def stuck_in(self) -> Doing | None:
        """The most telling activity under way (the longest under way of its kind), with the job scored on its
        thread; None when nothing is."""
        with self._lock:
            under_way = list(self._under_way.values())
        for stage in self.PRECEDENCE:
            for doing in under_way:
                if doing.stage == stage:
                    job_id = doing.job_id or next((d.job_id for d in under_way
                                                   if d.thread == doing.thread and d.job_id), None)
                    return Doing(doing.stage, doing.name, doing.thread, job_id)
        return None


ACTIVITY = Activity()


def describe(stage: str, name: str | None) -> str:
    return f"{stage} {name!r}" if name else stage


class JobDeadline:
    """The watch (see the module's docstring). ``version``: the weights version the worker holds (a failure report
    carries it). ``stopping``: whether the worker was asked to stop (then it is not restarted, and says so).
    ``stopped``: called before the exit, every job ended: the worker marks itself stopped (its heartbeat), not dead
    holding jobs."""

    def __init__(self, queue: JobQueue, timeout_s: float, max_attempts: int, events: EventLog, device,
                 version=lambda: None, stopping=lambda: False, stopped=lambda: None):
        self.queue, self.timeout_s, self.max_attempts = queue, timeout_s, max_attempts
        self.events, self.device, self.version = events, device, version
        self.stopping, self.stopped = stopping, stopped
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> JobDeadline:
        if self.timeout_s > 0:
            self._thread = threading.Thread(target=self._watch, name="job-deadline", daemon=True)
            self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()

    def _watch(self) -> None:
        while not self._stop.wait(CHECK_EVERY_S):
            now = time.monotonic()
            overdue = [job for job in self.queue.held() if now - job.claimed_mono > self.timeout_s]
            if overdue and not self._stop.is_set():
                self.expire(overdue)

    def expire(self, overdue: list[ClaimedJob]) -> None:
        """Fails the job that is stuck (the one being scored where that is known, else every overdue one: a
        generate call they share), gives the others back, and exits; returns when they ended meanwhile."""
        doing = ACTIVITY.stuck_in()
        where = "unknown work" if doing is None else describe(doing.stage, doing.name)
        stuck = [job for job in self.queue.held() if doing is not None and job.job_id == doing.job_id] or overdue
        stack = sys._current_frames().get(doing.thread) if doing is not None else None
        failed = []
        for job in stuck:
            message = (f"the job ran past its deadline (--job_timeout_s {self.timeout_s:g}: held "
                       f"{time.monotonic() - job.claimed_mono:.0f} s), stuck in {where}")
            error = {"type": "JobTimeout", "message": message,
                     "stage": "generation" if doing is not None and doing.stage == "generation" else "scoring",
                     "reward_function": doing.name if doing is not None and doing.stage == "reward function" else None,
                     "traceback": "".join(traceback.format_stack(stack))[-4000:] if stack else "",
                     "time": time.time(), "attempt": job.attempt, "worker_device": self.device,
                     "weights_version": self.version()}
            try:
                if not self.queue.fail(job, error, max_attempts=self.max_attempts, weights_version=self.version() or 0):
                    continue  # it ended meanwhile, or was recovered
            except Exception:  # (a full disk): the job returns through recovery; the worker must go all the same
                log.exception("[jobs] dev%s job=%s: its failure could not be recorded", self.device, job.job_id)
            failed.append(job)
            given_up = job.attempt >= self.max_attempts
            log.error("[jobs] dev%s job=%s attempt %d/%d: %s; %s", self.device, job.job_id, job.attempt,
                      self.max_attempts, message,
                      "reported to the PS as failed" if given_up else f"thrown again as attempt {job.attempt + 1}")
            self.events.emit("job_failed", job_id=job.job_id, attempt=job.attempt, error=message[:500],
                             given_up=given_up)
        if failed:
            self._exit(where)
        # else they ended as the deadline came: nothing is stuck

    def _exit(self, where: str) -> None:
        """Gives the other jobs back and exits, whatever goes wrong on the way: the stuck thread cannot be unwound."""
        try:
            others = self.queue.close_claims()  # (a claim under way gives its job back itself)
            for job in others:
                if self.queue.release(job):
                    self.events.emit("job_released", job_id=job.job_id)
            stopping = self.stopping()
            log.error("[worker] dev%s exits (status %d)%s: a job ran past --job_timeout_s %g, stuck in %s%s. Every "
                      "thread's stack follows.", self.device, EXIT_JOB_DEADLINE,
                      ", as it was asked to" if stopping else " to be restarted", self.timeout_s, where,
                      f"; {len(others)} other job(s) it held given back" if others else "")
            for handler in logging.getLogger().handlers + log.handlers:
                handler.flush()
            faulthandler.dump_traceback(file=sys.stderr, all_threads=True)
            sys.stderr.flush()
            self.stopped()  # its heartbeat: stopped, every job ended
        finally:
            _exit(EXIT_JOB_DEADLINE)


def _exit(status: int) -> None:
    os._exit(status)  # (tests replace this module-level function)
