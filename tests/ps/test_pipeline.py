"""The PS's job pipeline (ps/pipeline.py), in process, over a real run directory and real threads:
failures reach the trainer, the producer's journal (no id reused, no rows lost), the staleness
filter and re-throw, admission control, consumption order, synchronous mode.

A "worker" here is the test itself: it claims and completes jobs with the real queue calls.
Every wait is bounded; nothing sleeps and hopes.
"""

import contextlib
import functools
import os
import threading

import helpers
import pytest
import torch
from helpers import PYTHON, inject_disk_full
from helpers.pipelines import ROWS, make_pipeline

import ps.pipeline as pipeline_module
from asyncgrpo.config_parser import parse_config
from asyncgrpo.jobqueue import ArchiveReason, JobQueue, JobState
from asyncgrpo.run import fileops
from asyncgrpo.run.rundir import PSStatus
from ps.pipeline import PipelineError, StopRequested

WAIT_S = 10.0
wait_for = functools.partial(helpers.wait_for, timeout=WAIT_S, poll_s=0.01)  # wait_for(condition, what)


@pytest.fixture
def start(run):
    """``start(**flags)``: a pipeline over ``run`` with these flags, started from ``state`` (None: a fresh run) at
    ``published_version``, once ``until_pending`` jobs are pending when given. Stopped when the test ends."""
    pipelines = []

    def start_pipeline(state=None, published_version=0, until_pending=None, **overrides):
        pipeline = make_pipeline(run, **overrides)
        pipelines.append(pipeline)
        pipeline.start(state, published_version=published_version)
        if until_pending is not None:
            wait_for(lambda: pending(pipeline.queue) == until_pending, f"{until_pending} pending job(s)")
        return pipeline

    yield start_pipeline
    for pipeline in pipelines:
        pipeline.stop()


def batch(rows=ROWS, completion=3):
    return {"advantages": torch.zeros(rows), "prompt_ids": torch.ones(rows, 2, dtype=torch.long),
            "prompt_mask": torch.ones(rows, 2, dtype=torch.long),
            "completion_ids": torch.ones(rows, completion, dtype=torch.long),
            "completion_mask": torch.ones(rows, completion, dtype=torch.long),
            "old_per_token_logps": torch.zeros(rows, completion)}


def work_one(queue, version, device=1):
    """Claims the oldest pending job and completes it as generated with ``version``."""
    job = queue.claim(device)
    assert job is not None, queue.counts()
    assert queue.complete(job, {"batch": batch(), "metrics": {}, "rows": job.data["rows"]}, weights_version=version)
    return job


def pending(queue):
    return queue.counts()[JobState.PENDING.value]


def take(pipeline, step):
    """next_batch for a batch of one result: (that result's part, its staleness when taken)."""
    [part] = pipeline.next_batch(step).in_training.parts
    return part, step - part.weights_version


def next_batch_in_thread(pipeline, step):
    """next_batch on a thread: (thread, outcome dict) so a hang fails the test instead of hanging it."""
    outcome = {}

    def call():
        try:
            outcome["result"] = pipeline.next_batch(step)
        except BaseException as err:  # noqa: BLE001 - the test inspects it
            outcome["error"] = err

    thread = threading.Thread(target=call, daemon=True)
    thread.start()
    return thread, outcome


# --------------------------------------------------------------------------- failures reach the trainer


@pytest.mark.parametrize("where", ["write", "fsync"])
def test_a_full_disk_in_the_producer_stops_training_with_that_error(run, start, monkeypatch, where):
    inject_disk_full(monkeypatch, run, where)
    pipeline = start()
    thread, outcome = next_batch_in_thread(pipeline, step=0)
    thread.join(WAIT_S)
    assert not thread.is_alive(), "the trainer kept waiting after the producer died"
    err = outcome["error"]
    assert isinstance(err, PipelineError) and "job producer" in str(err) and "No space left" in str(err)
    pipeline.stop()
    assert os.listdir(run.queue) == [".tmp"]  # nothing half-written under a final name


def test_a_trainer_waiting_for_results_says_so_with_the_queue_as_the_train_lines_show_it(run, start, monkeypatch,
                                                                                         caplog):
    monkeypatch.setattr(pipeline_module, "TRAINER_WAIT_REPORT_S", 0.2)
    monkeypatch.setattr(pipeline_module, "TRAINER_WAIT_POLL_S", 0.02)
    pipeline = start(until_pending=2, max_pending=2)
    waits = []
    pipeline.while_waiting = waits.append  # (the trainer's: its last version again as an anchor, when asked or long)
    with caplog.at_level("WARNING", logger="asyncgrpo.ps"):
        thread, outcome = next_batch_in_thread(pipeline, step=0)
        wait_for(lambda: any("has waited" in r.getMessage() for r in caplog.records) and True in waits,
                 "a waiting line")
        work_one(pipeline.queue, version=0)
        thread.join(WAIT_S)
    assert not thread.is_alive() and "result" in outcome, outcome
    pipeline.stop()
    line = next(r.getMessage() for r in caplog.records if "has waited" in r.getMessage())
    # Between the lines, the hook is called too (a worker may have asked for an anchor).
    assert waits.index(True) > 0 and False in waits
    # The step that waits: the first (the trainer has trained none).
    assert line == ("[train] step=1 has waited 0s for a result; queue=pending:2 processing:0 complete:0 (what each "
                    f"worker holds: queue_tools ls {run.root})")


