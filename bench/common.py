"""What the benchmarks share: running each config for each seed, starting and stopping a run's processes,
reading what a run leaves behind, and plain TRL GRPOTrainer as the baseline (in a child process, or calibrated
in the benchmark's own process).

The benchmarks run as scripts (``python bench/NAME.py``), so this folder is on sys.path and they import this
module as ``common``. torch, transformers and trl are imported inside the functions that need them, so a
benchmark that only starts processes stays as light as it was.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

from asyncgrpo.events import read_events

REPO = Path(__file__).resolve().parents[1]


# ----------------------------------------------------------------------------- running a benchmark

def log(message: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


def run_matrix(seeds: list[int], configs: list[str], prefix: str, run_one: Callable[[str, int, Path], dict],
               summary_line: Callable[[dict], str]) -> dict[str, list[dict]]:
    """``run_one(config, seed, work)`` for each seed and config, one at a time, each in its own folder of a
    temporary one (prefix ``prefix``) removed at the end; logs each run's ``summary_line(result)`` and seconds.
    Returns each config's results as ``{"seed": seed, **result}``, in seed order."""
    work = Path(tempfile.mkdtemp(prefix=prefix))
    results: dict[str, list] = {c: [] for c in configs}
    try:
        for seed in seeds:
            for config in configs:
                log(f"{config} seed {seed}")
                started = time.time()
                result = run_one(config, seed, work / f"{config}_{seed}")
                results[config].append({"seed": seed, **result})
                log(f"  {summary_line(result)} ({time.time() - started:.0f} s)")
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return results


# ----------------------------------------------------------------------------- processes

def child_env(threads: int) -> dict:
    return {**os.environ, "OMP_NUM_THREADS": str(threads), "MKL_NUM_THREADS": str(threads),
            "PYTHONUNBUFFERED": "1", "TOKENIZERS_PARALLELISM": "false", "HF_HUB_OFFLINE": "1"}


def start_python(log_path: Path, *argv: str, env: dict) -> subprocess.Popen:
    """``python ARGV...`` from the repository root, its stdout and stderr appended to ``log_path``."""
    with open(log_path, "ab") as logf:
        return subprocess.Popen([sys.executable, *argv], cwd=REPO, env=env, stdout=logf, stderr=subprocess.STDOUT)


def reap(procs: list[subprocess.Popen], timeout: float) -> float:
    """Waits for every process (SIGKILL after timeout); returns their CPU seconds (user + system, rusage)."""
    cpu, deadline = 0.0, time.monotonic() + timeout
    pending = [p for p in procs if p.returncode is None]
    while pending:
        for proc in list(pending):
            pid, status, usage = os.wait4(proc.pid, os.WNOHANG)
            if pid:
                proc.returncode = os.waitstatus_to_exitcode(status)
                cpu += usage.ru_utime + usage.ru_stime
                pending.remove(proc)
        if pending and time.monotonic() > deadline:
            for proc in pending:
                proc.kill()
            deadline = time.monotonic() + 30
        time.sleep(0.02)
    return cpu


def terminate_and_reap(procs: list[subprocess.Popen], timeout: float) -> float:
    """SIGTERM to each process still running, in the order given, then reap(); returns their CPU seconds.
    Give the PS first: the workers then finish the job in hand and exit."""
    for proc in procs:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
    return reap(procs, timeout)


def remove_weight_buffers(run: Path) -> int:
    """Removes the run's mmap weight folders in /dev/shm that outlived its PS; returns how many there were.

    A PS stopped by SIGTERM/SIGINT leaves them (only a later PS of the same run directory removes them), so
    without this every run of the benchmark would leave its two weight buffers in RAM."""
    from asyncgrpo.weights.mmap_file import PREFIX, SHM_ROOT

    tag = hashlib.sha1(str(run.resolve()).encode()).hexdigest()[:12]  # mmap_file.run_tag
    folders = list(SHM_ROOT.glob(f"{PREFIX}{tag}-*"))
    for folder in folders:
        shutil.rmtree(folder, ignore_errors=True)
    return len(folders)


# ----------------------------------------------------------------------------- what a run leaves behind

def read_jsonl(path: Path) -> list[dict]:
    if not path.exists():
        return []
    out = []
    for line in path.read_text(errors="replace").splitlines():
        try:
            out.append(json.loads(line))
        except ValueError:
            pass
    return out


def ready_times(run: Path, workers: int) -> dict[int, float]:
    """When each worker first held the PS's weights (wall clock): its first weights_synced event; a worker that
    never synced is left out."""
    ready = {}
    for i in range(1, workers + 1):
        synced = read_events(run, process=f"worker-dev{i}", event="weights_synced")
        if synced:
            ready[i] = synced[0]["t"]
    return ready


def ready_to_train_at(run: Path, workers: int) -> float | None:
    """When training could start: the PS ready (ps.json's started_at) and every worker holding its first weights;
    None when a worker never held them."""
    ps_file = run / "ps.json"
    ps_started = (json.loads(ps_file.read_text()) if ps_file.exists() else {}).get("started_at")
    ready = ready_times(run, workers)
    return max([ps_started or 0.0, *ready.values()]) if len(ready) == workers else None


# ----------------------------------------------------------------------------- plain TRL in a child process
# In a process of its own, TRL's imports, threads and memory are its own, as each asyncgrpo process's are.

