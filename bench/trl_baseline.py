"""Calibration of a built-in task (--task demo: asyncgrpo.tasks.demo's repeat; --task lookup: asyncgrpo.tasks.lookup,
with TRL's tool loop) with plain, synchronous TRL GRPOTrainer on CPU.

Trains the task's tiny Llama with TRL 1.16's own GRPOTrainer (transformers generation, no vLLM; for lookup
`environment_factory=LookupEnv`, TRL's real multi-turn tool loop) using the task's defaults (DEMO_DEFAULTS,
LOOKUP_DEFAULTS) plus cpu_overrides(), one run per seed, logging the mean reward of every step (logging_steps=1)
through a TrainerCallback. Every --log-every steps it prints (stderr) the rolling mean of the last 10 steps'
rewards (for lookup also TRL's `tools/call_frequency`, tool calls per rollout); at the end ONE JSON object on
stdout: per seed the first step (and wall seconds since training began) at which the rolling-10 reward reaches
each of the task's thresholds (demo 0.8, 0.9, 0.99; lookup 0.5, 0.8, 0.9), the initial reward (first 10 steps),
the final rolling reward (and call frequency), the mean and median step time; and a summary over the seeds.

Run:  .venv/bin/python bench/trl_baseline.py --task demo|lookup [--seeds 0 1 2] [--max-steps N] [--stop-at R]
          [--lr X] [--temperature T] [--batch-size B] [--num-generations G] [--max-completion-length L]
          [--scheduler constant|linear|cosine] [--hidden-size H] [--num-layers K] [--intermediate-size I]
          [--log-every N] [--curve] [--job-seeds] [--set GRPOCONFIG_FIELD=VALUE ...]
By default a run trains all max_steps (which also sets the learning-rate decay); --stop-at R ends it once the
rolling mean reaches R. For the demo it reports, as a measure of stability, the lowest rolling mean after first
reaching 0.99 and the number of steps after that with a rolling mean below 0.95. --curve adds the per-step rewards
to the JSON. Each run's output_dir is a fresh temp dir under /tmp, removed at the end. Step counts are
deterministic for a seed (also across thread counts); wall times depend on what else the machine runs.
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
from dataclasses import dataclass, field
from types import ModuleType

from common import (
    model_shape,
    seed_each_batch_as_a_worker,
    set_overrides,
    step_times_ms,
    steps_to_thresholds,
    thresholds_summary,
    train_timed,
)
from transformers import TrainerCallback

from asyncgrpo.tasks import demo, lookup

WINDOW = 10


@dataclass
class Task:
    module: ModuleType  # its DEFAULTS, build_tokenizer, build_model, build_dataset, cpu_overrides
    defaults: dict
    reward: object
    thresholds: tuple[float, ...]
    seeds: list[int]
    trainer_kwargs: dict = field(default_factory=dict)
    uses_tools: bool = False
    stable_above: float | None = None  # once the top threshold is reached: steps whose rolling mean falls below


TASKS = {
    "demo": Task(demo, demo.DEMO_DEFAULTS, demo.repeat_digit_reward, (0.8, 0.9, 0.99), [0, 1], stable_above=0.95),
    "lookup": Task(lookup, lookup.LOOKUP_DEFAULTS, lookup.lookup_reward, (0.5, 0.8, 0.9), [0, 1, 2],
                   {"environment_factory": lookup.LookupEnv}, uses_tools=True),
}


class Recorder(TrainerCallback):
    """Records each logged step's reward, call frequency and time, and step durations; prints a progress line every
    ``log_every`` steps; stops training once the rolling mean reaches ``stop_at``."""

    def __init__(self, task: Task, log_every: int, stop_at: float | None):
        self.task, self.log_every, self.stop_at = task, log_every, stop_at
        self.rewards: list[float] = []
        self.call_freq: list[float] = []
        self.step_durations: list[float] = []
        self.reached: dict[float, tuple[int, float]] = {}
        self._t0 = self._step_t = 0.0

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
        self.call_freq.append(float(logs.get("tools/call_frequency", 0.0)))
        rolling = statistics.fmean(self.rewards[-WINDOW:])
        if len(self.rewards) >= WINDOW:
            for th in self.task.thresholds:
                if th not in self.reached and rolling >= th:
                    self.reached[th] = (state.global_step, now)
        if state.global_step % self.log_every == 0:
            calls = (f"  tools/call_frequency {statistics.fmean(self.call_freq[-WINDOW:]):.2f}"
                     if self.task.uses_tools else "")
            print(f"  step {state.global_step:5d}  reward {self.rewards[-1]:.3f}  rolling-{WINDOW} {rolling:.3f}"
                  f"{calls}  t {now:6.1f}s", file=sys.stderr, flush=True)
        if self.stop_at is not None and len(self.rewards) >= WINDOW and rolling >= self.stop_at:
            control.should_training_stop = True


def run_seed(task: Task, seed: int, overrides: dict, model_kwargs: dict, recorder: Recorder, curve: bool,
             job_seeds: bool) -> dict:
    from trl import GRPOConfig, GRPOTrainer

    out = tempfile.mkdtemp(prefix=f"trl_baseline_s{seed}_", dir="/tmp")
    try:
        kwargs = {**task.defaults, **task.module.cpu_overrides(), "output_dir": out, "seed": seed,
                  "disable_tqdm": True, **overrides}
        tok = task.module.build_tokenizer()
        model = task.module.build_model(seed=seed, tokenizer=tok, **model_kwargs)
        trainer = GRPOTrainer(model=model, reward_funcs=[task.reward], args=GRPOConfig(**kwargs),
                              train_dataset=task.module.build_dataset(n=1000, seed=seed), processing_class=tok,
                              callbacks=[recorder], **task.trainer_kwargs)
        if job_seeds:
            seed_each_batch_as_a_worker(trainer, seed)
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
        **steps_to_thresholds(recorder.reached, task.thresholds, digits=2),
    }
    if task.uses_tools:
        result["final_call_frequency"] = round(statistics.fmean(recorder.call_freq[-WINDOW:]), 4)
    if task.stable_above is not None:
        # Stability once learned: the lowest rolling mean after first reaching the top threshold, and how many steps
        # after that the rolling mean spent below ``stable_above`` (only telling without --stop-at).
        top = max(task.thresholds)
        rolling = [statistics.fmean(recorder.rewards[max(0, i - WINDOW + 1): i + 1])
                   for i in range(len(recorder.rewards))]
        step = result[f"steps_to_{top}"]
        after = rolling[step - 1:] if step is not None else []
        below = sum(r < task.stable_above for r in after)
        result[f"min_rolling_after_{top}"] = round(min(after), 4) if after else None
        result[f"steps_below_{task.stable_above}_after_{top}"] = below if after else None
    if curve:
        result["rewards"] = [round(r, 4) for r in recorder.rewards]
    return result


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--task", choices=list(TASKS), required=True)
    p.add_argument("--seeds", type=int, nargs="+", help="default: 0 1 for demo, 0 1 2 for lookup")
    p.add_argument("--max-steps", type=int, help="default: the task's max_steps")
    p.add_argument("--stop-at", type=float, default=None, help="stop a run once the rolling-10 reward reaches this")
    p.add_argument("--log-every", type=int, default=25)
    # Each default: the task's own (DEMO_DEFAULTS, LOOKUP_DEFAULTS).
    for flag, key, kind in (("--lr", "learning_rate", float), ("--temperature", "temperature", float),
                            ("--batch-size", "per_device_train_batch_size", int),
                            ("--num-generations", "num_generations", int),
                            ("--max-completion-length", "max_completion_length", int),
                            ("--scheduler", "lr_scheduler_type", str)):
        p.add_argument(flag, dest=key, type=kind, help=f"the GRPOConfig's {key} (default: the task's)")
    p.add_argument("--hidden-size", type=int, default=None)
    p.add_argument("--num-layers", type=int, default=None)
    p.add_argument("--intermediate-size", type=int, default=None)
    p.add_argument("--curve", action="store_true", help="the per-step rewards in the JSON")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="any other GRPOConfig field (VALUE parsed as JSON if it can be), e.g. --set max_grad_norm=0.5")
    p.add_argument("--job-seeds", action="store_true",
                   help="seed each generation batch's sampling as an asyncgrpo worker seeds a job")
    a = p.parse_args(argv)
    task = TASKS[a.task]

    given = {"max_steps": a.max_steps, **{key: getattr(a, key) for key in (
        "learning_rate", "temperature", "per_device_train_batch_size", "num_generations", "max_completion_length",
        "lr_scheduler_type")}}
    overrides = {key: value for key, value in given.items() if value is not None}
    overrides.update(set_overrides(a.set))
    model_kwargs = model_shape(a)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    warnings.filterwarnings("ignore")

    runs = []
    for seed in a.seeds or task.seeds:
        print(f"seed {seed}", file=sys.stderr, flush=True)
        recorder = Recorder(task, a.log_every, a.stop_at)
        runs.append(run_seed(task, seed, overrides, model_kwargs, recorder, a.curve, a.job_seeds))
        print(json.dumps({k: v for k, v in runs[-1].items() if k != "rewards"}), file=sys.stderr, flush=True)

    summary = {"seeds": len(runs), **thresholds_summary(runs, task.thresholds),
               "mean_step_ms": round(statistics.fmean(r["mean_step_ms"] for r in runs), 2)}
    if task.stable_above is not None:
        key = f"min_rolling_after_{max(task.thresholds)}"
        mins = [r[key] for r in runs if r[key] is not None]
        summary[key] = min(mins) if mins else None
    config = {**task.defaults, **task.module.cpu_overrides(), **overrides, "model_kwargs": model_kwargs}
    print(json.dumps({"task": a.task, "config": config, "runs": runs, "summary": summary}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
