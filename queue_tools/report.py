"""queue_tools report: where a run's time went, from its timeline events.

Reads every ``RUN/logs/events-*.jsonl`` (schema: asyncgrpo/events.py) and ``RUN/metrics.jsonl``,
prints a summary, writes ``RUN/report/trace.json`` (Chrome trace event format, for Perfetto; trace.py)
and, with matplotlib, PNG plots in ``RUN/report/``.

Definitions (docs/operations.md, "queue_tools report", has them all):
- Percentiles are nearest-rank: the p-th of n sorted values is the ceil(p/100 * n)-th smallest.
- PS lives: each PS process (pid) is one life; a resumed run has several. A life's training span
  is its first ``train_step_start`` to its last ``train_step_end`` (monotonic clock: one host);
  the time between one life's span and the next's is **downtime** (the PS was dead or starting
  up), left out of every figure below (collect latencies included) and shown apart. Steps a life
  trained after its last checkpoint and the next life trained again count once, in the later
  life; a job archived consumed by several lives counts once (as ``done/`` and ``ls`` count it).
- Training span: the sum of the lives' spans. Trainer idle fraction: the sum of
  ``train_step_end.wait_ms`` over that span; "steady" leaves out the first step of each life
  (the workers' start-up or resync): from each life's first step end to its last.
- Worker utilisation, per process, over its life (first event or span start to last event),
  downtime left out: syncing = union of ``weights_synced`` / ``weights_wait`` spans; busy =
  union of job spans (claimed -> written, failed or released) minus syncing; idle = the rest.
- Jobs dropped: ``job_dropped`` events (the PS gave a job up after its last attempt), named in
  the diagnosis with the last error.
- Multi-turn jobs (tools): a job's time split into generation (``generate_turn_end``, one per
  turn), tool calls (``tools_end``: from one turn's end to the next turn's start) and reward
  (``score_end``), summed over jobs; the diagnosis names tools when they take at least
  TOOLS_HIGH of it while generation is the bottleneck.
- A line that is not a JSON object with a string ``event`` and a numeric ``mono`` (a process
  killed mid-write) is skipped and counted.
"""

from __future__ import annotations

import json
import math
import statistics
import sys
from collections import defaultdict

from asyncgrpo.run import RunDir, metrics
from queue_tools.timeline import Track, length, load_events, num, overlap, subtract, union, worker_intervals
from queue_tools.trace import build_trace

# (key, label, event, field): the summary table, in order.
STATS = [
    ("queue_wait_ms", "queue wait (ms)", "job_claimed", "queue_wait_ms"),
    ("processing_ms", "processing (ms)", "result_written", "dur_ms"),
    ("generation_ms", "generation (ms)", "generate_end", "dur_ms"),
    ("scoring_ms", "scoring (ms)", "score_end", "dur_ms"),
    ("turn_generation_ms", "turn: generate (ms)", "generate_turn_end", "dur_ms"),
    ("turn_tools_ms", "turn: tool calls (ms)", "tools_end", "dur_ms"),
    ("weight_sync_ms", "weight sync (ms)", "weights_synced", "dur_ms"),
    ("weight_publish_ms", "weight publish (ms)", "weights_published", "dur_ms"),
    ("weight_publish_kb", "weight publish (KB)", "weights_published", "bytes"),
    ("collect_latency_ms", "collect latency (ms)", "result_collected", "latency_ms"),
    ("trainer_wait_ms", "trainer wait (ms)", "train_step_end", "wait_ms"),
    ("train_step_ms", "train step (ms)", "train_step_end", "dur_ms"),
    ("staleness", "staleness (steps)", "result_consumed", "staleness"),
    # Per completion token, from the counts each result_consumed event carries: with --in_flight_updates a
    # result's later tokens come from newer weights than its own.
    ("token_staleness", "token stale (steps)", "result_consumed", "token_staleness"),
]
# Diagnosis thresholds (fractions of time).
IDLE_LOW = 0.10   # trainer idle below this: training is the bottleneck
IDLE_HIGH = 0.25  # trainer idle at or above this: the workers do not keep up
SYNC_HIGH = 0.20  # workers syncing / waiting for weights this much: weight sync is the bottleneck
BUSY_HIGH = 0.60  # workers busy this much while the trainer waits: generation is the bottleneck
STALE_HIGH = 0.10  # results archived stale / results collected: said in the diagnosis from here on
TOOLS_HIGH = 0.50  # tool calls' share of multi-turn job time: named as the bottleneck from here on
EVAL_HIGH = 0.25  # evaluation's share of the trainer's time: named as the bottleneck from here on
PLOTS_HINT = "plots: matplotlib is not installed; pip install 'asyncgrpo[plots]' to get them"


