"""What the PS logs for each step, read from a real run (the session's 8-step demo run, two workers)."""

import re

import pytest

from asyncgrpo.run import fileops


def logged_dicts(ps_log: str) -> list[dict]:
    """The dicts TRL's log() prints for each step (every TrainerCallback and report_to integration gets these)."""
    return [dict(re.findall(r"'([\w/]+)': '?([^',}]+)'?", line)) for line in ps_log.splitlines()
            if line.lstrip().startswith("{'loss'")]


@pytest.mark.process
def test_num_tokens_is_the_ps_count_of_trained_tokens_and_only_grows(finished_demo_run):
    """Each worker counts only the jobs it generated; the PS's num_tokens counts every job it trained."""
    steps = logged_dicts((finished_demo_run.parent / "ps.log").read_text())
    assert len(steps) == 8
    counts = [float(step["num_tokens"]) for step in steps]
    assert all(later > earlier for earlier, later in zip(counts, counts[1:], strict=False)), counts
    done = finished_demo_run / "done"
    trained = [fileops.load_payload(path)["data"]["batch"] for path in done.glob("*_consumed.pt")]
    assert len(trained) == 8
    # TRL's count: prompt and completion tokens of every generation batch trained on.
    expected = sum(int(b["prompt_mask"].sum() + b["completion_mask"].sum()) for b in trained)
    assert abs(counts[-1] - expected) <= 1e-3 * expected  # the log prints 4 significant digits


def test_a_step_without_a_reward_still_prints_its_train_line(caplog):
    """Every reward function returned None for every row (TRL allows it: a function that does not apply to a row):
    the step's reward is None, and its [train] line still prints, with '-' for the reward (it raised a logging
    error and printed nothing before)."""
    import logging
    from types import SimpleNamespace

    from asyncgrpo.run.metrics import StepMetrics
    from ps.trainer import AsyncGRPOTrainer

    trainer = SimpleNamespace(pipeline=SimpleNamespace(failed=SimpleNamespace(prompts=0)),
                              cfg=SimpleNamespace(dynamic_sampling=False, difficulty_filter=0),
                              callback_handler=SimpleNamespace(callbacks=[]))
    line = StepMetrics(step=7, reward=None, reward_std=None, loss=0.0, grad_norm=0.0, staleness_mean=1.0,
                       staleness_max=1, token_staleness_mean=1.0, weights_version=6, trainer_wait_s=0.002,
                       groups_dropped=0, groups_dropped_total=0, prompts_skipped=0, tool_failure_rate=None,
                       frac_reward_zero_std=None, steps_without_reward=1, steps_without_spread=1,
                       step_time_s=0.1, time=0.0,
                       queue_depth={"pending": 1, "processing": 1, "committing": 0, "complete": 0, "collected": 0})
    with caplog.at_level(logging.INFO, logger="asyncgrpo.ps"):
        AsyncGRPOTrainer._show_progress(trainer, line)
    assert [r.getMessage() for r in caplog.records if r.getMessage().startswith("[train] step=7 reward=- ")]


@pytest.mark.parametrize("max_steps, logging_steps, shown", [
    (1000, 1, [1, *range(25, 1001, 25)]),
    # Only the steps TRL logs have a line: the shown ones are among them (steps 10, 20, 30 of 5, 10, 15 ... before).
    (60, 5, [1, *range(5, 61, 5)]),
    (2000, 10, [1, *range(50, 2001, 50)]),
])
def test_the_terminal_shows_a_few_dozen_step_lines_and_the_log_every_one(caplog, max_steps, logging_steps, shown):
    """A 1000-step run: the first, every 25th and the last at INFO (launch.sh's terminal shows those), the others at
    STEP: in the PS's log, not on the terminal."""
    import logging
    from types import SimpleNamespace

    from asyncgrpo.run.metrics import StepMetrics
    from ps.trainer import STEP, AsyncGRPOTrainer

    trainer = SimpleNamespace(pipeline=SimpleNamespace(failed=SimpleNamespace(prompts=0)),
                              cfg=SimpleNamespace(dynamic_sampling=False, difficulty_filter=0),
                              callback_handler=SimpleNamespace(callbacks=[]),
                              state=SimpleNamespace(max_steps=max_steps, logging_steps=logging_steps))
    logged = [step for step in range(1, max_steps + 1) if step == 1 or step % logging_steps == 0]
    with caplog.at_level(STEP, logger="asyncgrpo.ps"):
        for step in logged:
            line = StepMetrics(step=step, reward=0.5, reward_std=0.1, loss=0.0, grad_norm=0.0, staleness_mean=1.0,
                               staleness_max=1, token_staleness_mean=1.0, weights_version=step - 1,
                               trainer_wait_s=0.002, groups_dropped=0, groups_dropped_total=0, prompts_skipped=0,
                               tool_failure_rate=None, frac_reward_zero_std=0.5, steps_without_reward=0,
                               steps_without_spread=0, step_time_s=0.1, time=0.0,
                               queue_depth={"pending": 1, "processing": 1, "committing": 0, "complete": 0,
                                            "collected": 0})
            AsyncGRPOTrainer._show_progress(trainer, line)
    assert [int(r.getMessage().split()[1][5:]) for r in caplog.records if r.levelno == logging.INFO] == shown
    assert len([r for r in caplog.records if r.getMessage().startswith("[train] step=")]) == len(logged)


@pytest.mark.parametrize("logging_steps", [1, 10, 500])
def test_the_first_and_last_steps_are_logged_whatever_logging_steps(logging_steps):
    """TRL logs every --logging_steps (its default 10): a 3-step run logged nothing, so its terminal showed no
    [train] line and metrics.jsonl stayed empty. Steps 1 and max_steps are logged too; the others as TRL says."""
    from types import SimpleNamespace

    from transformers import TrainerControl, TrainerState, TrainingArguments
    from transformers.trainer_callback import DefaultFlowCallback

    from ps.trainer import _PipelineCallback

    args = TrainingArguments(output_dir="unused", logging_steps=logging_steps, report_to="none", max_steps=25)
    state = TrainerState(max_steps=25, logging_steps=logging_steps)
    trainer = SimpleNamespace(on_optimizer_step_end=lambda: None, hold_save_until_batch_ends=lambda control: None)
    callbacks = [DefaultFlowCallback(), _PipelineCallback(trainer)]  # in the order the trainer calls them
    logged = []
    for step in range(1, 26):
        state.global_step, control = step, TrainerControl()
        for callback in callbacks:
            callback.on_step_end(args, state, control)
        if control.should_log:
            logged.append(step)
    assert logged == sorted({1, 25, *range(logging_steps, 26, logging_steps)})
    no_logs = TrainingArguments(output_dir="unused", logging_strategy="no", report_to="none", max_steps=25)
    state.global_step, control = 1, TrainerControl()
    for callback in callbacks:
        callback.on_step_end(no_logs, state, control)
    assert not control.should_log