def test_a_crash_in_the_collector_stops_training_with_that_error(run, monkeypatch):
    pipeline = make_pipeline(run)

    def broken_recover(**kwargs):
        raise RuntimeError("recovery broke")

    monkeypatch.setattr(pipeline.queue, "recover", broken_recover)
    pipeline.start(None, published_version=0)
    try:
        thread, outcome = next_batch_in_thread(pipeline, step=0)
        thread.join(WAIT_S)
        assert not thread.is_alive()
        assert "result collector stopped: RuntimeError: recovery broke" in str(outcome["error"])
    finally:
        pipeline.stop()


def test_a_stop_request_ends_the_wait_for_a_result_and_leaves_the_results_for_the_next_start(run, start):
    pipeline = start(until_pending=2, max_pending=2)
    work_one(pipeline.queue, version=0)
    assert take(pipeline, step=0)[0].job_id == "000000_000"
    pipeline.on_step_end(1)
    picked = threading.Event()  # set once the trainer looks into the cache: it is past next_batch's first check
    pick = pipeline.pick
    pipeline.pick = lambda cached: (picked.set(), pick(cached))[1]
    thread, outcome = next_batch_in_thread(pipeline, step=1)  # no result: it waits
    assert picked.wait(WAIT_S)
    pipeline.stop_at_boundary.set()
    thread.join(WAIT_S)
    assert not thread.is_alive(), "the trainer kept waiting after the stop request"
    assert isinstance(outcome.get("error"), StopRequested), outcome
    assert pipeline.in_training is None and pipeline.state_dict()["consumed"] == ["000000_000"]
    work_one(pipeline.queue, version=1)  # a result that comes now is not taken: the next start trains it
    with pytest.raises(StopRequested):
        pipeline.next_batch(1)
    assert pipeline.state_dict()["consumed"] == ["000000_000"] and not list(run.done.glob("000000_001*consumed*"))


def fail_one(queue, message="boom", device=1):
    """Claims the oldest pending job (a fresh scan) and fails it as a worker does when its reward function raises."""
    queue = JobQueue(queue.run)  # a claim tries the candidates of its last scan first
    job = queue.claim(device)
    assert job is not None, queue.counts()
    error = {"type": "ValueError", "message": message, "reward_function": "my_reward", "stage": "scoring"}
    assert queue.fail(job, error, max_attempts=2, weights_version=0)
    return job


def test_jobs_failing_in_a_row_stop_the_waiting_trainer_with_their_error(run, start):
    pipeline = start(until_pending=2, max_attempts=2, max_failed_in_a_row=2, max_pending=2)
    thread, outcome = next_batch_in_thread(pipeline, step=0)
    for _ in range(4):  # two jobs, two attempts each: the oldest first, thrown-again attempts included
        fail_one(pipeline.queue, message="the server is down")
    thread.join(WAIT_S)  # well before the trainer's 30 s wait report
    assert not thread.is_alive(), "the trainer kept waiting while every job failed"
    err = outcome["error"]
    assert isinstance(err, PipelineError) and str(err).startswith(
        "2 jobs in a row failed on all 2 attempt(s), none produced a result: reward function 'my_reward' raised "
        "ValueError: the server is down")
    pipeline.stop()
    assert sorted(p.name for p in run.done.glob("*_failed_a2.pt")) == ["000000_000_failed_a2.pt",
                                                                        "000000_001_failed_a2.pt"]


def test_a_job_that_fails_on_every_attempt_is_dropped_and_training_goes_on(run, start):
    pipeline = start(until_pending=2, max_attempts=2, max_pending=2)
    failing = fail_one(pipeline.queue)  # attempt 1: thrown again, ahead of the newer job
    assert fail_one(pipeline.queue).job_id == failing.job_id  # attempt 2: reported, dropped
    good = work_one(pipeline.queue, version=0)
    result, _ = take(pipeline, 0)
    assert result.job_id == good.job_id
    wait_for(lambda: os.path.exists(run.done / f"{failing.job_id}_failed_a2.pt"), "the failed job archived")
    assert (pipeline.failed.jobs, pipeline.failed.prompts) == (1, 2)  # 4 rows, 2 generations each
    assert pipeline.producer.owed == []  # its prompts are dropped, not thrown again


