"""The Chrome trace of a run (``RUN/report/trace.json``, opens in Perfetto), built from the
events ``queue_tools.report`` loaded: one process per track, threads per kind of span, and a
flow arrow per consumed job from its creation through the workers to its consumption."""

from __future__ import annotations

import math
from collections import defaultdict

from queue_tools.timeline import COMMON, Track, num, span_of, worker_intervals

# thread order within a process
LANES = ["trainer", "publish", "producer", "collector", "consume", "jobs", "weights", "queue wait", "events"]
# event closing a span -> (thread group, category, slice name)
TRACE_SPANS = {"train_step_end": ("trainer", "train", "step {step}"),
               "eval_end": ("trainer", "eval", "evaluate at step {step}"),
               "wait_result": ("trainer", "wait", "wait for result"),
               "weights_published": ("publish", "weights", "publish v{weights_version}"),
               "generate_end": ("jobs", "job", "generate"), "score_end": ("jobs", "job", "score"),
               "generate_turn_end": ("jobs", "job", "turn {turn}: generate"),
               "tools_end": ("jobs", "tool", "turn {turn}: tools ({calls} calls)"),
               "weights_synced": ("weights", "weights", "sync weights"),
               "weights_wait": ("weights", "weights", "wait for weights v{weights_version}")}