def run_trl_child(script: str | Path, spec: dict, work: Path, env: dict, timeout: float
                  ) -> tuple[subprocess.Popen, float]:
    """Runs ``python SCRIPT --trl-child work/spec.json`` with ``spec`` written there first, its output in
    work/trl.log; returns the finished process and its CPU seconds."""
    (work / "spec.json").write_text(json.dumps(spec))
    proc = start_python(work / "trl.log", str(script), "--trl-child", str(work / "spec.json"), env=env)
    return proc, reap([proc], timeout)


def train_trl_child(spec: dict, work: str, model_dir: str, reward_funcs, train_dataset,
                    should_stop: Callable[[list[float], int], bool], **trainer_kwargs) -> None:
    """A --trl-child's training: plain TRL GRPOTrainer with spec['config'] until ``should_stop(rewards, step)``.
    Writes to spec['log'] one JSON line {"t", "event": "ready"} once the trainer is built, then one line
    {"t", "step", "reward"} per logged step (read_trl_steps reads them back)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from transformers.trainer_callback import PrinterCallback
    from trl import GRPOConfig, GRPOTrainer

    out = open(spec["log"], "a", buffering=1)
    rewards = []

    class Recorder(TrainerCallback):
        def on_log(self, args, state, control, logs=None, **kwargs):
            if logs and "reward" in logs:
                rewards.append(float(logs["reward"]))
                out.write(json.dumps({"t": time.time(), "step": state.global_step, "reward": rewards[-1]}) + "\n")
                if should_stop(rewards, state.global_step):
                    control.should_training_stop = True

    trainer = GRPOTrainer(model=AutoModelForCausalLM.from_pretrained(model_dir), reward_funcs=reward_funcs,
                          args=GRPOConfig(**spec["config"], output_dir=os.path.join(work, "out")),
                          train_dataset=train_dataset, processing_class=AutoTokenizer.from_pretrained(model_dir),
                          callbacks=[Recorder()], **trainer_kwargs)
    trainer.remove_callback(PrinterCallback)
    out.write(json.dumps({"t": time.time(), "event": "ready"}) + "\n")
    trainer.train()


def read_trl_steps(path: Path) -> tuple[float | None, list[dict]]:
    """What train_trl_child wrote: when its trainer was ready (None: never), and its step lines."""
    lines = read_jsonl(path)
    ready = next((x["t"] for x in lines if x.get("event") == "ready"), None)
    return ready, [x for x in lines if "step" in x]


# ----------------------------------------------------------------------------- calibrating a task against TRL
# bench/trl_baseline.py (--task demo, --task lookup) trains in its own process, one run per seed.

def set_overrides(items: list[str]) -> dict:
    """``--set KEY=VALUE`` items as GRPOConfig keyword arguments, each VALUE parsed as JSON if it can be."""
    overrides = {}
    for item in items:
        key, _, value = item.partition("=")
        try:
            overrides[key] = json.loads(value)
        except json.JSONDecodeError:
            overrides[key] = value
    return overrides


def model_shape(a) -> dict:
    """--hidden-size, --num-layers and --intermediate-size, those given, as build_model's keyword arguments."""
    given = (("hidden_size", a.hidden_size), ("num_layers", a.num_layers), ("intermediate_size", a.intermediate_size))
    return {k: v for k, v in given if v is not None}


def seed_each_batch_as_a_worker(trainer, seed: int) -> None:
    """Each generation batch's sampling seeded as an asyncgrpo worker seeds a job (worker/generate.py job_seed: the
    run's seed and the job id, here the batch's number), instead of one RNG stream running on through the run."""
    import torch

    from worker.generate import job_seed

    generate_and_score, batches = trainer._generate_and_score_completions, [0]

    def seeded(inputs):
        torch.manual_seed(job_seed(seed, f"{batches[0]:06d}_000"))
        batches[0] += 1
        return generate_and_score(inputs)

    trainer._generate_and_score_completions = seeded


def train_timed(trainer) -> float:
    """trainer.train() without TRL printing each log dict; returns its wall seconds."""
    from transformers.trainer_callback import PrinterCallback

    # disable_tqdm=True swaps the progress bar for PrinterCallback, which prints every log dict on stdout.
    trainer.remove_callback(PrinterCallback)
    started = time.perf_counter()
    trainer.train()
    return time.perf_counter() - started


def step_times_ms(durations: list[float], digits: int) -> dict:
    """mean_step_ms and median_step_ms of the optimizer steps' wall seconds."""
    durations = durations[1:] or durations  # the first step pays warm-up
    return {"mean_step_ms": round(1000 * statistics.fmean(durations), digits),
            "median_step_ms": round(1000 * statistics.median(durations), digits)}


def steps_to_thresholds(reached: dict[float, tuple[int, float]], thresholds, digits: int) -> dict:
    """steps_to_{th} and seconds_to_{th} for each threshold, from ``reached[th] = (step, seconds)`` (None: not
    reached)."""
    out = {}
    for th in thresholds:
        step, secs = reached.get(th, (None, None))
        out[f"steps_to_{th}"] = step
        out[f"seconds_to_{th}"] = None if secs is None else round(secs, digits)
    return out


def thresholds_summary(runs: list[dict], thresholds) -> dict:
    """Over the seeds' runs: whether every run reached each threshold, and the most steps one took to."""
    out = {}
    for th in thresholds:
        steps = [r[f"steps_to_{th}"] for r in runs]
        out[f"all_reached_{th}"] = all(s is not None for s in steps)
        out[f"max_steps_to_{th}"] = max((s for s in steps if s is not None), default=None)
    return out
