"""Where asynchrony matters: multi-turn rollouts whose tool calls wait (a seeded random latency per call).

    .venv/bin/python bench/tool_latency.py [--seeds 0,1,2] [--configs trl,async1,async3]
        [--latency-ms 200] [--steps 40] [--target 0.8] [--cap 400] [--out results.json]

The task is the built-in lookup task (asyncgrpo/tasks/lookup.py: the model calls lookup(key), then answers the
secret the tool returned), its environment slowed down: each call sleeps a uniform random 0..--latency-ms
milliseconds (SlowLookup below, seeded by the run's seed and the call's order in its process). A sleeping tool
waits and uses no CPU, like a sandbox, a web request or a database. TRL calls a batch's sync tools one after
the other, inside its training step, so the trainer waits for every call; asyncgrpo's workers wait on theirs
while the PS trains on the results other workers wrote.

Every run is real processes: plain TRL GRPOTrainer (environment_factory=SlowLookup) in a child of this script
with one thread; `python -m ps` and N `python -m worker` with `--builtin_task lookup
--environment_factory slow_lookup:SlowLookup --reward_funcs asyncgrpo.tasks.lookup:lookup_reward` (threads as
launch.sh gives them). Same model (the lookup task's
tiny Llama, seed 0), dataset, reward and GRPOConfig (LOOKUP_DEFAULTS).

Per run:
    samples_s   completions trained per second over the first --steps optimizer steps, from the moment training
                could start (TRL: the trainer built; asyncgrpo: the PS ready and every worker holding weights)
    wall_s      seconds from that moment to a rolling reward (mean over WINDOW steps) of --target, or None
                when the run stopped at --cap steps first
    tools       the fraction of the workers' job time spent in tool calls (asyncgrpo: queue_tools report's
                split from the turn events)
The table gives medians [min-max] over seeds and the ratios asyncgrpo / TRL. Progress goes to stderr; the
table and then the JSON document to stdout (and the JSON to --out).
"""

from __future__ import annotations

import os
import statistics
import sys
from pathlib import Path

import race
from common import REPO, child_env, run_matrix

from asyncgrpo.run import RunDir

BENCH = Path(__file__).resolve().parent
RUN_TIMEOUT_S = 3600
CONFIGS = {"trl": None, "async1": 1, "async3": 3}
LATENCY_ENV = "TOOL_LATENCY_MS"  # the slowed-down tool's latency bound, for every process of a run
SEED_ENV = "TOOL_LATENCY_SEED"


def hyperparameters(seed: int) -> dict:
    from asyncgrpo.tasks.demo import cpu_overrides
    from asyncgrpo.tasks.lookup import LOOKUP_DEFAULTS

    return {**LOOKUP_DEFAULTS, **cpu_overrides(), "seed": seed, "save_strategy": "no", "disable_tqdm": True}


def trl_child(spec_path: str) -> int:
    """Plain TRL with the slowed-down environment until the target or the cap; one JSON line per step."""
    spec = race.child_spec(spec_path)
    from slow_lookup import SlowLookup

    from asyncgrpo.tasks.lookup import build_dataset, lookup_reward, write_lookup_model

    def should_stop(rewards: list[float], step: int) -> bool:
        return (race.reached(rewards, spec["target"]) is not None and step >= spec["steps"]) or step >= spec["cap"]

    return race.train_trl(spec, write_lookup_model, lookup_reward, build_dataset, should_stop,
                     environment_factory=SlowLookup)


def bench_env(threads: int, latency_ms: float, seed: int) -> dict:
    env = child_env(threads)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(BENCH), str(REPO), env.get("PYTHONPATH")) if p)
    env[LATENCY_ENV], env[SEED_ENV] = str(latency_ms), str(seed)
    env["TRL_EXPERIMENTAL_SILENCE"] = "1"
    return env


def run_trl(seed: int, latency_ms: float, steps: int, target: float, cap: int, work: Path) -> dict:
    spec = {"config": hyperparameters(seed), "target": target, "cap": cap, "steps": steps}
    returncode, ready, rows = race.run_trl(__file__, spec, work, bench_env(1, latency_ms, seed), RUN_TIMEOUT_S)
    batch = spec["config"]["per_device_train_batch_size"]
    return summarize([r["reward"] for r in rows], [r["t"] for r in rows], ready, batch, steps, target,
                     tools=None, returncode=returncode)


