"""Dynamic sampling on the binary first_digit task: optimizer steps, generated samples and wall clock to a target
accuracy, with and without it, with 1 and 3 workers, and plain TRL GRPOTrainer (no filtering) as the reference.

    .venv/bin/python bench/dynamic_sampling.py [--seeds 0,1,2]
        [--configs trl,async1,async1_ds,async3,async3_ds,async3_ds_df]
        [--target 0.8] [--cap 600] [--out results.json] [--png dynamic_sampling.png]

Every run is real processes: `python -m ps` and N `python -m worker` with `--builtin_task first_digit` (plus
`--dynamic_sampling` for the `_ds` configs, and `--difficulty_filter 2` for `_df`), OpenMP threads as launch.sh
gives them; TRL's GRPOTrainer in a child of this script with one thread. Same model (the demo's tiny Llama,
initialised with seed 0), dataset, reward (first_digit_reward: 1 when the completion starts with the prompt's
digit, else 0) and GRPOConfig (the demo's: 4 prompts x 8 completions per step, lr 1e-3 decaying linearly to 0 at
max_steps 1000); `--seeds` vary data order and sampling.

Accuracy is the rolling mean over WINDOW steps of each step's reward: the mean reward of the completions
generated for the step's batch (with dynamic sampling, of the results its groups come from, dropped groups
included), so every config is measured on what its policy generates. A run stops when it reaches the target or at
the step cap ("not reached"). Per run:
    steps     optimizer steps to the target
    samples   completions generated until then (workers' results written by that time; TRL: steps x 32)
    wall_s    seconds from the moment training could start (TRL: the trainer built; asyncgrpo: the PS ready
              and every worker holding its first weights) to that step
    dropped   the fraction of groups dynamic sampling dropped (metrics.jsonl)
The table gives medians [min-max] over seeds, and for each worker count the ratios dynamic sampling / none of the
median steps and wall clock. The PNG plots each run's rolling accuracy against steps and against wall clock.
Progress goes to stderr; the table and then the JSON document to stdout (and the JSON to --out).
"""

from __future__ import annotations

import statistics
import sys
from pathlib import Path

import race
from common import child_env, run_matrix

from asyncgrpo.events import read_events

RUN_TIMEOUT_S = 1800
# asyncN: N workers; _ds: --dynamic_sampling; _df: --difficulty_filter DIFFICULTY_K as well.
CONFIGS = {"trl": None, "async1": (1, False, 0), "async1_ds": (1, True, 0), "async3": (3, False, 0),
           "async3_ds": (3, True, 0), "async3_ds_df": (3, True, 2)}
DIFFICULTY_K = 2
BATCH = 32  # completions per step (DEMO_DEFAULTS)


def hyperparameters(seed: int) -> dict:
    from asyncgrpo.tasks.demo import DEMO_DEFAULTS, cpu_overrides

    return {**DEMO_DEFAULTS, **cpu_overrides(), "seed": seed, "save_strategy": "no", "disable_tqdm": True}


def trl_child(spec_path: str) -> int:
    """Plain TRL on first_digit until the target or the cap; one JSON line per step to spec['log']."""
    spec = race.child_spec(spec_path)
    from asyncgrpo.tasks.demo import build_dataset, first_digit_reward, write_demo_model

    def should_stop(rewards: list[float], step: int) -> bool:
        return race.reached(rewards, spec["target"]) is not None or step >= spec["cap"]

    return race.train_trl(spec, write_demo_model, first_digit_reward, build_dataset, should_stop)


def run_trl(seed: int, target: float, cap: int, work: Path) -> dict:
    spec = {"config": hyperparameters(seed), "target": target, "cap": cap}
    returncode, ready, steps = race.run_trl(__file__, spec, work, child_env(1), RUN_TIMEOUT_S)
    return summarize([s["reward"] for s in steps], [s["t"] for s in steps], ready, target,
                     samples=lambda step, _t: step * BATCH, dropped=None, returncode=returncode)


