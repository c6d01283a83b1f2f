"""A worker's generation speed: eager, compiled, and compiled with several jobs per generate call.

    .venv/bin/python bench/generation_bench.py [--shapes demo,larger,qwen0.5b,qwen1.5b] [--device cpu|cuda]
        [--settings eager,compiled,graph] [--jobs 1,4] [--completion 64] [--batch 32] [--reps 5] [--peak-gbs N]
        [--profile] [--out results.json]

Each shape is a randomly initialised Llama built from a config (no download), run through the worker's own
code: a GRPOTrainer built as a worker builds it, and worker/generate.py generate_jobs over K jobs of --batch
rows each, prompts of the demo task. Every completion runs to --completion tokens (min_new_tokens), so the work
per call is fixed. Settings, per shape:

    eager       TRL's generate (dynamic cache), one job per call
    eagerK      the same, K jobs per call (the last of --jobs)
    compiled    static cache and compiled decoding step (worker/decoding/compiled.py), one job per call
    compiledK   the same, K jobs per call
    graph       the worker's own decoding loop, a token's forward, sampling and bookkeeping in one compiled
                function (worker/decoding/graph.py), one job per call
    graphK      the same, K jobs per call
    graph-autotune  graph compiled with torch.compile's max-autotune (GEMM kernels chosen by timing them; CUDA
                graphs), for comparison: slower to compile
    graph-nofuse    graph with q/k/v and gate/up as separate GEMMs (worker/decoding/fused_projections.py off)
    graph-nolevers  graph-nofuse, and sampling's reductions over the whole vocabulary at once (VOCAB_CHUNKS 1):
                the step as it was before either lever, to measure them in one run
    graph-wholecache  graph whose every step reads the whole KV cache (attention_buckets 1), where graph reads only
                its written prefix: put it first (``--settings graph-wholecache,graph``) for the ratio at a long
                --completion

For each: ms per generated token (one decoding step over the whole call's batch: call time / completion
length), samples/s and tokens/s, and ms per job (call time / jobs in the call). The memory-bandwidth limit
of a decoding step is the bytes it must read (every weight once, and the KV cache so far) over the device's
peak bandwidth (--peak-gbs; on CUDA a table of known GPUs, on CPU measured here with a large copy). Ratios
to the first setting (eager unless --settings says otherwise), one job a call, are measured in this run.
bf16 on CUDA, float32 on CPU. One JSON document on stdout (and --out), a table on stderr. Compilation
(warm-up) time is reported apart, not counted in the timings.

--profile: one more call per setting under torch.profiler, split into the regions the worker's code marks
(record_function): decode.prefill, decode.steps and decode.to_host (graph), generate (transformers' generate:
eager, compiled), behaviour_logps (their capture, inside generate), score (TRL's scoring of each job: rewards,
advantages); and, on CUDA, the device's busy time (its kernels and copies) against the call's wall time: what is
left is the host's, between steps.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

SHAPES = {  # hidden, layers, heads, KV heads, MLP, vocabulary
    "demo": None,  # asyncgrpo.tasks.demo's own model
    "larger": dict(hidden_size=256, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=4,
                   intermediate_size=448, vocab_size=16),
    "qwen0.5b": dict(hidden_size=896, num_hidden_layers=24, num_attention_heads=14, num_key_value_heads=2,
                     intermediate_size=4864, vocab_size=151936, attention_bias=True, tie_word_embeddings=True),
    "qwen1.5b": dict(hidden_size=1536, num_hidden_layers=28, num_attention_heads=12, num_key_value_heads=2,
                     intermediate_size=8960, vocab_size=151936, attention_bias=True, tie_word_embeddings=True),
}
PEAK_GBS = {"H100": 3350, "H200": 4800, "A100": 2039, "L40S": 864, "A10": 600}  # HBM/GDDR peak, GB/s


def log(msg: str) -> None:
    print(f"[generation_bench {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def peak_gbs(device: str, given: float | None) -> float:
    if given:
        return given
    if device == "cuda":
        name = torch.cuda.get_device_name()
        for key, gbs in PEAK_GBS.items():
            if key in name:
                return gbs
        raise SystemExit(f"generation_bench: no peak bandwidth known for {name}: pass --peak-gbs")
    src = torch.empty(256 << 20, dtype=torch.uint8)  # 256 MB, far beyond the caches
    dst = torch.empty_like(src)
    dst.copy_(src)
    start = time.perf_counter()
    for _ in range(5):
        dst.copy_(src)
    return 2 * 5 * src.numel() / (time.perf_counter() - start) / 1e9  # read + write


def build(shape: str, device: str, jobs: int, completion: int, batch: int, decoding: str, work: Path,
          end_p: float | None = None, dataset=None, own_lengths: bool = False):
    """A worker's trainer over ``shape``'s model and its decoder for ``decoding`` (None: eager), warmed up: (trainer,
    decoder, warm-up seconds, weight bytes). Completions run to ``completion`` tokens, or with ``end_p`` end with
    that probability at every token (asyncgrpo/tasks/long_tail.py: geometric lengths, cut at ``completion``).
    ``dataset``: the prompts (default: the demo task's). ``own_lengths``, or a model folder for ``shape``: completions
    end where the model ends them."""
    from asyncgrpo.config import AsyncGRPOConfig
    from asyncgrpo.tasks.demo import DEMO_DEFAULTS, build_dataset, build_model, build_tokenizer, repeat_digit_reward
    from asyncgrpo.tasks.long_tail import end_with_probability
    from worker.decoding.compiled import CompiledDecoding
    from worker.decoding.continuous import ContinuousDecoding
    from worker.decoding.graph import GraphDecoding
    from worker.decoding.shapes import ATTENTION_BUCKETS
    from worker.generate import build_trainer

    tok = build_tokenizer()
    if shape not in SHAPES:  # a model folder (a user's: its own tokenizer; completions end where it ends them)
        from transformers import AutoModelForCausalLM, AutoTokenizer

        model, tok = AutoModelForCausalLM.from_pretrained(shape), AutoTokenizer.from_pretrained(shape)
    elif SHAPES[shape] is None:
        model = build_model(seed=0, tokenizer=tok)
    else:
        from transformers import LlamaConfig, LlamaForCausalLM

        torch.manual_seed(0)
        config = {**SHAPES[shape], **({"tie_word_embeddings": False} if end_p else {})}
        model = LlamaForCausalLM(LlamaConfig(**config, max_position_embeddings=4096, bos_token_id=tok.bos_token_id,
                                             eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id))
        if end_p:
            end_with_probability(model, tok.eos_token_id, end_p)
    fixed_lengths = shape in SHAPES and not end_p and not own_lengths  # (else they end where the model ends them)
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    model = model.to(device=device, dtype=dtype)
    on_cpu = {"use_cpu": True, "bf16": False} if device == "cpu" else {"bf16": True}
    cfg = AsyncGRPOConfig(**{**DEMO_DEFAULTS, **on_cpu, "device_type": device, "output_dir": str(work),
                             "per_device_train_batch_size": batch, "max_completion_length": completion,
                             "generation_kwargs": {"min_new_tokens": completion} if fixed_lengths else {},
                             "disable_tqdm": True,
                             "jobs_per_generate": jobs, "report_to": "none"})
    trainer = build_trainer(cfg, model, tok, [repeat_digit_reward], dataset or build_dataset(n=200))
    compiled, warm_s = None, 0.0
    if decoding != "eager":
        dataset = trainer.train_dataset
        prompt_ids, _, _ = trainer._tokenize_prompts([dataset[i]["prompt"] for i in range(len(dataset))])
        if decoding == "compiled":
            compiled = CompiledDecoding(trainer, jobs, prompt_ids)
        elif decoding in ("continuous", "continuous-unshared", "continuous-eager"):
            compiled = ContinuousDecoding(trainer, jobs * trainer.args.generation_batch_size, prompt_ids,
                                          compile=decoding != "continuous-eager",
                                          share_prompts=decoding != "continuous-unshared")
        else:
            assert GraphDecoding.unsupported(trainer) is None, GraphDecoding.unsupported(trainer)
            mode = "max-autotune" if decoding == "graph-autotune" else None
            compiled = GraphDecoding(trainer, jobs, prompt_ids, compile_mode=mode,
                                     fuse=decoding not in ("graph-nofuse", "graph-nolevers"),
                                     attention_buckets=1 if decoding == "graph-wholecache" else ATTENTION_BUCKETS)
        warm_s = compiled.warm_up(prompt_ids)
    return trainer, compiled, warm_s, sum(p.numel() * p.element_size() for p in model.parameters())


def kv_bytes_per_step(shape: str, model, rows: int, seq: int) -> int:
    c = model.config
    head_dim = c.hidden_size // c.num_attention_heads
    return 2 * c.num_hidden_layers * rows * c.num_key_value_heads * head_dim * seq * model.dtype.itemsize


class NoEvents:
    def emit(self, *_args, **_fields):
        pass

    @contextlib.contextmanager
    def span(self, *_args, **_fields):
        yield {}


def measure(shape: str, device: str, jobs: int, decoding: str, a, work: Path) -> dict:
    from worker.generate import JobInput, generate_jobs

    trainer, compiled, warm_s, weight_bytes = build(shape, device, jobs, a.completion, a.batch, decoding, work)
    dataset = trainer.train_dataset
    inputs = [JobInput([dataset[(j * a.batch + i) // 8] for i in range(a.batch)], seed=j) for j in range(jobs)]
    times = []
    for rep in range(a.reps + 1):  # the first call warms the allocator and caches: not counted
        if device == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        outcomes = generate_jobs(trainer, inputs, NoEvents(), compiled)
        if device == "cuda":
            torch.cuda.synchronize()
        if rep:
            times.append(time.perf_counter() - start)
        for outcome in outcomes:
            if isinstance(outcome, Exception):
                raise outcome
    call_s = statistics.median(times)
    profile = profiled_call(trainer, inputs, compiled, device) if a.profile else None
    rows = jobs * a.batch
    model = trainer.model
    prompt = max(len(x) for x in trainer._tokenize_prompts([r["prompt"] for r in inputs[0].rows])[0])
    step_bytes = weight_bytes + kv_bytes_per_step(shape, model, rows, prompt + a.completion // 2)
    return {"shape": shape, "decoding": decoding, "jobs_per_call": jobs, "rows": rows,
            "ms_per_token": round(call_s / a.completion * 1e3, 3), "ms_per_job": round(call_s / jobs * 1e3, 1),
            "samples_per_s": round(rows / call_s, 1), "tokens_per_s": round(rows * a.completion / call_s),
            "bandwidth_limit_ms_per_token": round(step_bytes / (a.peak_gbs * 1e9) * 1e3, 4),
            "warm_up_s": round(warm_s, 1), "recompiles": compiled.recompiles() if compiled else 0,
            "weight_mb": round(weight_bytes / 1e6, 1), **({"profile": profile} if profile else {})}


REGIONS = ("decode.prefill", "decode.steps", "decode.to_host", "generate", "behaviour_logps", "score")


def profiled_call(trainer, inputs, decoding, device: str) -> dict:
    """One generate_jobs call under torch.profiler: its wall time, the host time in each marked region (summed
    over the call: behaviour_logps runs once per decoding step, score once per job) and, on CUDA, the device's
    busy time (the union of its kernels' and copies' intervals) and the kernels that took the most of it."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    from worker.generate import generate_jobs

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device == "cuda" else [])
    with profile(activities=activities) as prof:
        start = time.perf_counter()
        generate_jobs(trainer, inputs, NoEvents(), decoding)
        if device == "cuda":
            torch.cuda.synchronize()
        wall_ms = (time.perf_counter() - start) * 1e3
    events = prof.events()
    regions: dict[str, float] = {}
    for e in events:
        if e.name in REGIONS and e.device_type == DeviceType.CPU:
            regions[e.name] = regions.get(e.name, 0.0) + e.time_range.elapsed_us() / 1e3
    out = {"wall_ms": round(wall_ms, 2), "regions_ms": {k: round(v, 2) for k, v in regions.items()}}
    if device == "cuda":
        on_device = sorted((e.time_range.start, e.time_range.end, e.name) for e in events
                           if e.device_type == DeviceType.CUDA and e.name not in REGIONS)
        busy_us, reach, by_kernel = 0.0, float("-inf"), {}
        for begin, end, name in on_device:
            busy_us += max(0.0, end - max(begin, reach))
            reach = max(reach, end)
            calls, us = by_kernel.get(name, (0, 0.0))
            by_kernel[name] = (calls + 1, us + (end - begin))
        out["device_busy_ms"] = round(busy_us / 1e3, 2)
        out["device_idle_share"] = round(1 - busy_us / 1e3 / wall_ms, 3)
        out["device_kernels"] = len(on_device)
        # Each kernel's calls, total ms and mean µs a call: what a decoding step is made of.
        out["top_kernels"] = [{"name": name[:120], "calls": calls, "ms": round(us / 1e3, 2),
                               "us_per_call": round(us / calls, 1)}
                              for name, (calls, us) in sorted(by_kernel.items(), key=lambda kv: -kv[1][1])[:30]]
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--shapes", default=None, help="default: demo,larger on CPU; all four on CUDA")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--jobs", default="1,4", help="jobs per generate call: 1 and the K to compare")
    p.add_argument("--completion", type=int, default=64)
    p.add_argument("--batch", type=int, default=32, help="rows per job (TRL's generation batch)")
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--peak-gbs", type=float, default=None)
    p.add_argument("--settings", default="eager,compiled,graph",
                   help="any of eager, compiled, graph, graph-autotune, graph-nofuse, graph-nolevers, "
                        "graph-wholecache")
    p.add_argument("--profile", action="store_true", help="split one more call per setting with torch.profiler")
    p.add_argument("--out", default=None)
    a = p.parse_args()
    if a.device == "cpu":
        torch.set_num_threads(max(1, torch.get_num_threads()))
    shapes = (a.shapes or ("demo,larger" if a.device == "cpu" else ",".join(SHAPES))).split(",")
    a.peak_gbs = peak_gbs(a.device, a.peak_gbs)
    from worker.decoding import step

    vocab_chunks = step.VOCAB_CHUNKS
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for shape in shapes:
            for decoding in a.settings.split(","):
                for jobs in (int(k) for k in a.jobs.split(",")):
                    log(f"{shape} {decoding} jobs_per_call={jobs}")
                    # (a module constant the step reads while compiling, and is guarded on after)
                    step.VOCAB_CHUNKS = 1 if decoding == "graph-nolevers" else vocab_chunks
                    rows.append(measure(shape, a.device, jobs, decoding, a, Path(tmp)))
                    log(json.dumps(rows[-1]))
    for row in rows:  # ratios to the first setting of the shape with one job a call (eager by default), else its first
        same_shape = [r for r in rows if r["shape"] == row["shape"]]
        base = next((r for r in same_shape if r["jobs_per_call"] == 1), same_shape[0])
        row["baseline"] = base["decoding"]
        row["job_speedup_vs_baseline"] = round(base["ms_per_job"] / row["ms_per_job"], 2)
        row["samples_per_s_vs_baseline"] = round(row["samples_per_s"] / base["samples_per_s"], 2)
        row["x_bandwidth_limit"] = round(row["ms_per_token"] / row["bandwidth_limit_ms_per_token"], 1)
    device_name = torch.cuda.get_device_name() if a.device == "cuda" else platform.processor() or platform.machine()
    doc = {"device": a.device, "device_name": device_name, "threads": torch.get_num_threads(),
           "peak_gbs": round(a.peak_gbs, 1), "torch": torch.__version__, "completion": a.completion,
           "batch": a.batch, "results": rows}
    print(f"{'shape':<9} {'decoding':<14} {'K':>2} {'ms/token':>9} {'ms/job':>8} {'samples/s':>10} {'vs first':>9} "
          f"{'x limit':>8} {'warm-up s':>9}", file=sys.stderr)
    for r in rows:
        print(f"{r['shape']:<9} {r['decoding']:<14} {r['jobs_per_call']:>2} {r['ms_per_token']:>9.2f} "
              f"{r['ms_per_job']:>8.1f} {r['samples_per_s']:>10.1f} {r['job_speedup_vs_baseline']:>8.2f}x "
              f"{r['x_bandwidth_limit']:>8.1f} {r['warm_up_s']:>9.1f}", file=sys.stderr)
    print_doc(doc, a.out)


def print_doc(doc: dict, out: str | None) -> None:
    """The figures as JSON on stdout (the table went to stderr), and into ``out`` when given."""
    text = json.dumps(doc, indent=2)
    print(text)
    if out:
        Path(out).write_text(text)


if __name__ == "__main__":
    main()
