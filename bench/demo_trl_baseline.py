"""Calibration of the demo task (asyncgrpo.tasks.demo) with plain, synchronous TRL GRPOTrainer on CPU.

Trains the tiny demo Llama with TRL 1.16's own GRPOTrainer (transformers generation, no vLLM) using
DEMO_DEFAULTS (plus use_cpu=True, bf16=False), one run per seed, logging the mean reward of every step
(logging_steps=1) through a TrainerCallback. Prints ONE JSON object on stdout (progress on stderr):
per seed, the first step (and wall seconds since training began) at which the rolling mean over the last
10 steps' rewards reaches 0.8, 0.9 and 0.99; the initial reward (mean of the first 10 steps); the mean
and median step time; and a summary over the seeds.

Run:  .venv/bin/python bench/demo_trl_baseline.py [--seeds 0 1 2] [--max-steps N]
          [--lr X] [--temperature T] [--max-completion-length L] [--hidden-size H] [--num-layers K]
          [--intermediate-size I] [--scheduler constant|linear|cosine] [--early-stop] [--curve]
          [--set GRPOCONFIG_FIELD=VALUE ...]
By default a run trains all max_steps and reports, as a measure of stability, the lowest rolling mean after
first reaching 0.99 and the number of steps after that with a rolling mean below 0.95; --early-stop ends a
run once the rolling mean reaches 0.99; --curve adds the per-step rewards to the JSON. Each run's
output_dir is a fresh temp dir under /tmp, removed at the end. Step counts are deterministic for a seed
(also across thread counts); wall times depend on what else the machine runs.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
import warnings

from common import model_shape, set_overrides, step_times_ms, steps_to_thresholds, thresholds_summary, train_timed
from transformers import TrainerCallback

from asyncgrpo.tasks.demo import (
    DEMO_DEFAULTS,
    build_dataset,
    build_model,
    build_tokenizer,
    cpu_overrides,
    repeat_digit_reward,
)

THRESHOLDS = (0.8, 0.9, 0.99)
WINDOW = 10


class RewardRecorder(TrainerCallback):
    """Records (step, reward, seconds since train begin) at every log, and step durations."""

    def __init__(self, early_stop_at: float | None, window: int = WINDOW):
        self.rewards: list[float] = []
        self.times: list[float] = []
        self.step_durations: list[float] = []
        self.reached: dict[float, tuple[int, float]] = {}
        self.early_stop_at = early_stop_at
        self.window = window
        self._t0 = 0.0
        self._step_t = 0.0

    def on_train_begin(self, args, state, control, **kwargs):
        self._t0 = self._step_t = time.perf_counter()

    def on_step_begin(self, args, state, control, **kwargs):
        self._step_t = time.perf_counter()

    def on_step_end(self, args, state, control, **kwargs):
        self.step_durations.append(time.perf_counter() - self._step_t)

    def on_log(self, args, state, control, logs=None, **kwargs):
        if not logs or "reward" not in logs:
            return
        now = time.perf_counter() - self._t0
        self.rewards.append(float(logs["reward"]))
        self.times.append(now)
        if len(self.rewards) >= self.window:
            rolling = statistics.fmean(self.rewards[-self.window :])
            for th in THRESHOLDS:
                if th not in self.reached and rolling >= th:
                    self.reached[th] = (state.global_step, now)
        step = state.global_step
        if step % 50 == 0:
            rolling = statistics.fmean(self.rewards[-self.window :])
            print(f"  step {step:5d}  reward {self.rewards[-1]:.3f}  rolling {rolling:.3f}  t {now:6.1f}s",
                  file=sys.stderr, flush=True)
        if self.early_stop_at is not None and self.early_stop_at in self.reached:
            control.should_training_stop = True


def run_seed(seed: int, overrides: dict, model_kwargs: dict, early_stop_at: float | None, curve: bool) -> dict:
    from trl import GRPOConfig, GRPOTrainer

    out = tempfile.mkdtemp(prefix=f"demo_trl_baseline_s{seed}_", dir="/tmp")
    try:
        kwargs = {**DEMO_DEFAULTS, **cpu_overrides(), "output_dir": out, "seed": seed, "disable_tqdm": True}
        kwargs.update(overrides)
        args = GRPOConfig(**kwargs)
        tok = build_tokenizer()
        model = build_model(seed=seed, tokenizer=tok, **model_kwargs)
        recorder = RewardRecorder(early_stop_at)
        trainer = GRPOTrainer(
            model=model,
            reward_funcs=repeat_digit_reward,
            args=args,
            train_dataset=build_dataset(n=1000, seed=seed),
            processing_class=tok,
            callbacks=[recorder],
        )
        train_s = train_timed(trainer)
    finally:
        shutil.rmtree(out, ignore_errors=True)

    result = {
        "seed": seed,
        "steps_run": len(recorder.rewards),
        "train_wall_s": round(train_s, 2),
        "initial_reward": round(statistics.fmean(recorder.rewards[:WINDOW]), 4),
        "final_rolling_reward": round(statistics.fmean(recorder.rewards[-WINDOW:]), 4),
        **step_times_ms(recorder.step_durations, digits=2),
        "n_params": sum(p.numel() for p in model.parameters()),
        **steps_to_thresholds(recorder.reached, THRESHOLDS, digits=2),
    }
    rolling = [statistics.fmean(recorder.rewards[max(0, i - WINDOW + 1) : i + 1]) for i in range(len(recorder.rewards))]
    # Stability once learned: the lowest rolling mean after first reaching 0.99, and how many steps after that
    # the rolling mean spent below 0.95 (only telling without --early-stop).
    step_99 = result["steps_to_0.99"]
    after = rolling[step_99 - 1 :] if step_99 is not None else []
    result["min_rolling_after_0.99"] = round(min(after), 4) if after else None
    result["steps_below_0.95_after_0.99"] = sum(r < 0.95 for r in after) if after else None
    if curve:
        result["rewards"] = [round(r, 4) for r in recorder.rewards]
    return result


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1])
    p.add_argument("--max-steps", type=int, default=DEMO_DEFAULTS["max_steps"])
    p.add_argument("--lr", type=float, default=DEMO_DEFAULTS["learning_rate"])
    p.add_argument("--temperature", type=float, default=DEMO_DEFAULTS["temperature"])
    p.add_argument("--max-completion-length", type=int, default=DEMO_DEFAULTS["max_completion_length"])
    p.add_argument("--batch-size", type=int, default=DEMO_DEFAULTS["per_device_train_batch_size"])
    p.add_argument("--num-generations", type=int, default=DEMO_DEFAULTS["num_generations"])
    p.add_argument("--scheduler", default=DEMO_DEFAULTS["lr_scheduler_type"])
    p.add_argument("--hidden-size", type=int, default=None)
    p.add_argument("--num-layers", type=int, default=None)
    p.add_argument("--intermediate-size", type=int, default=None)
    p.add_argument("--early-stop", action="store_true", help="stop a run once the rolling mean reaches 0.99")
    p.add_argument("--curve", action="store_true")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="any other GRPOConfig field (VALUE parsed as JSON if it can be), e.g. --set max_grad_norm=0.5")
    a = p.parse_args(argv)

    overrides = {
        "max_steps": a.max_steps,
        "learning_rate": a.lr,
        "temperature": a.temperature,
        "max_completion_length": a.max_completion_length,
        "per_device_train_batch_size": a.batch_size,
        "num_generations": a.num_generations,
        "lr_scheduler_type": a.scheduler,
    }
    overrides.update(set_overrides(a.set))
    model_kwargs = model_shape(a)
    early = max(THRESHOLDS) if a.early_stop else None
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    warnings.filterwarnings("ignore")

    runs = []
    for seed in a.seeds:
        print(f"seed {seed}", file=sys.stderr, flush=True)
        runs.append(run_seed(seed, overrides, model_kwargs, early, a.curve))
        print(json.dumps({k: v for k, v in runs[-1].items() if k != "rewards"}), file=sys.stderr, flush=True)

    summary = {"seeds": len(runs), **thresholds_summary(runs, THRESHOLDS)}
    mins = [r["min_rolling_after_0.99"] for r in runs if r["min_rolling_after_0.99"] is not None]
    summary["min_rolling_after_0.99"] = min(mins) if mins else None
    summary["mean_step_ms"] = round(statistics.fmean(r["mean_step_ms"] for r in runs), 2)
    config = {**DEMO_DEFAULTS, **cpu_overrides(), **overrides, "model_kwargs": model_kwargs}
    print(json.dumps({"config": config, "runs": runs, "summary": summary}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
