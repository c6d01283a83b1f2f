"""Dynamic sampling in the PS's pipeline (ps/pipeline.py), in process over a real run directory and threads:
groups without reward spread are dropped and archived, a batch is filled from several results, a result split
across batches is taken once per group also across a restart, and admission throws more as groups are dropped.

The test is the worker: it completes jobs with the queue's own calls, choosing each completion's reward."""

import functools
import logging

import helpers
import pytest
import torch
from helpers import pipelines

import ps.pipeline as pipeline_module
from asyncgrpo.config_parser import parse_config
from asyncgrpo.jobqueue import JobQueue, JobState
from asyncgrpo.jobqueue.handoff import read_result_payload
from asyncgrpo.run import fileops
from asyncgrpo.run.liveness import WorkerPresence
from ps.pipeline import JobPipeline

G, ROWS = pipelines.GENERATIONS, pipelines.ROWS  # two groups of two per job, and per batch
wait_for = functools.partial(helpers.wait_for, timeout=10.0, poll_s=0.01)
SPREAD, FLAT = [0.0, 1.0], [1.0, 1.0]  # a group's two rewards


@pytest.fixture(autouse=True)
def worker_alive(run):
    """The test's worker, dev1, alive to recovery (its jobs are not taken back while it holds them)."""
    presence = WorkerPresence(run, 1).start()
    yield
    presence.stop()


def make_pipeline(run, **overrides):
    return pipelines.make_pipeline(run, **{"dynamic_sampling": "true", **overrides})


def complete_one(queue, groups: list[list[float]], version: int = 0):
    """Claims the oldest pending job and completes it with these rewards, group by group; each row's
    completion is its row number, so a test can tell rows apart in an assembled batch."""
    job = queue.claim(1)
    assert job is not None, queue.counts()
    rewards = torch.tensor([r for group in groups for r in group])
    batch = {"advantages": rewards - rewards.view(-1, G).mean(dim=1).repeat_interleave(G),
             "prompt_ids": torch.ones(ROWS, 2, dtype=torch.long), "prompt_mask": torch.ones(ROWS, 2, dtype=torch.long),
             "completion_ids": torch.arange(ROWS).unsqueeze(1) + 100 * (int(job.job_id[-3:]) + 1),
             "completion_mask": torch.ones(ROWS, 1, dtype=torch.long), "rewards": rewards}
    assert queue.complete(job, {"batch": batch, "metrics": {"reward": float(rewards.mean())},
                                "rows": job.data["rows"]}, weights_version=version)
    return job.job_id


def started(pipeline, state=None, step=0):
    pipeline.start(state, published_version=step)
    wait_for(lambda: pipeline.queue.counts()[JobState.PENDING.value] >= 2, "pending jobs")
    return pipeline


def parts_of(taken):
    return [(part.job_id, part.groups) for part in taken.in_training.parts]


def test_groups_without_reward_spread_are_dropped_and_the_batch_filled_from_the_next_result(run):
    pipeline = started(make_pipeline(run))
    try:
        first = complete_one(pipeline.queue, [FLAT, SPREAD])
        second = complete_one(pipeline.queue, [SPREAD, [0.0, 0.0]])
        taken = pipeline.next_batch(0)
    finally:
        pipeline.stop()
    assert parts_of(taken) == [(first, [1]), (second, [0])]
    assert taken.in_training.groups_dropped == 2
    assert taken.tensors["completion_ids"].squeeze(1).tolist() == [102, 103, 200, 201]  # rows 2-3, then 0-1
    assert torch.equal(taken.tensors["advantages"], torch.tensor([-0.5, 0.5, -0.5, 0.5]))
    assert "rewards" not in taken.tensors  # the trainer gets TRL's batch
    # Both results are used up (each group trained or dropped): archived consumed, each with a record of the
    # group it lost.
    for job, group in ((first, 0), (second, 1)):
        assert (run.done / f"{job}_consumed.pt").exists()
        record = fileops.load_payload(run.done / f"{job}_filtered.pt")["data"]
        assert record["groups"] == [group] and record["reward_std"] == [0.0] and len(record["rows"]) == G


def test_groups_dropped_in_a_row_with_none_kept_are_said(run, caplog, monkeypatch):
    """Every group's completions scored alike: dynamic sampling drops them all and no step comes, and the run went on
    forever without a word. Said from NO_SPREAD_WARN_STEPS batches' groups dropped in a row (here one batch's)."""
    monkeypatch.setattr(pipeline_module, "NO_SPREAD_WARN_STEPS", 1)
    pipeline = started(make_pipeline(run))
    try:
        with caplog.at_level(logging.WARNING, logger="asyncgrpo.ps"):
            complete_one(pipeline.queue, [FLAT, [0.0, 0.0]])
            complete_one(pipeline.queue, [SPREAD, SPREAD])
            pipeline.next_batch(0)
    finally:
        pipeline.stop()
    said = [r.getMessage() for r in caplog.records if "--dynamic_sampling dropped" in r.getMessage()]
    assert len(said) == 1 and said[0].startswith("[train] --dynamic_sampling dropped the last 2 groups and kept none:")