def percentile(sorted_values: list, p: float):
    """Nearest rank: the ceil(p/100 * n)-th smallest value (1-based)."""
    rank = max(1, math.ceil(p / 100 * len(sorted_values)))
    return sorted_values[rank - 1]


def summarize(values: list) -> dict:
    if not values:
        return {"count": 0, "mean": None, "p50": None, "p99": None, "max": None}
    s = sorted(values)
    return {"count": len(s), "mean": sum(s) / len(s), "p50": percentile(s, 50), "p99": percentile(s, 99), "max": s[-1]}


def token_staleness(events: list[dict]) -> dict:
    """summarize() over every completion token trained, from the counts by staleness each result_consumed event
    carries (weighted: a long run trains millions of tokens)."""
    counts: dict[int, int] = defaultdict(int)
    for e in events:
        by_staleness = e.get("token_staleness") if e["event"] == "result_consumed" else None
        if isinstance(by_staleness, dict):
            for staleness, n in by_staleness.items():
                if str(staleness).lstrip("-").isdigit() and isinstance(n, int) and n > 0:
                    counts[int(staleness)] += n
    total = sum(counts.values())
    if not total:
        return summarize([])
    ordered = sorted(counts.items())

    def percentile_of(p: float) -> int:
        rank, seen = max(1, math.ceil(p / 100 * total)), 0
        for value, n in ordered:
            seen += n
            if seen >= rank:
                return value
        return ordered[-1][0]

    return {"count": total, "mean": sum(v * n for v, n in ordered) / total, "p50": percentile_of(50),
            "p99": percentile_of(99), "max": ordered[-1][0]}


def utilisation(track: Track, downtime=()) -> dict:
    """Busy / syncing / idle over the worker's life, the PS's ``downtime`` intervals left out."""
    iv = worker_intervals(track)
    life = length(subtract([(iv["start"], iv["end"])], downtime))
    sync, jobs = union(subtract(iv["sync"], downtime)), union(subtract(iv["jobs"], downtime))
    syncing = length(sync)
    busy = length(jobs) - overlap(jobs, sync)
    idle = max(0.0, life - busy - syncing)

    def frac(x):
        return x / life if life > 0 else None
    written = [e for e in track.events if e["event"] == "result_written"]
    compiled = [e for e in track.events if e["event"] == "decoding_compiled"]
    return {"process": track.process, "pid": track.pid, "device": track.device, "life_s": life,
            "busy_s": busy, "syncing_s": syncing, "idle_s": idle, "busy_fraction": frac(busy),
            "syncing_fraction": frac(syncing), "idle_fraction": frac(idle), "jobs": len(written),
            # several jobs per generate call (--jobs_per_generate); compiled decoding's start-up and later graphs
            "jobs_per_call": statistics.fmean(e.get("jobs_in_call", 1) for e in written) if written else None,
            "compile_s": sum(e.get("dur_ms", 0) for e in compiled) / 1e3 if compiled else None,
            "recompiles": max((e.get("recompiles", 0) for e in written), default=0)}


def ps_lives(tracks: list[Track]) -> list[list]:
    """The events of each PS process that trained at least one step, in the order the lives ran."""
    lives = [t.events for t in tracks if t.role == "ps"]
    lives = [life for life in lives if any(e["event"] == "train_step_end" for e in life)]
    return sorted(lives, key=lambda life: life[0]["mono"])


