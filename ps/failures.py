"""Jobs the PS will never train on, and when their failures mean the run cannot go on.

Part of the job pipeline (ps/pipeline.py). A job whose generation or scoring raised on each of
its ``max_attempts`` attempts reaches the PS as a failure report (``JobQueue.fail``; the
result collector hands it here): it is archived ``failed`` with its errors, an event
``job_dropped`` is emitted, and the PS log says which error and how many prompts were
dropped so far. A job recovered ``max_attempts`` times (its workers died) is archived
``orphaned`` by recovery and counted here the same way.

Systematic failure: when ``max_failed_in_a_row`` jobs in a row, in job order, failed (no job
between them produced a result), nothing can be trained (a reward function that always raises,
returns the wrong number of rewards, ...): ``stop`` is called once with one line naming the
error, and the trainer stops with it (exit status 1) instead of waiting for results that never
come. A failure on some prompts only is retried, then dropped, and the run goes on. Job order,
not arrival order: a failing job arrives after its retries, later than the good jobs thrown
with it, so failures bunch up in arrival order even when most jobs succeed.
"""

from __future__ import annotations

import bisect
import logging
from collections.abc import Callable
from pathlib import Path

from asyncgrpo.config import AsyncGRPOConfig
from asyncgrpo.jobqueue import ArchiveReason, CollectedResult, JobQueue, RecoveryAction, describe_error
from asyncgrpo.jobqueue.names import done_reason

log = logging.getLogger("asyncgrpo.ps")
OUTCOMES_KEPT = 10_000  # job outcomes remembered for the in-a-row count (the newest job ids)


class FailedJobs:
    def __init__(self, cfg: AsyncGRPOConfig, queue: JobQueue, stop: Callable[[str], None]):
        self.cfg, self.queue, self.stop = cfg, queue, stop
        self.prompts_per_job = cfg.generation_batch_size // cfg.num_generations
        self.jobs = 0  # jobs dropped over the run's life (the checkpoint it resumed from counts those before)
        self.prompts = 0  # their prompts
        self.since_result = 0  # failure reports since the last good result arrived
        self.last_error: str | None = None  # describe_error of the newest failure report
        self.outcomes: list[tuple[str, bool]] = []  # (job id, produced a result), in job order; the newest kept
        self.stopped = False

    def resume(self, dropped: dict) -> None:
        """The jobs and prompts the run had dropped by the checkpoint it resumes from (a relaunch after a reward
        function was fixed still counts them: they were never trained on)."""
        self.jobs, self.prompts = int(dropped.get("jobs", 0)), int(dropped.get("prompts", 0))
        if self.prompts:
            log.info("[queue] this run dropped %d job(s), %d prompt(s), before the checkpoint it resumes from (jobs "
                     "that failed on every attempt): counted on", self.jobs, self.prompts)

    def result_arrived(self, job_id: str) -> None:
        """A good result was collected."""
        self.since_result = 0
        self._add_outcome(job_id, True)

    def record(self, report: CollectedResult) -> None:
        """A failure report: archived ``failed`` (its errors inside), counted, logged; may stop the run."""
        errors = report.data.errors  # a FailureReport (ps/collector.py read it)
        self.last_error = describe_error(errors[-1])
        archived = self.queue.archive_if_present(report.path, report.job_id, ArchiveReason.FAILED, report.attempt)
        self._dropped(report.job_id, f"failed on all {report.attempt} attempt(s) ({self.last_error})",
                      error=self.last_error, attempts=report.attempt)
        self.since_result += 1
        in_a_row = self._add_outcome(report.job_id, False)
        limit = self.cfg.max_failed_in_a_row
        if limit > 0 and in_a_row >= limit and not self.stopped:
            self.stopped = True
            device = errors[-1].get("worker_device")  # (its worker logged the traceback, a text: first)
            log_file = self.queue.run.logs / f"log_worker_{device}.txt"  # (launch.sh's and join.sh's name for it)
            places = [str(log_file)] if device is not None and log_file.is_file() else []
            places += [str(archived)] if archived else []
            where = f" (traceback in {' and '.join(places)})" if places else ""
            self.stop(f"{in_a_row} jobs in a row failed on all {report.attempt} attempt(s), none produced a "
                      f"result: {self.last_error}{where}")

    def record_recovery(self, actions: list[RecoveryAction]) -> None:
        """Jobs that recovery archived ``orphaned``: their workers died on each attempt."""
        for action in actions:
            if action.job_id and action.dst and done_reason(Path(action.dst).name) is ArchiveReason.ORPHANED:
                self._dropped(action.job_id, f"was orphaned ({action.why})", error=None, attempts=None)

    def summary(self) -> str:
        """For the trainer's wait message: '' when nothing failed since the last result."""
        if not self.since_result:
            return ""
        return f"; {self.since_result} job(s) failed since the last result, last: {self.last_error}"

    def _add_outcome(self, job_id: str, produced: bool) -> int:
        """Records a job's outcome; the number of failed jobs in a row, in job order, around it."""
        index = bisect.bisect(self.outcomes, (job_id, produced))
        self.outcomes.insert(index, (job_id, produced))
        if len(self.outcomes) > OUTCOMES_KEPT:
            removed = len(self.outcomes) - OUTCOMES_KEPT
            del self.outcomes[:removed]
            index -= removed
        if produced or index < 0:
            return 0
        start = end = index
        while start > 0 and not self.outcomes[start - 1][1]:
            start -= 1
        while end + 1 < len(self.outcomes) and not self.outcomes[end + 1][1]:
            end += 1
        return end - start + 1

    def _dropped(self, job_id: str, why: str, error: str | None, attempts: int | None) -> None:
        self.jobs += 1
        self.prompts += self.prompts_per_job
        self.queue.events.emit("job_dropped", job_id=job_id, attempt=attempts, prompts=self.prompts_per_job,
                               error=error and error[:500])
        # ([jobs], as the workers' failures: launch.sh shows these on the terminal)
        log.warning("[jobs] job %s %s: its %d prompt(s) are not trained on; %d job(s), %d prompt(s) dropped so far",
                    job_id, why, self.prompts_per_job, self.jobs, self.prompts)
