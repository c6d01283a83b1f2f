"""A job's deadline on a worker (worker/deadline.py), in one process with a real queue: the job stuck in a reward
function fails as that attempt, naming it, and the worker's other job goes back untouched; a job that ended as
the deadline came is left alone; the watch thread acts by itself. (The process exit is recorded, not made; the
whole story with real processes: tests/e2e/test_job_deadline.py.)"""

import threading

import pytest
from helpers import wait_for

from asyncgrpo.events import EventLog
from asyncgrpo.run import fileops
from worker import deadline
from worker.deadline import ACTIVITY, EXIT_JOB_DEADLINE, JobDeadline


@pytest.fixture
def exits(monkeypatch) -> list:
    statuses = []
    monkeypatch.setattr(deadline, "_exit", statuses.append)
    return statuses


def in_queue(run) -> list[str]:
    return sorted(p.name for p in run.queue.iterdir() if p.name != ".tmp")


def hanging_reward(job_id: str, started: threading.Event, release: threading.Event):
    """A scoring thread whose reward function 'hangs' waits for ``release``."""
    def scoring():
        with ACTIVITY.doing("scoring", job_id=job_id), ACTIVITY.doing("reward function", "hangs"):
            started.set()
            release.wait(30)

    thread = threading.Thread(target=scoring)
    thread.start()
    assert started.wait(10)
    return thread


def test_the_job_stuck_in_a_reward_function_fails_naming_it_and_the_other_job_goes_back(queue, run, exits):
    queue.put_job("000001_000", {"rows": []}, created_step=1)
    queue.put_job("000001_001", {"rows": []}, created_step=1)
    stuck, other = queue.claim(1), queue.claim(1)  # one generate call's jobs: the first is being scored
    release = threading.Event()
    thread = hanging_reward(stuck.job_id, threading.Event(), release)
    try:
        JobDeadline(queue, 5, max_attempts=2, events=EventLog.off(), device=1, version=lambda: 3).expire(
            [stuck, other])
    finally:
        release.set()
        thread.join()
    assert exits == [EXIT_JOB_DEADLINE]
    assert in_queue(run) == ["000001_000_pending_a2.pt", "000001_001_pending.pt"]
    [error] = fileops.load_payload(run.queue / "000001_000_pending_a2.pt")["errors"]
    assert error["type"] == "JobTimeout" and error["reward_function"] == "hangs" and error["stage"] == "scoring"
    assert "ran past its deadline (--job_timeout_s 5: held" in error["message"]
    assert error["message"].endswith("stuck in reward function 'hangs'")
    assert "in scoring" in error["traceback"]  # the stuck thread's stack
    assert "errors" not in fileops.load_payload(run.queue / "000001_001_pending.pt")
    assert queue.held() == []


def test_on_its_last_attempt_the_job_is_reported_failed(queue, run, exits):
    queue.put_job("000001_000", {"rows": []}, created_step=1)
    job = queue.claim(1)
    JobDeadline(queue, 5, max_attempts=1, events=EventLog.off(), device=1).expire([job])
    assert exits == [EXIT_JOB_DEADLINE]
    [result] = in_queue(run)
    assert result.startswith("000001_000_complete")
    [error] = fileops.load_payload(run.queue / result)["data"]["errors"]
    assert error["type"] == "JobTimeout" and error["message"].endswith("stuck in unknown work")


def test_a_job_that_ended_as_the_deadline_came_is_left_alone(queue, run, exits):
    queue.put_job("000001_000", {"rows": []}, created_step=1)
    job = queue.claim(1)
    assert queue.complete(job, {}, weights_version=0)
    JobDeadline(queue, 5, max_attempts=2, events=EventLog.off(), device=1).expire([job])
    assert exits == []
    assert in_queue(run) == ["000001_000_complete_from_dev1.pt"]


def test_the_watch_fails_a_job_held_past_the_deadline_by_itself(queue, run, exits):
    queue.put_job("000001_000", {"rows": []}, created_step=1)
    job = queue.claim(1)
    job.claimed_mono -= 10  # claimed 10 s ago
    watch = JobDeadline(queue, 5, max_attempts=2, events=EventLog.off(), device=1).start()
    try:
        wait_for(lambda: exits, "the watch to act", timeout=30)
    finally:
        watch.stop()
    assert exits[0] == EXIT_JOB_DEADLINE and in_queue(run) == ["000001_000_pending_a2.pt"]


