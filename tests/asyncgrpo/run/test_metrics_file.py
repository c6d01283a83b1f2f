"""RUN/metrics.jsonl through its one owner, asyncgrpo/run/metrics.py: the line the PS appends, what each reader
skips, the tail read of `queue_tools ls`, and the truncation of a resumed PS."""

import dataclasses
import json
import subprocess
import sys

import pytest

from asyncgrpo.run import metrics
from asyncgrpo.run.metrics import StepMetrics


def step_metrics(step: int, groups_dropped: int = 0) -> StepMetrics:
    return StepMetrics(step=step, reward=0.5, reward_std=0.1, loss=0.25, grad_norm=1.5, staleness_mean=1.0,
                       token_staleness_mean=1.0, staleness_max=2, weights_version=step - 1, trainer_wait_s=0.01,
                       groups_dropped=groups_dropped,
                       groups_dropped_total=groups_dropped, prompts_skipped=0, tool_failure_rate=None,
                       frac_reward_zero_std=0.25, steps_without_reward=0, steps_without_spread=0, step_time_s=0.2,
                       queue_depth={"pending": 1, "processing": 2}, time=1000.0 + step)


def write_lines(path, *lines: str) -> None:
    path.write_text("".join(f"{line}\n" for line in lines))


@pytest.fixture
def path(run):
    return run.metrics_file


def test_a_record_is_appended_as_one_json_line_with_its_fields_in_order(path):
    metrics.append(path, step_metrics(1))
    metrics.append(path, step_metrics(2))
    lines = path.read_text().splitlines()
    assert len(lines) == 2 and path.read_text().endswith("\n")
    first = json.loads(lines[0])
    # The keys every reader (queue_tools, bench/, tests) looks up, in the order the PS has always written them.
    assert list(first) == [f.name for f in dataclasses.fields(StepMetrics)]
    assert first == dataclasses.asdict(step_metrics(1))
    assert metrics.read_lines(path) == [dataclasses.asdict(step_metrics(1)), dataclasses.asdict(step_metrics(2))]


def test_read_lines_skips_corrupt_lines_and_keeps_the_rest_in_order(path):
    write_lines(path, '{"step": 1}', "not json", "[1, 2]", '{"reward": 0.5}', '{"step": "3"}', "", '{"step": 2}',
                '{"step": 3, "rew')  # the last: cut short by a crash, no newline
    path.write_text(path.read_text().rstrip("\n"))
    assert metrics.read_lines(path) == [{"step": 1}, {"step": 2}]


def test_read_lines_of_a_missing_file_is_empty(path):
    assert metrics.read_lines(path) == []


def test_last_line_is_the_last_full_line(path):
    write_lines(path, *(json.dumps({"step": step}) for step in (1, 2, 3)))
    assert metrics.last_line(path) == {"step": 3}
    with open(path, "a") as f:
        f.write('{"step": 4, "rew')  # being written
    assert metrics.last_line(path) == {"step": 3}


def test_last_line_reads_only_the_tail(path):
    # The file grows with every step: only its last TAIL_BYTES are read, here a part of one long line.
    write_lines(path, json.dumps({"step": 1}), json.dumps({"step": 2, "pad": "x" * metrics.TAIL_BYTES}))
    assert metrics.last_line(path) is None


def test_last_line_of_a_missing_or_empty_file_is_none(path):
    assert metrics.last_line(path) is None
    path.write_text("")
    assert metrics.last_line(path) is None


def test_read_new_lines_goes_on_from_its_offset_and_waits_for_a_line_to_end(path):
    assert metrics.read_new_lines(path, 0) == ([], 0)  # no file yet
    write_lines(path, '{"step": 1}')
    path.write_text(path.read_text() + '{"step": 2, ')  # being written
    lines, offset = metrics.read_new_lines(path, 0)
    assert lines == [{"step": 1}] and offset == len('{"step": 1}\n')
    with open(path, "a") as f:
        f.write('"reward": 0.5}\n{"step": 3}\n')
    lines, offset = metrics.read_new_lines(path, offset)
    assert lines == [{"step": 2, "reward": 0.5}, {"step": 3}] and offset == path.stat().st_size
    assert metrics.read_new_lines(path, offset) == ([], offset)