def _span(life: list) -> tuple[float, float]:
    """A PS life's training span: its first train_step_start (or step end, if the start was not logged) to its
    last train_step_end."""
    steps = [e for e in life if e["event"] in ("train_step_start", "train_step_end")]
    return min(e["mono"] for e in steps), max(e["mono"] for e in steps if e["event"] == "train_step_end")


def _evaluating_s(life: list) -> float:
    """The seconds a PS life spent evaluating within its training span: the evaluation after its last step (TRL's
    final one), or one cut by the PS's end, is not time taken from training."""
    start, end = _span(life)
    return sum(max(0.0, min(end, e["mono"]) - max(start, e["mono"] - (num(e, "dur_ms") or 0.0) / 1e3))
               for e in life if e["event"] == "eval_end")


def downtime(lives: list[list]) -> list[dict]:
    """The gaps between consecutive PS lives' training spans:
    {start, end, down_s, after_step, pid_before, pid_after}."""
    gaps = []
    for before, after in zip(lives, lives[1:], strict=False):
        end_before, start_after = _span(before)[1], _span(after)[0]
        last_step = max((e for e in before if e["event"] == "train_step_end"), key=lambda e: e["mono"])
        gaps.append({"start": end_before, "end": start_after, "down_s": max(0.0, start_after - end_before),
                     "after_step": last_step.get("step"), "pid_before": before[0].get("pid"),
                     "pid_after": after[0].get("pid")})
    return gaps


def rolled_back_steps_removed(lives: list[list]) -> list[list]:
    """Each life's events without its steps the next life trained again: a PS killed after a checkpoint trained
    steps whose weights were lost; the next resumes from the checkpoint, so those steps (and the results they
    consumed) count once, in the life whose training was kept, as in the ledger and `ls`."""
    kept = []
    for i, life in enumerate(lives):
        if i == len(lives) - 1:
            kept.append(life)
            continue
        after = lives[i + 1]
        resumed_at = min(e.get("step", 0) for e in after if e["event"] in ("train_step_start", "train_step_end")) - 1
        kept.append([e for e in life if e["event"] not in ("train_step_start", "train_step_end", "result_consumed")
                     or (num(e, "step") or 0) <= resumed_at])
    return kept


def without_downtime(latency_ms: float, end: float, gaps: list[dict]) -> float:
    """A latency that ended at ``end`` (seconds, monotonic), minus the time in it no PS was training."""
    start = end - latency_ms / 1e3
    return latency_ms - 1e3 * sum(max(0.0, min(end, g["end"]) - max(start, g["start"])) for g in gaps)


def training_numbers(lives: list[list]) -> dict:
    """Throughput and trainer idle over the PS lives' training spans (downtime between them left out). Times
    count every step a life trained; steps, samples and tokens count a step a later life trained again once."""
    ends = [sorted((e for e in life if e["event"] == "train_step_end"), key=lambda e: e["mono"]) for life in lives]
    kept = [e for life in rolled_back_steps_removed(lives) for e in life]
    consumed = [e for e in kept if e["event"] == "result_consumed"]
    samples = sum(num(e, "samples") or 0 for e in consumed)
    tokens = sum(num(e, "tokens") or 0 for e in consumed)
    waits = [num(e, "wait_ms") or 0.0 for life_ends in ends for e in life_ends]
    eval_s = sum(_evaluating_s(life) for life in lives)
    out = {"steps": sum(e["event"] == "train_step_end" for e in kept), "span_s": None, "samples": samples,
           "tokens": tokens, "samples_per_s": None, "tokens_per_s": None, "trainer_wait_s": sum(waits) / 1e3,
           "trainer_idle_fraction": None, "trainer_idle_fraction_steady": None, "between_steps_fraction": None,
           "eval_s": eval_s, "eval_fraction": None}
    span = sum(end - start for start, end in map(_span, lives))
    if span > 0:
        step_s = sum(num(e, "dur_ms") or 0.0 for life_ends in ends for e in life_ends) / 1e3
        out.update(span_s=span, samples_per_s=samples / span, tokens_per_s=tokens / span,
                   trainer_idle_fraction=sum(waits) / span / 1e3, between_steps_fraction=(span - step_s) / span,
                   eval_fraction=eval_s / span)
    steady_span = sum(life_ends[-1]["mono"] - life_ends[0]["mono"] for life_ends in ends)
    if steady_span > 0:
        steady_waits = sum(num(e, "wait_ms") or 0.0 for life_ends in ends for e in life_ends[1:])
        out["trainer_idle_fraction_steady"] = steady_waits / 1e3 / steady_span
    return out


