"""Decoders on a worker's stream of jobs, with completion lengths like a real run's (a long tail) or all alike.

    .venv/bin/python bench/long_tail.py [--shapes larger] [--settings graph,continuous] [--jobs 2] [--stream 16]
        [--completion 64] [--lengths long-tail,fixed] [--batch 32] [--device cpu|cuda] [--out results.json]

Each shape is a randomly initialised Llama (no download), decoded by the worker's own code as
bench/generation_bench.py builds it; ``demo``, the demo task's own model; or a model folder (``--shapes DIR``: a
user's model with its tokenizer). ``--stream`` jobs of ``--batch`` rows
(prompts of the demo task) go through each decoder as a worker takes them:

    graph       the fixed-batch decoding step (worker/decoding/graph.py), ``--jobs`` jobs a call, each call scored by
                TRL as generate_jobs does (the worker's loop)
    continuous  continuous batching (worker/decoding/continuous.py) over ``--jobs`` jobs' rows of slots: a job is
                added as soon as a slot is free and no row waits, its rows join as slots free up, and it is scored on
                a thread of its own while the slots decode, as the worker's continuous loop does
    compiled, eager   transformers' generate, compiled or not, ``--jobs`` jobs a call

``continuous/N``: the engine with the host looking at which rows ended every N steps (CHECK_EVERY of
worker/decoding/continuous.py; a setting may be named twice, e.g. ``continuous/1,continuous/2,continuous/1``).
``continuous-wide``: the engine with every step over every slot (its narrower steps, when few slots hold rows, off).
``continuous-unshared``: the engine with every row prefilling its prompt (a group's rows copying one prefill, off).
``continuous-untiered``: the engine with every slot reading the same columns (its ranges of slots reading their own
numbers of columns, off).
``continuous-eager``: the engine run eagerly, nothing compiled.

Prompts (``--prompt-tokens``): the demo task's (a few tokens), or ``LOW-HIGH``, prompts of LOW to HIGH tokens (a
real task's are 128-256), each of the demo's digits ending a random run of digits. A job's rows are 8 generations
of each of its prompts, as TRL's groups.

Lengths (``--lengths``): ``fixed``, every completion runs to ``--completion`` tokens (min_new_tokens); ``long-tail``,
each token ends its row with probability 4 / ``--completion`` (asyncgrpo/tasks/long_tail.py: geometric lengths,
mean about a quarter of the cap, about 2% of rows reaching it); ``own``, completions end where the model ends them
(the demo's model and a model folder: ``fixed`` or ``own`` for the demo's, ``own`` only for a folder's, ``fixed`` or
``long-tail`` for a Llama shape). The same prompts and job seeds for every decoder; lengths follow the same
distribution (the decoders draw their samples differently).

Printed per decoder and workload, measured in this run after each decoder's warm-up: row utilisation (tokens kept
over row-steps computed: every slot or row of every decoding step, and each prefill's rows; for ``continuous``
also until the stream's last row joined, "(wait)": a worker in a run, whose queue does not run dry, decodes so until
the run's end), samples/s and tokens/s over the stream's wall time, job latency p50/p99 (from the start of the
job's generation, its call or its joining the slots, to its scored result) and the median decoding steps over that
span (a call's; the engine's from a job's joining to its last row's end), the prompt tokens computed per sample (a
fixed batch's prefills: its rows by the cache's prompt part); ratios to ``graph``'s on the same
workload wherever it ran in the order (without ``graph``, to the first setting's). One JSON document on stdout
(and --out), a table on stderr.
"""

from __future__ import annotations

import argparse
import json
import platform
import random
import statistics
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from generation_bench import SHAPES, NoEvents, build, log, print_doc  # noqa: E402  (bench/ is the script's folder)

from worker.decoding.compiled_step import compiled_graphs  # noqa: E402
from worker.generation import SWITCH_INTERVAL_S  # noqa: E402

PROGRESS_EVERY_S = 20