def run_async(seed: int, workers: int, dynamic: bool, difficulty_k: int, target: float, cap: int, work: Path) -> dict:
    run = work / "run"
    flags = ["--run_dir", str(run), "--device_type", "cpu", "--disable_tqdm", "true", "--seed", str(seed),
             "--save_strategy", "no", "--builtin_task", "first_digit"]
    ps_flags = (*(["--dynamic_sampling"] if dynamic else []),
                *(["--difficulty_filter", str(difficulty_k)] if difficulty_k else []))
    status, steps, all_ready = race.run_asyncgrpo(
        run, flags, child_env(race.launch_threads(workers)), workers,
        lambda rewards: race.reached(rewards, target) is not None or len(rewards) >= cap, RUN_TIMEOUT_S, 120,
        ps_flags)
    written = read_events(run, role="worker", event="result_written")
    dropped = sum(s.get("groups_dropped") or 0 for s in steps)
    return summarize([s["reward"] for s in steps], [s["time"] for s in steps], all_ready, target,
                     samples=lambda _step, t: sum(e["samples"] for e in written if e["t"] <= t),
                     dropped=dropped / (dropped + len(steps) * BATCH // 8) if dynamic and steps else None,
                     returncode=status)


def summarize(rewards, times, ready, target, samples, dropped, returncode) -> dict:
    step = race.reached(rewards, target)
    out = {"steps": step, "samples": None, "wall_s": None, "dropped": None if dropped is None else round(dropped, 3),
           "steps_run": len(rewards), "returncode": returncode,
           "curve": {"rolling": [round(r, 4) for r in race.rolling(rewards)],
                     "t": [round(t - ready, 2) if ready else None for t in times]}}
    if step is not None:
        out["samples"] = samples(step, times[step - 1])
        out["wall_s"] = round(times[step - 1] - ready, 2) if ready else None
    return out


def median_range(values: list) -> str:
    values = [v for v in values if v is not None]
    if not values:
        return "not reached"
    med = statistics.median(values)
    return f"{med:.0f} [{min(values):.0f}-{max(values):.0f}]" if med >= 10 else \
        f"{med:.2f} [{min(values):.2f}-{max(values):.2f}]"


def table(results: dict, seeds: list[int]) -> tuple[str, dict]:
    lines = [f"{'config':<11}{'steps':>18}{'samples':>22}{'wall_s':>20}{'dropped':>18}{'reached':>9}"]
    for config, runs in results.items():
        lines.append(f"{config:<11}" + "".join(f"{median_range([r[k] for r in runs]):>{w}}" for k, w in
                                                (("steps", 18), ("samples", 22), ("wall_s", 20), ("dropped", 18)))
                     + f"{sum(r['steps'] is not None for r in runs):>6}/{len(seeds)}")
    ratios = {}
    for workers in (1, 3):
        base, ds = results.get(f"async{workers}"), results.get(f"async{workers}_ds")
        if not base or not ds:
            continue
        ratio = {}
        for key in ("steps", "samples", "wall_s"):
            a, b = [[r[key] for r in runs if r[key] is not None] for runs in (base, ds)]
            ratio[key] = round(statistics.median(b) / statistics.median(a), 3) if a and b else None
        ratios[f"{workers} worker(s)"] = ratio
        lines.append(f"dynamic sampling / none, {workers} worker(s): steps x{ratio['steps']}, "
                     f"samples x{ratio['samples']}, wall clock x{ratio['wall_s']} (medians over seeds)")
    return "\n".join(lines), ratios


def plot(results: dict, path: Path, target: float) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (by_step, by_time) = plt.subplots(1, 2, figsize=(12, 4.5))
    colours = dict(zip(results, plt.rcParams["axes.prop_cycle"].by_key()["color"], strict=False))
    for config, runs in results.items():
        for i, run in enumerate(runs):
            curve = run["curve"]["rolling"]
            label = config if i == 0 else None
            by_step.plot(range(1, len(curve) + 1), curve, color=colours[config], alpha=0.8, lw=1, label=label)
            if None not in run["curve"]["t"]:
                by_time.plot(run["curve"]["t"], curve, color=colours[config], alpha=0.8, lw=1, label=label)
    for ax, xlabel in ((by_step, "optimizer step"), (by_time, "seconds since training could start")):
        ax.axhline(target, color="grey", ls="--", lw=0.8)
        ax.set_xlabel(xlabel)
        ax.set_ylabel(f"accuracy (rolling mean over {race.WINDOW} steps)")
        ax.legend(fontsize=8)
    fig.suptitle("first_digit: dynamic sampling (_ds) against none, and plain TRL")
    fig.tight_layout()
    fig.savefig(path, dpi=80)


def main(argv: list[str] | None = None) -> int:
    parser = race.argument_parser(__doc__.splitlines()[0], CONFIGS, cap=600)
    parser.add_argument("--png", default="dynamic_sampling.png")
    args = race.parse(parser, argv, CONFIGS)
    if args.trl_child:
        return trl_child(args.trl_child)

    def run_one(config: str, seed: int, work: Path) -> dict:
        if CONFIGS[config] is None:
            return run_trl(seed, args.target, args.cap, work)
        return run_async(seed, *CONFIGS[config], args.target, args.cap, work)

    def summary_line(r: dict) -> str:
        return f"steps {r['steps']} samples {r['samples']} wall {r['wall_s']} s dropped {r['dropped']}"

    results = run_matrix(args.seeds, args.configs, "bench_ds_", run_one, summary_line)
    text, ratios = table(results, args.seeds)
    plot(results, Path(args.png), args.target)
    doc = {"target": args.target, "window": race.WINDOW, "cap": args.cap, "seeds": args.seeds, "ratios": ratios,
           "results": results, "png": str(Path(args.png).resolve())}
    race.report(text, doc, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
