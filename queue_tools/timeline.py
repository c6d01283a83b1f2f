"""The timeline the report, its trace and its plots share: each process's events from
``RUN/logs/events-*.jsonl`` (schema and reader: asyncgrpo/events.py), the spans they close, interval
arithmetic over those spans, and ``RUN/metrics.jsonl``'s lines."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from asyncgrpo.events import event_files, read_event_file
from asyncgrpo.run import RunDir, metrics

COMMON = ("event", "t", "mono", "pid", "process", "role", "device")  # fields every event has


@dataclass
class Track:
    """One process's events (a relaunched process, new pid, is a new track)."""
    process: str
    pid: object
    role: str
    device: str
    events: list = field(default_factory=list)


def num(event: dict, key: str) -> float | None:
    value = event.get(key)
    ok = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
    return float(value) if ok else None


def load_events(run: RunDir) -> tuple[list[Track], int, int]:
    """(tracks sorted PS first, number of events files, lines skipped: not events, e.g. torn)."""
    files = event_files(run.root)
    tracks: dict[tuple, Track] = {}
    skipped = 0
    for path in files:
        events, corrupt = read_event_file(path)
        skipped += corrupt
        for ev in events:
            process = str(ev.get("process") or path.stem.removeprefix("events-"))
            key = (process, ev.get("pid"))
            if key not in tracks:
                tracks[key] = Track(process, ev.get("pid"), str(ev.get("role", "")), str(ev.get("device", "")))
            tracks[key].events.append(ev)
    for track in tracks.values():
        track.events.sort(key=lambda e: e["mono"])
    ordered = sorted(tracks.values(), key=lambda t: (t.role != "ps", t.process, t.events[0]["mono"]))
    return ordered, len(files), skipped


def span_of(ev: dict) -> tuple[float, float] | None:
    """(start, end) in seconds of an event that closes a span, else None."""
    dur = num(ev, "dur_ms")
    return None if dur is None else (ev["mono"] - dur / 1e3, ev["mono"])


def union(intervals) -> list:
    merged: list[list[float]] = []
    for start, end in sorted(intervals):
        if merged and start <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], end)
        else:
            merged.append([start, end])
    return merged


def length(intervals) -> float:
    return sum(end - start for start, end in intervals)


def overlap(a, b) -> float:
    """Overlap of two unions (sorted, disjoint)."""
    i = j = 0
    total = 0.0
    while i < len(a) and j < len(b):
        total += max(0.0, min(a[i][1], b[j][1]) - max(a[i][0], b[j][0]))
        if a[i][1] < b[j][1]:
            i += 1
        else:
            j += 1
    return total


def worker_intervals(track: Track) -> dict:
    """A worker's life (start, end), its jobs and its weight sync/wait spans. A job runs from its
    claim (the earlier of ``result_written``'s span start and the ``job_claimed`` event: a process
    descheduled between taking a time and emitting shifts one of them) to its ``result_written``
    / ``job_failed`` / ``job_released``, or to the process's last event."""
    claimed: dict = {}  # job_id -> job_claimed event
    records, sync = [], []
    start = end = track.events[0]["mono"]
    for ev in track.events:
        name, mono, job = ev["event"], ev["mono"], ev.get("job_id")
        span = span_of(ev)
        if name == "job_claimed":
            claimed[job] = ev
        elif name in ("result_written", "job_failed", "job_released") and (job in claimed or span):
            claim = claimed.pop(job, None)
            began = min(span[0] if name == "result_written" and span else mono, claim["mono"] if claim else mono)
            records.append({"job_id": job, "start": began, "end": mono, "claim": claim, "close": ev})
        elif name in ("weights_synced", "weights_wait") and span:
            sync.append(span)
        start = min(start, span[0] if span else mono)
        end = max(end, mono)
    records += [{"job_id": job, "start": claim["mono"], "end": end, "claim": claim, "close": None}
                for job, claim in claimed.items()]  # still running at its last event (killed?)
    return {"start": start, "end": end, "jobs": [(r["start"], r["end"]) for r in records], "records": records,
            "sync": sync}


def subtract(intervals, holes) -> list:
    """The parts of ``intervals`` outside every one of ``holes``."""
    out = []
    for start, end in intervals:
        pieces = [(start, end)]
        for hole_start, hole_end in holes:
            pieces = [(a, b) for lo, hi in pieces for a, b in ((lo, min(hi, hole_start)), (max(lo, hole_end), hi))
                      if b > a]
        out += pieces
    return out


def load_metrics(run: RunDir) -> list[dict]:
    """metrics.jsonl's lines; corrupt ones are skipped."""
    return metrics.read_lines(run.metrics_file)