def dropped_groups(lives: list[list]) -> dict | None:
    """Dynamic sampling's count: groups dropped (``groups_dropped``; one judged again after a restart counts
    once) and groups trained (``result_consumed``, each step once); None when no group was dropped."""
    dropped = {(e.get("job_id"), g) for life in lives for e in life if e["event"] == "groups_dropped"
               for g in e.get("groups") or []}
    if not dropped:
        return None
    trained = sum(len(e.get("groups") or []) for life in rolled_back_steps_removed(lives) for e in life
                  if e["event"] == "result_consumed")
    return {"dropped": len(dropped), "trained": trained, "dropped_fraction": len(dropped) / (len(dropped) + trained)}


def dropped_jobs(events: list) -> dict:
    """Jobs the PS gave up after their last attempt (``job_dropped``): count, prompts, the newest error."""
    dropped = sorted((e for e in events if e["event"] == "job_dropped"), key=lambda e: e["mono"])
    errors = [e["error"] for e in dropped if isinstance(e.get("error"), str)]
    return {"jobs": len(dropped), "prompts": int(sum(num(e, "prompts") or 0 for e in dropped)),
            "last_error": errors[-1] if errors else None}


def rollout_split(events: list) -> dict | None:
    """Multi-turn jobs: seconds in generation, tool calls and reward over all jobs, the tool calls made,
    failed and cut by the timeout; None without turn events (no tools)."""
    turns = [e for e in events if e["event"] == "generate_turn_end"]
    if not turns:
        return None
    tools = [e for e in events if e["event"] == "tools_end"]
    seconds = {"generation_s": sum(num(e, "dur_ms") or 0.0 for e in turns) / 1e3,
               "tools_s": sum(num(e, "dur_ms") or 0.0 for e in tools) / 1e3,
               "reward_s": sum(num(e, "dur_ms") or 0.0 for e in events if e["event"] == "score_end") / 1e3}
    total = sum(seconds.values())
    return {**seconds, "tools_fraction": seconds["tools_s"] / total if total else 0.0,
            "turns_per_job": len(turns) / max(1, len({e.get("job_id") for e in turns})),
            **{key: int(sum(num(e, key) or 0 for e in tools)) for key in ("calls", "failed", "timed_out")}}


def pct(fraction: float) -> str:
    return f"{fraction * 100:.0f}%"


def diagnose(training: dict, workers: dict | None, stale_fraction: float | None = None,
             dropped: dict | None = None, gaps: list | None = None, rollouts: dict | None = None) -> str:
    """One line naming the bottleneck (thresholds IDLE_LOW, IDLE_HIGH, SYNC_HIGH, BUSY_HIGH), the share of
    results thrown away as stale when it reaches STALE_HIGH, jobs dropped after failing, and the PS's downtime
    (left out of the fractions)."""
    line = _bottleneck(training, workers)
    if rollouts and rollouts["tools_fraction"] >= TOOLS_HIGH and "generation is the bottleneck" in line:
        line += (f"; tool calls take {pct(rollouts['tools_fraction'])} of the workers' job time: tools are the "
                 "bottleneck (a worker waits on them: add workers, or make the tools faster)")
    if stale_fraction is not None and stale_fraction >= STALE_HIGH:
        line += (f"; {pct(stale_fraction)} of the results were too stale to train on and were generated again "
                 "(raise max_staleness)")
    if dropped and dropped["jobs"]:
        line += (f"; {dropped['jobs']} job(s) ({dropped['prompts']} prompts) failed on every attempt and were not "
                 f"trained on (last error: {dropped['last_error'] or 'none recorded: orphaned'})")
    if gaps:
        line += (f"; the PS was down {sum(g['down_s'] for g in gaps):.1f} s over {len(gaps)} restart(s), "
                 "not counted above")
    return line