def test_a_result_without_any_spread_is_archived_filtered_and_never_enters_the_ledger(run):
    pipeline = started(make_pipeline(run))
    try:
        flat = complete_one(pipeline.queue, [FLAT, [0.0, 0.0]])
        kept = complete_one(pipeline.queue, [SPREAD, SPREAD])
        taken = pipeline.next_batch(0)
        pipeline.on_step_end(1)
        state = pipeline.state_dict()
    finally:
        pipeline.stop()
    assert parts_of(taken) == [(kept, [0, 1])]
    assert (run.done / f"{flat}_filtered.pt").exists() and not (run.done / f"{flat}_consumed.pt").exists()
    assert state["consumed"] == [kept] and state["groups_done"] == {}


def test_a_result_split_across_batches_trains_each_group_once_across_a_restart(run):
    pipeline = started(make_pipeline(run))
    try:
        first = complete_one(pipeline.queue, [FLAT, SPREAD])
        split = complete_one(pipeline.queue, [SPREAD, SPREAD])
        assert parts_of(pipeline.next_batch(0)) == [(first, [1]), (split, [0])]
        pipeline.on_step_end(1)
        state = pipeline.state_dict()  # the checkpoint after step 1
        # The result's other group waits for the next batch, its file still in queue/.
        assert state["consumed"] == [first] and state["groups_done"] == {split: [0]}
        assert not (run.done / f"{split}_consumed.pt").exists()
    finally:
        pipeline.stop()  # the PS dies here, before step 2
    resumed = started(make_pipeline(run), state, step=1)
    try:
        later = complete_one(resumed.queue, [SPREAD, SPREAD], version=1)
        taken = resumed.next_batch(1)
        resumed.on_step_end(2)
        final = resumed.state_dict(final=True)
    finally:
        resumed.stop()
    # The split result's group 1 first (never group 0 again), then the next result's first group.
    assert parts_of(taken) == [(split, [1]), (later, [0])]
    assert taken.in_training.parts[0].weights_version == 0  # each group keeps its own result's version
    assert (run.done / f"{split}_consumed.pt").exists()
    assert final["consumed"] == sorted([first, split, later]) and final["groups_done"] == {}


@pytest.mark.parametrize("expected_yield, jobs", [(1.0, 3), (0.25, 9)])
def test_admission_throws_more_jobs_as_fewer_groups_are_expected_to_train(run, expected_yield, jobs):
    # Before each throw: 0 (next take) + in_flight x yield x 1 step - 0 (oldest version) <= 2 (max_staleness).
    pipeline = make_pipeline(run, max_staleness=2, max_pending=16)
    pipeline.progress.expected_yield = expected_yield
    pipeline.start(None, published_version=0)
    try:
        wait_for(lambda: pipeline.queue.counts()[JobState.PENDING.value] >= jobs, f"{jobs} jobs")
    finally:
        pipeline.stop()
    assert pipeline.queue.counts()[JobState.PENDING.value] == jobs


def test_the_expected_yield_is_measured_from_the_groups_judged(run):
    pipeline = started(make_pipeline(run))
    try:
        complete_one(pipeline.queue, [FLAT, SPREAD])
        complete_one(pipeline.queue, [SPREAD, [0.0, 0.0]])
        pipeline.next_batch(0)
    finally:
        pipeline.stop()
    assert pipeline.progress.expected_yield == 0.5


def test_a_settled_prompt_is_set_aside_for_a_while_and_comes_back_with_nothing_lost(run):
    """Difficulty filtering: p0's last group scored alike, so each time a batch draws p0 its group waits two
    batches; every prompt drawn is in a job thrown, or set aside, or owed: none lost, none twice."""
    dataset = [{"prompt": f"p{i}"} for i in range(4)]  # two batches an epoch
    cfg = {"generation_batch_size": ROWS, "per_device_train_batch_size": ROWS, "num_generations": G,
           "max_pending": 6, "max_outstanding": 16, "max_staleness": 8, "lease_s": 30, "seed": 0,
           "model_name_or_path": "unused", "output_dir": "unused", "difficulty_filter": 1, "difficulty_filter_wait": 2}
    pipeline = JobPipeline(parse_config([f"--{k}={v}" for k, v in cfg.items()]), run, JobQueue(run), dataset)
    pipeline.producer.settled.record({"prompt": "p0"}, flat=True)
    pipeline.start(None, published_version=0)
    try:
        wait_for(lambda: pipeline.queue.counts()[JobState.PENDING.value] >= 6, "six jobs")
    finally:
        pipeline.stop()
    journal = fileops.read_json(run.producer_journal)
    thrown = [row["prompt"] for name in sorted(pipeline.queue.scan()[0])
              for row in fileops.load_payload(pipeline.queue.path(name))["data"]["rows"]]
    waiting = [row["prompt"] for entry in journal["set_aside"] + journal["owed"] for row in entry["rows"]]
    batches = pipeline.producer.generation_batches()
    drawn = [row["prompt"] for _ in range(journal["batches_drawn"]) for row in next(batches)]
    assert sorted(thrown + waiting) == sorted(drawn)
    assert journal["prompts_skipped"] == drawn.count("p0") // G > 0
    assert "p0" in thrown  # it came back
    assert all(len(set(thrown[i:i + G])) == 1 for i in range(0, len(thrown), G))  # whole groups