def run_async(seed: int, workers: int, latency_ms: float, steps: int, target: float, cap: int, work: Path) -> dict:
    run = work / "run"
    # The task's reward named, so its environment can be swapped: its defaults are then given as flags.
    from asyncgrpo.tasks.lookup import LOOKUP_DEFAULTS

    flags = ["--run_dir", str(run), "--device_type", "cpu", "--disable_tqdm", "true",
             *[f"--{k}={v}" for k, v in LOOKUP_DEFAULTS.items()], "--seed", str(seed), "--save_strategy", "no",
             "--builtin_task", "lookup", "--environment_factory", "slow_lookup:SlowLookup",
             "--reward_funcs", "asyncgrpo.tasks.lookup:lookup_reward"]

    def should_stop(rewards: list[float]) -> bool:
        return (race.reached(rewards, target) is not None and len(rewards) >= steps) or len(rewards) >= cap

    env = bench_env(race.launch_threads(workers), latency_ms, seed)
    status, rows, all_ready = race.run_asyncgrpo(run, flags, env, workers, should_stop, RUN_TIMEOUT_S, 180)
    from queue_tools.report import make_report

    report = make_report(RunDir(run)) or {}
    split = report.get("rollouts") or {}
    batch = hyperparameters(seed)["per_device_train_batch_size"]
    return summarize([r["reward"] for r in rows], [r["time"] for r in rows], all_ready, batch, steps, target,
                     tools=split.get("tools_fraction"),
                     returncode=status)


def summarize(rewards, times, ready, batch, steps, target, tools, returncode) -> dict:
    step = race.reached(rewards, target)
    out = {"samples_s": None, "wall_s": None, "steps_to_target": step, "steps_run": len(rewards),
           "tools": None if tools is None else round(tools, 3), "returncode": returncode}
    if ready and len(times) >= steps:
        out["samples_s"] = round(steps * batch / (times[steps - 1] - ready), 2)
    if ready and step is not None:
        out["wall_s"] = round(times[step - 1] - ready, 1)
    return out


def median_range(values: list, digits: int = 1) -> str:
    values = [v for v in values if v is not None]
    if not values:
        return "-"
    med = statistics.median(values)
    return f"{med:.{digits}f} [{min(values):.{digits}f}-{max(values):.{digits}f}]"


def table(results: dict) -> tuple[str, dict]:
    lines = [f"{'config':<8}{'samples/s':>22}{'wall_s to target':>24}{'steps to target':>20}{'tool share':>20}"]
    for config, runs in results.items():
        lines.append(f"{config:<8}" + "".join(f"{median_range([r[k] for r in runs], d):>{w}}" for k, w, d in
                                              (("samples_s", 22, 1), ("wall_s", 24, 1), ("steps_to_target", 20, 0),
                                               ("tools", 20, 2))))
    ratios = {}
    base = results.get("trl")
    for config, runs in results.items():
        if config == "trl" or not base:
            continue
        ratio = {}
        for key in ("samples_s", "wall_s"):
            a, b = [[r[key] for r in rs if r[key] is not None] for rs in (base, runs)]
            ratio[key] = round(statistics.median(b) / statistics.median(a), 2) if a and b else None
        ratios[config] = ratio
        lines.append(f"{config} / trl: samples/s x{ratio['samples_s']}, wall clock to target x{ratio['wall_s']} "
                     "(medians over seeds)")
    return "\n".join(lines), ratios


def main(argv: list[str] | None = None) -> int:
    parser = race.argument_parser(__doc__.splitlines()[0], CONFIGS, cap=400)
    parser.add_argument("--latency-ms", type=float, default=200.0)
    parser.add_argument("--steps", type=int, default=40, help="optimizer steps samples/s is measured over")
    args = race.parse(parser, argv, CONFIGS)
    if args.trl_child:
        return trl_child(args.trl_child)

    def run_one(config: str, seed: int, work: Path) -> dict:
        if CONFIGS[config] is None:
            return run_trl(seed, args.latency_ms, args.steps, args.target, args.cap, work)
        return run_async(seed, CONFIGS[config], args.latency_ms, args.steps, args.target, args.cap, work)

    results = run_matrix(args.seeds, args.configs, "bench_tools_", run_one, str)
    text, ratios = table(results)
    doc = {"latency_ms": args.latency_ms, "steps": args.steps, "target": args.target, "window": race.WINDOW,
           "cap": args.cap, "seeds": args.seeds, "ratios": ratios, "results": results}
    race.report(text, doc, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