def _bottleneck(training: dict, workers: dict | None) -> str:
    idle, when = training["trainer_idle_fraction_steady"], " after the first step"  # (as the trainer idle line)
    if idle is None:
        idle, when = training["trainer_idle_fraction"], ""
    if idle is None:
        return "no completed train steps: nothing to diagnose yet"
    evaluating = training.get("eval_fraction") or 0.0
    if evaluating >= EVAL_HIGH:  # (the trainer is busy then, but not training)
        return (f"evaluation takes {pct(evaluating)} of the trainer's time: it is the bottleneck (evaluate less "
                f"often, --eval_steps, or on fewer prompts); training {pct(max(0.0, 1 - idle - evaluating))}, "
                f"waiting for results {pct(idle)}")
    if not workers:
        return f"trainer idle {pct(idle)}{when}: no worker events recorded; are the workers running?"
    w_busy, w_sync, w_idle = workers["busy_fraction"], workers["syncing_fraction"], workers["idle_fraction"]
    if idle < IDLE_LOW:
        return f"trainer busy {pct(1 - idle)}{when}: training is the bottleneck; workers idle {pct(w_idle)}"
    if idle >= IDLE_HIGH:
        if w_sync >= SYNC_HIGH:
            return (f"trainer idle {pct(idle)}{when}: workers wait for weights {pct(w_sync)} of the time; weight sync "
                    "is the bottleneck (raise max_staleness or use a faster weight transport)")
        if w_busy >= BUSY_HIGH:
            return (f"trainer idle {pct(idle)}{when}: generation is the bottleneck (workers busy {pct(w_busy)}); "
                    "add workers or lower num_generations")
        return (f"trainer idle {pct(idle)}{when} while workers idle {pct(w_idle)}: jobs reach the workers too "
                "slowly; raise max_pending / max_outstanding / max_staleness")
    extra = f"; workers wait for weights {pct(w_sync)} of the time" if w_sync >= SYNC_HIGH else ""
    return (f"balanced: trainer idle {pct(idle)}{when}, workers busy {pct(w_busy)}, syncing {pct(w_sync)}, "
            f"idle {pct(w_idle)}{extra}")


def analyse(tracks: list[Track]) -> dict:
    every = [e for t in tracks for e in t.events]
    lives = ps_lives(tracks)
    gaps = downtime(lives)
    # A step a later life trained again, and the results it consumed, once (as throughput and `ls` count them).
    kept = [e for life in rolled_back_steps_removed(lives) for e in life]
    stats = {}
    for key, _label, event, fld in STATS:
        if key == "token_staleness":
            stats[key] = token_staleness(kept)
            continue
        source = kept if event in ("train_step_end", "result_consumed") else every
        values = [(v, e["mono"]) for e in source if e["event"] == event and (v := num(e, fld)) is not None]
        if key == "collect_latency_ms":  # a result written before a PS died waits for the next: not latency
            values = [(without_downtime(v, mono, gaps), mono) for v, mono in values]
        if key == "weight_publish_kb":
            values = [(v / 1e3, mono) for v, mono in values]
        stats[key] = summarize([v for v, _ in values])
    training = training_numbers(lives)
    workers = [utilisation(t, [(g["start"], g["end"]) for g in gaps]) for t in tracks if t.role == "worker"]
    total = None
    life = sum(w["life_s"] for w in workers)
    if life > 0:
        total = {f"{k}_fraction": sum(w[f"{k}_s"] for w in workers) / life for k in ("busy", "syncing", "idle")}
    archived: dict = defaultdict(int)
    # As in done/: a result a relaunched PS rolled back (consumed after its checkpoint) left it, and counts where it
    # ended (consumed again, once; or stale, unused). Logs from before the rolled-back event count it consumed once.
    consumed_now: dict = {}
    for e in sorted(every, key=lambda e: e.get("t", 0)):
        if e["event"] == "result_archived" and e.get("reason") == "consumed":
            consumed_now[e.get("job_id")] = True
        elif e["event"] == "result_rolled_back":
            consumed_now[e.get("job_id")] = False
        elif e["event"] == "result_archived":
            archived[str(e.get("reason"))] += 1
    if any(consumed_now.values()):
        archived["consumed"] = sum(consumed_now.values())
    collected = stats["collect_latency_ms"]["count"]
    stale = archived.get("stale", 0) / collected if collected else None
    dropped = dropped_jobs(every)
    rollouts = rollout_split(every)
    return {"stats": stats, "training": training, "workers": workers, "workers_total": total,
            "archived": dict(sorted(archived.items(), key=lambda kv: -kv[1])), "stale_fraction": stale,
            "dropped": dropped, "groups": dropped_groups(lives), "rollouts": rollouts,
            "downtime": {"restarts": len(gaps), "down_s": sum(g["down_s"] for g in gaps),
                                             "gaps": gaps},
            "diagnosis": diagnose(training, total, stale, dropped, gaps, rollouts)}


