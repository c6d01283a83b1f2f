"""What a reward function sees on a worker: TRL's keyword arguments, with the PS's step as
``trainer_state.global_step`` (a worker never trains, so its own step would always be 0)."""

from helpers import demo_config

from asyncgrpo.events import EventLog
from asyncgrpo.messages import RepeatedFailureLog
from asyncgrpo.tasks.demo import build_dataset, build_model, build_tokenizer
from worker.generate import build_trainer, generate_and_score, job_seed


def test_a_reward_function_sees_the_ps_step_the_job_was_thrown_at(tmp_path):
    seen = []

    def reward_reading_the_step(prompts, completions, trainer_state, **kwargs):
        seen.append(trainer_state.global_step)
        return [0.0] * len(prompts)

    cfg = demo_config(tmp_path)
    tokenizer = build_tokenizer()
    dataset = build_dataset(n=40)
    trainer = build_trainer(cfg, build_model(seed=0, tokenizer=tokenizer), tokenizer, [reward_reading_the_step],
                            dataset)
    rows = [dataset[i // cfg.num_generations] for i in range(cfg.generation_batch_size)]
    for ps_step in (7, 12):
        generate_and_score(trainer, rows, EventLog.off(), seed=0, ps_step=ps_step)
    assert seen == [7, 12]


def test_a_reward_function_drawing_random_numbers_draws_by_job_not_in_lockstep_across_workers(tmp_path):
    """TRL's set_seed gives every worker's trainer the same generators: two workers' rewards drew the same numbers
    from Python's ``random`` and numpy's, in the same order, and a restarted worker drew them again. They are seeded
    by the job now, as its sampling is: another job draws others, the same job the same on any worker."""
    import random

    import numpy as np

    drawn = []

    def reward_drawing(prompts, **kwargs):
        drawn.append((random.random(), float(np.random.random())))
        return [0.0] * len(prompts)

    cfg = demo_config(tmp_path)
    tokenizer = build_tokenizer()
    dataset = build_dataset(n=40)
    rows = [dataset[i // cfg.num_generations] for i in range(cfg.generation_batch_size)]

    def a_worker():  # (its trainer built as a worker's is: TRL seeds it)
        return build_trainer(cfg, build_model(seed=0, tokenizer=tokenizer), tokenizer, [reward_drawing], dataset)

    first, second = a_worker(), a_worker()
    generate_and_score(first, rows, EventLog.off(), seed=job_seed(cfg.seed, "000001_000"))
    generate_and_score(second, rows, EventLog.off(), seed=job_seed(cfg.seed, "000001_001"))
    generate_and_score(second, rows, EventLog.off(), seed=job_seed(cfg.seed, "000001_000"))
    assert drawn[0] != drawn[1] and drawn[0][0] != drawn[1][0] and drawn[0][1] != drawn[1][1]
    assert drawn[2] == drawn[0]


def test_a_reward_function_that_has_not_returned_after_a_while_is_named_in_a_jobs_line(tmp_path, monkeypatch, caplog):
    """A reward that hangs would stall the run with no word of where: past SLOW_REWARD_S a [jobs] line (which
    launch.sh shows) names it, sync or async; one that returns in time says nothing, and TRL still names each
    reward by its function's name."""
    import asyncio
    import time

    from worker import generate

    def slow_reward(prompts, **kwargs):
        time.sleep(0.6)
        return [0.0] * len(prompts)

    async def slow_async_reward(prompts, **kwargs):
        await asyncio.sleep(0.6)
        return [0.0] * len(prompts)

    def quick_reward(prompts, **kwargs):
        return [1.0] * len(prompts)

    monkeypatch.setattr(generate, "SLOW_REWARD_S", 0.2)
    monkeypatch.setattr(generate, "JOB_FAILURES", RepeatedFailureLog(generate.log, "jobs"))
    cfg = demo_config(tmp_path)
    tokenizer = build_tokenizer()
    dataset = build_dataset(n=40)
    trainer = build_trainer(cfg, build_model(seed=0, tokenizer=tokenizer), tokenizer,
                            [slow_reward, slow_async_reward, quick_reward], dataset)
    assert trainer.reward_func_names == ["slow_reward", "slow_async_reward", "quick_reward"]
    rows = [dataset[i // cfg.num_generations] for i in range(cfg.generation_batch_size)]
    with caplog.at_level("WARNING", logger="asyncgrpo.worker"):
        batch, _ = generate_and_score(trainer, rows, EventLog.off(), seed=0)
    lines = sorted(r.getMessage() for r in caplog.records if "[jobs]" in r.getMessage())
    assert lines == [f"[jobs] reward function {name!r} has run for 0.2 s and not returned: the job waits for it, "
                     "and the trainer for the job (the first such failure; repeats are counted and logged every 60 s)"
                     for name in ("slow_async_reward", "slow_reward")]
    assert batch["rewards"].tolist() == [1.0] * cfg.generation_batch_size  # 0 + 0 + 1: each reward's own output


def test_a_reward_that_is_not_a_finite_number_is_named_and_counts_as_not_scored(tmp_path, monkeypatch, caplog):
    """inf, a string, a list: each named once in a [jobs] line (the function and the value) and read as None
    (that completion not scored by it), never reaching the advantages; numbers, None and NaN (TRL's None) as
    they were, and the other rows scored as they would be."""
    import math

    import numpy as np
    import torch

    from worker import generate

    odd = [math.inf, "0.5", [1.0], -math.inf]

    def odd_reward(prompts, **kwargs):
        return [odd[i] if i < len(odd) else 1.0 for i in range(len(prompts))]

    def fine_reward(prompts, **kwargs):
        return [0.5] * len(prompts)

    monkeypatch.setattr(generate, "JOB_FAILURES", RepeatedFailureLog(generate.log, "jobs"))
    numbers = [1, True, None, math.nan, np.float32(2), torch.tensor(3.0), np.array([4.0])]
    with caplog.at_level("WARNING", logger="asyncgrpo.worker"):
        checked = generate.scored("r", numbers)
    assert all(a is b for a, b in zip(checked, numbers, strict=True))  # as they were
    assert not caplog.records  # (numbers, None and NaN are no news)
    cfg = demo_config(tmp_path)
    tokenizer = build_tokenizer()
    dataset = build_dataset(n=40)
    trainer = build_trainer(cfg, build_model(seed=0, tokenizer=tokenizer), tokenizer, [odd_reward, fine_reward],
                            dataset)
    rows = [dataset[i // cfg.num_generations] for i in range(cfg.generation_batch_size)]
    with caplog.at_level("WARNING", logger="asyncgrpo.worker"):
        batch, _ = generate_and_score(trainer, rows, EventLog.off(), seed=0)
    lines = sorted(r.getMessage().split(" (the first")[0] for r in caplog.records if "[jobs]" in r.getMessage())
    assert lines == sorted(f"[jobs] reward function 'odd_reward' returned {value}, not a finite number: that "
                           "completion counts as not scored by it, as with None"
                           for value in ("inf", "'0.5'", "[1.0]", "-inf"))
    rewards = batch["rewards"]
    assert rewards.tolist() == [0.5] * len(odd) + [1.5] * (cfg.generation_batch_size - len(odd))
    assert torch.isfinite(batch["advantages"]).all()


def test_a_worker_s_trainer_state_holds_the_run_s_last_step_for_rewards_that_schedule_by_it(tmp_path):
    """A reward reads TRL's trainer_state; a worker never trains, so transformers left its max_steps at 0 (a schedule
    by global_step / max_steps divided by 0). The PS writes the run's last step in ps.json, its epochs' count where
    --max_steps is -1; the worker's state takes it, and the logging, eval and save steps it makes of their fractions."""
    import dataclasses
    import threading

    from asyncgrpo.jobqueue import JobQueue
    from asyncgrpo.run import RunDir
    from asyncgrpo.run.rundir import PSStatus
    from asyncgrpo.tasks.demo import write_demo_model
    from worker import loop

    run = RunDir.create(tmp_path / "run")
    write_demo_model(run.root / "demo_model")
    cfg = demo_config(tmp_path, max_steps=-1, num_train_epochs=0.16, logging_steps=0.25)
    status = PSStatus.starting(str(run.root / "demo_model"), None, cfg.generation_settings(), max_steps=40)
    run.write_ps_status(status)
    trainer = loop._wait_and_build_trainer(cfg, run, threading.Event(), None, loop.Waiting(1))
    assert (trainer.state.max_steps, trainer.state.logging_steps) == (40, 10)
    # A PS relaunched for more epochs: the worker's next claim reads its status.
    run.write_ps_status(dataclasses.replace(status, max_steps=80))
    queue = JobQueue(run)
    queue.put_job("000001_000", {}, created_step=1)
    loop._read_claimed(cfg, run, queue, queue.claim(1), 0, EventLog.off(), trainer)
    assert (trainer.state.max_steps, trainer.state.logging_steps) == (80, 20)
    # --max_steps given: the run's length, whatever an older PS's status says.
    trainer = loop._wait_and_build_trainer(demo_config(tmp_path, max_steps=16), run, threading.Event(), None,
                                           loop.Waiting(1))
    assert trainer.state.max_steps == 16
