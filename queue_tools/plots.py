"""queue_tools report's PNG plots (matplotlib, Agg backend). Importing this module without
matplotlib raises ImportError, which the report turns into a one-line install hint."""

from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
from matplotlib.ticker import MaxNLocator  # noqa: E402

from asyncgrpo.run import RunDir  # noqa: E402
from queue_tools.timeline import load_metrics, num, span_of, worker_intervals  # noqa: E402

STATES = ["pending", "processing", "committing", "complete", "collected"]
COLORS = {"busy": "tab:green", "syncing": "tab:orange", "train step": "tab:blue", "trainer waits": "tab:red",
          "weights publish": "tab:purple"}


def _save(fig, path: Path) -> Path:
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def _numbers(rows: list[dict], key: str) -> tuple[list, list]:
    pairs = [(r["step"], r[key]) for r in rows if isinstance(r.get(key), (int, float)) and "step" in r]
    return [p[0] for p in pairs], [p[1] for p in pairs]


def reward_loss(metrics: list[dict], path: Path) -> Path:
    fig, (top, bottom) = plt.subplots(2, 1, sharex=True, figsize=(8, 6))
    steps, reward = _numbers(metrics, "reward")
    top.plot(steps, reward, color="tab:green", label="reward (mean over the step's groups)")
    std = dict(zip(*_numbers(metrics, "reward_std"), strict=False))
    if std and steps:
        lo = [r - std.get(s, 0) for s, r in zip(steps, reward, strict=True)]
        hi = [r + std.get(s, 0) for s, r in zip(steps, reward, strict=True)]
        top.fill_between(steps, lo, hi, color="tab:green", alpha=0.15, label="± reward_std")
    top.set(title="Reward per train step", ylabel="reward")
    top.legend(loc="lower right")
    top.grid(alpha=0.3)
    steps, loss = _numbers(metrics, "loss")
    bottom.plot(steps, loss, color="tab:purple", label="loss")
    bottom.set(title="Loss per train step", xlabel="train step", ylabel="loss")
    bottom.legend(loc="upper right")
    bottom.grid(alpha=0.3)
    return _save(fig, path)


def staleness_hist(staleness: list[float], path: Path) -> Path:
    fig, ax = plt.subplots(figsize=(7, 4))
    if staleness:
        top = int(max(staleness))
        ax.hist(staleness, bins=[b - 0.5 for b in range(int(min(staleness)), top + 2)], color="tab:blue",
                edgecolor="white", label=f"{len(staleness)} consumed results")
        ax.set_xticks(range(int(min(staleness)), top + 1))
        ax.legend()
    else:
        ax.text(0.5, 0.5, "no consumed results", ha="center", va="center", transform=ax.transAxes)
    ax.set(title="Staleness of consumed results (train step - weights version)",
           xlabel="staleness (steps)", ylabel="results")
    ax.grid(alpha=0.3, axis="y")
    return _save(fig, path)


def queue_depth(metrics: list[dict], path: Path) -> Path:
    fig, ax = plt.subplots(figsize=(8, 4))
    rows = [r for r in metrics if isinstance(r.get("queue_depth"), dict)]
    times = [r.get("time") for r in rows]
    use_time = rows and all(isinstance(t, (int, float)) for t in times)
    xs = [t - times[0] for t in times] if use_time else [r.get("step") for r in rows]
    states = STATES + sorted({k for r in rows for k in r["queue_depth"]} - set(STATES))
    for state in states:
        ys = [r["queue_depth"].get(state, 0) for r in rows]
        if any(ys):
            ax.step(xs, ys, where="post", label=state)
    if rows and ax.get_legend_handles_labels()[0]:
        ax.legend(title="state", loc="upper left", bbox_to_anchor=(1.01, 1.0))
    elif not rows:
        ax.text(0.5, 0.5, "no queue_depth in metrics.jsonl", ha="center", va="center", transform=ax.transAxes)
    ax.set(title="Queue depth per state (sampled at each logged step)",
           xlabel="seconds since the first logged step" if use_time else "train step", ylabel="files in queue/")
    ax.yaxis.set_major_locator(MaxNLocator(integer=True))
    ax.grid(alpha=0.3)
    return _save(fig, path)


def timeline(rows: list[tuple[str, dict]], path: Path) -> Path:
    """One row per process: workers busy / syncing on a grey life span (idle shows grey); the PS's
    train steps and waits."""
    fig, ax = plt.subplots(figsize=(11, 1.2 + 0.7 * max(1, len(rows))))
    labelled = set()
    for i, (_label, kinds) in enumerate(rows):
        y = (len(rows) - 1 - i) * 10
        for kind in ("life", "busy", "train step", "weights publish", "syncing", "trainer waits"):  # last on top
            spans = kinds.get(kind)
            if not spans:
                continue
            name = "idle (process alive)" if kind == "life" else kind
            h = 4 if kind == "trainer waits" else 8
            ax.broken_barh(spans, (y + (8 - h) / 2, h), facecolors=COLORS.get(kind, "lightgrey"),
                           label=None if name in labelled else name)
            labelled.add(name)
    ax.set_yticks([(len(rows) - 1 - i) * 10 + 4 for i in range(len(rows))], [label for label, _ in rows])
    ax.set(title="Timeline per process: workers busy / syncing weights / idle; trainer steps and waits",
           xlabel="seconds since the first event")
    ax.legend(loc="upper center", bbox_to_anchor=(0.5, -0.25 if len(rows) < 4 else -0.12), ncol=6, frameon=False)
    ax.grid(alpha=0.3, axis="x")
    return _save(fig, path)


def timeline_rows(tracks: list, origin: float) -> list[tuple[str, dict]]:
    """Per process, its spans by kind as (start, width) in seconds from origin."""
    rows = []
    for t in tracks:
        if t.role == "ps":
            kinds = {kind: [s for e in t.events if e["event"] == event and (s := span_of(e))]
                     for kind, event in (("train step", "train_step_end"), ("evaluation", "eval_end"),
                                         ("trainer waits", "wait_result"), ("weights publish", "weights_published"))}
        elif t.role == "worker":
            iv = worker_intervals(t)
            kinds = {"busy": iv["jobs"], "syncing": iv["sync"], "life": [(iv["start"], iv["end"])]}
        else:
            continue
        rows.append((f"{t.process}\npid {t.pid}", {k: [(a - origin, b - a) for a, b in v] for k, v in kinds.items()}))
    return rows


def make_plots(out_dir: Path, run: RunDir, tracks: list, origin: float) -> list[Path]:
    metrics = load_metrics(run)
    staleness = [v for t in tracks for e in t.events
                 if e["event"] == "result_consumed" and (v := num(e, "staleness")) is not None]
    rows = timeline_rows(tracks, origin)
    return [reward_loss(metrics, out_dir / "reward_loss.png"),
            staleness_hist(staleness, out_dir / "staleness.png"),
            queue_depth(metrics, out_dir / "queue_depth.png"),
            timeline(rows, out_dir / "workers_timeline.png")]