@pytest.mark.parametrize("version", ["3", 2.5, None, -1, True])
def test_a_result_whose_weights_version_is_not_an_integer_is_rejected_not_fatal(run, start, version):
    pipeline = start(until_pending=2, max_pending=2)
    job = pipeline.queue.claim(1)
    assert pipeline.queue.complete(job, {"batch": batch(), "metrics": {}, "rows": job.data["rows"]},
                                   weights_version=version)
    good = work_one(pipeline.queue, version=0, device=2)
    result, staleness = take(pipeline, 0)
    assert (result.job_id, staleness) == (good.job_id, 0)
    assert os.path.exists(run.done / f"{job.job_id}_failed_load.pt")


# --------------------------------------------------------------------------- end of training


def test_finish_archives_what_is_left_unused_and_a_failure_report_failed(run, start):
    pipeline = start(until_pending=3, max_pending=3, max_attempts=2)
    cached = work_one(pipeline.queue, version=0)
    wait_for(lambda: len(pipeline.cache) == 1, "the result cached")
    pipeline.stop()  # from here only finish collects: what comes now is finish's to judge
    failing = fail_one(pipeline.queue)  # attempt 1: thrown again
    assert fail_one(pipeline.queue).job_id == failing.job_id  # attempt 2: a failure report for the PS
    late = work_one(pipeline.queue, version=0)
    pipeline.finish()
    assert os.listdir(run.queue) == [".tmp"]
    done = {p.name for p in run.done.iterdir()}
    assert {f"{cached.job_id}_unused.pt", f"{late.job_id}_unused.pt", f"{failing.job_id}_failed_a2.pt"} <= done
    assert not [name for name in done if name.endswith("_consumed.pt")]
    assert pipeline.failed.jobs == 1


# --------------------------------------------------------------------------- the producer's journal


def thrown_jobs(queue):
    return {n.job_id: fileops.load_payload(queue.path(n))["data"]["rows"]
            for n in queue.scan()[0] if n.state is JobState.PENDING}


@pytest.mark.parametrize("prompt_chars", [4, 20_000], ids=["short", "journal_over_64KiB"])
def test_a_job_id_reserved_before_a_crash_is_not_reused_and_its_rows_are_thrown_again(run, start, prompt_chars):
    """The old PS wrote its journal for job 000000_001 and died before the job file existed. Realistic prompts make
    the journal (whole batches of rows) far larger than a status file: it is read whole."""
    lost_rows = [{"prompt": "lost"[:prompt_chars] + "x" * (prompt_chars - 4)}] * ROWS
    fileops.write_json(run.root / "producer.json", {"batches_drawn": 2, "last_job_id": "000000_001",
                                                    "last_rows": lost_rows, "owed": []})
    pipeline = start(until_pending=1, max_pending=1, max_staleness=0)
    pipeline.stop()
    assert thrown_jobs(pipeline.queue) == {"000000_002": lost_rows}


def test_a_job_written_before_a_crash_keeps_its_id_and_is_not_thrown_twice(run, start):
    """The old PS died right after the job file appeared: the journal already names it."""
    queue = JobQueue(run)
    rows = [{"prompt": "kept"}] * ROWS
    fileops.write_json(run.root / "producer.json", {"batches_drawn": 1, "last_job_id": "000000_000",
                                                    "last_rows": rows, "owed": []})
    queue.put_job("000000_000", {"rows": rows, "min_weights_version": 0}, created_step=0)
    pipeline = start(until_pending=2, max_pending=2, max_staleness=8)
    pipeline.stop()
    jobs = thrown_jobs(queue)
    assert sorted(jobs) == ["000000_000", "000000_001"]
    assert jobs["000000_001"] != rows  # the next batch of the dataset, not the same rows again


def test_a_lost_journal_never_reuses_an_id_still_in_the_queue(run, start):
    queue = JobQueue(run)
    queue.put_job("000007_003", {"rows": [], "min_weights_version": 0}, created_step=7)
    pipeline = start(until_pending=2, max_pending=2)
    pipeline.stop()
    assert sorted(thrown_jobs(queue)) == ["000007_003", "000007_004"]


# --------------------------------------------------------------------------- staleness and re-throw


def a_result_archived_stale(run, start, **flags):
    """A result 2 steps stale (max_staleness 1) taken by next_batch (on a thread), archived stale and its rows thrown
    again: the pipeline, the stale job, and next_batch's thread and outcome (it waits for another result)."""
    pipeline = start(state={"consumed": [f"00000{i}_000" for i in range(3)]}, published_version=3,  # taken 3
                     until_pending=1, max_pending=1, max_outstanding=1, max_staleness=1, **flags)
    stale = work_one(pipeline.queue, version=1)  # 3 - 1 = 2 steps stale at step 3
    thread, outcome = next_batch_in_thread(pipeline, step=3)
    wait_for(lambda: os.path.exists(run.done / f"{stale.job_id}_stale.pt"), "the stale archive")
    wait_for(lambda: pending(pipeline.queue) == 1, "the re-thrown job")
    return pipeline, stale, thread, outcome


