"""A job whose generation or scoring raises: thrown again with its error (attempt + 1), then reported to
the PS, which archives it `failed` with its errors, counts its prompts as dropped, and stops the run
only when the failures are systematic (jobs in a row, in job order). What a worker's TRL trainer tells
about the error (which reward function), and the completions-table rows a result carries.

The same through real processes: tests/e2e/test_failures_e2e.py."""

import contextlib
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from helpers import demo_config
from processes.reward_faults import always_raises, one_reward_too_few

from asyncgrpo.events import EventLog
from asyncgrpo.jobqueue import JobState, QueueName, describe_error
from asyncgrpo.jobqueue.handoff import ResultData, read_result_payload
from asyncgrpo.run import fileops
from asyncgrpo.tasks.demo import build_dataset, build_model, build_tokenizer, repeat_digit_reward
from ps.failures import FailedJobs
from worker.generate import build_trainer, completion_logs, error_record, generate_and_score

ROWS = [{"prompt": "3:", "digit": 3}] * 4


def an_error(attempt: int, message="boom") -> dict:
    return {"type": "ValueError", "message": message, "stage": "scoring", "reward_function": "my_reward",
            "traceback": "Traceback ...", "time": 0.0, "attempt": attempt, "worker_device": 1, "weights_version": 0}


def queue_files(run) -> list[str]:
    return sorted(p.name for p in run.queue.iterdir() if p.name != ".tmp")


def done_files(run) -> list[str]:
    return sorted(p.name for p in run.done.iterdir())


def failed_jobs(queue, stopped: list, limit=3) -> FailedJobs:
    cfg = SimpleNamespace(generation_batch_size=4, num_generations=2, max_failed_in_a_row=limit)
    return FailedJobs(cfg, queue, stopped.append)


# ---------------------------------------------------------------- the queue: retry, then a failure report


def test_a_failing_job_is_thrown_again_with_its_errors_then_reported_and_archived_failed(queue, run):
    queue.put_job("000001_000", {"rows": ROWS, "min_weights_version": 0}, created_step=1)
    for attempt in (1, 2):
        job = queue.claim(device=1)
        assert job.attempt == attempt and job.payload.get("errors", []) == [an_error(a) for a in range(1, attempt)]
        assert queue.fail(job, an_error(attempt), max_attempts=3, weights_version=0)
        assert queue_files(run) == [f"000001_000_pending_a{attempt + 1}.pt"]  # its prompts kept, attempt + 1
    assert done_files(run) == ["000001_000_retried.pt", "000001_000_retried_a2.pt"]
    job = queue.claim(device=2)
    assert queue.fail(job, an_error(3, "boom at last"), max_attempts=3, weights_version=5)
    # The last attempt goes to the PS as a failure report, through the result's fenced path.
    assert queue_files(run) == ["000001_000_complete_from_dev2.pt"]
    [report] = queue.collect(lambda payload: read_result_payload(payload, rows_per_job=4))
    assert report.data.job["rows"] == ROWS and report.attempt == 3

    stopped = []
    failed = failed_jobs(queue, stopped)
    failed.record(report)
    assert queue_files(run) == [] and stopped == []
    assert "000001_000_failed_a3.pt" in done_files(run)
    archived = fileops.load_payload(run.done / "000001_000_failed_a3.pt")
    assert [e["message"] for e in archived["data"]["errors"]] == ["boom", "boom", "boom at last"]
    assert (failed.jobs, failed.prompts) == (1, 2)  # 4 rows of 2 generations each
    assert failed.last_error == "reward function 'my_reward' raised ValueError: boom at last"


def test_a_failure_after_the_job_was_recovered_from_the_worker_is_dropped(queue, run):
    queue.put_job("000001_000", {"rows": ROWS}, created_step=1)
    job = queue.claim(device=1)
    queue.recover(lease_s=30)  # dev1 holds no lock: its job goes back to pending as attempt 2
    assert queue_files(run) == ["000001_000_pending_a2.pt"]
    assert not queue.fail(job, an_error(1), max_attempts=3, weights_version=0)
    assert queue_files(run) == ["000001_000_pending_a2.pt"] and not list(run.tmp.iterdir())


