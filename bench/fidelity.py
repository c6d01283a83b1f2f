"""Learning curves of TRL and asyncgrpo on each built-in task: does asyncgrpo learn as TRL does?

    .venv/bin/python bench/fidelity.py [--tasks repeat,first_digit,lookup] [--configs trl,trl_job_seeds,sync,async3]
        [--seeds 0,1,2] [--max-steps N] [--out DIR]

For each task (its built-in defaults: asyncgrpo/tasks/demo.py DEMO_DEFAULTS, lookup.py LOOKUP_DEFAULTS), seed
and config, one run of --max-steps steps (default: the task's own, 1000), the same model, data, reward and
hyperparameters:

    trl            plain TRL GRPOTrainer, in this process (one RNG stream through the run)
    trl_job_seeds  the same, each generation batch's sampling seeded as asyncgrpo's workers seed a job
                   (worker/generate.py job_seed): seeded alike, synchronous asyncgrpo trains as this step for step
                   (tests/e2e/test_fidelity_with_trl.py)
    sync           asyncgrpo, `launch.sh --workers 1 --max_staleness 0` (real processes)
    asyncN         asyncgrpo, `launch.sh --workers N`

Per run: the first step at which the rolling mean of 10 steps' rewards reaches each of the task's two targets
(fixed here, before any run: TARGETS), and the final rolling reward. Per config: the median over seeds of the steps
to each target (a run that never reaches it counts as not reached: the median is then "-" if most did not). One
JSON document on stdout (and DIR/fidelity.json), a table on stderr, and DIR/fidelity_{task}.png: each run's
rolling reward against samples trained (steps x the generation batch), the configs' curves overlaid.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
TARGETS = {"repeat": (0.5, 0.9), "first_digit": (0.5, 0.9), "lookup": (0.5, 0.8)}
WINDOW = 10


def log(msg: str) -> None:
    print(f"[fidelity {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def task_parts(task: str) -> dict:
    """The task's defaults, model, data, reward and rollout hooks, as asyncgrpo's PS builds them (seed 0 model)."""
    from asyncgrpo.tasks import demo, lookup

    if task == "lookup":
        tok = lookup.build_tokenizer()
        return {"defaults": lookup.LOOKUP_DEFAULTS, "tokenizer": tok,
                "model": lookup.build_model(seed=0, tokenizer=tok), "reward": lookup.lookup_reward,
                "hooks": {"environment_factory": lookup.LookupEnv}, "dataset": lookup.build_dataset}
    tok = demo.build_tokenizer()
    reward = demo.first_digit_reward if task == "first_digit" else demo.repeat_digit_reward
    return {"defaults": demo.DEMO_DEFAULTS, "tokenizer": tok, "model": demo.build_model(seed=0, tokenizer=tok),
            "reward": reward, "hooks": {}, "dataset": demo.build_dataset}


def run_trl(task: str, seed: int, max_steps: int, job_seeds: bool) -> list[float]:
    """Plain TRL on the task: each step's reward."""
    from common import seed_each_batch_as_a_worker
    from transformers import TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from asyncgrpo.tasks.demo import cpu_overrides

    parts = task_parts(task)
    out = tempfile.mkdtemp(prefix="fidelity_trl_")
    args = GRPOConfig(**{**parts["defaults"], **cpu_overrides(), "output_dir": out, "seed": seed,
                         "max_steps": max_steps, "disable_tqdm": True, "report_to": "none", "save_strategy": "no"})
    trainer = GRPOTrainer(model=parts["model"], reward_funcs=[parts["reward"]], args=args,
                          train_dataset=parts["dataset"](seed=seed), processing_class=parts["tokenizer"],
                          **parts["hooks"])
    if job_seeds:
        seed_each_batch_as_a_worker(trainer, seed)
    rewards = []

    class Keep(TrainerCallback):
        def on_log(self, a, state, control, logs=None, **kwargs):
            if logs and "reward" in logs:
                rewards.append(float(logs["reward"]))

    trainer.add_callback(Keep())
    trainer.train()
    return rewards


def run_asyncgrpo(task: str, seed: int, max_steps: int, workers: int, sync: bool, work: Path) -> list[float]:
    run = work / f"{task}_s{seed}_w{workers}{'_sync' if sync else ''}"
    cmd = ["bash", str(REPO / "launch.sh"), "--workers", str(workers), "--run-dir", str(run), "--seed", str(seed),
           "--builtin_task", task, "--max-steps", str(max_steps), *(["--max_staleness", "0"] if sync else [])]
    result = subprocess.run(cmd, cwd=work, capture_output=True, text=True, timeout=7200)
    if result.returncode != 0:
        raise SystemExit(f"fidelity: {' '.join(cmd)} exited {result.returncode}: {result.stderr[-2000:]}")
    from asyncgrpo.run import RunDir, metrics

    return [line["reward"] for line in metrics.read_lines(RunDir(run).metrics_file)]