def test_no_deadline_no_watch(queue):
    assert JobDeadline(queue, 0, max_attempts=2, events=EventLog.off(), device=1).start()._thread is None


def test_a_worker_asked_to_stop_and_kept_from_it_by_a_stuck_job_ends_as_stopped(queue, run, exits, caplog):
    """SIGTERM came while a reward function never returns: at the deadline the job fails as any attempt, and the
    worker marks itself stopped (its heartbeat's state), not dead, before it exits, and does not ask for a
    restart."""
    queue.put_job("000001_000", {"rows": []}, created_step=1)
    job = queue.claim(1)
    stopped = []
    JobDeadline(queue, 5, max_attempts=2, events=EventLog.off(), device=1, stopping=lambda: True,
                stopped=lambda: stopped.append(True)).expire([job])
    assert exits == [EXIT_JOB_DEADLINE] and stopped == [True]
    assert in_queue(run) == ["000001_000_pending_a2.pt"]
    assert "dev1 exits (status 4), as it was asked to: a job ran past --job_timeout_s 5" in caplog.text


def test_a_job_past_its_deadline_is_described_by_where_it_was_stuck():
    from asyncgrpo.jobqueue import describe_error

    message = "the job ran past its deadline (--job_timeout_s 30: held 31 s), stuck in reward function 'score'"
    assert describe_error({"type": "JobTimeout", "message": message, "reward_function": "score"}) == message
    assert describe_error({"type": "ValueError", "message": "bad", "reward_function": "score"}) == (
        "reward function 'score' raised ValueError: bad")


def test_the_job_being_scored_is_failed_though_its_call_partner_came_first(queue, run, exits):
    """Two jobs of one generate call: the first claimed is overdue a moment before the second, whose reward function
    hangs. The second is failed, the first goes back as it was."""
    queue.put_job("000001_000", {"rows": []}, created_step=1)
    queue.put_job("000001_001", {"rows": []}, created_step=1)
    first, stuck = queue.claim(1), queue.claim(1)
    release = threading.Event()
    thread = hanging_reward(stuck.job_id, threading.Event(), release)
    try:
        JobDeadline(queue, 5, max_attempts=2, events=EventLog.off(), device=1).expire([first])  # only it overdue
    finally:
        release.set()
        thread.join()
    assert exits == [EXIT_JOB_DEADLINE]
    assert in_queue(run) == ["000001_000_pending.pt", "000001_001_pending_a2.pt"]


def test_of_two_threads_ending_one_job_one_does(queue, run):
    """The deadline fails a job as the worker's main thread publishes it: the second to come is told it lost."""
    queue.put_job("000001_000", {"rows": []}, created_step=1)
    job = queue.claim(1)
    assert queue.fail(job, {"type": "JobTimeout"}, max_attempts=2, weights_version=0)
    assert not queue.complete(job, {}, weights_version=0)
    assert not queue.release(job)
    assert in_queue(run) == ["000001_000_pending_a2.pt"]


def test_a_worker_about_to_exit_claims_no_more(queue, run):
    queue.put_job("000001_000", {"rows": []}, created_step=1)
    queue.put_job("000001_001", {"rows": []}, created_step=1)
    held = queue.claim(1)
    assert queue.close_claims() == [held]
    assert queue.claim(1) is None
    assert in_queue(run) == ["000001_000_processing_by_dev1.pt", "000001_001_pending.pt"]


def test_a_failure_that_cannot_be_written_still_ends_in_the_exit_with_the_job_given_back(queue, run, exits,
                                                                                     monkeypatch):
    from asyncgrpo.run import QueueWriteError
    from asyncgrpo.run import fileops as run_fileops

    queue.put_job("000001_000", {"rows": []}, created_step=1)
    job = queue.claim(1)

    def disk_full(*args, **kwargs):
        raise QueueWriteError("no space left on the disk")

    monkeypatch.setattr(run_fileops, "stage_bytes", disk_full)
    JobDeadline(queue, 5, max_attempts=2, events=EventLog.off(), device=1).expire([job])
    assert exits == [EXIT_JOB_DEADLINE]
    assert in_queue(run) == ["000001_000_pending.pt"]  # given back as it was
