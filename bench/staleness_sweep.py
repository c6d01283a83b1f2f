"""Staleness sweep: how asyncgrpo's learning degrades with --max_staleness, with and without the off-policy correction.

    .venv/bin/python bench/staleness_sweep.py [--workload larger] [--seeds 0] [--staleness 1,2,4,8]
        [--corrections none,token_truncate] [--off-policy-cap X] [--workers 3] [--cap N]
        [--out sweep.json] [--png sweep.png] [--keep]

For every seed, max_staleness S and correction C, one asyncgrpo run (a PS and --workers workers, real processes,
one run at a time) through bench/e2e_vs_trl.py's run_async: same workloads (`small`, `larger`), model, dataset,
reward, hyperparameters, thread split (nproc // (workers + 1)) and stopping rule (rolling mean reward over WINDOW
steps reaches TARGET, then MARGIN more steps; or the step cap, "not reached"). The run gets `--max_staleness S`
and `--off_policy_correction C`; C = `none` is "without correction"; `default` passes no correction flag (the
config's default; also how to run the sweep on a build without the flag). --off-policy-cap X adds
`--off_policy_cap X` to every run whose C is not `none`.

Per setting (median [min-max] over seeds), definitions as in e2e_vs_trl.py:
    reached            runs whose rolling mean reached the target / runs
    samples_to_target  first step whose rolling mean reaches the target x samples per step (32): fewer is better
    wall_to_target_s   wall clock from the first process's start (imports included) to that step
    samples_per_s      trained-on completions per second from step WARMUP to the last step
    staleness_mean     mean over steps WARMUP.. of RUN/metrics.jsonl's staleness_mean (step - weights version)
    staleness_max      largest staleness_max of any step (here, not in e2e_vs_trl.py)
    stale, stale_share results archived `stale` in RUN/done/ (generated with weights more than S steps old: not
                       trained on, their prompts thrown again), and their share of the results the trainer took:
                       stale / (consumed + stale + duplicate)
    trainer_idle       sum(trainer_wait_s) / wall span over steps WARMUP.. (the trainer waiting for a result)
Note: the PS keeps at most S + 1 jobs in flight (fewer while one is older; docs/design.md, "Staleness and
admission control"), so at S = 1 no more than 2 workers are busy.

The PNG (--png) has two panels, samples to target and wall clock to target versus max_staleness, one line per
correction. A point is the median over seeds, a run that did not reach the target counted at its cap (cap x 32
samples; the wall clock of its last step); the marker is hollow when not every seed reached the target.
Progress goes to stderr, the table to stdout, the JSON document to --out.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import e2e_vs_trl as e2e  # noqa: E402

from asyncgrpo.run import RunDir, metrics  # noqa: E402

NO_CORRECTION = "none"
DEFAULT = "default"  # no --off_policy_correction flag: the config's default
KNOWN = {NO_CORRECTION, "token_truncate", "token_mask", "sequence_truncate", "sequence_mask", DEFAULT}
METRICS = ["samples_to_target", "wall_to_target_s", "samples_per_s", "staleness_mean", "staleness_max", "stale",
           "stale_share", "trainer_idle", "steps_run", "total_wall_s"]
COLUMNS = [("samples_to_target", f"samples→{e2e.TARGET}"), ("wall_to_target_s", f"wall→{e2e.TARGET} s"),
           ("samples_per_s", "samples/s"), ("staleness_mean", "stale mean"), ("staleness_max", "stale max"),
           ("stale", "archived stale"), ("stale_share", "stale share"), ("trainer_idle", "idle"),
           ("steps_run", "steps"), ("total_wall_s", "run s")]


def log(msg: str) -> None:
    print(f"[sweep {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def correction_flags(correction: str, off_policy_cap: float | None) -> list[str]:
    if correction == DEFAULT:
        flags = []
    else:
        flags = ["--off_policy_correction", correction]
    if off_policy_cap is not None and correction != NO_CORRECTION:
        flags += ["--off_policy_cap", str(off_policy_cap)]
    return flags


def label(correction: str) -> str:
    return {NO_CORRECTION: "none (without correction)", DEFAULT: "default (no flag)"}.get(correction, correction)


def sweep_figures(result: dict, run: Path, cap: int, batch: int) -> dict:
    """The sweep's own per-run figures, from run_async's result and the run directory (before it is removed)."""
    steps = metrics.read_lines(RunDir(run).metrics_file)
    archived = result.get("archived") or {}
    stale = archived.get("stale", 0)
    taken = archived.get("consumed", 0) + stale + archived.get("duplicate", 0)
    out = {"stale": stale, "results_taken": taken, "stale_share": e2e.r3(stale / taken) if taken else None,
           "staleness_max": max((s["staleness_max"] for s in steps if "staleness_max" in s), default=None),
           "reached": result.get("steps_to_target") is not None}
    # Where a run that did not reach the target is drawn: its step cap, and the wall clock of its last step.
    out["samples_at_cap"] = cap * batch
    if steps and result.get("first_step_s") is not None:
        out["wall_at_last_step_s"] = e2e.r2(result["first_step_s"] + steps[-1]["time"] - steps[0]["time"])
    return out


def stats(xs: list) -> dict | None:
    xs = [x for x in xs if x is not None]
    if not xs:
        return None
    return {"median": e2e.r3(statistics.median(xs)), "min": min(xs), "max": max(xs), "n": len(xs)}


def summarize_sweep(runs: list[dict]) -> list[dict]:
    """One entry per (max_staleness, correction), over seeds, in sweep order."""
    groups: dict[tuple, list[dict]] = {}
    for r in runs:
        groups.setdefault((r["max_staleness"], r["correction"]), []).append(r)
    out = []
    for (staleness, correction), rs in groups.items():
        s = {"max_staleness": staleness, "correction": correction, "seeds": [r["seed"] for r in rs],
             "reached": sum(r["reached"] for r in rs), "failed": sum(r["returncode"] != 0 for r in rs)}
        for m in METRICS:
            s[m] = stats([r.get(m) for r in rs])
        # The plotted values: not-reached runs count at their cap.
        s["plot_samples"] = stats([r["samples_to_target"] if r["reached"] else r["samples_at_cap"] for r in rs])
        s["plot_wall_s"] = stats([r["wall_to_target_s"] if r["reached"] else r.get("wall_at_last_step_s")
                                  for r in rs])
        out.append(s)
    return out


def table(summary: list[dict], workload: str, cap: int) -> str:
    head = ["max_stale", "correction", "reached"] + [c[1] for c in COLUMNS]
    rows = [[str(s["max_staleness"]), s["correction"],
             f"{s['reached']}/{len(s['seeds'])}" + (f" ({s['failed']} failed)" if s["failed"] else "")]
            + [e2e.fmt(s[k]) for k, _ in COLUMNS] for s in summary]
    widths = [max(len(r[i]) for r in [head] + rows) for i in range(len(head))]
    lines = [f"== {workload}, step cap {cap} ==  (median [min-max] over seeds; reached: runs whose rolling-"
             f"{e2e.WINDOW} mean reward reached {e2e.TARGET}; '-': not reached or not measured)"]
    lines += ["  ".join(x.rjust(w) for x, w in zip(r, widths, strict=True)) for r in [head] + rows]
    return "\n".join(lines)


def plot(summary: list[dict], path: Path, workload: str, cap: int, batch: int, workers: int) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.lines import Line2D

    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2))
    corrections = list(dict.fromkeys(s["correction"] for s in summary))
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    panels = [("plot_samples", f"samples to rolling reward {e2e.TARGET}"),
              ("plot_wall_s", f"wall clock to rolling reward {e2e.TARGET} (s)")]
    for ax, (key, ylabel) in zip(axes, panels, strict=True):
        for i, correction in enumerate(corrections):
            color = colors[i % len(colors)]
            pts = sorted((s["max_staleness"], s[key]["median"], s["reached"] == len(s["seeds"]))
                         for s in summary if s["correction"] == correction and s[key])
            if not pts:
                continue
            ax.plot([p[0] for p in pts], [p[1] for p in pts], color=color, label=label(correction))
            for x, y, all_reached in pts:
                ax.plot(x, y, "o", ms=7, color=color, markerfacecolor=color if all_reached else "white",
                        markeredgewidth=1.5)
        if key == "plot_samples":
            ax.axhline(cap * batch, color="grey", ls=":", lw=1)
            ax.text(0.01, cap * batch, f"step cap ({cap} x {batch})", va="bottom", fontsize=8, color="grey",
                    transform=ax.get_yaxis_transform())
        stalenesses = sorted({s["max_staleness"] for s in summary})
        ax.set_xscale("log", base=2)
        ax.set_xticks(stalenesses, [str(x) for x in stalenesses])
        ax.minorticks_off()
        ax.set(xlabel="--max_staleness", ylabel=ylabel)
        ax.set_ylim(bottom=0, top=ax.get_ylim()[1] * 1.08)
        ax.grid(alpha=0.3)
    handles, _ = axes[0].get_legend_handles_labels()
    handles.append(Line2D([], [], marker="o", ls="", color="grey", markerfacecolor="white",
                          label="not reached by every seed (counted at the cap)"))
    axes[0].legend(handles=handles, fontsize=8)
    fig.suptitle(f"asyncgrpo staleness sweep: {workload}, {workers} workers, median over seeds", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def csv_list(text: str, kind=str) -> list:
    return [kind(x) for x in text.split(",") if x.strip()]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--workload", default="larger", choices=sorted(e2e.CAPS))
    p.add_argument("--seeds", default="0")
    p.add_argument("--staleness", default="1,2,4,8", help="--max_staleness values (default %(default)s)")
    p.add_argument("--corrections", default=f"{NO_CORRECTION},token_truncate",
                   help=f"--off_policy_correction values, of {','.join(sorted(KNOWN))} (default %(default)s); "
                        f"the non-{NO_CORRECTION} one is the 'with correction' line")
    p.add_argument("--off-policy-cap", type=float, default=None,
                   help="pass --off_policy_cap X to the runs with a correction (default: the config's)")
    p.add_argument("--workers", type=int, default=3)
    p.add_argument("--cap", type=int, default=None, help="step cap of every run (default: e2e_vs_trl.py's CAPS)")
    p.add_argument("--out", default=None, help="write the JSON document here")
    p.add_argument("--png", default=None, help="write the two-panel figure here")
    p.add_argument("--keep", action="store_true", help="keep the run directories (printed on stderr)")
    a = p.parse_args(argv)
    seeds, stalenesses, corrections = csv_list(a.seeds, int), csv_list(a.staleness, int), csv_list(a.corrections)
    for bad in set(corrections) - KNOWN:
        p.error(f"unknown correction {bad}")
    if any(s < 1 for s in stalenesses):
        p.error("--staleness values must be >= 1 (0 is synchronous mode: bench/e2e_vs_trl.py's sync)")
    if a.workers < 1:
        p.error("--workers must be >= 1")
    wl, cap = a.workload, a.cap or e2e.CAPS[a.workload]
    batch = e2e.hyperparameters(wl, 0)["per_device_train_batch_size"]
    os.environ.setdefault("HF_HUB_OFFLINE", "1")

    base = Path(tempfile.mkdtemp(prefix="staleness_sweep_"))
    log(f"work folder {base}; {wl}, seeds {seeds}, max_staleness {stalenesses}, corrections {corrections}, "
        f"{a.workers} workers, cap {cap} steps")
    started = time.time()
    try:
        runs = sweep(a, base, seeds, stalenesses, corrections, cap, batch)
    finally:
        if a.keep:
            log(f"runs kept in {base}")
        else:
            shutil.rmtree(base, ignore_errors=True)
    return finish(a, runs, wl, cap, batch, seeds, stalenesses, corrections, started)


def sweep(a, base: Path, seeds: list[int], stalenesses: list[int], corrections: list[str], cap: int,
          batch: int) -> list[dict]:
    """The runs, one at a time; stops early when the PS rejects its flags (every later run would too)."""
    model_dir = None
    if a.workload == "larger":
        from asyncgrpo.tasks.demo import write_demo_model

        model_dir = write_demo_model(base / "larger_model", seed=0, **e2e.LARGER_MODEL)
    runs = []
    for seed in seeds:
        for staleness in stalenesses:
            for correction in corrections:
                name = f"s{seed}_stale{staleness}_{correction}"
                flags = correction_flags(correction, a.off_policy_cap)
                log(f"{name}: running {flags} (load {os.getloadavg()[0]:.1f})")
                t = time.time()
                work = base / name
                r = e2e.run_async(a.workload, seed, model_dir, cap, e2e.MARGIN, a.workers, staleness, work, flags)
                r = {"seed": seed, "max_staleness": staleness, "correction": correction, "flags": flags, **r,
                     **sweep_figures(r, work / "run", cap, batch), "bench_s": e2e.r1(time.time() - t)}
                runs.append(r)
                log(f"{name}: " + json.dumps({k: v for k, v in r.items() if k != "error"}))
                if not a.keep:
                    shutil.rmtree(work, ignore_errors=True)
                if r.get("error"):
                    log(f"{name}: FAILED (rc {r['returncode']}):\n{r['error']}")
                    if r["returncode"] == 2 and not r["steps_run"]:
                        log("the PS rejected its flags (exit 2, bad input): sweep stopped")
                        return runs
    return runs


def finish(a, runs, wl, cap, batch, seeds, stalenesses, corrections, started) -> int:
    summary = summarize_sweep(runs)
    print(table(summary, wl, cap))
    if a.png and summary:
        plot(summary, Path(a.png), wl, cap, batch, a.workers)
        log(f"figure written to {a.png}")
    if a.out:
        doc = {
            "machine": {"cpus": os.cpu_count(), "platform": platform.platform(), "python": platform.python_version(),
                        "loadavg_at_end": [round(x, 2) for x in os.getloadavg()]},
            "settings": {"workload": wl, "seeds": seeds, "max_staleness": stalenesses, "corrections": corrections,
                         "off_policy_cap": a.off_policy_cap, "workers": a.workers, "cap": cap, "target": e2e.TARGET,
                         "window": e2e.WINDOW, "warmup_step": e2e.WARMUP, "margin_steps": e2e.MARGIN,
                         "hyperparameters": e2e.hyperparameters(wl, 0),
                         "larger_model": e2e.LARGER_MODEL if wl == "larger" else None,
                         "bench_wall_s": round(time.time() - started, 1)},
            "runs": runs, "summary": summary,
        }
        Path(a.out).write_text(json.dumps(doc, indent=1) + "\n")
        log(f"JSON written to {a.out}")
    return 0 if runs and all(r["returncode"] == 0 for r in runs) else 1


if __name__ == "__main__":
    sys.exit(main())