def rolling(rewards: list[float]) -> list[float]:
    return [statistics.fmean(rewards[max(0, i - WINDOW + 1):i + 1]) for i in range(len(rewards))]


def steps_to(curve: list[float], target: float) -> int | None:
    return next((i + 1 for i, r in enumerate(curve) if i + 1 >= WINDOW and r >= target), None)


def median_steps(steps: list[int | None]) -> float | None:
    """The median with "not reached" above every number: None when half or more did not reach it."""
    ordered = sorted(steps, key=lambda s: float("inf") if s is None else s)
    middle = ordered[(len(ordered) - 1) // 2]
    return None if middle is None else float(middle)


def plot(task: str, runs: list[dict], batch: int, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    colours = {}
    fig, ax = plt.subplots(figsize=(8, 4.5))
    for r in runs:
        colour = colours.setdefault(r["config"], f"C{len(colours)}")
        curve = rolling(r["rewards"])
        ax.plot([(i + 1) * batch for i in range(len(curve))], curve, color=colour, alpha=0.8, linewidth=1,
                label=r["config"] if r["seed"] == min(x["seed"] for x in runs) else None)
    for target in TARGETS[task]:
        ax.axhline(target, color="grey", linestyle=":", linewidth=0.8)
    ax.set(title=f"{task}: rolling-{WINDOW} reward, seeds overlaid", xlabel="samples trained", ylabel="reward")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tasks", default="repeat,first_digit,lookup")
    p.add_argument("--configs", default="trl,trl_job_seeds,sync,async3")
    p.add_argument("--seeds", default="0,1,2")
    p.add_argument("--max-steps", type=int, default=None, help="default: the task's own (1000)")
    p.add_argument("--out", default=None, help="folder for fidelity.json and the PNGs (default: a /tmp folder)")
    a = p.parse_args()
    out = Path(a.out or tempfile.mkdtemp(prefix="fidelity_"))
    out.mkdir(parents=True, exist_ok=True)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    doc = {"tasks": {}, "window": WINDOW, "targets": TARGETS}
    with tempfile.TemporaryDirectory() as tmp:
        for task in a.tasks.split(","):
            defaults = task_parts(task)["defaults"]
            max_steps = a.max_steps or defaults["max_steps"]
            runs = []
            for config in a.configs.split(","):
                for seed in (int(s) for s in a.seeds.split(",")):
                    log(f"{task} {config} seed {seed}")
                    started = time.monotonic()
                    if config.startswith("trl"):
                        rewards = run_trl(task, seed, max_steps, job_seeds=config == "trl_job_seeds")
                    else:
                        workers = 1 if config == "sync" else int(config.removeprefix("async"))
                        rewards = run_asyncgrpo(task, seed, max_steps, workers, config == "sync", Path(tmp))
                    curve = rolling(rewards)
                    runs.append({"config": config, "seed": seed, "rewards": rewards,
                                 "wall_s": round(time.monotonic() - started, 1),
                                 **{f"steps_to_{t}": steps_to(curve, t) for t in TARGETS[task]},
                                 "final_rolling": round(curve[-1], 3) if curve else None})
                    log(json.dumps({k: v for k, v in runs[-1].items() if k != "rewards"}))
            summary = {config: {f"median_steps_to_{t}": median_steps([r[f"steps_to_{t}"] for r in runs
                                                                       if r["config"] == config])
                                for t in TARGETS[task]} for config in a.configs.split(",")}
            doc["tasks"][task] = {"max_steps": max_steps, "runs": runs, "summary": summary}
            plot(task, runs, defaults["per_device_train_batch_size"], out / f"fidelity_{task}.png")
    print(f"{'task':<12} {'config':<14} " + " ".join(f"{'to ' + str(t):>8}" for t in (1, 2)), file=sys.stderr)
    for task, t in doc["tasks"].items():
        for config, s in t["summary"].items():
            print(f"{task:<12} {config:<14} " + " ".join(f"{'-' if v is None else int(v):>8}" for v in s.values()),
                  file=sys.stderr)
    text = json.dumps(doc)
    (out / "fidelity.json").write_text(text)
    print(text)
    log(f"figures in {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