def now(device: str) -> float:
    if device == "cuda":
        torch.cuda.synchronize()
    return time.perf_counter()


def long_prompts(tokens: str, n: int = 200, seed: int = 0):
    """A dataset of the demo task's rows whose prompts have ``LOW-HIGH`` tokens: a run of random digits, then the
    demo's "N:"."""
    from datasets import Dataset

    low, high = (int(t) for t in tokens.split("-"))
    rng = random.Random(seed)
    digits = [i % 10 for i in range(n)]
    rng.shuffle(digits)
    prompts = [" ".join(str(rng.randrange(10)) for _ in range(rng.randint(low, high) // 2 - 1)) + f" {d}:"
               for d in digits]
    return Dataset.from_dict({"prompt": prompts, "digit": digits})


def job_inputs(trainer, count: int, batch: int) -> list:
    from worker.generate import JobInput

    dataset = trainer.train_dataset
    return [JobInput([dataset[(j * batch + i) // 8 % len(dataset)] for i in range(batch)], seed=j,
                     fields={"job_id": f"{j:06d}_000"}) for j in range(count)]


def stream_fixed_batches(trainer, decoder, inputs: list, jobs: int, device: str) -> tuple[list, list, list, int, None]:
    """(outcomes, latencies, decoding steps a job, row-steps, None) of the stream in calls of ``jobs`` jobs, as the
    worker's loop runs them."""
    from worker.generate import generate_jobs

    outcomes, latencies, job_steps, row_steps = [], [], [], 0
    rows_per_call = jobs * len(inputs[0].rows)
    if decoder is not None:
        decoder.prompt_tokens = 0  # (each call's prefill: its rows by the cache's prompt part)
    for first in range(0, len(inputs), jobs):
        steps_before = getattr(decoder, "steps_run", 0)
        start = now(device)
        called = generate_jobs(trainer, inputs[first:first + jobs], NoEvents(), decoder)
        latencies += [now(device) - start] * len(called)
        outcomes += called
        if hasattr(decoder, "steps_run"):  # the step's own count, and the prefill's token
            steps = decoder.steps_run - steps_before + 1
        else:  # generate stops when every row of the call has ended
            steps = max(int(o.batch["completion_mask"].sum(dim=1).max()) for o in called)
        row_steps += rows_per_call * steps
        job_steps += [steps] * len(called)
        if decoder is not None:
            decoder.prompt_tokens += rows_per_call * getattr(decoder, "prompt_part", 0)
    return outcomes, latencies, job_steps, row_steps, None


def stream_continuously(trainer, engine, inputs: list, device: str) -> tuple[list, list, list, int, float]:
    """The same through the engine: a job added as soon as a slot is free and no row waits, its rows joining as
    slots free up, scored on another thread; and the row utilisation until the stream's last row joined (what a
    worker in a run sees, where the queue does not run dry)."""
    from worker.generate import prompt_ids_of, score_generated

    waiting, joined, futures = list(enumerate(inputs)), {}, []

    def score(finished):
        job = inputs[finished.key]
        outcome = score_generated(trainer, job, finished.prompt_ids, finished.completion_ids, finished.tokens,
                                  finished.logps, NoEvents(), token_versions=finished.token_versions)
        return finished.key, outcome, time.perf_counter() - joined[finished.key], finished.steps

    row_steps_before, while_jobs_wait = engine.row_steps, None
    engine.runner.prompt_tokens = 0
    said = time.perf_counter()
    sys.setswitchinterval(SWITCH_INTERVAL_S)  # as the worker's continuous loop sets it
    with ThreadPoolExecutor(1) as scorer, torch.no_grad(), trainer.accelerator.autocast():
        while waiting or not engine.empty():
            while waiting and engine.wants_a_job():
                key, job = waiting.pop(0)
                engine.add(key, prompt_ids_of(trainer, job.rows), job.seed)
                joined[key] = time.perf_counter()
            engine.run(engine.check_every)
            if while_jobs_wait is None and not waiting and not engine.scheduler.waiting:
                while_jobs_wait = engine.decoded_tokens() / (engine.row_steps - row_steps_before)
            futures += [scorer.submit(score, finished) for finished in engine.collect()]
            if time.perf_counter() - said > PROGRESS_EVERY_S:  # (where a run cut short was)
                said = time.perf_counter()
                log(f"{len(futures)} of {len(inputs)} jobs decoded, {engine.steps} steps, "
                    f"{engine.recompiles()} graphs compiled since the warm-up")
        results = sorted(f.result() for f in futures)
    return [outcome for _, outcome, _, _ in results], [seconds for _, _, seconds, _ in results], \
        [steps for *_, steps in results], engine.row_steps - row_steps_before, while_jobs_wait


def measure(shape: str, decoding: str, lengths: str, a, work: Path) -> dict:
    end_p = 4 / a.completion if lengths == "long-tail" else None
    setting, decoding, _, every = decoding, *decoding.partition("/")
    wide, untiered = decoding == "continuous-wide", decoding == "continuous-untiered"
    decoding = "continuous" if wide or untiered else decoding
    dataset = long_prompts(a.prompt_tokens) if a.prompt_tokens else None
    trainer, decoder, warm_s, _ = build(shape, a.device, a.jobs, a.completion, a.batch, decoding, work, end_p=end_p,
                                        dataset=dataset, own_lengths=lengths == "own")
    if every:
        decoder.check_every = int(every)
    if wide:
        decoder.reads.widths.clear()
    if untiered:
        decoder.reads.tiered = None
    log(f"{decoding}: warmed up in {warm_s:.1f} s, {compiled_graphs()} graphs compiled in this process")
    inputs = job_inputs(trainer, a.stream, a.batch)
    start = now(a.device)
    if decoding.startswith("continuous"):
        outcomes, latencies, job_steps, row_steps, while_jobs_wait = stream_continuously(trainer, decoder, inputs,
                                                                                         a.device)
    else:
        outcomes, latencies, job_steps, row_steps, while_jobs_wait = stream_fixed_batches(trainer, decoder, inputs,
                                                                                          a.jobs, a.device)
    wall_s = now(a.device) - start
    for outcome in outcomes:
        if isinstance(outcome, Exception):
            raise outcome
    row_lengths = [n for o in outcomes for n in o.batch["completion_mask"].sum(dim=1).tolist()]
    kept = sum(row_lengths)
    latencies = sorted(latencies)
    return {"shape": shape, "decoding": setting, "lengths": lengths, "jobs": a.jobs, "rows": a.jobs * a.batch,
            "stream_jobs": a.stream, "wall_s": round(wall_s, 3), "samples_per_s": round(len(row_lengths) / wall_s, 1),
            "tokens_per_s": round(kept / wall_s), "row_utilisation": round(kept / row_steps, 3),
            # every call of a fixed batch is alike: no different while jobs wait
            "row_utilisation_while_jobs_wait": round(while_jobs_wait or kept / row_steps, 3),
            "mean_length": round(kept / len(row_lengths), 1),
            "at_cap": round(sum(n == a.completion for n in row_lengths) / len(row_lengths), 3),
            "latency_p50_s": round(statistics.median(latencies), 3),
            "latency_p99_s": round(latencies[min(len(latencies) - 1, int(0.99 * len(latencies)))], 3),
            "job_steps_p50": statistics.median(job_steps),
            "prompt_tokens_per_sample": round(decoder.prompt_tokens / len(row_lengths), 1) if decoder else None,
            "warm_up_s": round(warm_s, 1), "recompiles": decoder.recompiles() if decoder is not None else 0}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--shapes", default="larger", help=f"any of {', '.join(s for s in SHAPES if SHAPES[s])}")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--settings", default="graph,continuous")
    p.add_argument("--lengths", default="long-tail,fixed")
    p.add_argument("--jobs", type=int, default=2, help="jobs a call (fixed batches) or jobs' rows of slots")
    p.add_argument("--stream", type=int, default=16, help="jobs in the stream")
    p.add_argument("--completion", type=int, default=64, help="max_completion_length")
    p.add_argument("--batch", type=int, default=32, help="rows per job (TRL's generation batch)")
    p.add_argument("--prompt-tokens", default=None, help="LOW-HIGH: prompts of that many tokens (default: the demo's)")
    p.add_argument("--out", default=None)
    a = p.parse_args()
    for setting in a.settings.split(","):  # (before any run: a typo found after minutes of runs loses them)
        decoding, _, every = setting.partition("/")
        if every and (not decoding.startswith("continuous") or not every.isdigit() or int(every) < 1):
            raise SystemExit(f"long_tail: {setting!r}: only continuous takes /N, a number of steps of at least 1")
    if a.device == "cpu":
        torch.set_num_threads(max(1, torch.get_num_threads()))
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for shape in a.shapes.split(","):
            if shape not in SHAPES and not Path(shape, "config.json").is_file():
                raise SystemExit(f"long_tail: {shape!r} is neither a shape of generation_bench.py nor a model folder")
            allowed = {"fixed", "long-tail"} if SHAPES.get(shape) else {"fixed", "own"} if shape in SHAPES else {"own"}
            if not set(a.lengths.split(",")) <= allowed:
                raise SystemExit(f"long_tail: --lengths for {shape}: any of {', '.join(sorted(allowed))}")
            for lengths in a.lengths.split(","):
                for decoding in a.settings.split(","):
                    log(f"{shape} {lengths} {decoding}")
                    rows.append(measure(shape, decoding, lengths, a, Path(tmp)))
                    log(json.dumps(rows[-1]))
                    if a.out:  # (the rows so far: a run cut short, on a lent GPU's clock, keeps them)
                        Path(a.out).write_text(json.dumps({"partial": True, "results": rows}, indent=2))
    for row in rows:
        same = [r for r in rows if r["shape"] == row["shape"] and r["lengths"] == row["lengths"]]
        base = next((r for r in same if r["decoding"] == "graph"), same[0])
        row["baseline"] = base["decoding"]
        row["samples_per_s_vs_baseline"] = round(row["samples_per_s"] / base["samples_per_s"], 2)
        row["utilisation_vs_baseline"] = round(row["row_utilisation"] / base["row_utilisation"], 2)
    device_name = torch.cuda.get_device_name() if a.device == "cuda" else platform.processor() or platform.machine()
    doc = {"device": a.device, "device_name": device_name, "threads": torch.get_num_threads(),
           "torch": torch.__version__, "completion": a.completion, "batch": a.batch,
           "prompt_tokens": a.prompt_tokens or "demo", "results": rows}
    print(f"{'shape':<9} {'lengths':<9} {'decoding':<11} {'util':>5} {'(wait)':>6} {'samples/s':>10} {'vs base':>8} "
          f"{'util vs':>7} {'p50 s':>7} {'p99 s':>7} {'steps p50':>9} {'mean len':>8} {'prompt/smp':>10} "
          f"{'warm-up s':>9}",
          file=sys.stderr)
    for r in rows:
        print(f"{r['shape']:<9} {r['lengths']:<9} {r['decoding']:<11} {r['row_utilisation']:>5.2f} "
              f"{r['row_utilisation_while_jobs_wait']:>6.2f} "
              f"{r['samples_per_s']:>10.1f} {r['samples_per_s_vs_baseline']:>7.2f}x "
              f"{r['utilisation_vs_baseline']:>6.2f}x "
              f"{r['latency_p50_s']:>7.3f} {r['latency_p99_s']:>7.3f} {r['job_steps_p50']:>9.0f} "
              f"{r['mean_length']:>8.1f} {r['prompt_tokens_per_sample'] or 0:>10.1f} {r['warm_up_s']:>9.1f}",
              file=sys.stderr)
    print_doc(doc, a.out)


if __name__ == "__main__":
    main()
