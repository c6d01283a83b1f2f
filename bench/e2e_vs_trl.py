"""End to end: asyncgrpo (1, 2, 3 workers; synchronous mode) against plain TRL GRPOTrainer on the demo task.
(One script, longer than a module should be: the two sides, run as they must be compared, read side by side.)

    .venv/bin/python bench/e2e_vs_trl.py [--workloads small,larger] [--seeds 0,1,2]
        [--configs trl,async1,async2,async3,sync] [--quick] [--out results.json] [--keep]
        [--async-flags "--name value ..."]

Every run is real processes started from here: TRL's GRPOTrainer (synchronous, transformers generation, no
vLLM) in a child of this script (`--trl-child`), asyncgrpo as `python -m ps` plus N `python -m worker`, started
as launch.sh starts them (OMP/MKL threads = nproc // (N + 1), at least 1; `--device_type cpu`). `sync` is one
worker with `--max_staleness 0`. `trl` runs TRL twice, with 1 and with 2 OpenMP threads (trl1, trl2); the faster
(median step_ms) is the baseline of the ratios (trl2 is cut short when its steps take > 3x trl1's: two
threads on two busy cores can be 10x slower). Same model (initialised with seed 0), tokenizer, dataset, reward
function and GRPOConfig in both; `--seed` varies data order and sampling. Checkpointing is off in both
(`--save_strategy no`; launch.sh's demo saves every 100 steps, plain TRL does not). `--async-flags` adds flags
to every asyncgrpo process of every asyncgrpo config (e.g. "--off_policy_correction none"); TRL runs ignore them.

Workloads:
    small   the demo exactly as launch.sh runs it (75k-parameter Llama, DEMO_DEFAULTS, no model flag)
    larger  a 2.4M-parameter Llama (hidden 256, 4 layers, 4 heads, MLP 448) written here with save_pretrained,
            `--model_name_or_path DIR --max_completion_length 16 --learning_rate 1e-4`, DEMO_DEFAULTS otherwise

Both keep max_steps 1000 (it sets the linear lr decay); a run is stopped once the rolling mean reward over
WINDOW steps has reached the target and MARGIN more steps ran, or at the step cap ("not reached"): TRL by a
callback, asyncgrpo by SIGTERM to the PS and then the workers (their Ctrl-C path).

Per run (all times from the moment the first process was started, imports included):
    startup_s          processes ready. TRL: the trainer is built (just before train()). asyncgrpo: every
                       process is ready, i.e. the last worker has synced the PS's first weights.
    imports_s          of that, until the imports were done (TRL: after its imports; asyncgrpo: the PS's
                       ps.lock, made right after it parsed its flags); ps_ready_s, workers_ready_s: per process
    first_step_s       the first optimizer step has been logged
    steps_to_target    first step whose rolling mean (WINDOW steps) reaches the target; samples_to_target =
                       that x samples per step (32): learning efficiency (fewer is better)
    wall_to_target_s   wall clock from process start to that step
    samples_per_s      consumed (trained-on) completions per second from step WARMUP to the last step
    step_ms            1000 x (that span) / (steps in it): steady-state step time
    trainer_idle       asyncgrpo: sum(trainer_wait_s) / span over the same steps (RUN/metrics.jsonl). TRL: 0 by
                       construction; gen_frac says how much of its step is generation and scoring
    gen_ms             generation + scoring per batch (TRL: timed around _generate_and_score_completions;
                       asyncgrpo: per job, its generate and score spans in the timeline events; generate_ms and
                       score_ms split it, score including any behaviour log-probs not captured during generation)
    train_ms           the trainer's own time per step: TRL step minus its generation; asyncgrpo: PS step
                       minus its wait for a result (train_step_end events)
    queue_ms, sync_ms  asyncgrpo's per-job overhead: queue (claim, write, hand-off to the PS) and weight sync,
                       from the timeline events (RUN/logs/events-*.jsonl; see overhead())
    cpu_s, cores       CPU seconds of all the run's processes (rusage) and cpu_s / wall: how busy the cores were
    leaked_weight_buffers  the PS's /dev/shm weight folders left after it stopped (removed here)
Medians with [min-max] over seeds, ratios asyncgrpo / TRL of medians, and a headline per workload (the best config's
ratios and each config's samples to target against TRL's range).
Progress goes to stderr; the table and then the JSON document to stdout (and the JSON to --out).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shlex
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections import Counter, defaultdict
from pathlib import Path

from common import (
    REPO,
    child_env,
    ready_times,
    reap,
    remove_weight_buffers,
    run_trl_child,
    start_python,
    terminate_and_reap,
)

from asyncgrpo.jobqueue.names import done_reason
from asyncgrpo.run import RunDir, metrics
from queue_tools.timeline import length, load_events, num, span_of, subtract, union, worker_intervals

TARGET = 0.9       # rolling mean reward to reach
WINDOW = 20        # steps in the rolling mean
WARMUP = 20        # samples/s, step time and idle fraction count from this step on
MARGIN = 20        # steps run after reaching the target, then stop
CAPS = {"small": 700, "larger": 400}   # a run stops here if it has not reached the target ("not reached")
QUICK_CAPS = {"small": 400, "larger": 250}
QUICK_MARGIN = 5
# trl2 is stopped after WARMUP + SLOW_PROBE_STEPS steps when its steps take over SLOW_FACTOR x trl1's: it cannot be
# the baseline then (two OpenMP threads on two busy cores can be 10x slower than one).
SLOW_PROBE_STEPS, SLOW_FACTOR = 10, 3.0
RUN_TIMEOUT_S = 1800
LARGER_MODEL = {"hidden_size": 256, "num_layers": 4, "num_heads": 4, "intermediate_size": 448}  # 2.43M params
LARGER_OVERRIDES = {"learning_rate": 1e-4, "max_completion_length": 16}
# trlN: plain TRL with N OpenMP threads; "trl" in --configs means trl1 and trl2, and the faster of them (median
# step_ms) is the baseline the ratios use. asyncN: N workers; sync: 1 worker, max_staleness 0.
CONFIGS = {"trl1": 1, "trl2": 2, "async1": (1, None), "async2": (2, None), "async3": (3, None), "sync": (1, 0)}
DEFAULT_CONFIGS = "trl,async1,async2,async3,sync"


def log(msg: str) -> None:
    print(f"[e2e {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


# ----------------------------------------------------------------------------- stopping rule, shared by both

def rolling(rewards: list[float], i: int) -> float:
    """Mean reward of steps i-WINDOW+1 .. i (1-based step i)."""
    return statistics.fmean(rewards[i - WINDOW:i])


def target_step(rewards: list[float]) -> int | None:
    for i in range(WINDOW, len(rewards) + 1):
        if rolling(rewards, i) >= TARGET:
            return i
    return None


def should_stop(rewards: list[float], cap: int, margin: int) -> bool:
    reached = target_step(rewards)
    return len(rewards) >= cap or (reached is not None and len(rewards) >= reached + margin)


# ----------------------------------------------------------------------------- the TRL child process

def trl_child(spec_path: str) -> int:
    """Plain TRL: load the model, build GRPOTrainer, train until the stopping rule; JSON lines to spec['log']."""
    spec = json.loads(Path(spec_path).read_text())
    out = open(spec["log"], "a", buffering=1)

    def emit(**fields):
        out.write(json.dumps({"t": time.time(), **fields}) + "\n")

    import warnings

    warnings.filterwarnings("ignore")
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from transformers.trainer_callback import PrinterCallback
    from trl import GRPOConfig, GRPOTrainer

    from asyncgrpo.tasks.demo import build_dataset, repeat_digit_reward, write_demo_model

    emit(event="imported")
    work = tempfile.mkdtemp(prefix="e2e_trl_", dir=spec["tmp"])
    model_dir = spec["model_dir"] or write_demo_model(os.path.join(work, "demo_model"))  # as the PS does
    model = AutoModelForCausalLM.from_pretrained(model_dir)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    args = GRPOConfig(**spec["config"], output_dir=os.path.join(work, "out"))
    cap, margin, rewards, times, gen_s = spec["cap"], spec["margin"], [], [], []

    class Recorder(TrainerCallback):
        def on_log(self, args, state, control, logs=None, **kwargs):
            if not logs or "reward" not in logs:
                return
            rewards.append(float(logs["reward"]))
            times.append(time.time())
            emit(event="step", step=state.global_step, reward=rewards[-1], gen_s=sum(gen_s))
            gen_s.clear()
            if should_stop(rewards, cap, margin):
                control.should_training_stop = True
            probe = WARMUP + SLOW_PROBE_STEPS
            if spec["max_step_s"] and len(times) == probe + 1 and \
                    (times[probe] - times[WARMUP]) / SLOW_PROBE_STEPS > spec["max_step_s"]:
                emit(event="aborted_slow")
                control.should_training_stop = True

    trainer = GRPOTrainer(model=model, reward_funcs=repeat_digit_reward, args=args,
                          train_dataset=build_dataset(n=1000, seed=args.seed), processing_class=tokenizer,
                          callbacks=[Recorder()])
    trainer.remove_callback(PrinterCallback)
    generate = trainer._generate_and_score_completions

    def timed_generate(*a, **k):
        started = time.perf_counter()
        try:
            return generate(*a, **k)
        finally:
            gen_s.append(time.perf_counter() - started)

    trainer._generate_and_score_completions = timed_generate
    emit(event="ready")
    trainer.train()
    emit(event="end")
    shutil.rmtree(work, ignore_errors=True)
    return 0


# ----------------------------------------------------------------------------- processes

def hyperparameters(workload: str, seed: int) -> dict:
    """The GRPOConfig keyword arguments both sides train with."""
    from asyncgrpo.tasks.demo import DEMO_DEFAULTS, cpu_overrides

    hp = {**DEMO_DEFAULTS, **cpu_overrides(), "seed": seed, "save_strategy": "no", "disable_tqdm": True}
    if workload == "larger":
        hp.update(LARGER_OVERRIDES)
    return hp


def run_trl(workload: str, seed: int, model_dir: str | None, cap: int, margin: int, threads: int,
            work: Path, max_step_s: float | None = None) -> dict:
    work.mkdir(parents=True)
    events = work / "trl_events.jsonl"
    spec = {"config": hyperparameters(workload, seed), "model_dir": model_dir, "cap": cap, "margin": margin,
            "max_step_s": max_step_s, "log": str(events), "tmp": str(work)}
    t0 = time.time()
    proc, cpu = run_trl_child(__file__, spec, work, child_env(threads), RUN_TIMEOUT_S)
    t_end = time.time()
    lines = [json.loads(x) for x in events.read_text().splitlines()] if events.exists() else []
    steps = [x for x in lines if x["event"] == "step"]
    ready = next((x["t"] for x in lines if x["event"] == "ready"), None)
    imported = next((x["t"] for x in lines if x["event"] == "imported"), None)
    result = summarize(steps, t0, t_end, ready, cpu, proc.returncode, spec["config"]["per_device_train_batch_size"])
    gen = [s["gen_s"] for s in steps[WARMUP:] if s["gen_s"] > 0]
    result["gen_ms"] = r1(1e3 * statistics.median(gen)) if gen else None
    rest = [b["t"] - a["t"] - b["gen_s"] for a, b in zip(steps[WARMUP:-1], steps[WARMUP + 1:], strict=True)]
    result["train_ms"] = r1(1e3 * statistics.median(rest)) if rest else None  # the step minus generation
    if len(steps) > WARMUP + 1:
        span = steps[-1]["t"] - steps[WARMUP]["t"]
        result["gen_frac"] = r3(sum(s["gen_s"] for s in steps[WARMUP + 1:]) / span)
    result["trainer_idle"] = 0.0
    result["threads"] = threads
    result["imports_s"] = r2(imported - t0) if imported else None
    if any(x["event"] == "aborted_slow" for x in lines):
        result["aborted"] = f"steps {WARMUP + 2}-{WARMUP + SLOW_PROBE_STEPS + 1} took > {max_step_s:.3f} s each"
    if proc.returncode != 0:
        result["error"] = (work / "trl.log").read_text(errors="replace")[-2000:]
    return result


def async_args(workload: str, seed: int, model_dir: str | None, run: Path, max_staleness: int | None,
               extra: list[str] | tuple[str, ...] = ()) -> list[str]:
    """The flags of the PS and of every worker; `extra` (e.g. ["--off_policy_correction", "none"]) goes last."""
    args = ["--run_dir", str(run), "--device_type", "cpu", "--disable_tqdm", "true", "--seed", str(seed),
            "--save_strategy", "no"]
    if workload == "larger":  # not the demo: every hyperparameter spelled out, as the user of a model would
        hp = hyperparameters(workload, seed)
        for key in ("use_cpu", "bf16", "seed", "save_strategy", "disable_tqdm"):
            hp.pop(key)
        args += ["--model_name_or_path", model_dir] + [f"--{k}={v}" for k, v in hp.items()]
    if max_staleness is not None:
        args += ["--max_staleness", str(max_staleness)]
    return args + list(extra)


def run_async(workload: str, seed: int, model_dir: str | None, cap: int, margin: int, workers: int,
              max_staleness: int | None, work: Path, extra: list[str] | tuple[str, ...] = ()) -> dict:
    run = work / "run"
    (run / "logs").mkdir(parents=True)
    args = async_args(workload, seed, model_dir, run, max_staleness, extra)
    threads = max(1, (os.cpu_count() or 1) // (workers + 1))  # launch.sh on CPU
    env = child_env(threads)

    def start(name, *cmd):
        return start_python(run / "logs" / name, "-m", *cmd, *args, env=env)

    t0 = time.time()
    ps = start("log_parameter_server.txt", "ps")
    procs = [ps] + [start(f"log_worker_{i}.txt", "worker", "--device", str(i)) for i in range(1, workers + 1)]
    metrics_file, offset, steps = RunDir(run).metrics_file, 0, []
    ps_started = None
    deadline = time.monotonic() + RUN_TIMEOUT_S
    try:
        while ps.poll() is None and time.monotonic() < deadline:
            if ps_started is None and (run / "ps.json").exists():
                try:
                    ps_started = json.loads((run / "ps.json").read_text()).get("started_at")
                except (OSError, ValueError):
                    pass
            appended, offset = metrics.read_new_lines(metrics_file, offset)
            steps += appended
            if steps and should_stop([s["reward"] for s in steps], cap, margin):
                break
            time.sleep(0.1)
    finally:
        cpu = terminate_and_reap(procs, 120)  # the PS first: workers then finish the job in hand and exit
    t_end = time.time()
    leaked = remove_weight_buffers(run)
    steps = metrics.read_lines(metrics_file)
    for s in steps:
        s["t"] = s["time"]
    ready = ready_times(run, workers)
    all_ready = max([ps_started or 0.0, *ready.values()]) if len(ready) == workers else None
    batch = hyperparameters(workload, seed)["per_device_train_batch_size"]
    result = summarize(steps, t0, t_end, all_ready, cpu, 0 if ps.returncode in (0, 130, -15) else ps.returncode,
                       batch)
    result["ps_ready_s"] = r2(ps_started - t0) if ps_started else None
    # The PS creates ps.lock right after parsing its flags: its imports are done by then.
    result["imports_s"] = r2((run / "ps.lock").stat().st_mtime - t0) if (run / "ps.lock").exists() else None
    result["workers_ready_s"] = [r2(ready[i] - t0) for i in sorted(ready)]
    result["threads"] = threads
    if len(steps) > WARMUP + 1:
        span = steps[-1]["t"] - steps[WARMUP]["t"]
        result["trainer_idle"] = r3(sum(s["trainer_wait_s"] for s in steps[WARMUP + 1:]) / span)
        result["staleness_mean"] = r2(statistics.fmean(s["staleness_mean"] for s in steps[WARMUP:]))
    result["leaked_weight_buffers"] = leaked
    result.update(overhead(run))
    if result["returncode"] != 0:
        result["error"] = (run / "logs" / "log_parameter_server.txt").read_text(errors="replace")[-2000:]
    return result


# ----------------------------------------------------------------------------- measurements

def r1(x): return None if x is None else round(x, 1)
def r2(x): return None if x is None else round(x, 2)
def r3(x): return None if x is None else round(x, 3)


def summarize(steps: list[dict], t0: float, t_end: float, ready: float | None, cpu: float, rc: int,
              batch: int) -> dict:
    """The per-run figures both sides share; steps: dicts with step, reward and t (wall time of its log)."""
    rewards = [s["reward"] for s in steps]
    reached = target_step(rewards)
    res = {
        "returncode": rc,
        "steps_run": len(steps),
        "startup_s": r2(ready - t0) if ready else None,
        "first_step_s": r2(steps[0]["t"] - t0) if steps else None,
        "steps_to_target": reached,
        "samples_to_target": reached * batch if reached else None,
        "wall_to_target_s": r2(steps[reached - 1]["t"] - t0) if reached else None,
        "final_rolling_reward": r3(rolling(rewards, len(rewards))) if len(rewards) >= WINDOW else None,
        "total_wall_s": r2(t_end - t0),
        "cpu_s": r1(cpu),
        "cores": r2(cpu / (t_end - t0)),
    }
    if len(steps) > WARMUP + 1:
        span = steps[-1]["t"] - steps[WARMUP]["t"]
        n = len(steps) - 1 - WARMUP
        res["samples_per_s"] = r1(n * batch / span)
        res["step_ms"] = r1(1e3 * span / n)
    return res


def med(xs: list[float]) -> float | None:
    return r2(statistics.median(xs)) if xs else None


def overhead(run: Path) -> dict:
    """asyncgrpo's per-job figures from the run's timeline events, on queue_tools' tracks and interval arithmetic
    (queue_tools/timeline.py); medians in ms:
        sync_ms, syncs     weights_synced.dur_ms per sync (a worker copies the newest weights), and how many
        publish_ms         weights_published.dur_ms per step (PS)
        train_ms           train_step_end.dur_ms minus its wait_ms, from step WARMUP on
        gen_ms             per consumed job: its generate span's start to its score_end (with several jobs in one
                           generate call, the call's scoring before it included); generate_ms, score_ms: the spans
        worker_queue_ms    per job: its claim to result_written (the report's job span) while its worker neither
                           generated, scored, synced nor waited for weights: claims and loads, results' save + fsync
                           + rename (with several jobs in one call, theirs too)
        handoff_ms         result_collected.latency_ms (result written -> collected by the PS)
        queue_ms           per job: worker_queue_ms + handoff_ms
        pending_wait_ms    per consumed job: job_claimed.queue_wait_ms (created -> claimed: waiting for a free
                           worker; buffering, not overhead)
        consumed_after_ms  per consumed job: result_written -> archived consumed (waiting for the trainer; buffering)
    and archived: done/'s files by reason (asyncgrpo/jobqueue/names.py's grammar).
    """
    done = run / "done"
    reasons = [done_reason(name) for name in (os.listdir(done) if done.exists() else [])]
    res: dict = {"archived": dict(Counter(r.value for r in reasons if r is not None))}
    tracks, _, _ = load_events(RunDir(run))
    ps = [e for t in tracks if t.role == "ps" for e in t.events]
    workers = [t for t in tracks if t.role == "worker"]
    worker_events = [e for t in workers for e in t.events]

    def values(events: list[dict], name: str, field: str = "dur_ms") -> list[float]:
        return [v for e in events if e["event"] == name and (v := num(e, field)) is not None]

    computing = defaultdict(list)  # job id -> its generate and score spans
    worker_queue, written_at = {}, {}
    for track in workers:
        timeline = worker_intervals(track)
        busy = list(timeline["sync"])  # the worker syncing, waiting for weights, generating or scoring (any job)
        for e in track.events:
            if e["event"] in ("generate_end", "score_end") and (span := span_of(e)):
                computing[e.get("job_id")].append(span)
                busy.append(span)
        busy = union(busy)
        for job in timeline["records"]:
            if job["close"] is not None and job["close"]["event"] == "result_written":
                worker_queue[job["job_id"]] = 1e3 * length(subtract([(job["start"], job["end"])], busy))
                written_at[job["job_id"]] = job["end"]
    handoff = {e.get("job_id"): e["latency_ms"] for e in ps
               if e["event"] == "result_collected" and num(e, "latency_ms") is not None}
    consumed_at = {e.get("job_id"): e["mono"] for e in reversed(ps)  # (reversed: a job's first archive wins)
                   if e["event"] == "result_archived" and e.get("reason") == "consumed"}
    waited = {e.get("job_id"): e["queue_wait_ms"] for e in worker_events  # (a job's last claim wins)
              if e["event"] == "job_claimed" and num(e, "queue_wait_ms") is not None}
    syncs = values(worker_events, "weights_synced")
    steps = [e for e in ps if e["event"] == "train_step_end" and num(e, "dur_ms") is not None][WARMUP:]
    res.update(
        sync_ms=med(syncs), syncs=len(syncs), publish_ms=med(values(ps, "weights_published")),
        train_ms=med([e["dur_ms"] - (num(e, "wait_ms") or 0.0) for e in steps]),
        gen_ms=med([1e3 * (max(end for _, end in spans) - min(start for start, _ in spans))
                    for job, spans in computing.items() if job in consumed_at]),
        generate_ms=med(values(worker_events, "generate_end")), score_ms=med(values(worker_events, "score_end")),
        worker_queue_ms=med(list(worker_queue.values())), handoff_ms=med(list(handoff.values())),
        queue_ms=med([worker_queue[j] + handoff[j] for j in worker_queue if j in handoff]),
        pending_wait_ms=med([waited[j] for j in consumed_at if j in waited]),
        consumed_after_ms=med([1e3 * (consumed_at[j] - written_at[j]) for j in written_at if j in consumed_at]))
    return res


# ----------------------------------------------------------------------------- aggregation and report

METRICS = ["startup_s", "imports_s", "first_step_s", "samples_per_s", "step_ms", "steps_to_target",
           "samples_to_target", "wall_to_target_s", "final_rolling_reward", "trainer_idle", "gen_frac", "gen_ms",
           "generate_ms", "score_ms", "train_ms", "queue_ms", "sync_ms", "publish_ms", "staleness_mean", "cpu_s",
           "cores", "total_wall_s"]
RATIO_METRICS = ["startup_s", "imports_s", "first_step_s", "samples_per_s", "step_ms", "samples_to_target",
                 "wall_to_target_s", "cpu_s"]


def aggregate(runs: list[dict]) -> dict:
    out: dict = {}
    for r in runs:
        out.setdefault(r["workload"], {}).setdefault(r["config"], []).append(r)
    summary = {}
    for wl, by_cfg in out.items():
        summary[wl] = {}
        for cfg, rs in by_cfg.items():
            s = {"seeds": [r["seed"] for r in rs], "reached": sum(r["steps_to_target"] is not None for r in rs),
                 "aborted_slow": sum("aborted" in r for r in rs)}
            for m in METRICS:
                xs = [r[m] for r in rs if r.get(m) is not None]
                if xs:
                    s[m] = {"median": r3(statistics.median(xs)), "min": min(xs), "max": max(xs), "n": len(xs)}
            summary[wl][cfg] = s
    return summary


def baseline(by_cfg: dict) -> str | None:
    """The TRL configuration the ratios use: the fastest (lowest median step_ms) of trl1 / trl2."""
    cands = [(s["step_ms"]["median"], cfg) for cfg, s in by_cfg.items() if cfg.startswith("trl") and "step_ms" in s]
    return min(cands)[1] if cands else None


def ratios(summary: dict) -> dict:
    """{workload: {"baseline": trlN, "by_config": {asyncgrpo config: {metric: its median / baseline's}}}}."""
    out = {}
    for wl, by_cfg in summary.items():
        name = baseline(by_cfg)
        if name is None:
            continue
        base = by_cfg[name]
        out[wl] = {"baseline": name, "by_config": {
            cfg: {m: r2(s[m]["median"] / base[m]["median"]) if m in s and m in base and base[m]["median"] else None
                  for m in RATIO_METRICS}
            for cfg, s in by_cfg.items() if not cfg.startswith("trl")}}
    return out


def headline(summary: dict, rat: dict) -> dict:
    """The headline ratios, on medians against the TRL baseline, and each config's samples to target beside TRL's
    range: figures, not a verdict (docs/performance.md states no thresholds). null: a figure is missing (not
    reached)."""
    out = {}

    def best(wl, key):
        cands = [(s[key]["median"], cfg) for cfg, s in summary[wl].items() if not cfg.startswith("trl") and key in s]
        return min(cands)[1] if cands else None

    def efficiency(wl):
        base = summary[wl][rat[wl]["baseline"]].get("samples_to_target")
        if not base:
            return None
        return {cfg: {"median": s["samples_to_target"]["median"], "trl_range": [base["min"], base["max"]]}
                for cfg, s in summary[wl].items() if not cfg.startswith("trl") and "samples_to_target" in s}

    if "larger" in rat:
        cfg = best("larger", "wall_to_target_s")
        r = rat["larger"]["by_config"].get(cfg, {})
        out["larger"] = {"baseline": rat["larger"]["baseline"], "best_config": cfg,
                         "wall_to_target_ratio": r.get("wall_to_target_s"),
                         "samples_per_s_ratio": r.get("samples_per_s"),
                         "learning_efficiency": efficiency("larger")}
    if "small" in rat:
        cfg = best("small", "step_ms")
        r = rat["small"]["by_config"].get(cfg, {})
        out["small"] = {"baseline": rat["small"]["baseline"], "best_config": cfg,
                        "step_ms_ratio": r.get("step_ms"),
                        "startup_ratio": r.get("startup_s"),
                        "startup_ratio_by_config": {c: x.get("startup_s")
                                                    for c, x in rat["small"]["by_config"].items()},
                        "learning_efficiency": efficiency("small")}
    return out


COLUMNS = [("startup_s", "start s"), ("first_step_s", "1st step s"), ("samples_per_s", "samples/s"),
           ("step_ms", "step ms"), ("steps_to_target", f"steps→{TARGET}"), ("wall_to_target_s", f"wall→{TARGET} s"),
           ("trainer_idle", "idle"), ("gen_frac", "gen frac"), ("gen_ms", "gen ms"), ("train_ms", "train ms"),
           ("queue_ms", "queue ms"), ("sync_ms", "sync ms"), ("staleness_mean", "stale"), ("cpu_s", "cpu s"),
           ("cores", "cores")]


def fmt(s: dict | None) -> str:
    if not s:
        return "-"
    v = lambda x: f"{x:.3g}" if isinstance(x, float) else str(x)  # noqa: E731
    return v(s["median"]) if s["n"] == 1 or s["min"] == s["max"] else f"{v(s['median'])} [{v(s['min'])}-{v(s['max'])}]"


def table(summary: dict, rat: dict) -> str:
    lines = []
    for wl, by_cfg in summary.items():
        lines.append(f"\n== {wl} ==  (median [min-max] over seeds; reached: runs whose rolling-{WINDOW} mean reward "
                     f"reached {TARGET})")
        head = ["config", "reached"] + [c[1] for c in COLUMNS]
        rows = [[cfg, f"{s['reached']}/{len(s['seeds'])}" + (" (slow)" if s["aborted_slow"] else "")]
                + [fmt(s.get(k)) for k, _ in COLUMNS]
                for cfg, s in by_cfg.items()]
        widths = [max(len(str(r[i])) for r in [head] + rows) for i in range(len(head))]
        for r in [head] + rows:
            lines.append("  ".join(str(x).rjust(w) for x, w in zip(r, widths, strict=True)))
        if wl in rat:
            lines.append(f"ratios asyncgrpo / {rat[wl]['baseline']} (medians):")
            for cfg, r in rat[wl]["by_config"].items():
                lines.append(f"  {cfg:7s} " + "  ".join(f"{m}={'-' if x is None else x}" for m, x in r.items()))
    return "\n".join(lines)


def import_cost() -> dict:
    """Wall and CPU seconds of `import torch, transformers, trl` in a fresh process (one thread): the floor of
    every process's start-up, paid by 1 process for TRL and N + 1 for asyncgrpo."""
    code = "import torch, transformers, trl, trl.trainer.grpo_trainer"
    t0 = time.time()
    proc = subprocess.Popen([sys.executable, "-c", code], cwd=REPO, env=child_env(1))
    cpu = reap([proc], 600)
    return {"wall_s": r2(time.time() - t0), "cpu_s": r2(cpu)}


# ----------------------------------------------------------------------------- main

def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--workloads", default="small,larger")
    p.add_argument("--seeds", default="0,1,2")
    p.add_argument("--configs", default=DEFAULT_CONFIGS,
                   help=f"of {','.join(CONFIGS)}; trl = trl1,trl2 (default %(default)s)")
    p.add_argument("--quick", action="store_true",
                   help=f"seed 0 only, step caps {QUICK_CAPS}, {QUICK_MARGIN} steps after the target")
    p.add_argument("--cap", type=int, default=None, help="step cap for every run (overrides the defaults)")
    p.add_argument("--out", default=None, help="also write the JSON document here")
    p.add_argument("--keep", action="store_true", help="keep the run directories (printed on stderr)")
    p.add_argument("--async-flags", default="", metavar="FLAGS",
                   help='extra flags for every asyncgrpo process, one shell-quoted string, '
                        'e.g. --async-flags="--off_policy_correction none"')
    p.add_argument("--trl-child", default=None, help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    if a.trl_child:
        return trl_child(a.trl_child)
    workloads = [w for w in a.workloads.split(",") if w]
    configs = [c for x in a.configs.split(",") if x for c in (["trl1", "trl2"] if x == "trl" else [x])]
    seeds = [0] if a.quick else [int(s) for s in a.seeds.split(",") if s]
    for bad in set(workloads) - set(CAPS):
        p.error(f"unknown workload {bad}")
    for bad in set(configs) - set(CONFIGS):
        p.error(f"unknown config {bad}")
    caps = {w: a.cap or (QUICK_CAPS if a.quick else CAPS)[w] for w in workloads}
    margin = QUICK_MARGIN if a.quick else MARGIN
    extra = shlex.split(a.async_flags)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")

    base = Path(tempfile.mkdtemp(prefix="e2e_vs_trl_"))
    log(f"work folder {base}; workloads {workloads}, seeds {seeds}, configs {configs}, caps {caps}"
        + (f", asyncgrpo flags {extra}" if extra else ""))
    imports = import_cost()
    log(f"import torch, transformers, trl: {imports}")
    runs = []
    started = time.time()
    try:
        model_dirs = {"small": None}
        if "larger" in workloads:
            from asyncgrpo.tasks.demo import write_demo_model

            model_dirs["larger"] = write_demo_model(base / "larger_model", seed=0, **LARGER_MODEL)
        for wl in workloads:
            for seed in seeds:
                for cfg in configs:
                    work = base / f"{wl}_s{seed}_{cfg}"
                    log(f"{wl} seed {seed} {cfg}: running (cap {caps[wl]} steps, load {os.getloadavg()[0]:.1f})")
                    if cfg.startswith("trl"):
                        trl1 = next((r for r in runs if (r["workload"], r["seed"], r["config"]) == (wl, seed, "trl1")
                                     and r.get("step_ms")), None)
                        limit = SLOW_FACTOR * trl1["step_ms"] / 1e3 if trl1 and cfg != "trl1" else None
                        r = run_trl(wl, seed, model_dirs[wl], caps[wl], margin, CONFIGS[cfg], work, limit)
                    else:
                        workers, staleness = CONFIGS[cfg]
                        r = run_async(wl, seed, model_dirs[wl], caps[wl], margin, workers, staleness, work, extra)
                    r = {"workload": wl, "config": cfg, "seed": seed, **r}
                    runs.append(r)
                    log(f"{wl} seed {seed} {cfg}: " + json.dumps({k: v for k, v in r.items() if k != "error"}))
                    if r.get("error"):
                        log(f"{wl} seed {seed} {cfg}: FAILED (rc {r['returncode']}):\n{r['error']}")
    finally:
        if a.keep:
            log(f"runs kept in {base}")
        else:
            shutil.rmtree(base, ignore_errors=True)

    summary = aggregate(runs)
    rat = ratios(summary)
    doc = {
        "machine": {"cpus": os.cpu_count(), "platform": platform.platform(), "python": platform.python_version(),
                    "loadavg_at_end": [round(x, 2) for x in os.getloadavg()], "import_stack": imports},
        "settings": {"target": TARGET, "window": WINDOW, "warmup_step": WARMUP, "margin_steps": margin,
                     "caps": caps, "seeds": seeds, "configs": configs, "async_flags": extra,
                     "threads": "trlN: N; asyncgrpo: nproc // (workers + 1), at least 1 (launch.sh)",
                     "larger_model": LARGER_MODEL, "larger_overrides": LARGER_OVERRIDES,
                     "hyperparameters": {w: hyperparameters(w, 0) for w in workloads},
                     "bench_wall_s": round(time.time() - started, 1)},
        "runs": runs, "summary": summary, "ratios": rat, "headline": headline(summary, rat),
    }
    print(table(summary, rat))
    print("\nheadline: " + json.dumps(doc["headline"], indent=1))
    text = json.dumps(doc, indent=1)
    print(text)
    if a.out:
        Path(a.out).write_text(text + "\n")
    return 0 if all(r["returncode"] == 0 for r in runs) else 1


if __name__ == "__main__":
    sys.exit(main())
