"""Steps that teach nothing (ps/learning_signal.py): counted by optimizer step, said at most once a minute, and a
run without a reward stops."""

import logging

import pytest

from ps import learning_signal
from ps.learning_signal import NO_REWARD_STOP_STEPS, NO_SPREAD_WARN_STEPS, FlatGroups, LearningSignal, finite


def warnings(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]


@pytest.fixture
def clock(monkeypatch) -> list[float]:
    now = [1000.0]
    monkeypatch.setattr(learning_signal.time, "monotonic", lambda: now[0])
    return now


def test_steps_whose_groups_all_scored_alike_warn_once_they_last_and_at_most_once_a_minute(caplog, clock):
    signal = LearningSignal()
    with caplog.at_level(logging.WARNING, logger="asyncgrpo.ps"):
        for step in range(1, NO_SPREAD_WARN_STEPS):
            signal.observe(step, 0.0, 1.0)
        assert signal.steps_without_spread == NO_SPREAD_WARN_STEPS - 1 and warnings(caplog) == []
        signal.observe(NO_SPREAD_WARN_STEPS, 0.0, 1.0)
        [line] = warnings(caplog)
        assert line.startswith(f"[train] step={NO_SPREAD_WARN_STEPS}: for {NO_SPREAD_WARN_STEPS} steps every group's "
                               "completions scored alike (frac_reward_zero_std 1): the advantages are all 0")
        signal.observe(21, 0.0, 1.0)
        clock[0] += 59
        signal.observe(22, 0.0, 1.0)
        assert len(warnings(caplog)) == 1
        clock[0] += 1
        signal.observe(23, 0.0, 1.0)
        assert len(warnings(caplog)) == 2
    signal.observe(24, 0.5, 0.75)  # a group whose rewards differ: the count starts again
    assert signal.steps_without_spread == 0 and signal.stop is None


def test_a_step_whose_completions_were_all_cut_and_masked_says_so_at_most_once_a_minute(caplog, clock):
    """--mask_truncated_completions leaves out of the loss every completion cut at --max_completion_length: when all
    were, loss and gradient are 0 whatever the rewards, and TRL says nothing."""
    signal = LearningSignal()
    with caplog.at_level(logging.WARNING, logger="asyncgrpo.ps"):
        signal.observe(1, 0.5, 0.0, all_masked=False)
        assert warnings(caplog) == []
        signal.observe(2, 0.5, 0.0, all_masked=True)
        signal.observe(3, 0.5, 0.0, all_masked=True)
        assert warnings(caplog) == [
            "[train] step=2: every completion reached --max_completion_length and --mask_truncated_completions masked "
            "them all out of the loss: nothing is learned. Give a larger --max_completion_length, or run without "
            "--mask_truncated_completions"]
        clock[0] += 60
        signal.observe(4, 0.5, 0.0, all_masked=True)
        assert len(warnings(caplog)) == 2
    assert signal.stop is None


def test_dynamic_samplings_groups_dropped_in_a_row_warn_once_they_last_and_at_most_once_a_minute(caplog, clock):
    flat = FlatGroups(warn_at=4)
    with caplog.at_level(logging.WARNING, logger="asyncgrpo.ps"):
        flat.observe(kept=0, dropped=2)
        assert warnings(caplog) == []
        flat.observe(kept=0, dropped=2)
        assert warnings(caplog) == [
            "[train] --dynamic_sampling dropped the last 4 groups and kept none: each group's completions scored "
            "alike, so no step can train. Look at the reward (does it tell this model's completions apart?), the "
            "model (do its completions differ?), or run without --dynamic_sampling"]
        clock[0] += 59
        flat.observe(kept=0, dropped=2)
        assert len(warnings(caplog)) == 1
        clock[0] += 1
        flat.observe(kept=0, dropped=2)
        assert "dropped the last 8 groups" in warnings(caplog)[-1]
        flat.observe(kept=1, dropped=1)  # a group kept: the count starts again
        clock[0] += 60
        flat.observe(kept=0, dropped=2)
        assert flat.in_a_row == 2 and len(warnings(caplog)) == 2


def test_logged_lines_count_the_steps_they_cover():
    signal = LearningSignal()
    signal.observe(10, 0.0, 1.0)  # --logging_steps 10
    signal.observe(20, 0.0, 1.0)
    assert signal.steps_without_spread == 20


def test_a_run_whose_steps_have_no_reward_says_so_then_stops(caplog, clock):
    signal = LearningSignal()
    with caplog.at_level(logging.WARNING, logger="asyncgrpo.ps"):
        for step in range(1, NO_REWARD_STOP_STEPS):
            signal.observe(step, None, None)
            assert signal.stop is None
        [line] = warnings(caplog)
        assert line == ("[train] step=1: no reward: every reward function returned None (or NaN) for every completion "
                        f"(1 step(s) in a row; the run stops at {NO_REWARD_STOP_STEPS})")
        signal.observe(NO_REWARD_STOP_STEPS, None, None)
    assert signal.stop.startswith(f"{NO_REWARD_STOP_STEPS} steps in a row without a reward: every reward function "
                                  "returned None (or NaN) for every completion")
    assert signal.steps_without_reward == signal.steps_without_spread == NO_REWARD_STOP_STEPS


def test_a_reward_now_and_then_never_stops_the_run():
    signal = LearningSignal()
    for step in range(1, 200):
        signal.observe(step, None if step % NO_REWARD_STOP_STEPS else 0.5, None)
    assert signal.stop is None


def test_nan_is_no_reward():
    assert finite(float("nan")) is None and finite(None) is None and finite(0.25) == 0.25


def test_a_resumed_run_counts_from_its_checkpoint_step_on():
    """Resumed at step 500 whose line counted 3 steps without a reward: the next step makes 4, not 501."""
    signal = LearningSignal.resumed(500, {"step": 500, "steps_without_reward": 3, "steps_without_spread": 3})
    signal.observe(501, None, None)
    assert signal.steps_without_reward == 4 and signal.stop is None
    fresh = LearningSignal.resumed(500, None)
    fresh.observe(501, None, None)
    assert fresh.steps_without_reward == 1