# ---------------------------------------------------------------------------------------- output

def _fmt(value) -> str:
    if value is None:
        return "-"
    return f"{value:.0f}" if abs(value) >= 1000 else f"{value:.3g}" if abs(value) < 10 else f"{value:.1f}"


def format_text(r: dict) -> str:
    lines = [f"run: {r['run_dir']}",
             f"events: {r['events']} from {len(r['processes'])} process(es) in {r['events_files']} file(s)"
             + (f"; {r['corrupt_lines']} corrupt line(s) skipped" if r["corrupt_lines"] else "")]
    lines.append(f"{'':<22}{'count':>7}{'mean':>9}{'p50':>9}{'p99':>9}{'max':>9}")
    for key, label, _event, _field in STATS:
        s = r["stats"][key]
        if key.startswith("turn_") and not s["count"]:  # single-turn jobs: no turns to show
            continue
        lines.append(f"{label:<22}{s['count']:>7}" + "".join(f"{_fmt(s[k]):>9}" for k in ("mean", "p50", "p99", "max")))
    t = r["training"]
    if t["span_s"] is None:
        lines.append(f"training: {t['steps']} step(s) completed; no training span to measure")
    else:
        lines.append(f"throughput: {t['steps']} steps in {t['span_s']:.1f} s: {t['samples_per_s']:.1f} samples/s, "
                     f"{t['tokens_per_s']:.0f} tokens/s ({t['samples']:.0f} samples, {t['tokens']:.0f} tokens)")
        steady = t["trainer_idle_fraction_steady"]
        lines.append(f"trainer idle: {pct(t['trainer_idle_fraction'])} (waited {t['trainer_wait_s']:.1f} s of "
                     f"{t['span_s']:.1f} s)" + (f"; {pct(steady)} after the first step" if steady is not None else "")
                     + f"; outside train steps (publish, logging, checkpoints): {pct(t['between_steps_fraction'])}"
                     + (f", of which evaluation {pct(t['eval_fraction'])} ({t['eval_s']:.1f} s)" if t.get("eval_s")
                        else ""))
    down = r["downtime"]
    if down["restarts"]:
        lines.append(f"downtime: {down['down_s']:.1f} s between {down['restarts'] + 1} PS lives, left out of the "
                     "figures here (" + ", ".join(f"{g['down_s']:.1f} s after step {g['after_step']}"
                                                  for g in down["gaps"]) + ")")
    if r.get("mps"):
        lines.append(f"NVIDIA MPS: {r['mps']}")
    lines.append(f"workers: {len(r['workers'])} (time busy on a job / syncing or waiting for weights / idle)")
    for w in r["workers"]:
        lines.append(f"  {w['process']:<14} pid {w['pid']!s:<8} {w['device']:<7} life {w['life_s']:6.1f} s  "
                     f"jobs {w['jobs']:<5} busy {pct(w['busy_fraction'] or 0):>4}  "
                     f"syncing {pct(w['syncing_fraction'] or 0):>4}  idle {pct(w['idle_fraction'] or 0):>4}"
                     + (f"  jobs/call {w['jobs_per_call']:.1f}" if (w.get("jobs_per_call") or 1) > 1 else "")
                     + (f"  compiled in {w['compile_s']:.0f} s, recompiles {w['recompiles']}"
                        if w.get("compile_s") is not None else ""))
    if r["workers_total"]:
        w = r["workers_total"]
        lines.append(f"  all workers: busy {pct(w['busy_fraction'])}, syncing {pct(w['syncing_fraction'])}, "
                     f"idle {pct(w['idle_fraction'])}")
    if r.get("groups"):
        g = r["groups"]
        lines.append(f"dynamic sampling: {g['dropped']} group(s) dropped (rewards without spread), {g['trained']} "
                     f"trained: {pct(g['dropped_fraction'])} of the groups judged dropped")
    if r.get("rollouts"):
        m = r["rollouts"]
        total = m["generation_s"] + m["tools_s"] + m["reward_s"]
        lines.append(f"multi-turn jobs: {m['turns_per_job']:.1f} turns a job; of their time, generation "
                     f"{pct(m['generation_s'] / total if total else 0)}, tool calls {pct(m['tools_fraction'])}, "
                     f"reward {pct(m['reward_s'] / total if total else 0)}; {m['calls']} tool calls, {m['failed']} "
                     f"failed ({m['timed_out']} cut by --tool_timeout_s)")
    if r["archived"]:
        lines.append("archived: " + ", ".join(f"{reason} {n}" for reason, n in r["archived"].items())
                     + (f" (stale: {pct(r['stale_fraction'])} of collected results)" if r["stale_fraction"] else ""))
    lines.append(f"diagnosis: {r['diagnosis']}")
    if r["trace"]:
        lines.append(f"trace: {r['trace']} (ui.perfetto.dev -> Open trace file, or chrome://tracing)")
    lines.append(f"plots: {', '.join(r['plots'])}" if r["plots"] else r["plots_note"])
    return "\n".join(lines)


