"""What a job and its result carry (asyncgrpo/jobqueue/handoff.py): written with to_dict, read back checked."""

from __future__ import annotations

import pytest
import torch

from asyncgrpo.jobqueue.handoff import (
    HANDOFF_VERSION,
    REWARDS_KEY,
    VERSION_KEY,
    FailureReport,
    JobData,
    ResultData,
    read_result,
)
from asyncgrpo.run import fileops

ROWS = [{"prompt": "3:", "digit": 3}] * 4


def a_result(rows: int = 4, **batch_changes) -> ResultData:
    batch = {"advantages": torch.zeros(rows), "prompt_ids": torch.ones(rows, 2, dtype=torch.long),
             "prompt_mask": torch.ones(rows, 2, dtype=torch.long),
             "completion_ids": torch.ones(rows, 3, dtype=torch.long),
             "completion_mask": torch.ones(rows, 3), "old_per_token_logps": torch.zeros(rows, 3)}
    batch.update(batch_changes)
    return ResultData(batch, torch.arange(rows, dtype=torch.float32), {"reward": 0.5}, ROWS[:rows])


def through_a_file(data: dict, tmp_path) -> dict:
    """``data`` as a worker or the PS reads it back from a queue file (torch.load, weights_only)."""
    path = tmp_path / "payload.pt"
    path.unlink(missing_ok=True)
    fileops.write_payload(tmp_path, path, data, fsync=False)
    return fileops.load_payload(path)


def test_a_job_and_a_result_come_back_from_a_file_as_they_were_written(tmp_path):
    job = JobData(ROWS, min_weights_version=7)
    assert JobData.from_dict(through_a_file(job.to_dict(), tmp_path)) == job
    result = a_result()
    data = through_a_file(result.to_dict(), tmp_path)
    assert data[VERSION_KEY] == HANDOFF_VERSION
    assert REWARDS_KEY in data["batch"]  # in the batch, where workers of earlier versions put it
    back = read_result(data, rows_per_job=4)
    assert isinstance(back, ResultData) and REWARDS_KEY not in back.batch
    assert torch.equal(back.rewards, result.rewards) and back.rows == ROWS and back.metrics == {"reward": 0.5}
    assert back.batch.keys() == result.batch.keys() and back.completions == 4


def test_data_without_a_version_is_read_as_version_1_and_another_version_is_refused():
    unversioned = JobData(ROWS, 0).to_dict()
    del unversioned[VERSION_KEY]
    assert JobData.from_dict(unversioned).rows == ROWS
    with pytest.raises(ValueError, match="handoff version '2'"):
        JobData.from_dict({**unversioned, VERSION_KEY: 2})
    with pytest.raises(ValueError, match="handoff version '2'"):
        read_result({**a_result().to_dict(), VERSION_KEY: 2}, rows_per_job=4)


@pytest.mark.parametrize("data, problem", [
    ({"rows": ROWS}, "min_weights_version 'None'"),
    ({"rows": ROWS, "min_weights_version": -1}, "min_weights_version '-1'"),
    ({"rows": [], "min_weights_version": 0}, "rows must be a non-empty list"),
    ({"rows": ["3:"], "min_weights_version": 0}, "rows must be a non-empty list of dicts"),
    (["not", "a", "dict"], "must be a dict"),
])
def test_a_job_that_a_worker_cannot_read_is_refused_with_its_reason(data, problem):
    with pytest.raises(ValueError, match=problem):
        JobData.from_dict(data)


@pytest.mark.parametrize("change, problem", [
    ({"advantages": torch.zeros(5)}, r"advantages has shape \(5,\), expected \(4,\)"),
    ({"completion_mask": torch.ones(4, 2)}, "inconsistent shapes"),
    ({"old_per_token_logps": torch.zeros(4, 2)}, "inconsistent shapes"),
    ({"prompt_ids": [[1, 2]] * 4}, r"batch\['prompt_ids'\] is missing or not a tensor"),
    ({REWARDS_KEY: torch.zeros(4, dtype=torch.long)}, r"batch\['rewards'\] must be a float tensor of shape \(4,\)"),
    # A job of empty prompts: TRL's padding of no token at all is a float tensor, and the PS's loss failed on it.
    ({"prompt_ids": torch.zeros(4, 0), "prompt_mask": torch.zeros(4, 0)},
     r"batch\['prompt_ids'\] holds torch.float32, not token ids"),
    ({"prompt_mask": torch.tensor([[1, 1]] * 3 + [[0, 0]])}, r"a row has no prompt token \(an empty prompt\?\)"),
])
def test_a_result_that_does_not_fit_its_job_is_refused_with_its_reason(change, problem):
    data = a_result().to_dict()
    data["batch"].update(change)
    with pytest.raises(ValueError, match=problem):
        read_result(data, rows_per_job=4)


def test_a_failure_report_is_read_as_one():
    error = {"type": "ValueError", "message": "boom", "stage": "scoring", "reward_function": "f"}
    report = read_result(FailureReport([error], JobData(ROWS, 0).to_dict()).to_dict(), rows_per_job=4)
    assert isinstance(report, FailureReport) and report.errors == [error] and report.job["rows"] == ROWS
    with pytest.raises(ValueError, match="errors must be a non-empty list of dicts"):
        read_result({"errors": [], "job": {"rows": ROWS}}, rows_per_job=4)


def test_the_versions_that_sampled_a_results_tokens_come_back_and_count_its_tokens(tmp_path):
    result = a_result()  # 4 rows of 3 completion tokens
    result.batch["completion_mask"] = torch.tensor([[1, 1, 1], [1, 1, 0], [1, 0, 0], [1, 1, 1]])
    result.token_versions = [[(0, 5), (2, 6)], [(0, 5), (1, 6)], [(0, 6)], [(0, 5), (2, 6)]]  # a row's each
    back = read_result(through_a_file(result.to_dict(), tmp_path), rows_per_job=4)
    assert back.token_versions == result.token_versions and back.oldest_version == 5
    assert back.tokens_by_version([0, 1, 2, 3], weights_version=5) == {5: 5, 6: 4}
    assert back.tokens_by_version([1, 2], weights_version=5) == {5: 1, 6: 2}
    result.token_versions = None  # every token by the result's weights_version
    assert result.tokens_by_version([0, 1], weights_version=5) == {5: 5}


@pytest.mark.parametrize("runs", [[], [[1, 5]], [[0, 5], [0, 6]], [[0, 5], [3, -1]], [[0, 5, 1]], "0:5"])
def test_token_versions_that_are_not_runs_are_refused(runs):
    data = a_result().to_dict()
    data["token_versions"] = [[[0, 5]]] * 3 + [runs]
    with pytest.raises(ValueError, match="token_versions must be runs"):
        read_result(data, rows_per_job=4)
    data["token_versions"] = [[[0, 5]]] * 3  # a row without its runs
    with pytest.raises(ValueError, match="one list of runs a row, 4 of them"):
        read_result(data, rows_per_job=4)
