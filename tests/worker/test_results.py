"""A failed job's lines in the worker's log (worker/results.py fail): one a failure, the traceback with the first of
its kind only, and the [jobs] line launch.sh shows, said once and then counted (asyncgrpo/messages.py)."""

from __future__ import annotations

import logging
from types import SimpleNamespace

from asyncgrpo.events import EventLog
from asyncgrpo.messages import RepeatedFailureLog
from worker import results


def raised(message: str) -> Exception:
    try:
        raise RuntimeError(message)
    except RuntimeError as err:
        return err


def test_a_failed_jobs_traceback_is_logged_with_the_first_failure_of_its_kind_only(queue, monkeypatch, caplog):
    monkeypatch.setattr(results, "JOB_FAILURES", RepeatedFailureLog(results.log, "jobs", every_s=3600))
    cfg = SimpleNamespace(max_attempts=1)  # reported failed at once: claimed no more
    for i, message in enumerate(["the reward server is down", "the reward server is down", "the disk is gone"]):
        queue.put_job(f"000001_00{i}", {"rows": []}, created_step=1)
        results.fail(cfg, queue, queue.claim(1), raised(message), 0, EventLog.off())
    failed = [r.getMessage() for r in caplog.records if r.levelno == logging.ERROR and "[gen]" in r.getMessage()]
    assert [line.splitlines()[0] for line in failed] == [
        f"[gen] dev1 job=000001_00{i} attempt 1/1 failed: scoring raised RuntimeError: {message}; reported to the "
        "PS as failed" for i, message in enumerate(["the reward server is down", "the reward server is down",
                                                 "the disk is gone"])]
    assert ["Traceback" in line for line in failed] == [True, False, True]
    first = [r.getMessage() for r in caplog.records if "(the first such failure" in r.getMessage()]
    assert [line.split(" (")[0] for line in first] == [
        "[jobs] a job failed: scoring raised RuntimeError: the reward server is down",
        "[jobs] a job failed: scoring raised RuntimeError: the disk is gone"]