def test_recovery_does_not_throw_again_a_job_its_dead_worker_already_threw_again(queue, run):
    """The worker died between publishing attempt 2 and archiving its fenced attempt-1 file."""
    queue.put_job("000001_000", {"rows": ROWS}, created_step=1)
    job = queue.claim(device=1)
    fence = job.name.moved_to(JobState.COMMITTING, 1)
    fileops.move(job.path, queue.path(fence))
    queue.put_job("000001_000", {"rows": ROWS}, created_step=1)  # stands for the published attempt 2 ...
    fileops.move(queue.path(QueueName("000001_000")), queue.path(QueueName("000001_000", attempt=2)))
    [action] = queue.recover(lease_s=30)
    assert action.dst == "done/000001_000_duplicate.pt" and "attempt 2 is in the queue" in action.why
    assert queue_files(run) == ["000001_000_pending_a2.pt"]


def test_a_failure_report_must_hold_its_errors_and_the_job_rows():
    good = {"weights_version": 0, "data": {"errors": [an_error(3)], "job": {"rows": ROWS}}}
    read_result_payload(good, rows_per_job=4)
    for data in ({"errors": [], "job": {"rows": ROWS}}, {"errors": ["boom"], "job": {"rows": ROWS}},
                 {"errors": [an_error(3)]}, {"errors": [an_error(3)], "job": {}}):
        with pytest.raises(ValueError):
            read_result_payload({"weights_version": 0, "data": data}, rows_per_job=4)


# ---------------------------------------------------------------- the PS: dropped, or systematic


def report_for(queue, job_id: str, message="boom"):
    """A collected failure report for ``job_id`` (its three attempts failed with ``message``)."""
    queue.put_job(job_id, {"rows": ROWS}, created_step=int(job_id[:6]))
    for attempt in (1, 2, 3):
        queue.fail(queue.claim(device=1), an_error(attempt, message), max_attempts=3, weights_version=0)
    [report] = queue.collect(lambda payload: read_result_payload(payload, rows_per_job=4))
    return report


def test_failures_that_bunch_up_in_arrival_order_do_not_stop_the_run(queue):
    """Failing jobs arrive after their retries, so late and together; in job order good ones lie between."""
    stopped = []
    failed = failed_jobs(queue, stopped, limit=3)
    failed.result_arrived("000001_001")
    failed.result_arrived("000001_003")
    for job_id in ("000001_000", "000001_002", "000001_004"):
        failed.record(report_for(queue, job_id))
    assert stopped == [] and failed.jobs == 3 and failed.since_result == 3


def test_jobs_failing_in_a_row_stop_the_run_once_naming_the_error(queue):
    stopped = []
    failed = failed_jobs(queue, stopped, limit=3)
    (queue.run.logs / "log_worker_1.txt").write_text("Traceback ...\n")  # (launch.sh's log of worker 1)
    failed.result_arrived("000001_000")
    failed.record(report_for(queue, "000001_002"))
    failed.record(report_for(queue, "000001_003"))
    failed.result_arrived("000001_004")  # arrives between them, but comes after them in job order
    assert stopped == []
    failed.record(report_for(queue, "000001_001", message="the server is down"))  # 001, 002, 003 in a row
    failed.record(report_for(queue, "000001_005"))
    [reason] = stopped
    assert reason.startswith("3 jobs in a row failed on all 3 attempt(s), none produced a result: reward function "
                             f"'my_reward' raised ValueError: the server is down (traceback in "
                             f"{queue.run.logs / 'log_worker_1.txt'} and ")  # (a text first: the file is a pickle)
    assert reason.endswith("000001_001_failed_a3.pt)")


def test_never_stops_with_max_failed_in_a_row_0(queue):
    stopped = []
    failed = failed_jobs(queue, stopped, limit=0)
    for i in range(4):
        failed.record(report_for(queue, f"000001_00{i}"))
    assert stopped == [] and failed.jobs == 4


def test_describe_error_is_one_line():
    assert describe_error({"type": "KeyError", "message": "'x'\nmore", "reward_function": None,
                           "stage": "generation"}) == "generation raised KeyError: 'x' ..."


# ---------------------------------------------------------------- what a worker's TRL trainer tells


