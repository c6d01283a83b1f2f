"""Calibration of the lookup task (asyncgrpo.tasks.lookup) with plain TRL GRPOTrainer and its tool loop, on CPU.

Trains the tiny lookup Llama with TRL 1.16's own GRPOTrainer (transformers generation, no vLLM), with
`environment_factory=LookupEnv` (TRL's real multi-turn tool loop) and `reward_funcs=[lookup_reward]`, using
LOOKUP_DEFAULTS plus cpu_overrides(), one run per seed. Every --log-every steps it prints (stderr) the
rolling mean of the last 10 steps' rewards, TRL's `tools/call_frequency` (tool calls per rollout) and the
fraction of rollouts answered right; at the end ONE JSON object on stdout: per seed the first step (and
wall seconds) at which the rolling-10 reward reaches 0.5, 0.8 and 0.9, the initial reward (first 10 steps),
the final rolling reward and call frequency, and the mean / median step time.

Run:  .venv/bin/python bench/lookup_trl_baseline.py [--seeds 0 1 2] [--max-steps N] [--stop-at 0.9] [--job-seeds]
          [--lr X] [--temperature T] [--batch-size B] [--max-completion-length L] [--hidden-size H]
          [--num-layers K] [--intermediate-size I] [--log-every N] [--set GRPOCONFIG_FIELD=VALUE ...]
--stop-at R ends a run once the rolling mean reaches R (max_steps still sets the learning-rate decay).
Each run's output_dir is a fresh temp dir under /tmp, removed at the end.
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

from asyncgrpo.tasks.lookup import (
    LOOKUP_DEFAULTS,
    LookupEnv,
    build_dataset,
    build_model,
    build_tokenizer,
    cpu_overrides,
    lookup_reward,
)

THRESHOLDS = (0.5, 0.8, 0.9)
WINDOW = 10


class Recorder(TrainerCallback):
    """Records each logged step's reward, call frequency and time; prints a progress line every `log_every` steps."""

    def __init__(self, log_every: int, stop_at: float | None):
        self.rewards: list[float] = []
        self.call_freq: list[float] = []
        self.step_durations: list[float] = []
        self.reached: dict[float, tuple[int, float]] = {}
        self.log_every, self.stop_at = log_every, stop_at
        self._t0 = self._step_t = 0.0

    def on_train_begin(self, args, state, control, **kwargs):
        self._t0 = time.perf_counter()

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
            for th in THRESHOLDS:
                if th not in self.reached and rolling >= th:
                    self.reached[th] = (state.global_step, now)
        if state.global_step % self.log_every == 0:
            calls = statistics.fmean(self.call_freq[-WINDOW:])
            print(f"  step {state.global_step:5d}  rolling-{WINDOW} reward {rolling:.3f}  "
                  f"tools/call_frequency {calls:.2f}  t {now:6.1f}s", file=sys.stderr, flush=True)
        if self.stop_at is not None and len(self.rewards) >= WINDOW and rolling >= self.stop_at:
            control.should_training_stop = True


def run_seed(seed: int, overrides: dict, model_kwargs: dict, log_every: int, stop_at: float | None,
             job_seeds: bool = False) -> dict:
    from trl import GRPOConfig, GRPOTrainer

    out = tempfile.mkdtemp(prefix=f"lookup_trl_baseline_s{seed}_", dir="/tmp")
    try:
        kwargs = {**LOOKUP_DEFAULTS, **cpu_overrides(), "output_dir": out, "seed": seed, "disable_tqdm": True}
        kwargs.update(overrides)
        tok = build_tokenizer()
        model = build_model(seed=seed, tokenizer=tok, **model_kwargs)
        recorder = Recorder(log_every, stop_at)
        trainer = GRPOTrainer(
            model=model,
            reward_funcs=[lookup_reward],
            args=GRPOConfig(**kwargs),
            train_dataset=build_dataset(n=1000, seed=seed),
            processing_class=tok,
            environment_factory=LookupEnv,
            callbacks=[recorder],
        )
        if job_seeds:
            seed_each_batch_as_a_worker(trainer, seed)
        train_s = train_timed(trainer)
    finally:
        shutil.rmtree(out, ignore_errors=True)

    return {
        "seed": seed,
        "steps_run": len(recorder.rewards),
        "train_wall_s": round(train_s, 1),
        "initial_reward": round(statistics.fmean(recorder.rewards[:WINDOW]), 3),
        "final_rolling_reward": round(statistics.fmean(recorder.rewards[-WINDOW:]), 3),
        "final_call_frequency": round(statistics.fmean(recorder.call_freq[-WINDOW:]), 3),
        **step_times_ms(recorder.step_durations, digits=1),
        "n_params": sum(p.numel() for p in model.parameters()),
        **steps_to_thresholds(recorder.reached, THRESHOLDS, digits=1),
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    p.add_argument("--max-steps", type=int, default=LOOKUP_DEFAULTS["max_steps"])
    p.add_argument("--stop-at", type=float, default=None, help="stop a run once the rolling-10 reward reaches this")
    p.add_argument("--log-every", type=int, default=25)
    p.add_argument("--lr", type=float, default=LOOKUP_DEFAULTS["learning_rate"])
    p.add_argument("--temperature", type=float, default=LOOKUP_DEFAULTS["temperature"])
    p.add_argument("--batch-size", type=int, default=LOOKUP_DEFAULTS["per_device_train_batch_size"])
    p.add_argument("--max-completion-length", type=int, default=LOOKUP_DEFAULTS["max_completion_length"])
    p.add_argument("--hidden-size", type=int, default=None)
    p.add_argument("--num-layers", type=int, default=None)
    p.add_argument("--intermediate-size", type=int, default=None)
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="any other GRPOConfig field (VALUE parsed as JSON if it can be)")
    p.add_argument("--job-seeds", action="store_true",
                   help="seed each generation batch's sampling as an asyncgrpo worker seeds a job")
    a = p.parse_args(argv)

    overrides = {
        "max_steps": a.max_steps,
        "learning_rate": a.lr,
        "temperature": a.temperature,
        "per_device_train_batch_size": a.batch_size,
        "max_completion_length": a.max_completion_length,
    }
    overrides.update(set_overrides(a.set))
    model_kwargs = model_shape(a)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    warnings.filterwarnings("ignore")

    runs = []
    for seed in a.seeds:
        print(f"seed {seed}", file=sys.stderr, flush=True)
        runs.append(run_seed(seed, overrides, model_kwargs, a.log_every, a.stop_at, a.job_seeds))
        print(json.dumps(runs[-1]), file=sys.stderr, flush=True)

    summary = {"seeds": len(runs), "mean_step_ms": round(statistics.fmean(r["mean_step_ms"] for r in runs), 1),
               **thresholds_summary(runs, THRESHOLDS)}
    config = {**LOOKUP_DEFAULTS, **cpu_overrides(), **overrides, "model_kwargs": model_kwargs}
    print(json.dumps({"config": config, "runs": runs, "summary": summary}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