def test_truncate_after_keeps_the_steps_up_to_n(path):
    write_lines(path, *(json.dumps({"step": step, "groups_dropped": step}) for step in (1, 2, 3, 4, 5)))
    truncated = metrics.truncate_after(path, 3)
    assert [line["step"] for line in truncated.kept] == [1, 2, 3]
    assert (truncated.removed, truncated.unreadable) == (2, 0)
    assert [line["step"] for line in metrics.read_lines(path)] == [1, 2, 3]
    assert path.read_text() == "".join(json.dumps({"step": s, "groups_dropped": s}) + "\n" for s in (1, 2, 3))


def test_truncate_after_removes_unreadable_lines_and_counts_them_apart(path):
    kept = [json.dumps({"step": step}) for step in (1, 2)]
    write_lines(path, kept[0], "garbage", kept[1], json.dumps({"step": 3}))
    path.write_text(path.read_text() + '{"step": 4, "rew')
    truncated = metrics.truncate_after(path, 2)
    assert (truncated.removed, truncated.unreadable) == (1, 2)
    assert path.read_text() == "".join(f"{line}\n" for line in kept)


def test_truncate_after_leaves_a_file_with_nothing_to_remove_as_it_is(path):
    write_lines(path, '{"step": 1}', "", '{"step":  2}')  # a blank line and odd spacing: kept byte for byte
    before = path.read_text()
    mtime = path.stat().st_mtime_ns
    truncated = metrics.truncate_after(path, 2)
    assert (len(truncated.kept), truncated.removed, truncated.unreadable) == (2, 0, 0)
    assert path.read_text() == before and path.stat().st_mtime_ns == mtime


def test_truncate_after_of_a_missing_file_creates_nothing(path):
    truncated = metrics.truncate_after(path, 3)
    assert (truncated.kept, truncated.removed, truncated.unreadable) == ([], 0, 0)
    assert not path.exists()


@pytest.mark.process
def test_metrics_imports_no_torch():
    # queue_tools ls reads the file; it must answer without loading torch.
    code = ("import sys; import asyncgrpo.run.metrics, asyncgrpo.run.checkpoints; "
            "print([m for m in ('torch', 'transformers', 'trl') if m in sys.modules])")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


def test_an_evaluation_s_line_is_kept_apart_from_the_steps_lines(tmp_path):
    path = tmp_path / "metrics.jsonl"
    metrics.append(path, step_metrics(1))
    metrics.append(path, metrics.eval_line(1, {"eval_loss": 0.5, "eval_reward": 0.25, "loss": 9.0}))
    metrics.append(path, step_metrics(2))
    metrics.append(path, metrics.eval_line(2, {"eval_loss": 0.4, "eval_reward": 0.5}))
    assert [line["step"] for line in metrics.read_lines(path)] == [1, 2]
    evals = metrics.read_lines(path, kind="eval")
    assert [(e["step"], e["eval_reward"]) for e in evals] == [(1, 0.25), (2, 0.5)] and "loss" not in evals[0]
    assert metrics.last_line(path)["step"] == 2 and "kind" not in metrics.last_line(path)
    metrics.truncate_after(path, 1)
    assert len(metrics.read_lines(path)) == 1 and len(metrics.read_lines(path, kind="eval")) == 1


@pytest.mark.parametrize("loss, shown", [(0.1, "0.1000"), (-0.0421, "-0.0421"), (0.0, "0.0000"), (-0.0, "0.0000"),
                                         (-3.2e-6, "-3.20e-06"), (4.56e-5, "4.56e-05"), (None, "-")])
def test_a_step_line_shows_a_small_loss_with_its_digits(loss, shown):
    line = dataclasses.asdict(step_metrics(1)) | {"loss": loss}
    assert metrics.step_words(line).split(" loss=")[1] == shown