def make_report(run: RunDir) -> dict | None:
    """Analyses the run, writes RUN/report/trace.json and the plots; None when there are no events."""
    tracks, n_files, corrupt = load_events(run)
    if not tracks:
        return None
    report = {"run_dir": str(run.root), "events_files": n_files, "events": sum(len(t.events) for t in tracks),
              "corrupt_lines": corrupt,
              "processes": [{"process": t.process, "pid": t.pid, "role": t.role, "device": t.device,
                             "events": len(t.events)} for t in tracks],
              **analyse(tracks)}
    if note := metrics.learning_note(metrics.last_line(run.metrics_file)):  # (a fact of the steps, not of the events)
        report["diagnosis"] += f"; {note}"
    ps = run.read_ps_status()
    report["mps"] = ps.mps if ps is not None else None  # NVIDIA MPS, as launch.sh found it ("on", "off: why")
    out_dir = run.root / "report"
    report["trace"], report["plots"], report["plots_note"] = None, [], None
    trace = build_trace(tracks)
    tmp = out_dir / ".trace.json.tmp"
    try:
        out_dir.mkdir(exist_ok=True)
        tmp.write_text(json.dumps(trace, separators=(",", ":")))
        tmp.replace(out_dir / "trace.json")
        report["trace"] = str(out_dir / "trace.json")
        from queue_tools import plots
        report["plots"] = [str(p) for p in plots.make_plots(out_dir, run, tracks,
                                                            trace["otherData"]["origin_mono_s"])]
    except ImportError as err:
        if not (err.name or "").startswith("matplotlib"):
            raise
        report["plots_note"] = PLOTS_HINT
    except OSError as err:  # (a full disk: the numbers above need none)
        tmp.unlink(missing_ok=True)
        report["plots_note"] = f"trace and plots: cannot write them in {out_dir}: {err.strerror or err}"
    return report


def cmd_report(run, args) -> int:
    report = make_report(run)
    if report is None:
        print(f"queue_tools: error: {run.root} has no timeline events (logs/events-*.jsonl): nothing to report",
              file=sys.stderr)
        return 2
    print(json.dumps(report, indent=2) if args.json else format_text(report))
    return 0