def test_a_stale_result_is_archived_and_its_rows_are_thrown_again(run, start):
    pipeline, stale, thread, outcome = a_result_archived_stale(run, start)
    rethrown = pipeline.queue.claim(1)
    assert rethrown.data["rows"] == stale.data["rows"] and rethrown.job_id > stale.job_id
    assert pipeline.queue.complete(rethrown, {"batch": batch(), "metrics": {}, "rows": rethrown.data["rows"]},
                                   weights_version=3)
    thread.join(WAIT_S)
    [part] = outcome["result"].in_training.parts
    assert part.job_id == rethrown.job_id and part.weights_version == 3


def taken_once_done(pipeline, thread, outcome, version):
    """Completes the next pending job; the job, once the waiting next_batch (next_batch_in_thread) took its result."""
    job = pipeline.queue.claim(1)
    assert pipeline.queue.complete(job, {"batch": batch(), "metrics": {}, "rows": job.data["rows"]},
                                   weights_version=version)
    thread.join(WAIT_S)
    assert outcome["result"].in_training.parts[0].job_id == job.job_id
    return job


def test_a_stale_results_rows_go_out_again_only_once_the_result_has_left_the_queue(run, start, monkeypatch):
    """Had a job taken a stale result's rows while the result was still in the queue, a PS killed right then would
    find the result at its restart, judge it again and train its prompts twice. While the result is being archived,
    a worker claims the pending job (room for one more) and the producer is given a second to throw: it must not
    throw those rows yet."""
    pipeline = start(state={"consumed": [f"{i:06d}_000" for i in range(10)]}, published_version=10,  # taken 10
                     until_pending=1, max_pending=1, max_outstanding=10, max_staleness=5,
                     lease_s=3600)  # (the test's claims have no heartbeat: recovery must not take them back)
    stale = work_one(pipeline.queue, version=1)  # 10 - 1 = 9 steps stale at step 10
    wait_for(lambda: pending(pipeline.queue) == 1, "the next job")
    archive, thrown_early = pipeline.queue.archive_if_present, []

    def its_rows_thrown():
        return [rows for rows in thrown_jobs(pipeline.queue).values() if rows == stale.data["rows"]]

    def archive_once_the_producer_had_its_chance(path, job_id, reason, attempt=1):
        if reason is ArchiveReason.STALE:
            assert pipeline.queue.claim(2) is not None
            with contextlib.suppress(AssertionError):  # (the wait timing out is the outcome hoped for)
                thrown_early.append(wait_for(its_rows_thrown, "a job of the stale result's rows", timeout=1.0))
        return archive(path, job_id, reason, attempt)

    monkeypatch.setattr(pipeline.queue, "archive_if_present", archive_once_the_producer_had_its_chance)
    thread, outcome = next_batch_in_thread(pipeline, step=10)
    wait_for(lambda: os.path.exists(run.done / f"{stale.job_id}_stale.pt"), "the stale archive")
    assert thrown_early == []
    wait_for(its_rows_thrown, "the stale result's rows thrown again")
    assert taken_once_done(pipeline, thread, outcome, version=10).data["rows"] == stale.data["rows"]


def test_a_second_result_of_a_job_archived_stale_is_a_duplicate_not_trained(run, start):
    """A job's result was archived stale and its rows thrown again; a second result of the same job comes later (its
    worker was silent past the lease, say, and its job generated twice). Trained, its prompts would train twice."""
    pipeline, stale, thread, outcome = a_result_archived_stale(run, start)
    fileops.write_payload(run.tmp, run.queue / f"{stale.job_id}_pending_a2.pt", stale.payload)
    second = pipeline.queue.claim(2)  # the oldest job first: the stale one's attempt 2, fresh
    assert (second.job_id, second.attempt) == (stale.job_id, 2)
    assert pipeline.queue.complete(second, {"batch": batch(), "metrics": {}, "rows": second.data["rows"]},
                                   weights_version=3)
    wait_for(lambda: os.path.exists(run.done / f"{stale.job_id}_duplicate_a2.pt"), "the second result archived")
    assert taken_once_done(pipeline, thread, outcome, version=3).job_id != stale.job_id