@pytest.fixture(scope="module")
def worker_trainer(tmp_path_factory):
    cfg = demo_config(tmp_path_factory.mktemp("worker"))
    tokenizer = build_tokenizer()
    dataset = build_dataset(n=40)
    trainer = build_trainer(cfg, build_model(seed=0, tokenizer=tokenizer), tokenizer, [repeat_digit_reward], dataset)
    rows = [dataset[i // cfg.num_generations] for i in range(cfg.generation_batch_size)]
    return trainer, rows


@contextlib.contextmanager
def scoring_with(trainer, reward):
    """The trainer scores with ``reward`` instead of the demo reward inside the block (TRL keeps functions and
    their names side by side)."""
    trainer.reward_funcs, trainer.reward_func_names = [reward], [reward.__name__]
    try:
        yield
    finally:
        trainer.reward_funcs, trainer.reward_func_names = [repeat_digit_reward], [repeat_digit_reward.__name__]


def error_of(trainer, rows) -> dict:
    with pytest.raises(Exception) as raised:
        generate_and_score(trainer, rows, EventLog.off(), seed=0)
    return error_record(raised.value)


def test_the_error_names_the_reward_function_that_raised(worker_trainer):
    trainer, rows = worker_trainer
    with scoring_with(trainer, always_raises):
        error = error_of(trainer, rows)
    assert (error["type"], error["message"], error["stage"]) == ("RuntimeError", "the reward server is down", "scoring")
    assert error["reward_function"] == "always_raises" and "in always_raises" in error["traceback"]


def test_the_error_names_the_reward_function_that_returned_too_few_rewards(worker_trainer):
    trainer, rows = worker_trainer
    with scoring_with(trainer, one_reward_too_few):
        error = error_of(trainer, rows)
    assert (error["type"], error["reward_function"]) == ("ValueError", "one_reward_too_few")
    assert error["message"].startswith("The reward function 'one_reward_too_few' returned 31 rewards, but 32")


def test_an_error_in_generation_names_no_reward_function(worker_trainer, monkeypatch):
    trainer, rows = worker_trainer

    def broken_generate(*args, **kwargs):
        raise torch.OutOfMemoryError("out of memory")

    monkeypatch.setattr(trainer.model, "generate", broken_generate)
    error = error_of(trainer, rows)
    assert (error["type"], error["stage"], error["reward_function"]) == ("OutOfMemoryError", "generation", None)


def reward_logging_extra_columns(prompts, completions, log_extra, **kwargs):
    """The demo reward, logging an extra column of numpy values (a result is loaded with weights_only=True)."""
    log_extra("length", [np.int64(len(c)) for c in completions])
    return repeat_digit_reward(prompts, completions)


def test_a_result_carries_the_rows_of_trls_completions_table(worker_trainer, run):
    trainer, rows = worker_trainer
    with scoring_with(trainer, reward_logging_extra_columns):
        for seed in (0, 1):  # the second job's rows only: the table is emptied before each job
            batch, _ = generate_and_score(trainer, rows, EventLog.off(), seed=seed)
            logs = completion_logs(trainer)
    assert logs["prompt"] == [row["prompt"] for row in rows]
    assert len(logs["completion"]) == len(rows) and all(isinstance(c, str) for c in logs["completion"])
    assert list(logs["rewards"]) == ["reward_logging_extra_columns"]
    assert len(logs["rewards"]["reward_logging_extra_columns"]) == len(rows)
    assert logs["advantages"] == pytest.approx(batch["advantages"].tolist())
    assert logs["extra"] == {"length": [len(c) for c in logs["completion"]]}
    fileops.write_payload(run.tmp, run.root / "logs.pt", {"logs": logs})
    assert fileops.load_payload(run.root / "logs.pt")["logs"] == logs  # as the PS loads a result


def test_a_result_whose_oldest_token_is_not_its_weights_version_is_refused():
    """With in-flight updates a result's weights_version is its oldest token's: the staleness bound goes by it."""
    rows = 4
    batch = {"advantages": torch.zeros(rows), "prompt_ids": torch.ones(rows, 2, dtype=torch.long),
             "prompt_mask": torch.ones(rows, 2, dtype=torch.long),
             "completion_ids": torch.ones(rows, 3, dtype=torch.long),
             "completion_mask": torch.ones(rows, 3)}
    # Rows join at different steps: the oldest token is the first of the row that started first.
    versions = [[(0, 6)], [(0, 5), (2, 6)], [(0, 6), (1, 7)], [(0, 7)]]
    data = ResultData(batch, None, {}, ROWS, token_versions=versions).to_dict()
    read_result_payload({"weights_version": 5, "data": data}, rows_per_job=rows)
    for version in (4, 6):
        with pytest.raises(ValueError, match=f"token_versions start at version 5, the result's weights_version is "
                                             f"{version}"):
            read_result_payload({"weights_version": version, "data": ResultData(
                batch, None, {}, ROWS, token_versions=versions).to_dict()}, rows)