def build_trace(tracks: list[Track]) -> dict:
    """Chrome trace: one process per track, threads per kind of span (more lanes where spans
    overlap), a flow per consumed job from its creation through the workers to its consumption."""
    slices, instants, flows = [], [], defaultdict(list)  # flows: job_id -> [(phase, slice)]

    def add(pid, group, start, end, name, cat, args, flow=None):
        slices.append(sl := {"pid": pid, "group": group, "start": start, "end": end, "name": name, "cat": cat,
                             "args": {k: v for k, v in args.items() if k not in COMMON}})
        if flow:
            flows[flow[1]].append((flow[0], sl))

    # A job is claimable once its file is linked, before put returns and job_created is emitted:
    # its creation starts at the earliest of that event and (claimed - queue wait).
    jobs = {id(t): worker_intervals(t)["records"] for t in tracks if t.role == "worker"}
    born: dict = {}
    for r in (r for records in jobs.values() for r in records):
        if r["claim"] and (qw := num(r["claim"], "queue_wait_ms")) is not None:
            born[r["job_id"]] = min(born.get(r["job_id"], math.inf), r["start"] - qw / 1e3)
    for pid, track in enumerate(tracks, start=1):
        for r in jobs.get(id(track), []):
            job = r["job_id"]
            if r["claim"] and (qw := num(r["claim"], "queue_wait_ms")) is not None:
                add(pid, "queue wait", r["start"] - qw / 1e3, r["start"], f"queued {job}", "queue", r["claim"])
            add(pid, "jobs", r["start"], r["end"], f"job {job}" + ("" if r["close"] else " (unfinished)"), "job",
                r["close"] or {}, ("t", job))
        for ev in track.events:
            name, mono, job = ev["event"], ev["mono"], ev.get("job_id")
            span = span_of(ev)
            if name in TRACE_SPANS and span:
                group, cat, label = TRACE_SPANS[name]
                add(pid, group, *span, label.format_map(defaultdict(str, ev)), cat, ev)
            elif name == "job_created":
                add(pid, "producer", min(span[0] if span else mono, born.get(job, mono)), mono, f"create {job}", "job",
                    ev, ("s", job))
            elif name == "result_collected":
                add(pid, "collector", mono - (num(ev, "latency_ms") or 0) / 1e3, mono, f"result {job} waits", "queue",
                    ev, ("t", job))
            elif name == "result_consumed":
                add(pid, "consume", mono, mono, f"consume {job}", "job", ev, ("f", job))
            if name in ("job_failed", "job_released") or (name == "result_archived" and ev.get("reason") != "consumed"):
                instants.append({"name": f"{name} {job}", "ph": "i", "s": "t", "mono": mono, "pid": pid, "cat": "job",
                                 "args": {k: v for k, v in ev.items() if k not in COMMON}})
    origin = min([sl["start"] for sl in slices] + [i["mono"] for i in instants])
    for sl in slices:  # whole microseconds (exact nesting); at least 2 so a flow can bind inside
        sl["ts"] = round((sl["start"] - origin) * 1e6)
        sl["te"] = max(round((sl["end"] - origin) * 1e6), sl["ts"] + 2)
    # Within one thread slices must nest or be disjoint: one that would cross another goes to the
    # group's next lane. Thread ids in display order: process, LANES, lane.
    lanes: dict = {}  # (pid, group) -> per lane, a stack of open end times
    for sl in sorted(slices, key=lambda sl: (sl["ts"], -sl["te"])):
        stacks = lanes.setdefault((sl["pid"], sl["group"]), [])
        for lane, stack in enumerate(stacks + [[]]):
            while stack and stack[-1] <= sl["ts"]:
                stack.pop()
            if not stack or sl["te"] <= stack[-1]:
                if lane == len(stacks):
                    stacks.append(stack)
                stack.append(sl["te"])
                sl["lane"] = (sl["pid"], sl["group"], lane)
                break
    for i in instants:
        i["lane"] = (i["pid"], "events", 0)
    keys = sorted({x["lane"] for x in slices + instants}, key=lambda k: (k[0], LANES.index(k[1]), k[2]))
    tids = {k: n for n, k in enumerate(keys, start=1)}
    meta = [{"name": n, "ph": "M", "pid": pid, "tid": 0, "ts": 0, "args": a} for pid, t in enumerate(tracks, start=1)
            for n, a in (("process_name", {"name": f"{t.process} (pid {t.pid}, {t.device})"}),
                         ("process_sort_index", {"sort_index": pid}))]
    meta += [{"name": n, "ph": "M", "pid": k[0], "tid": tid, "ts": 0, "args": a} for k, tid in tids.items()
             for n, a in (("thread_name", {"name": k[1] + (f" {k[2] + 1}" if k[2] else "")}),
                          ("thread_sort_index", {"sort_index": tid}))]
    timed = [{"name": sl["name"], "cat": sl["cat"], "ph": "X", "ts": sl["ts"], "dur": sl["te"] - sl["ts"],
              "pid": sl["pid"], "tid": tids[sl["lane"]], "args": sl["args"]} for sl in slices]
    timed += [{**{k: v for k, v in i.items() if k not in ("mono", "lane")}, "ts": round((i["mono"] - origin) * 1e6),
               "tid": tids[i["lane"]]} for i in instants]
    flow_id = 0
    for job, points in flows.items():
        starts, ends = ([sl for ph, sl in points if ph == kind] for kind in "sf")
        if len(starts) != 1 or len(ends) != 1 or ends[0]["ts"] < starts[0]["ts"]:
            continue  # not created and consumed (in order) in these events: no arrow
        # Each point 1 us inside its slice (Perfetto binds a flow event to the slice open there), in
        # time order: a step outside [start, finish] or out of order is left out.
        kept = [("s", starts[0])]
        for sl in sorted((sl for ph, sl in points if ph == "t"), key=lambda sl: sl["ts"]):
            if kept[-1][1]["ts"] <= sl["ts"] <= ends[0]["ts"]:
                kept.append(("t", sl))
        flow_id += 1
        for ph, sl in kept + [("f", ends[0])]:
            timed.append({"name": "job", "cat": "job", "ph": ph, "id": flow_id, "ts": sl["ts"] + 1, "pid": sl["pid"],
                          "tid": tids[sl["lane"]], "args": {"job_id": job}, **({"bp": "e"} if ph == "f" else {})})
    timed.sort(key=lambda e: (e["ts"], -e.get("dur", 0)))
    return {"traceEvents": meta + timed, "displayTimeUnit": "ms",
            "otherData": {"origin_mono_s": origin, "source": "queue_tools report"}}