def test_a_late_result_of_a_job_archived_stale_past_a_lowered_max_attempts_is_a_duplicate(run, start):
    """An earlier PS of the run (--max_attempts 3) threw a job again up to attempt 3 and archived that attempt's
    result stale; relaunched with --max_attempts 2, the PS gets attempt 2's result late (its worker silent past the
    lease). The stale archive lies past this PS's attempts, not past the run's, which ps.json carries: trained, its
    prompts would train twice."""
    earlier = PSStatus.starting("model", None, {}, max_attempts=3)
    run.write_ps_status(PSStatus.starting("model", None, {}, max_attempts=2, previous=earlier))  # (as ps/__main__.py)
    pipeline, stale, thread, outcome = a_result_archived_stale(run, start, max_attempts=2)
    os.rename(run.done / f"{stale.job_id}_stale.pt", run.done / f"{stale.job_id}_stale_a3.pt")  # the earlier PS's
    fileops.write_payload(run.tmp, run.queue / f"{stale.job_id}_pending_a2.pt", stale.payload)
    late = pipeline.queue.claim(2)
    assert (late.job_id, late.attempt) == (stale.job_id, 2)
    assert pipeline.queue.complete(late, {"batch": batch(), "metrics": {}, "rows": late.data["rows"]},
                                   weights_version=3)
    wait_for(lambda: os.path.exists(run.done / f"{stale.job_id}_duplicate_a2.pt"), "the late result archived")
    assert taken_once_done(pipeline, thread, outcome, version=3).job_id != stale.job_id


def test_the_runs_most_attempts_outlive_a_lowered_max_attempts(run):
    """What the queue's most_attempts is set from: each PS's status keeps the largest --max_attempts of the run's
    PSs, through ps.json, whatever the PSs between them were given."""
    statuses = [None]
    for max_attempts in (5, 2, 3, 7):
        run.write_ps_status(PSStatus.starting("model", None, {}, max_attempts=max_attempts, previous=statuses[-1]))
        statuses.append(run.read_ps_status())
    assert [(s.max_attempts, s.most_attempts) for s in statuses[1:]] == [(5, 5), (2, 5), (3, 5), (7, 7)]
    older = PSStatus(pid=1, host="h", model="m", state="finished", started_at=0.0, max_attempts=4)  # (no most_attempts)
    assert PSStatus.starting("model", None, {}, max_attempts=2, previous=older).most_attempts == 4


def test_a_result_the_checkpoints_ledger_counts_is_a_duplicate_even_when_stale(run, start):
    """A result whose job the checkpoint's ledger counts as consumed (a result split across batches at the end of a
    run, relaunched with a larger --max_steps) is a duplicate, even past the staleness bound: archived stale, all its
    rows would be thrown again, and some of them have trained."""
    queue = JobQueue(run)
    queue.put_job("000000_500", {"rows": [{"prompt": "trained"}] * ROWS}, created_step=0)
    assert queue.complete(queue.claim(1), {"batch": batch(), "metrics": {}, "rows": [{"prompt": "trained"}] * ROWS},
                          weights_version=1)
    pipeline = start(state={"consumed": ["000000_500"]}, published_version=10, until_pending=1, max_pending=1,
                     max_outstanding=2, max_staleness=1)
    thread, outcome = next_batch_in_thread(pipeline, step=10)
    wait_for(lambda: os.path.exists(run.done / "000000_500_duplicate.pt"), "the result archived duplicate")
    assert not os.path.exists(run.done / "000000_500_stale.pt") and pipeline.producer.owed == []
    assert taken_once_done(pipeline, thread, outcome, version=10).job_id != "000000_500"


def test_a_result_is_as_stale_as_its_oldest_token(run, start):
    """With in-flight updates a result's later tokens come from newer weights; the bound goes by its oldest (its
    weights_version), so a result whose newest tokens are fresh is still archived stale, and admission is as it
    is without them (docs/design.md, "In-flight weight updates")."""
    pipeline = start(state={"consumed": [f"00000{i}_000" for i in range(3)]}, published_version=3,  # taken 3
                     until_pending=1, max_pending=1, max_outstanding=1, max_staleness=1)
    job = pipeline.queue.claim(1)
    # Tokens 0-1 sampled by version 1 (2 steps stale at step 3), tokens 2- by version 3 (fresh).
    assert pipeline.queue.complete(job, {"batch": batch(), "metrics": {}, "rows": job.data["rows"],
                                         "token_versions": [[[0, 1], [2, 3]]] * ROWS}, weights_version=1)
    thread, outcome = next_batch_in_thread(pipeline, step=3)
    wait_for(lambda: os.path.exists(run.done / f"{job.job_id}_stale.pt"), "the stale archive")
    rethrown = wait_for(lambda: pipeline.queue.claim(1), "the re-thrown job")
    assert pipeline.queue.complete(rethrown, {"batch": batch(), "metrics": {}, "rows": rethrown.data["rows"],
                                              "token_versions": [[[0, 3], [1, 4]]] * ROWS}, weights_version=3)
    thread.join(WAIT_S)
    [part] = outcome["result"].in_training.parts
    # Each row's 3 completion tokens: the first by version 3, the other two by version 4.
    assert part.job_id == rethrown.job_id and part.tokens_by_version == {3: ROWS, 4: 2 * ROWS}