def test_the_groups_judged_tell_difficulty_filtering_which_prompts_are_settled(run):
    pipeline = started(make_pipeline(run, dynamic_sampling="false", difficulty_filter=1))
    try:
        job = complete_one(pipeline.queue, [FLAT, SPREAD])
        taken = pipeline.next_batch(0)
    finally:
        pipeline.stop()
    assert parts_of(taken) == [(job, [0, 1])]  # without dynamic sampling every group trains
    rows = fileops.load_payload(run.done / f"{job}_consumed.pt")["data"]["rows"]
    assert pipeline.producer.settled.settled(rows[0]) and not pipeline.producer.settled.settled(rows[G])


def test_the_completions_table_of_an_assembled_batch_holds_the_rows_of_its_groups(run):
    pipeline = started(make_pipeline(run))
    try:
        for groups in ([FLAT, SPREAD], [SPREAD, FLAT]):
            job = pipeline.queue.claim(1)
            rewards = torch.tensor([r for group in groups for r in group])
            batch = {"advantages": torch.zeros(ROWS), "rewards": rewards,
                     "prompt_ids": torch.ones(ROWS, 2, dtype=torch.long),
                     "prompt_mask": torch.ones(ROWS, 2, dtype=torch.long),
                     "completion_ids": torch.ones(ROWS, 1, dtype=torch.long),
                     "completion_mask": torch.ones(ROWS, 1, dtype=torch.long)}
            logs = {"prompt": [f"{job.job_id}/{i}" for i in range(ROWS)], "completion": list("abcd"),
                    "rewards": {"f": rewards.tolist()}, "advantages": [0.0] * ROWS, "extra": {}}
            assert pipeline.queue.complete(job, {"batch": batch, "metrics": {}, "rows": job.data["rows"],
                                                 "logs": logs}, weights_version=0)
        taken = pipeline.next_batch(0)
    finally:
        pipeline.stop()
    (first, _), (second, _) = parts_of(taken)
    assert taken.logs["prompt"] == [f"{first}/2", f"{first}/3", f"{second}/0", f"{second}/1"]
    assert taken.logs["rewards"]["f"] == [0.0, 1.0, 0.0, 1.0] and taken.logs["completion"] == list("cdab")


def test_a_batch_of_several_optimizer_steps_enters_the_ledger_after_its_last(run):
    pipeline = started(make_pipeline(run, num_iterations=2))
    try:
        first = complete_one(pipeline.queue, [FLAT, SPREAD])
        split = complete_one(pipeline.queue, [SPREAD, SPREAD])
        assert parts_of(pipeline.next_batch(0)) == [(first, [1]), (split, [0])]
        pipeline.on_step_end(1)
        assert pipeline.state_dict()["consumed"] == [] and pipeline.state_dict()["groups_done"] == {first: [0]}
        pipeline.on_step_end(2)
        assert pipeline.state_dict()["consumed"] == [first] and pipeline.state_dict()["groups_done"] == {split: [0]}
    finally:
        pipeline.stop()


@pytest.mark.parametrize("rewards", [torch.zeros(ROWS + 1), torch.zeros(ROWS, dtype=torch.long), [0.0] * ROWS])
def test_a_result_whose_rewards_do_not_fit_its_rows_is_refused_when_collected(rewards):
    batch = {"advantages": torch.zeros(ROWS), "prompt_ids": torch.ones(ROWS, 2, dtype=torch.long),
             "prompt_mask": torch.ones(ROWS, 2, dtype=torch.long),
             "completion_ids": torch.ones(ROWS, 1, dtype=torch.long),
             "completion_mask": torch.ones(ROWS, 1), "rewards": rewards}
    payload = {"weights_version": 0, "data": {"batch": batch, "metrics": {}, "rows": [{"prompt": "p"}] * ROWS}}
    with pytest.raises(ValueError, match="batch\\['rewards'\\] must be a float tensor of shape"):
        read_result_payload(payload, ROWS)
    batch["rewards"] = torch.zeros(ROWS)
    read_result_payload(payload, ROWS)  # as a worker sends it
