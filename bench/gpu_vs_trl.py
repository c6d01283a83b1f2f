"""Throughput on one GPU: asyncgrpo (PS and 1-2 workers sharing the GPU) against TRL's GRPOTrainer.

    python bench/gpu_vs_trl.py [--configs trl,async1,async2] [--steps 40]
        [--warmup 10] [--completion 64] [--layers 24] [--out results.json]

The model: a randomly initialised Llama with Qwen2.5-0.5B's shape (hidden 896, 24 layers, 14 heads, 2 KV
heads, MLP 4864, bias on the attention projections, tied embeddings, vocabulary 151,936: 494M parameters),
built from a config and saved here (no download). The demo task's data, reward and 16-character tokenizer:
the tokenizer decodes only its own ids, so a random policy scores about 0 and every completion runs to
--completion tokens: the work per step is fixed, which is what a throughput comparison needs (nothing here
measures learning). bf16 autocast on both sides (GRPOConfig's default on a GPU), gradient checkpointing off.

Configs (every run real processes started from here, all on cuda:0):
    trl          plain TRL: one process that generates, scores and trains in turn
    asyncN       `python -m ps` + N `python -m worker`, placed as launch.sh places them on one GPU, with the
                 workers' defaults (--worker_decoding auto: graph on a GPU; --jobs_per_generate's default)
    asyncN_eager the same with the workers as they were before compiled decoding: --worker_decoding eager
                 --jobs_per_generate 1
    asyncN_compiled, asyncN_graph   the same with --worker_decoding compiled (transformers' generate with its
                 decoding step compiled) or graph (the worker's own decoding loop)
    asyncN_kK    the same as asyncN with --jobs_per_generate K
    ..._mps      the same under NVIDIA MPS (a control daemon of the run's own, as launch.sh --mps on starts it),
                 suffixes combined in any order: async2_graph_mps
    ..._inflight the same with --in_flight_updates (weights synced between decoding steps inside a job):
                 in_flight_syncs and in_flight_sync_ms_median (their cost inside a job), token_staleness_mean
    *_cb         the same with --use_transformers_continuous_batching true (TRL's generation engine; for TRL
                 only: asyncgrpo's workers decode with their own engine)

Per run, from step --warmup to the last step: step_ms (median time between logged steps), samples_per_s
(completions trained per second), and for asyncgrpo trainer_idle (the PS's share of that time spent
waiting for a result), gen_ms (a worker's generation + scoring per job), sync_ms, publish_ms. Ratios to
trl in the same run. One JSON document on stdout (and --out), a table on stderr.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import e2e_vs_trl as e2e  # noqa: E402
import in_flight  # noqa: E402
from common import REPO, read_jsonl, run_trl_child, start_python, terminate_and_reap  # noqa: E402

from asyncgrpo.events import read_events  # noqa: E402
from asyncgrpo.run import RunDir, metrics  # noqa: E402

QWEN05_SHAPE = {"hidden_size": 896, "num_layers": 24, "num_heads": 14, "num_kv_heads": 2,
                "intermediate_size": 4864, "vocab_size": 151936}
RUN_TIMEOUT_S = 900


def log(msg: str) -> None:
    print(f"[gpu_vs_trl {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def write_model(path: Path, layers: int) -> int:
    """Saves the Qwen2.5-0.5B-shaped Llama with the demo tokenizer; returns its parameter count."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from asyncgrpo.tasks.demo import build_tokenizer

    tok = build_tokenizer()
    tok.model_max_length = 4096
    shape = QWEN05_SHAPE
    config = LlamaConfig(vocab_size=shape["vocab_size"], hidden_size=shape["hidden_size"],
                         intermediate_size=shape["intermediate_size"], num_hidden_layers=layers,
                         num_attention_heads=shape["num_heads"], num_key_value_heads=shape["num_kv_heads"],
                         attention_bias=True, max_position_embeddings=4096, tie_word_embeddings=True,
                         bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    torch.manual_seed(0)
    model = LlamaForCausalLM(config)
    model.save_pretrained(path, safe_serialization=True)
    tok.save_pretrained(path)
    return sum(p.numel() for p in model.parameters())


def hyperparameters(steps: int, completion: int, continuous_batching: bool, device: str) -> dict:
    from asyncgrpo.tasks.demo import DEMO_DEFAULTS, cpu_overrides

    hp = {**DEMO_DEFAULTS, "learning_rate": 1e-6, "max_steps": steps, "max_completion_length": completion,
          "save_strategy": "no", "disable_tqdm": True, "seed": 0, **(cpu_overrides() if device == "cpu" else {})}
    if continuous_batching:
        hp["use_transformers_continuous_batching"] = True
    return hp


def env() -> dict:
    return {**os.environ, "CUDA_VISIBLE_DEVICES": "0", "PYTHONUNBUFFERED": "1", "TOKENIZERS_PARALLELISM": "false",
            "HF_HUB_OFFLINE": "1"}


def run_trl(model_dir: Path, hp: dict, steps: int, work: Path) -> list[float]:
    """Plain TRL in a child process (e2e_vs_trl's --trl-child); returns the wall time of each logged step."""
    work.mkdir(parents=True)
    events = work / "trl_events.jsonl"
    spec = {"config": hp, "model_dir": str(model_dir), "cap": steps, "margin": 0, "max_step_s": None,
            "log": str(events), "tmp": str(work)}
    proc, _cpu = run_trl_child(REPO / "bench" / "e2e_vs_trl.py", spec, work, env(), RUN_TIMEOUT_S)
    if proc.returncode != 0:
        raise RuntimeError(f"TRL exited {proc.returncode}: {(work / 'trl.log').read_text(errors='replace')[-1500:]}")
    return [x["t"] for x in read_jsonl(events) if x["event"] == "step"]


def worker_settings(name: str) -> tuple[int, list[str], bool]:
    """An asyncN config name: (N workers, the worker flags its suffixes name, whether under MPS)."""
    base, *settings = name.split("_")
    workers, extra = int(base.removeprefix("async")), []
    for setting in settings:
        if setting == "eager":
            extra += ["--worker_decoding", "eager", "--jobs_per_generate", "1"]
        elif setting in ("compiled", "graph"):
            extra += ["--worker_decoding", setting]
        elif setting.startswith("k"):
            extra += ["--jobs_per_generate", setting[1:]]
        elif setting == "inflight":
            extra += ["--in_flight_updates"]
        elif setting != "mps":
            raise SystemExit(f"gpu_vs_trl: unknown setting {setting!r} in {name!r}")
    return workers, extra, "mps" in settings


def in_flight_figures(run: Path) -> dict:
    """Token staleness (bench/in_flight.py's definition) and the syncs made inside jobs (_inflight configs)."""
    mean, p90 = in_flight.token_staleness(run)
    syncs = [e["dur_ms"] for e in read_events(run, role="worker", event="weights_synced") if e.get("in_flight")]
    return {"token_staleness_mean": mean, "token_staleness_p90": p90, "in_flight_syncs": len(syncs),
            "in_flight_sync_ms_median": round(statistics.median(syncs), 3) if syncs else None}


def mps_daemon(folder: Path) -> dict:
    """Starts NVIDIA MPS as launch.sh --mps on does (scripts/launch_common.sh); returns its clients' environment."""
    folders = {"CUDA_MPS_PIPE_DIRECTORY": str(folder / "pipe"), "CUDA_MPS_LOG_DIRECTORY": str(folder / "log")}
    for path in folders.values():
        os.makedirs(path, exist_ok=True)
    subprocess.run(["nvidia-cuda-mps-control", "-d"], env={**os.environ, **folders}, check=True, timeout=60)
    return folders


def stop_mps(folders: dict) -> None:
    subprocess.run(["nvidia-cuda-mps-control"], input="quit\n", text=True, env={**os.environ, **folders}, timeout=60)


def run_async(model_dir: Path, hp: dict, workers: int, work: Path, device: str,
              extra: list[str], mps: bool = False) -> tuple[list[dict], Path]:
    """PS + workers until the PS reaches max_steps (under MPS: a daemon of the run's own); returns metrics.jsonl's
    lines and the run directory."""
    run = work / "run"
    (run / "logs").mkdir(parents=True)
    mps_env = mps_daemon(Path(tempfile.mkdtemp(prefix="mps-"))) if mps else {}
    flags = ["--run_dir", str(run), "--device_type", device, "--model_name_or_path", str(model_dir)]
    flags += [f"--{k}={v}" for k, v in hp.items()] + extra

    def start(name, *cmd):
        return start_python(run / "logs" / name, "-m", *cmd, *flags, env={**env(), **mps_env})

    ps = start("log_parameter_server.txt", "ps")
    procs = [ps] + [start(f"log_worker_{i}.txt", "worker", "--device", str(i)) for i in range(1, workers + 1)]
    try:
        ps.wait(RUN_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        log(f"async{workers}: the PS did not finish in {RUN_TIMEOUT_S} s")
    finally:
        terminate_and_reap(procs, 60)
        if mps_env:
            stop_mps(mps_env)
    if ps.returncode != 0:
        text = (run / "logs" / "log_parameter_server.txt").read_text(errors="replace")
        raise RuntimeError(f"PS exited {ps.returncode}: {text[-1500:]}")
    return metrics.read_lines(RunDir(run).metrics_file), run


def throughput(times: list[float], warmup: int, batch: int) -> dict:
    gaps = [b - a for a, b in zip(times[warmup:-1], times[warmup + 1:], strict=True)]
    if not gaps:
        return {"steps_run": len(times)}
    return {"steps_run": len(times), "step_ms": round(1e3 * statistics.median(gaps), 1),
            "samples_per_s": round(batch * len(gaps) / (times[-1] - times[warmup]), 1)}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--configs", default="trl,async1,async2")
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--warmup", type=int, default=10)
    p.add_argument("--completion", type=int, default=64, help="max_completion_length")
    p.add_argument("--layers", type=int, default=QWEN05_SHAPE["num_layers"], help="fewer for a quick run")
    p.add_argument("--out", default=None)
    p.add_argument("--device", default="cuda", choices=("cuda", "cpu"), help="cpu: a smoke test of this script")
    args = p.parse_args()
    import torch

    if args.device == "cuda" and not torch.cuda.is_available():
        print("gpu_vs_trl: error: no CUDA GPU here", file=sys.stderr)
        return 2
    root = Path(tempfile.mkdtemp(prefix="gpu_vs_trl_"))
    n_params = write_model(root / "model", args.layers)
    log(f"model: {n_params / 1e6:.0f}M parameters in {root / 'model'}")
    results: dict[str, dict] = {}
    for name in args.configs.split(","):
        base, cb = name.removesuffix("_cb"), name.endswith("_cb")
        hp = hyperparameters(args.steps, args.completion, cb, args.device)
        batch = hp["per_device_train_batch_size"]
        log(f"{name} ...")
        t0 = time.time()
        try:
            if base == "trl":
                res = throughput(run_trl(root / "model", hp, args.steps, root / name), args.warmup, batch)
            else:
                workers, extra, mps = worker_settings(base)
                lines, run = run_async(root / "model", hp, workers, root / name, args.device, extra, mps)
                res = throughput([x["time"] for x in lines], args.warmup, batch)
                after = lines[args.warmup + 1:]
                if after:
                    res["trainer_idle"] = round(sum(x["trainer_wait_s"] for x in after)
                                                / (lines[-1]["time"] - lines[args.warmup]["time"]), 3)
                    res["staleness_mean"] = round(statistics.fmean(x["staleness_mean"] for x in after), 2)
                over = e2e.overhead(run)
                res.update({k: over.get(k) for k in ("gen_ms", "train_ms", "sync_ms", "publish_ms", "archived")})
                res.update(in_flight_figures(run))
        except RuntimeError as err:
            res = {"error": str(err)}
        res["wall_s"] = round(time.time() - t0, 1)
        results[name] = res
        log(f"{name}: {res}")
    for name, res in results.items():
        trl = results.get("trl_cb" if name.endswith("_cb") and "trl_cb" in results else "trl", {})
        if "samples_per_s" in res and "samples_per_s" in trl:
            res["samples_per_s_over_trl"] = round(res["samples_per_s"] / trl["samples_per_s"], 2)
            res["step_ms_over_trl"] = round(res["step_ms"] / trl["step_ms"], 2)
    device = torch.cuda.get_device_name(0) if args.device == "cuda" else platform.processor() or "cpu"
    doc = {"device": device, "torch": torch.__version__, "python": platform.python_version(),
           "params": n_params, "layers": args.layers, "steps": args.steps, "warmup": args.warmup,
           "completion_tokens": args.completion, "batch": 32, "results": results}
    shutil.rmtree(root, ignore_errors=True)
    for name, res in results.items():
        log(f"{name:<10} " + "  ".join(f"{k}={res.get(k)}" for k in
                                      ("step_ms", "samples_per_s", "samples_per_s_over_trl", "trainer_idle", "gen_ms")))
    text = json.dumps(doc, indent=1)
    print(text)
    if args.out:
        Path(args.out).write_text(text)
    return 0 if all("error" not in r for r in results.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