def test_rows_owed_when_the_ps_died_go_out_first_unless_their_result_is_still_queued(run):
    """The journal owes the rows of two stale results; the archiving of one was cut short (its
    result is still collected in queue/, so it will be judged again): only the other is owed."""
    queue = JobQueue(run)
    fileops.write_payload(run.tmp, run.queue / "000002_000_collected.pt", {"not": "read here"})
    owed = [{"from_job": "000001_000", "rows": [{"prompt": "owed"}] * ROWS},
            {"from_job": "000002_000", "rows": [{"prompt": "still queued"}] * ROWS}]
    fileops.write_json(run.root / "producer.json", {"batches_drawn": 1, "last_job_id": "000002_000",
                                                    "last_rows": [], "owed": owed})
    pipeline = make_pipeline(run, max_pending=2, max_staleness=8)
    pipeline.producer.load_state(None)
    assert pipeline.producer.owed == owed[:1]
    pipeline.producer.throw()
    assert thrown_jobs(queue) == {"000002_001": owed[0]["rows"]}


def test_rows_owed_by_a_result_archived_stale_stay_owed_whatever_of_its_job_is_still_queued(run):
    """The PS died before throwing again the rows of two results it had archived stale. One job is queued again as
    attempt 2 (its worker was silent past the lease); the other's archive was cut short inside the move (the queued
    result and the archive are one file). Both queued files are duplicates now, so the rows must stay owed: dropped,
    they would never be trained."""
    queue = JobQueue(run)
    fileops.write_payload(run.tmp, run.queue / "000003_000_pending_a2.pt", {"not": "read here"})
    fileops.write_payload(run.tmp, run.done / "000003_000_stale.pt", {"not": "read here"})
    fileops.write_payload(run.tmp, run.queue / "000004_000_collected.pt", {"not": "read here"})
    os.link(run.queue / "000004_000_collected.pt", run.done / "000004_000_stale.pt")
    owed = [{"from_job": "000003_000", "rows": [{"prompt": "requeued"}] * ROWS},
            {"from_job": "000004_000", "rows": [{"prompt": "cut short"}] * ROWS}]
    fileops.write_json(run.root / "producer.json", {"batches_drawn": 1, "last_job_id": "000004_000",
                                                    "last_rows": [], "owed": owed})
    pipeline = make_pipeline(run, max_pending=2, max_staleness=8)
    pipeline.producer.load_state(None)
    assert pipeline.producer.owed == owed
    assert queue.counts()["pending"] == 1


def test_the_checkpointed_state_holds_the_ledger_the_journal_and_the_owed_rows(run, start):
    pipeline = start(until_pending=1, max_pending=1, max_staleness=0)
    job = work_one(pipeline.queue, version=0)
    result, _ = take(pipeline, 0)
    pipeline.producer.owe("000000_999", [{"prompt": "owed"}], archive=lambda: None)
    between_batches, state = pipeline.state_dict(), pipeline.state_dict(final=True)
    assert between_batches["consumed"] == []  # its step has not trained yet
    assert state["consumed"] == [job.job_id] == [result.job_id]  # the run ends here: a batch cut short counts
    assert state["producer"]["owed"] == [{"from_job": "000000_999", "rows": [{"prompt": "owed"}]}]
    assert state["producer"]["batches_drawn"] >= 1 and state["producer"]["last_job_id"] >= job.job_id


# --------------------------------------------------------------------------- admission and order


def test_admission_throws_only_what_can_still_be_trained_within_the_bound(start):
    """max_staleness 3. A job claimed at version 0 stays in a worker's hands; every job in flight
    could be trained before it, so the producer keeps taken + in_flight - 0 <= 3 by throwing less
    as steps pass. (Capping jobs in flight at max_staleness + 1 alone would keep 4 in flight.)"""
    pipeline = start(until_pending=4, max_pending=8, max_staleness=3)
    queue = pipeline.queue
    assert pipeline.producer.may_throw() is False
    straggler = queue.claim(1)
    for step in (1, 2, 3):  # the other three are generated with newer weights and trained
        work_one(queue, version=step - 1, device=2)
        assert take(pipeline, step - 1)[1] <= 3
        pipeline.on_step_end(step)
        assert pipeline.producer.may_throw() is False  # taken + in flight - 0 would exceed 3
    assert [(n.job_id, n.state) for n in queue.scan()[0]] == [(straggler.job_id, JobState.PROCESSING)]
    assert queue.complete(straggler, {"batch": batch(), "metrics": {}, "rows": straggler.data["rows"]},
                          weights_version=0)
    result, staleness = take(pipeline, 3)
    assert (result.job_id, staleness) == (straggler.job_id, 3)  # trained, not stale
    pipeline.on_step_end(4)
    wait_for(lambda: pending(queue) == 4, "the producer to throw again")


