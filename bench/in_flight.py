"""In-flight weight updates: token staleness, learning and speed with and without --in_flight_updates.

    .venv/bin/python bench/in_flight.py [--workload larger] [--seeds 0,1,2] [--completion 64] [--max-staleness 8]
        [--workers 3] [--cap N] [--async-flags "--name value ..."] [--out in_flight.json] [--keep]

For every seed, two asyncgrpo runs, one at a time, through bench/e2e_vs_trl.py's run_async (same workload, model,
dataset, reward, thread split and stopping rule: the rolling mean reward over WINDOW steps reaches TARGET, then
MARGIN more steps; or the step cap): `off` and `on` (--in_flight_updates), both with --max_staleness S and
--max_completion_length C (longer completions: more decoding steps for newer weights to arrive in), and
--async-flags added to both (split as a shell would: --async-flags "--generation_kwargs '{\"min_new_tokens\": 56}'"
makes completions of at least 56 tokens, where the task's own end after a few).

Per setting (median [min-max] over seeds):
    token_stale_mean   mean staleness of every completion token trained (the step it trains at minus 1, minus
                       the weights version that sampled it; from the PS's result_consumed events)
    token_stale_p90    its 90th percentile
    staleness_mean     per result: its oldest token's (what the staleness bound goes by), as e2e_vs_trl.py
    samples_to_target, wall_to_target_s, samples_per_s   as e2e_vs_trl.py
    capped_frac        mean over logged steps of TRL's logged off_policy/capped_frac: the share of tokens whose
                       importance ratio current/behaviour exceeded --off_policy_cap
    in_flight_syncs    syncs between decoding steps (the workers' weights_synced events with in_flight)
Then the ratios on/off of the medians: token staleness (goal <= 0.5) and samples/s (goal within 5%).
Progress goes to stderr, the table to stdout, the JSON document to --out.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import re
import shlex
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import e2e_vs_trl as e2e  # noqa: E402
from common import log  # noqa: E402

from asyncgrpo.events import read_events  # noqa: E402

SETTINGS = {"off": [], "on": ["--in_flight_updates"]}
COLUMNS = [("token_stale_mean", "token stale mean"), ("token_stale_p90", "token stale p90"),
           ("staleness_mean", "result stale mean"), ("samples_to_target", f"samples→{e2e.TARGET}"),
           ("wall_to_target_s", f"wall→{e2e.TARGET} s"), ("samples_per_s", "samples/s"),
           ("capped_frac", "capped frac"), ("in_flight_syncs", "in-flight syncs")]
CAPPED = re.compile(r"'off_policy/capped_frac': '?([0-9.eE+-]+)")


def token_staleness(run: Path) -> tuple[float | None, int | None]:
    """(mean, p90) over every completion token the PS trained."""
    counts: dict[int, int] = {}
    for e in read_events(run, process="ps", event="result_consumed"):
        if isinstance(e.get("token_staleness"), dict):
            for staleness, n in e["token_staleness"].items():
                counts[int(staleness)] = counts.get(int(staleness), 0) + n
    total = sum(counts.values())
    if not total:
        return None, None
    seen, rank, p90 = 0, max(1, math.ceil(0.9 * total)), None
    for staleness, n in sorted(counts.items()):
        seen += n
        if seen >= rank:
            p90 = staleness
            break
    return e2e.r3(sum(s * n for s, n in counts.items()) / total), p90


def run_figures(run: Path) -> dict:
    mean, p90 = token_staleness(run)
    ps_log = (run / "logs" / "log_parameter_server.txt").read_text(errors="replace") if (
        run / "logs" / "log_parameter_server.txt").exists() else ""
    capped = [float(x) for x in CAPPED.findall(ps_log)]
    syncs = sum(1 for e in read_events(run, role="worker", event="weights_synced") if e.get("in_flight"))
    return {"token_stale_mean": mean, "token_stale_p90": p90,
            "capped_frac": e2e.r3(statistics.fmean(capped)) if capped else None, "in_flight_syncs": syncs}


def stats(xs: list) -> dict | None:
    xs = [x for x in xs if x is not None]
    if not xs:
        return None
    return {"median": e2e.r3(statistics.median(xs)), "min": min(xs), "max": max(xs), "n": len(xs)}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--workload", default="larger", choices=sorted(e2e.CAPS))
    p.add_argument("--seeds", default="0,1,2")
    p.add_argument("--completion", type=int, default=64, help="--max_completion_length (default %(default)s)")
    p.add_argument("--max-staleness", type=int, default=8)
    p.add_argument("--workers", type=int, default=3)
    p.add_argument("--cap", type=int, default=None, help="step cap of every run (default: e2e_vs_trl.py's CAPS)")
    p.add_argument("--async-flags", default="", help="flags added to every process of both settings")
    p.add_argument("--out", default=None, help="write the JSON document here")
    p.add_argument("--keep", action="store_true", help="keep the run directories (printed on stderr)")
    a = p.parse_args(argv)
    seeds = [int(s) for s in a.seeds.split(",") if s]
    cap = a.cap or e2e.CAPS[a.workload]
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    base = Path(tempfile.mkdtemp(prefix="in_flight_"))
    log(f"work folder {base}; {a.workload}, seeds {seeds}, completion {a.completion}, max_staleness "
        f"{a.max_staleness}, {a.workers} workers, cap {cap} steps")
    started, runs = time.time(), []
    try:
        model_dir = None
        if a.workload == "larger":
            from asyncgrpo.tasks.demo import write_demo_model

            model_dir = write_demo_model(base / "larger_model", seed=0, **e2e.LARGER_MODEL)
        for seed in seeds:
            for setting, flags in SETTINGS.items():
                name, work = f"s{seed}_{setting}", base / f"s{seed}_{setting}"
                flags = [*flags, "--max_completion_length", str(a.completion), *shlex.split(a.async_flags)]
                log(f"{name}: running {flags}")
                r = e2e.run_async(a.workload, seed, model_dir, cap, e2e.MARGIN, a.workers, a.max_staleness, work,
                                  flags)
                r = {"seed": seed, "setting": setting, **r, **run_figures(work / "run")}
                runs.append(r)
                log(f"{name}: " + json.dumps({k: v for k, v in r.items() if k != "error"}))
                if r.get("error"):
                    log(f"{name}: FAILED (rc {r['returncode']}):\n{r['error']}")
                    if r["returncode"] == 2 and not r["steps_run"]:
                        raise SystemExit("the PS rejected its flags (exit 2, bad input): stopped")
                if not a.keep:
                    shutil.rmtree(work, ignore_errors=True)
    finally:
        if a.keep:
            log(f"runs kept in {base}")
        else:
            shutil.rmtree(base, ignore_errors=True)
    summary = {setting: {key: stats([r.get(key) for r in runs if r["setting"] == setting]) for key, _ in COLUMNS}
               for setting in SETTINGS}

    def ratio(key: str) -> float | None:
        on, off = summary["on"][key], summary["off"][key]
        return e2e.r3(on["median"] / off["median"]) if on and off and off["median"] else None

    ratios = {"token_staleness_on_over_off": ratio("token_stale_mean"),
              "samples_per_s_on_over_off": ratio("samples_per_s")}
    head = ["setting"] + [label for _, label in COLUMNS]
    rows = [[setting] + [e2e.fmt(summary[setting][key]) for key, _ in COLUMNS] for setting in SETTINGS]
    widths = [max(len(r[i]) for r in [head] + rows) for i in range(len(head))]
    print(f"== {a.workload}, completion {a.completion}, max_staleness {a.max_staleness}, step cap {cap}, seeds "
          f"{seeds} ==  (median [min-max] over seeds)")
    for r in [head] + rows:
        print("  ".join(x.rjust(w) for x, w in zip(r, widths, strict=True)))
    print(f"on/off: token staleness x{ratios['token_staleness_on_over_off']}, samples/s "
          f"x{ratios['samples_per_s_on_over_off']}")
    if a.out:
        doc = {"machine": {"cpus": os.cpu_count(), "platform": platform.platform(),
                           "python": platform.python_version()},
               "settings": {"workload": a.workload, "seeds": seeds, "completion": a.completion,
                            "async_flags": a.async_flags,
                            "max_staleness": a.max_staleness, "workers": a.workers, "cap": cap,
                            "target": e2e.TARGET, "bench_wall_s": round(time.time() - started, 1)},
               "runs": runs, "summary": summary, "ratios": ratios}
        Path(a.out).write_text(json.dumps(doc, indent=1) + "\n")
        log(f"JSON written to {a.out}")
    return 0 if runs and all(r["returncode"] == 0 for r in runs) else 1


if __name__ == "__main__":
    sys.exit(main())
