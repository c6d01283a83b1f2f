"""A decoder's warm-up in a fresh process, cold (an empty compile cache) and warm (the cache the cold one filled: a
second worker of the run, or a restarted one), and, on a CPU, warm in a fork of launch.sh's fork server (a worker
that launch.sh restarts on a CPU machine: the libraries imported already; on a GPU it starts a new interpreter).

    .venv/bin/python bench/warm_up.py [--shape larger] [--decoding continuous] [--completion 512] [--jobs 4]
        [--device cpu|cuda] [--cache DIR] [--out results.json]

Each warm-up runs in a new interpreter, as a worker's does, with torch's compile caches (inductor's, under
TORCHINDUCTOR_CACHE_DIR and the temp folder) in a folder of its own: empty for the cold one, the cold one's for the
warm ones (``--cache DIR``: that folder, kept; default: a temporary one); the forked one is a fork of
asyncgrpo/forkserver.py, started and done importing before it is timed. Printed: the seconds of each warm-up (the
decoder's ``warm_up``: every graph compiled and run), the graphs compiled, each process's seconds from its start to
a warmed decoder, and the warm one's ratio to the cold one. One JSON document on stdout (and --out), a table on
stderr, and each start's figures on stderr as it ends (a run cut short keeps those).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def child(a) -> None:
    sys.path.insert(0, str(REPO / "bench"))
    sys.path.insert(0, str(REPO))
    import torch
    from generation_bench import build

    from worker.decoding.compiled_step import compiled_graphs

    if a.device == "cpu":
        torch.set_num_threads(max(1, torch.get_num_threads()))
    with tempfile.TemporaryDirectory() as work:
        started = time.monotonic()
        _, decoder, warm_s, _ = build(a.shape, a.device, a.jobs, a.completion, a.batch, a.decoding, Path(work),
                                      end_p=4 / a.completion)
        print(json.dumps({"warm_up_s": round(warm_s, 1), "graphs": compiled_graphs(),
                          "build_s": round(time.monotonic() - started - warm_s, 1)}))


FORKED_PYTHON = REPO / "scripts" / "forked_python"


def start_fork_server(folder: Path, env: dict) -> tuple[subprocess.Popen, dict]:
    """launch.sh's fork server (asyncgrpo/forkserver.py) with ``env``, done importing; it and the environment of its
    clients."""
    from asyncgrpo import forkserver

    folder.mkdir()
    socket_path = folder / f"server{forkserver.SOCKET_SUFFIX}"
    server = subprocess.Popen([sys.executable, str(REPO / "asyncgrpo" / "forkserver.py"), str(socket_path)], env=env,
                              stdin=subprocess.DEVNULL)
    env = {**env, "ASYNCGRPO_FORK_SERVER": str(socket_path), "ASYNCGRPO_FORK_PYTHON": sys.executable}
    subprocess.run([str(FORKED_PYTHON), "-c", "pass"], env=env, check=True)  # answered once the imports are done
    return server, env


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--shape", default="larger")
    p.add_argument("--decoding", default="continuous")
    p.add_argument("--completion", type=int, default=512, help="max_completion_length")
    p.add_argument("--jobs", type=int, default=4, help="jobs a call (fixed batches) or jobs' rows of slots")
    p.add_argument("--batch", type=int, default=32, help="rows per job")
    p.add_argument("--device", default=None, help="default: cuda if there is one, else cpu")
    p.add_argument("--cache", default=None, help="the compile cache's folder (default: a temporary one)")
    p.add_argument("--out", default=None)
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.device is None:
        import torch

        a.device = "cuda" if torch.cuda.is_available() else "cpu"
    if a.child:
        child(a)
        return
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        cache = Path(a.cache or tmp) / "inductor"
        # Inductor keeps caches of its own in the temp folder too (its on-disk cache, under TMPDIR/cache): a cold
        # start finds that empty as well, as on a machine that never compiled.
        temp = Path(a.cache or tmp) / "tmp"
        temp.mkdir(parents=True, exist_ok=True)
        env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": str(cache), "TMPDIR": str(temp)}
        server = None
        try:
            # (launch.sh forks its processes only where no GPU is seen: a CUDA worker starts a new interpreter)
            for start in ("cold", "warm") if a.device == "cuda" else ("cold", "warm", "forked"):
                command = [sys.executable, __file__, "--child", *sys.argv[1:]]
                if start == "forked":
                    server, env = start_fork_server(Path(tmp) / "forks", env)
                    command[0] = str(FORKED_PYTHON)
                print(f"[warm_up] {a.decoding} at {a.shape}, cap {a.completion}: {start}", file=sys.stderr,
                      flush=True)
                started = time.monotonic()
                done = subprocess.run(command, env=env, stdout=subprocess.PIPE, text=True, check=True)
                rows.append({"start": start, **json.loads(done.stdout.strip().splitlines()[-1]),
                             "process_s": round(time.monotonic() - started, 1)})
                print(f"[warm_up] {start}: {json.dumps(rows[-1])}", file=sys.stderr, flush=True)  # (a run cut short)
        finally:
            if server is not None:
                server.terminate()
                server.wait()
    doc = {"shape": a.shape, "decoding": a.decoding, "completion": a.completion, "device": a.device,
           "warm_vs_cold": round(rows[1]["warm_up_s"] / rows[0]["warm_up_s"], 2), "results": rows}
    print(f"{'start':<6} {'warm-up s':>9} {'graphs':>6} {'process s':>9}", file=sys.stderr)
    for r in rows:
        print(f"{r['start']:<6} {r['warm_up_s']:>9.1f} {r['graphs']:>6} {r['process_s']:>9.1f}", file=sys.stderr)
    print(f"warm / cold: {doc['warm_vs_cold']:.2f}", file=sys.stderr)
    text = json.dumps(doc, indent=1)
    print(text)
    if a.out:
        Path(a.out).write_text(text + "\n")


if __name__ == "__main__":
    main()