def test_a_result_taken_but_not_yet_accounted_for_still_counts_as_in_flight(start):
    """Between leaving the cache and moving next_take_step on, the result the trainer is judging is
    in neither: admission must still count it, or it throws one job too many (one that goes stale)."""
    pipeline = start(until_pending=2, max_pending=8, max_staleness=1)
    pipeline.producer.stop()  # from here the test makes each call the threads would make, one at a time
    cache_results(pipeline, versions=[0, 0])
    assert pipeline.producer.may_throw() is False  # 0 + 2 in flight - 0 > 1
    # The trainer, in the middle of next_batch: the result is out of the cache and archived consumed
    # (out of queue/), and next_take_step is not yet 1.
    result = pipeline.cache.take(pipeline.pick, timeout=WAIT_S)
    assert pipeline.queue.consume(result) and pipeline.progress.next_take_step == 0
    assert pipeline.producer.may_throw() is False


def test_synchronous_mode_throws_one_job_for_the_newest_weights(start):
    pipeline = start(state={"consumed": ["000000_000", "000001_000"]}, published_version=2, until_pending=1,
                     max_pending=8, max_staleness=0)
    assert pipeline.producer.may_throw() is False  # one job in flight is all synchronous mode allows
    job = pipeline.queue.claim(1)
    assert job.data["min_weights_version"] == 2  # the worker waits for the weights of step 2


def cache_results(pipeline, versions):
    """Completes one pending job per version (in job order) and waits until they are cached."""
    ids = []
    for version in versions:
        ids.append(work_one(pipeline.queue, version).job_id)
    wait_for(lambda: len(pipeline.cache) == len(versions), "the collector to cache the results")
    return ids


def test_ready_order_trains_the_result_with_the_oldest_weights_first(start):
    pipeline = start(until_pending=3, max_pending=3, max_staleness=8)
    ids = cache_results(pipeline, versions=[2, 0, 1])
    order = []
    for step in (3, 4, 5):
        order.append(take(pipeline, step)[0].job_id)
        pipeline.on_step_end(step + 1)
    assert order == [ids[1], ids[2], ids[0]]


def test_fifo_order_waits_for_an_older_job_still_in_a_workers_hands(start):
    pipeline = start(until_pending=2, max_pending=2, max_staleness=8, consume_order="fifo")
    first = pipeline.queue.claim(1)
    second = work_one(pipeline.queue, version=0, device=2)
    wait_for(lambda: len(pipeline.cache) == 1, "the second result cached")
    thread, outcome = next_batch_in_thread(pipeline, step=0)
    thread.join(0.3)
    assert thread.is_alive() and not outcome  # head-of-line: waits for the first job
    assert pipeline.queue.complete(first, {"batch": batch(), "metrics": {}, "rows": first.data["rows"]},
                                   weights_version=0)
    thread.join(WAIT_S)
    assert outcome["result"].in_training.parts[0].job_id == first.job_id
    pipeline.on_step_end(1)
    assert take(pipeline, 1)[0].job_id == second.job_id


@pytest.mark.parametrize("flags, steps_per_job", [
    ([], 1),
    (["--num_iterations", "2"], 2),
    (["--steps_per_generation", "2"], 2),
    (["--steps_per_generation", "4", "--num_iterations", "3", "--gradient_accumulation_steps", "2"], 6),
])
def test_a_job_trains_steps_per_generation_x_num_iterations_over_accumulation_steps(flags, steps_per_job):
    assert parse_config(flags).steps_per_job == steps_per_job


@pytest.mark.parametrize("flags", [["--steps_per_generation", "3", "--gradient_accumulation_steps", "2"],
                                   ["--steps_per_generation", "1", "--gradient_accumulation_steps", "2"]])
def test_a_job_that_would_end_inside_an_optimizer_step_is_refused_in_one_line(flags):
    from asyncgrpo.config import ConfigError

    with pytest.raises(ConfigError, match="must be a multiple of --gradient_accumulation_steps 2") as err:
        parse_config(flags)
    assert "\n" not in str(err.value)


# --------------------------------------------------------------------------- one job, several optimizer steps


