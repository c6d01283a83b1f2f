"""The trainer's one record of what it trained (ps/step_record.py): the train_step_end event, TRL's logs and the
metrics line read the same numbers, each counted once, and a line starts the next span afresh."""

from ps.learning_signal import LearningSignal
from ps.ledger import GroupsTaken
from ps.step_record import StepRecord

DEPTH = {"pending": 0, "processing": 1, "committing": 0, "complete": 0, "collected": 0}


def part(version: int, groups: int, tokens: int, tokens_by_version: dict | None = None) -> GroupsTaken:
    return GroupsTaken(job_id=f"{version:06d}_000", weights_version=version, groups=list(range(groups)),
                       of_groups=groups, samples=2 * groups, tokens=tokens, tokens_by_version=tokens_by_version)


def test_two_steps_gathered_into_one_line_each_number_counted_once():
    record = StepRecord(groups_dropped_before=5, dynamic_sampling=True)
    record.step_started()
    record.waited(0.25)
    record.dropped(2)
    event = record.step_trained(4, [part(1, 2, 10), part(3, 1, 6, {2: 2, 3: 4})])
    assert event["staleness"] == 2 and event["wait_ms"] == 250.0 and event["dur_ms"] >= 0
    record.step_started()
    record.waited(0.5)
    event = record.step_trained(5, [part(3, 1, 4)])
    assert event["staleness"] == 1 and event["wait_ms"] == 500.0  # this step's own wait

    assert record.trl_logs() == {"staleness/mean": (2 + 2 + 0 + 1) / 4, "staleness/max": 2,
                                 # tokens: 10 at 2, 2 at 1 (version 2), 4 at 0 (version 3), 4 at 1 (step 5)
                                 "staleness/token_mean": (10 * 2 + 2 * 1 + 4 * 1) / 20,
                                 "weights_version": 3, "trainer_wait_s": 0.75, "dynamic_sampling/groups_dropped": 2}
    logs = {"reward": float("nan"), "reward_std": 0.0, "loss": 0.5, "grad_norm": 1.0, "frac_reward_zero_std": 1.0}
    line = record.line(5, logs, LearningSignal(steps_without_reward=3), prompts_skipped=7, queue_depth=DEPTH)
    assert (line.step, line.reward, line.loss, line.staleness_mean, line.staleness_max, line.trainer_wait_s) == (
        5, None, 0.5, 1.25, 2, 0.75)
    assert (line.groups_dropped, line.groups_dropped_total, line.prompts_skipped, line.steps_without_reward) == (
        2, 7, 7, 3)
    assert line.token_staleness_mean == 1.3 and line.weights_version == 3 and line.queue_depth == DEPTH

    assert not record.has_trained  # the next line gathers anew, its running total going on
    record.dropped(1)
    record.step_trained(6, [part(5, 1, 3)])
    nxt = record.line(6, {"loss": 0.1}, LearningSignal(), prompts_skipped=7, queue_depth=DEPTH)
    assert (nxt.groups_dropped, nxt.groups_dropped_total, nxt.trainer_wait_s, nxt.staleness_mean) == (1, 8, 0.0, 0.0)


def test_without_dynamic_sampling_trls_logs_carry_no_dropped_groups():
    record = StepRecord()
    record.step_trained(1, [part(0, 1, 3)])
    assert "dynamic_sampling/groups_dropped" not in record.trl_logs()