def test_a_job_of_several_steps_enters_the_ledger_when_its_last_step_has_trained(start):
    pipeline = start(until_pending=1, max_pending=1, max_staleness=8, num_iterations=2)
    job = work_one(pipeline.queue, version=0)
    result, staleness = take(pipeline, 0)
    assert (result.job_id, staleness) == (job.job_id, 0)
    pipeline.on_step_end(1)
    assert pipeline.ledger.consumed == set() and pipeline.in_training.parts[0].job_id == job.job_id
    with pytest.raises(PipelineError, match="while the one in training has 1 step"):
        take(pipeline, 1)  # the trainer's steps and the jobs are out of step: stop, loudly
    pipeline.on_step_end(2)
    assert pipeline.ledger.consumed == {job.job_id} and pipeline.in_training is None


def test_admission_counts_the_steps_each_job_in_flight_will_train(start):
    """Two steps per job, max_staleness 3: a job thrown now may wait for the two before it, 4
    steps, so only two are in flight at version 0; one more once step 1's weights are out."""
    pipeline = start(until_pending=2, max_pending=8, max_staleness=3, num_iterations=2)
    queue = pipeline.queue
    assert pipeline.producer.may_throw() is False
    work_one(queue, version=0)
    assert take(pipeline, 0)[1] == 0  # trains steps 1 and 2; the next take is at step 2
    assert pipeline.producer.may_throw() is False  # 2 + 1 x 2 - 0 > 3
    pipeline.on_step_end(1)
    wait_for(lambda: pending(queue) == 2, "a job for the weights of step 1")  # 2 + 1 x 2 - 1 <= 3
    assert pipeline.producer.may_throw() is False


def test_synchronous_mode_with_several_steps_per_job_waits_for_the_jobs_last_step(start):
    pipeline = start(until_pending=1, max_pending=8, max_staleness=0, num_iterations=2)
    queue = pipeline.queue
    work_one(queue, version=0)
    take(pipeline, 0)
    pipeline.on_step_end(1)
    assert pipeline.producer.may_throw() is False  # its result would be taken at step 2
    pipeline.on_step_end(2)
    wait_for(lambda: pending(queue) == 1, "the next job")
    assert queue.claim(1).data["min_weights_version"] == 2


def test_an_unknown_off_policy_correction_is_refused_in_one_line():
    from asyncgrpo.config import ConfigError

    with pytest.raises(ConfigError, match="--off_policy_correction 'clip': must be one of none, token_truncate"):
        parse_config(["--off_policy_correction", "clip"])


@pytest.mark.process
def test_a_ps_whose_producer_hits_a_full_disk_exits_1_with_the_error_on_the_terminal(tmp_path):
    """A real PS process; every job file write fails like a full disk (injected at start-up
    through a sitecustomize module, so the PS's own code runs unchanged)."""
    import subprocess

    from helpers import DEMO_RUN_FLAGS, PROCESS_ENV, REPO

    inject = tmp_path / "inject"
    inject.mkdir()
    (inject / "sitecustomize.py").write_text(
        "# asyncgrpo.forkserver: runs in a fork too\n"  # (it patches the project's module, imported after it)
        "import errno\n"
        "from asyncgrpo.run import fileops\n"
        "_write = fileops.write_payload\n"
        "def write_payload(tmp_dir, path, payload, **kwargs):\n"
        "    if str(path).endswith('_pending.pt'):\n"
        "        raise fileops.QueueWriteError(errno.ENOSPC, 'No space left on device')\n"
        "    return _write(tmp_dir, path, payload, **kwargs)\n"
        "fileops.write_payload = write_payload\n")
    env = {**PROCESS_ENV, "PYTHONPATH": os.pathsep.join([str(inject), str(REPO)])}
    ps = subprocess.run([PYTHON, "-m", "ps", "--run_dir", str(tmp_path / "run"), *DEMO_RUN_FLAGS],
                        cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    assert ps.returncode == 1, ps.stderr[-3000:]
    assert "\nps: error: the job producer stopped: QueueWriteError: [Errno 28] No space left on device\n" in ps.stderr


def test_the_prompts_a_run_dropped_are_counted_over_its_life_across_a_relaunch(run, start, caplog):
    """A relaunch (a reward function fixed) resumes the count from its checkpoint: the prompts dropped before were
    never trained on, and the terminal's dropped_prompts says the run's, not the launch's."""
    first = start(until_pending=2, max_attempts=2, max_pending=2)
    failing = fail_one(first.queue)  # attempt 1: thrown again
    assert fail_one(first.queue).job_id == failing.job_id  # attempt 2: reported, dropped
    wait_for(lambda: first.failed.prompts == 2, "the failed job dropped")
    state = first.state_dict()
    first.stop()
    with caplog.at_level("INFO", logger="asyncgrpo.ps"):
        relaunched = start(state=state, max_attempts=2, max_pending=2)
    assert (relaunched.failed.jobs, relaunched.failed.prompts) == (1, 2)
    assert ("[queue] this run dropped 1 job(s), 2 prompt(s), before the checkpoint it resumes from (jobs that failed "
            "on every attempt): counted on") in caplog.messages
