"""queue_tools report: its numbers against an independent computation, its Chrome trace, its plots,
its behaviour without matplotlib and on bad input; and once on a real PS + 2 workers run."""

import json
import math
import random
import subprocess
import sys
from collections import defaultdict
from pathlib import Path

import numpy as np
import pytest
from helpers import REPO

from asyncgrpo.events import read_events
from asyncgrpo.run import RunDir
from queue_tools.cli import main

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"
T0 = 5000.0  # monotonic seconds of the synthetic run's start
WALL = 1.7e9 - T0  # wall clock = mono + WALL


def call_main(argv) -> int:
    try:
        return main([str(a) for a in argv])
    except SystemExit as exited:  # argparse's errors
        return exited.code


class Process:
    """Writes one process's events the way asyncgrpo.events.EventLog does, at chosen times."""

    def __init__(self, logs: Path, process: str, pid: int, role: str):
        self.path, self.common = logs / f"events-{process}.jsonl", {"pid": pid, "process": process, "role": role,
                                                                    "device": "cpu"}
        self.lines = []

    def emit(self, mono: float, event: str, **fields):
        self.lines.append((mono, {"event": event, "t": mono + WALL, "mono": mono, **self.common, **fields}))

    def flush(self, extra_lines=()):
        with open(self.path, "a") as f:
            for _, record in sorted(self.lines, key=lambda x: x[0]):
                f.write(json.dumps(record) + "\n")
            f.writelines(extra_lines)


def synthetic_run(root: Path, n_jobs=40, seed=0) -> dict:
    """A PS and workers dev1, dev2 (dev2 is killed mid-job and relaunched with a new pid), on a
    schedule chosen here. Returns what the report must find, computed from the schedule itself."""
    rng = random.Random(seed)
    run = RunDir.create(root)
    ps = Process(run.logs, "ps", 100, "ps")
    workers = {201: Process(run.logs, "worker-dev1", 201, "worker"),
               202: Process(run.logs, "worker-dev2", 202, "worker"),
               203: Process(run.logs, "worker-dev2", 203, "worker")}
    free = {201: T0 + 0.020, 202: T0 + 0.025}  # pid 203 replaces 202 after the kill
    life = {pid: [math.inf, -math.inf] for pid in workers}
    busy, syncing = defaultdict(float), defaultdict(float)
    want = defaultdict(list)
    written, jobs_done = {}, defaultdict(int)
    kill_at_job = 12
    job_ids = [f"000000_{j:03d}" for j in range(n_jobs)]
    for j, job in enumerate(job_ids):
        created = T0 + 0.004 * j
        ps.emit(created, "job_created", job_id=job, weights_version=0, rows=4, created_step=0)
        pid = min(free, key=free.get)
        w, t = workers[pid], free[pid]
        if rng.random() < 0.4:
            dur = rng.uniform(0.005, 0.02)
            w.emit(t + dur, "weights_synced", weights_version=j, dur_ms=dur * 1e3, bytes=1000)
            life[pid][0] = min(life[pid][0], t)
            syncing[pid] += dur
            want["weight_sync_ms"].append(dur * 1e3)
            t += dur
        claim = max(t, created + 0.001)
        life[pid][0] = min(life[pid][0], claim)
        wait_ms = (claim - created) * 1e3
        want["queue_wait_ms"].append(wait_ms)
        w.emit(claim, "job_claimed", job_id=job, attempt=1, queue_wait_ms=wait_ms)
        gen, score = rng.uniform(0.02, 0.05), rng.uniform(0.002, 0.01)
        w.emit(claim + 0.0005, "generate_start", job_id=job, weights_version=j)
        if j == kill_at_job:  # SIGKILL during generation: a relaunched process takes over
            busy[pid] += 0.0005  # claimed -> its last event
            life[pid][1] = claim + 0.0005
            del free[pid]
            free[203] = claim + 0.2
            created = claim  # the job comes back through recovery
            pid, w = 203, workers[203]
            claim = free[pid]
            life[pid][0] = claim
            want["queue_wait_ms"].append((claim - created) * 1e3)
            w.emit(claim, "job_claimed", job_id=job, attempt=2, queue_wait_ms=(claim - created) * 1e3)
            w.emit(claim + 0.0005, "generate_start", job_id=job, weights_version=j)
        w.emit(claim + 0.0005 + gen, "generate_end", job_id=job, weights_version=j, dur_ms=gen * 1e3, tokens=64)
        w.emit(claim + 0.0006 + gen, "score_start", job_id=job)
        w.emit(claim + 0.0006 + gen + score, "score_end", job_id=job, dur_ms=score * 1e3)
        done = claim + 0.001 + gen + score
        w.emit(done, "result_written", job_id=job, weights_version=j, dur_ms=(done - claim) * 1e3, published=True)
        want["generation_ms"].append(gen * 1e3)
        want["scoring_ms"].append(score * 1e3)
        want["processing_ms"].append((done - claim) * 1e3)
        busy[pid] += done - claim
        life[pid][1] = max(life[pid][1], done)
        free[pid] = done + rng.uniform(0, 0.01)
        written[job] = done
        jobs_done[pid] += 1
    # The PS: step i consumes job i-1 once it is collected.
    t = T0 + 0.01
    first_start, samples, tokens, waits, step_s = t, 0, 0, [], 0.0
    for i, job in enumerate(job_ids, start=1):
        latency = rng.uniform(0.001, 0.004)
        collected = written[job] + latency
        ps.emit(collected, "result_collected", job_id=job, weights_version=i, worker_device=1, latency_ms=latency * 1e3)
        want["collect_latency_ms"].append(latency * 1e3)
        ps.emit(t, "train_step_start", step=i)
        consumed = max(t, collected) + 0.0002
        wait = consumed - t
        ps.emit(consumed, "wait_result", step=i - 1, dur_ms=wait * 1e3)
        staleness, n_tokens = rng.randint(0, 4), rng.randint(100, 256)
        newer = rng.randint(0, n_tokens) if staleness else 0  # tokens of a newer version (in-flight updates)
        by_staleness = {str(staleness): n_tokens - newer, **({str(staleness - 1): newer} if newer else {})}
        ps.emit(consumed, "result_consumed", job_id=job, weights_version=i - staleness, step=i - 1,
                staleness=staleness, samples=32, tokens=n_tokens, token_staleness=by_staleness)
        ps.emit(consumed + 0.0001, "result_archived", job_id=job, reason="consumed")
        want["staleness"].append(staleness)
        want["token_staleness"] += [staleness] * (n_tokens - newer) + [staleness - 1] * newer
        samples, tokens = samples + 32, tokens + n_tokens
        end = consumed + rng.uniform(0.01, 0.03)
        ps.emit(end, "train_step_end", step=i, dur_ms=(end - t) * 1e3, wait_ms=wait * 1e3, reward=0.5, loss=0.1)
        want["train_step_ms"].append((end - t) * 1e3)
        want["trainer_wait_ms"].append(wait * 1e3)
        waits.append(wait)
        step_s += end - t
        if i == 1:
            first_end = end
        publish = rng.uniform(0.001, 0.003)
        published = 150_000 if i % 20 == 1 else rng.randint(2_000, 9_000)  # an anchor, or a delta
        ps.emit(end + publish, "weights_published", weights_version=i, dur_ms=publish * 1e3, bytes=published)
        want["weight_publish_ms"].append(publish * 1e3)
        want["weight_publish_kb"].append(published / 1e3)
        t = end + publish
    corrupt = ["not json\n", '{"event": "job_claimed", "t": 1.0, "mo\n', "[1, 2]\n", '{"event": "x", "mono": "soon"}\n']
    ps.flush(corrupt[:1])
    for pid, w in workers.items():
        w.flush(corrupt[1:] if pid == 202 else ())
    metrics = [{"step": i, "reward": 0.1 + 0.02 * i, "reward_std": 0.1, "loss": 0.5 / i, "staleness_mean": 1.0,
                "staleness_max": 2, "weights_version": i - 1, "trainer_wait_s": 0.01, "step_time_s": 0.02,
                "queue_depth": {"pending": i % 3, "processing": 2, "committing": 0, "complete": i % 2, "collected": 0},
                "time": WALL + T0 + 0.03 * i} for i in range(1, n_jobs + 1)]
    (root / "metrics.jsonl").write_text("".join(json.dumps(m) + "\n" for m in metrics) + '{"step": 4')
    span = t - publish - first_start  # last train_step_end - first train_step_start
    return {"run": run, "want": want, "corrupt": len(corrupt), "span": span, "samples": samples, "tokens": tokens,
            "idle": sum(waits) / span, "between": (span - step_s) / span,
            "idle_steady": sum(waits[1:]) / (t - publish - first_end),
            "workers": {pid: {"life": life[pid][1] - life[pid][0], "busy": busy[pid], "syncing": syncing[pid],
                              "jobs": jobs_done[pid]} for pid in workers},
            "consumed": len(job_ids)}


def nearest_rank(values, p):
    return float(np.percentile(np.array(values, dtype=float), p, method="inverted_cdf"))


def report_json(capsys, run_root) -> dict:
    assert call_main(["report", run_root, "--json"]) == 0
    return json.loads(capsys.readouterr().out)


def assert_stats_equal(got: dict, values: list):
    assert got["count"] == len(values)
    assert got["mean"] == pytest.approx(sum(values) / len(values), rel=1e-9)
    assert got["p50"] == pytest.approx(nearest_rank(values, 50), rel=1e-9)
    assert got["p99"] == pytest.approx(nearest_rank(values, 99), rel=1e-9)
    assert got["max"] == pytest.approx(max(values), rel=1e-9)


def test_numbers_match_the_schedule_the_events_were_written_from(tmp_path, capsys):
    syn = synthetic_run(tmp_path / "run")
    r = report_json(capsys, syn["run"].root)
    assert r["corrupt_lines"] == syn["corrupt"]
    assert len(r["processes"]) == 4  # ps, dev1, dev2 and dev2 relaunched: one track per pid
    for key, values in syn["want"].items():
        assert_stats_equal(r["stats"][key], values)
    multi_turn = {"turn_generation_ms", "turn_tools_ms"}  # no tools in this run: no turn events
    assert all(r["stats"][key]["count"] == 0 for key in multi_turn)
    assert set(r["stats"]) - multi_turn == set(syn["want"])  # every statistic was checked
    t = r["training"]
    assert t["steps"] == syn["consumed"]
    assert t["span_s"] == pytest.approx(syn["span"], rel=1e-9)
    assert t["samples_per_s"] == pytest.approx(syn["samples"] / syn["span"], rel=1e-9)
    assert t["tokens_per_s"] == pytest.approx(syn["tokens"] / syn["span"], rel=1e-9)
    assert t["trainer_idle_fraction"] == pytest.approx(syn["idle"], rel=1e-9)
    assert t["trainer_idle_fraction_steady"] == pytest.approx(syn["idle_steady"], rel=1e-9)
    assert t["between_steps_fraction"] == pytest.approx(syn["between"], rel=1e-6)
    by_pid = {w["pid"]: w for w in r["workers"]}
    assert set(by_pid) == set(syn["workers"])
    for pid, want in syn["workers"].items():
        got = by_pid[pid]
        assert got["jobs"] == want["jobs"]
        assert got["life_s"] == pytest.approx(want["life"], abs=1e-9)
        assert got["busy_s"] == pytest.approx(want["busy"], abs=1e-9)
        assert got["syncing_s"] == pytest.approx(want["syncing"], abs=1e-9)
        assert got["idle_s"] == pytest.approx(want["life"] - want["busy"] - want["syncing"], abs=1e-9)
        assert got["busy_fraction"] == pytest.approx(want["busy"] / want["life"], abs=1e-9)
    total_life = sum(w["life"] for w in syn["workers"].values())
    assert r["workers_total"]["busy_fraction"] == pytest.approx(
        sum(w["busy"] for w in syn["workers"].values()) / total_life, abs=1e-9)
    assert r["archived"] == {"consumed": syn["consumed"]} and r["stale_fraction"] == 0
    # 19% idle after the first step: between the thresholds, so neither side is named the bottleneck.
    assert r["diagnosis"].startswith(f"balanced: trainer idle {syn['idle_steady'] * 100:.0f}%")


def test_text_report_says_what_the_json_says(tmp_path, capsys):
    syn = synthetic_run(tmp_path / "run")
    assert call_main(["report", syn["run"].root]) == 0
    out = capsys.readouterr().out
    r = report_json(capsys, syn["run"].root)
    assert f"{syn['corrupt']} corrupt line(s) skipped" in out
    assert f"diagnosis: {r['diagnosis']}\n" in out
    assert f"{r['training']['samples_per_s']:.1f} samples/s" in out
    assert f"trainer idle: {r['training']['trainer_idle_fraction'] * 100:.0f}%" in out
    line = next(x for x in out.splitlines() if x.startswith("queue wait (ms)"))
    assert line.split()[3] == str(r["stats"]["queue_wait_ms"]["count"])
    assert "turn:" not in out and "multi-turn jobs" not in out  # no tools, no turn rows


def make_track_events(role, spans, pid=1, process=None):
    """(event, mono, fields) triples -> event dicts of one process."""
    process = process or ("ps" if role == "ps" else f"worker-dev{pid}")
    return [{"event": e, "t": m + WALL, "mono": m, "pid": pid, "process": process, "role": role, "device": "cpu", **f}
            for e, m, f in spans]


def two_ps_lives(root: Path) -> RunDir:
    """A PS that trains steps 1-3, dies, and is relaunched (new pid) 59.2 s later to train steps 4-6; a worker
    lives through both, busy on a job 0.7 s of each second of training, idle while there is no PS."""
    run = RunDir.create(root)
    ps_lines, worker_lines = [], []
    for step, (pid, start) in enumerate([(100, 10.0), (100, 11.0), (100, 12.0), (300, 72.0), (300, 73.0),
                                          (300, 74.0)], start=1):
        ps_lines += make_track_events("ps", [
            ("train_step_start", start, {"step": step}),
            ("result_consumed", start + 0.2, {"job_id": f"000000_00{step}", "samples": 32, "tokens": 100}),
            ("train_step_end", start + 0.8, {"step": step, "dur_ms": 800.0, "wait_ms": 200.0})], pid=pid)
    jobs = [(9.5, 10.2), (10.5, 11.2), (11.5, 12.2), (12.5, 13.5), (71.5, 72.2), (72.5, 73.2), (73.5, 74.2)]
    for j, (claimed, written) in enumerate(jobs):  # the 4th ends after the PS died, the 5th starts before it is back
        worker_lines += make_track_events("worker", [
            ("job_claimed", claimed, {"job_id": f"000000_00{j}", "queue_wait_ms": 1.0}),
            ("result_written", written, {"job_id": f"000000_00{j}", "dur_ms": (written - claimed) * 1e3})], pid=201)
    worker_lines += make_track_events("worker", [("job_released", 75.0, {"job_id": "000000_009"})], pid=201)
    for name, lines in (("ps", ps_lines), ("worker-dev1", worker_lines)):
        (run.logs / f"events-{name}.jsonl").write_text("".join(json.dumps(e) + "\n" for e in lines))
    return run


def test_the_time_between_two_ps_lives_is_downtime_outside_every_figure(tmp_path, capsys):
    run = two_ps_lives(tmp_path / "run")
    r = report_json(capsys, run.root)
    assert r["downtime"]["restarts"] == 1 and r["downtime"]["down_s"] == pytest.approx(72.0 - 12.8)
    [gap] = r["downtime"]["gaps"]
    assert (gap["after_step"], gap["pid_before"], gap["pid_after"]) == (3, 100, 300)
    t = r["training"]
    assert t["steps"] == 6 and t["span_s"] == pytest.approx(2 * 2.8)  # each life: first start to last end
    assert t["trainer_idle_fraction"] == pytest.approx(6 * 0.2 / 5.6)
    assert t["trainer_idle_fraction_steady"] == pytest.approx(4 * 0.2 / (2 * 2.0))  # each life's first step out
    assert t["samples_per_s"] == pytest.approx(6 * 32 / 5.6)
    [w] = r["workers"]
    assert w["life_s"] == pytest.approx(75.0 - 9.5 - 59.2)
    assert w["busy_s"] == pytest.approx(5 * 0.7 + (12.8 - 12.5) + (72.2 - 72.0))
    assert w["idle_s"] == pytest.approx(w["life_s"] - w["busy_s"])
    # Counted over the whole 64.8 s, the trainer would be "busy 98%, the bottleneck".
    assert r["diagnosis"] == ("balanced: trainer idle 20% after the first step, workers busy 63%, syncing 0%, idle "
                              "37%; the PS was down 59.2 s over 1 restart(s), not counted above")
    assert call_main(["report", run.root]) == 0
    assert ("downtime: 59.2 s between 2 PS lives, left out of the figures here (59.2 s after step 3)"
            in capsys.readouterr().out)


def test_steps_a_relaunched_ps_trained_again_count_once_in_the_table_too(tmp_path, capsys):
    """A PS that trained steps 1-3 and died with its checkpoint at step 1: the next trains 2-4 again. Throughput said
    4 steps while the table's rows of steps and consumed results counted 6 (the docs: they count once)."""
    run = RunDir.create(tmp_path / "run")
    lines = []
    for step, (pid, start) in enumerate([(100, 10.0), (100, 11.0), (100, 12.0)], start=1):
        lines += make_track_events("ps", [
            ("train_step_start", start, {"step": step}),
            ("result_consumed", start + 0.2,
             {"job_id": f"000000_00{step}", "step": step, "samples": 32, "staleness": 9}),
            ("train_step_end", start + 0.8, {"step": step, "dur_ms": 800.0, "wait_ms": 200.0})], pid=pid)
    for step, start in ((2, 72.0), (3, 73.0), (4, 74.0)):
        lines += make_track_events("ps", [
            ("train_step_start", start, {"step": step}),
            ("result_consumed", start + 0.2,
             {"job_id": f"000001_00{step}", "step": step, "samples": 32, "staleness": 1}),
            ("train_step_end", start + 0.8, {"step": step, "dur_ms": 800.0, "wait_ms": 200.0})], pid=300)
    (run.logs / "events-ps.jsonl").write_text("".join(json.dumps(e) + "\n" for e in lines))
    r = report_json(capsys, run.root)
    assert r["training"]["steps"] == 4
    assert [r["stats"][key]["count"] for key in ("train_step_ms", "trainer_wait_ms", "staleness")] == [4, 4, 4]
    assert r["stats"]["staleness"]["max"] == 9  # step 1's, kept; steps 2-3 of the first life are not


def test_a_sync_inside_a_job_counts_as_syncing_not_busy(tmp_path):
    from queue_tools.report import utilisation
    from queue_tools.timeline import Track
    events = make_track_events("worker", [
        ("job_claimed", 10.0, {"job_id": "000000_000", "queue_wait_ms": 1.0}),
        ("weights_synced", 10.5, {"dur_ms": 300.0}),           # 10.2 .. 10.5, inside the job
        ("result_written", 11.0, {"job_id": "000000_000", "dur_ms": 1000.0}),
        ("weights_wait", 12.0, {"job_id": "000000_001", "dur_ms": 500.0}),  # 11.5 .. 12.0
        ("job_claimed", 12.0, {"job_id": "000000_001", "queue_wait_ms": 2.0}),
        ("job_released", 12.5, {"job_id": "000000_001"}),
        ("weights_synced", 13.0, {"dur_ms": 100.0}),           # 12.9 .. 13.0
    ])
    u = utilisation(Track("worker-dev1", 1, "worker", "cpu", events))
    assert u["life_s"] == pytest.approx(3.0)
    assert u["syncing_s"] == pytest.approx(0.3 + 0.5 + 0.1)
    assert u["busy_s"] == pytest.approx(1.0 - 0.3 + 0.5)
    assert u["idle_s"] == pytest.approx(3.0 - 0.9 - 1.2)


@pytest.mark.parametrize("idle, workers, expected", [
    (0.03, {"busy_fraction": 0.4, "syncing_fraction": 0.0, "idle_fraction": 0.6},
     "trainer busy 97% after the first step: training is the bottleneck; workers idle 60%"),
    (0.41, {"busy_fraction": 0.9, "syncing_fraction": 0.05, "idle_fraction": 0.05},
     "trainer idle 41% after the first step: generation is the bottleneck (workers busy 90%); add workers or lower "
     "num_generations"),
    (0.30, {"busy_fraction": 0.5, "syncing_fraction": 0.3, "idle_fraction": 0.2},
     "trainer idle 30% after the first step: workers wait for weights 30% of the time"),
    (0.50, {"busy_fraction": 0.3, "syncing_fraction": 0.05, "idle_fraction": 0.65},
     "trainer idle 50% after the first step while workers idle 65%"),
    (0.15, {"busy_fraction": 0.7, "syncing_fraction": 0.1, "idle_fraction": 0.2},
     "balanced: trainer idle 15% after the first step, workers busy 70%, syncing 10%, idle 20%"),
])
def test_diagnosis_names_the_bottleneck_from_the_numbers(idle, workers, expected):
    from queue_tools.report import diagnose
    line = diagnose({"trainer_idle_fraction": idle + 0.1, "trainer_idle_fraction_steady": idle}, workers)
    assert line.startswith(expected), line


def test_diagnosis_says_when_many_results_were_too_stale():
    from queue_tools.report import diagnose
    training = {"trainer_idle_fraction": 0.2, "trainer_idle_fraction_steady": 0.03}
    workers = {"busy_fraction": 0.8, "syncing_fraction": 0.0, "idle_fraction": 0.2}
    assert diagnose(training, workers, 0.05) == ("trainer busy 97% after the first step: training is the bottleneck; "
                                                 "workers idle 20%")
    assert diagnose(training, workers, 0.16).endswith(
        "; 16% of the results were too stale to train on and were generated again (raise max_staleness)")


def test_multi_turn_jobs_are_split_into_generation_tools_and_reward_and_slow_tools_are_named():
    from queue_tools.report import diagnose, rollout_split

    def job(job_id, turns_ms, tools_ms, score_ms, calls, failed=0, timed_out=0):
        events = [{"event": "generate_turn_end", "mono": 0.0, "job_id": job_id, "turn": i, "dur_ms": ms}
                  for i, ms in enumerate(turns_ms)]
        events += [{"event": "tools_end", "mono": 0.0, "job_id": job_id, "turn": i + 1, "dur_ms": ms, "calls": calls,
                    "failed": failed, "timed_out": timed_out} for i, ms in enumerate(tools_ms)]
        return events + [{"event": "score_end", "mono": 0.0, "job_id": job_id, "dur_ms": score_ms}]

    events = job("a", [100, 50, 50], [400, 300], 100, calls=8, failed=1) + job("b", [100], [], 100, calls=0)
    events += job("c", [80, 20], [600], 100, calls=4, failed=2, timed_out=2)
    split = rollout_split(events)
    assert split["generation_s"] == pytest.approx(0.4) and split["tools_s"] == pytest.approx(1.3)
    assert split["reward_s"] == pytest.approx(0.3) and split["tools_fraction"] == pytest.approx(1.3 / 2.0)
    assert split["turns_per_job"] == pytest.approx(2.0)
    assert (split["calls"], split["failed"], split["timed_out"]) == (20, 4, 2)
    assert rollout_split([e for e in events if e["event"] == "score_end"]) is None
    training = {"trainer_idle_fraction": 0.5, "trainer_idle_fraction_steady": 0.41}
    busy = {"busy_fraction": 0.9, "syncing_fraction": 0.05, "idle_fraction": 0.05}
    assert diagnose(training, busy, rollouts=split).endswith(
        "; tool calls take 65% of the workers' job time: tools are the bottleneck (a worker waits on them: add "
        "workers, or make the tools faster)")
    assert "tool" not in diagnose(training, busy, rollouts={**split, "tools_fraction": 0.3})
    training_bound = {"trainer_idle_fraction": 0.1, "trainer_idle_fraction_steady": 0.03}
    assert "tool" not in diagnose(training_bound, busy, rollouts=split)


def validate_chrome_trace(trace: dict) -> dict:
    """Checks the Chrome trace event format as Perfetto reads it; returns counts."""
    assert isinstance(trace, dict) and isinstance(trace["traceEvents"], list)
    events = trace["traceEvents"]
    named = {e["pid"] for e in events if e["ph"] == "M" and e["name"] == "process_name"}
    spans = defaultdict(list)
    flows = defaultdict(list)
    for e in events:
        for key in ("name", "ph", "pid", "tid", "ts"):
            assert key in e, (key, e)
        assert isinstance(e["pid"], int) and isinstance(e["tid"], int)
        assert isinstance(e["ts"], (int, float)) and e["ts"] >= 0, e
        assert e["ph"] in ("M", "X", "i", "s", "t", "f"), e
        if e["ph"] == "M":
            assert e["name"] in ("process_name", "process_sort_index", "thread_name", "thread_sort_index")
            assert isinstance(e["args"], dict)
            continue
        assert e["pid"] in named, f"pid {e['pid']} has no process_name"
        if e["ph"] == "X":
            assert isinstance(e["dur"], (int, float)) and e["dur"] >= 0, e
            spans[(e["pid"], e["tid"])].append((e["ts"], e["ts"] + e["dur"]))
        elif e["ph"] in "stf":
            assert "id" in e and "cat" in e, e
            flows[(e["cat"], e["name"], e["id"])].append(e)
            if e["ph"] == "f":
                assert e.get("bp") == "e", e
    for track, items in spans.items():  # one thread: slices in time order in the file, nested or disjoint
        assert [start for start, _ in items] == sorted(start for start, _ in items), f"{track}: ts goes back"
        items.sort(key=lambda x: (x[0], -x[1]))
        open_ends = []
        for start, end in items:
            while open_ends and open_ends[-1] <= start:
                open_ends.pop()
            assert not open_ends or end <= open_ends[-1], f"{track}: [{start}, {end}] crosses a slice"
            open_ends.append(end)
    for key, points in flows.items():
        phases = [p["ph"] for p in sorted(points, key=lambda p: p["ts"])]
        assert phases.count("s") == 1 and phases.count("f") == 1, (key, phases)
        assert phases[0] == "s" and phases[-1] == "f", (key, phases)
        for p in points:  # bound to a slice open at that moment on its thread
            assert any(start <= p["ts"] <= end for start, end in spans[(p["pid"], p["tid"])]), p
    return {"flows": len(flows), "pids": len(named), "slices": sum(len(v) for v in spans.values())}


def test_trace_is_a_valid_chrome_trace_with_one_flow_per_consumed_job(tmp_path, capsys):
    syn = synthetic_run(tmp_path / "run")
    r = report_json(capsys, syn["run"].root)
    trace = json.loads(Path(r["trace"]).read_text())
    counts = validate_chrome_trace(trace)
    assert counts["pids"] == 4
    assert counts["flows"] == syn["consumed"]
    names = {e["args"]["name"] for e in trace["traceEvents"] if e["name"] == "process_name"}
    assert names == {"ps (pid 100, cpu)", "worker-dev1 (pid 201, cpu)", "worker-dev2 (pid 202, cpu)",
                     "worker-dev2 (pid 203, cpu)"}
    # The recovered job's flow goes through both workers' attempts.
    steps = [e for e in trace["traceEvents"] if e["ph"] == "t" and e["args"]["job_id"] == "000000_012"]
    assert len({e["pid"] for e in steps}) == 3  # dev2 (killed), dev2 relaunched, then the PS collector


def test_plots_are_pngs(tmp_path, capsys):
    syn = synthetic_run(tmp_path / "run")
    r = report_json(capsys, syn["run"].root)
    assert [Path(p).name for p in r["plots"]] == ["reward_loss.png", "staleness.png", "queue_depth.png",
                                                  "workers_timeline.png"]
    for p in r["plots"]:
        assert Path(p).read_bytes()[:8] == PNG_SIGNATURE


def test_on_a_full_disk_the_report_prints_its_numbers_and_says_what_it_could_not_write(tmp_path, capsys,
                                                                                       monkeypatch):
    """It printed only "queue_tools: error: [Errno 28] No space left on device": the numbers need no disk."""
    import errno
    import os

    syn = synthetic_run(tmp_path / "run")

    def full(self, *args, **kwargs):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(Path, "write_text", full)
    assert call_main(["report", syn["run"].root]) == 0
    out = capsys.readouterr().out
    assert "diagnosis: " in out and "trace: " not in out
    where = syn["run"].root / "report"
    assert out.splitlines()[-1] == f"trace and plots: cannot write them in {where}: No space left on device"
    assert list((syn["run"].root / "report").iterdir()) == []  # (no temp file left)


@pytest.mark.process
def test_without_matplotlib_the_report_still_runs_and_says_how_to_get_plots(tmp_path):
    syn = synthetic_run(tmp_path / "run")
    code = ("import sys; sys.modules['matplotlib'] = None; from queue_tools.cli import main; "
            f"sys.exit(main(['report', {str(syn['run'].root)!r}]))")
    result = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert "pip install 'asyncgrpo[plots]'" in result.stdout
    assert "diagnosis: " in result.stdout
    assert not list((syn["run"].root / "report").glob("*.png"))
    validate_chrome_trace(json.loads((syn["run"].root / "report" / "trace.json").read_text()))


@pytest.mark.parametrize("make", ["missing", "not_a_run", "file"])
def test_bad_run_dir_is_one_line_and_exit_2(tmp_path, capsys, make):
    target = tmp_path / "x"
    if make == "not_a_run":
        target.mkdir()
    elif make == "file":
        target.write_text("x")
    assert call_main(["report", target]) == 2
    out, err = capsys.readouterr()
    assert out == "" and err.count("\n") == 1 and err.startswith("queue_tools: error: ")


def test_run_without_events_is_one_line_and_exit_2(run, capsys):
    (run.logs / "events-ps.jsonl").write_text("garbage\n")
    assert call_main(["report", run.root]) == 2
    out, err = capsys.readouterr()
    assert out == "" and err.count("\n") == 1 and "no timeline events" in err


def test_a_run_before_its_first_step_reports_what_there_is(run, capsys):
    w = Process(run.logs, "worker-dev1", 7, "worker")
    w.emit(T0, "weights_synced", weights_version=0, dur_ms=4.0, bytes=10)
    w.emit(T0 + 0.01, "job_claimed", job_id="000000_000", attempt=1, queue_wait_ms=3.0)
    w.flush()
    assert call_main(["report", run.root]) == 0
    out = capsys.readouterr().out
    assert "training: 0 step(s) completed" in out
    assert "diagnosis: no completed train steps: nothing to diagnose yet" in out
    r = report_json(capsys, run.root)
    assert r["stats"]["queue_wait_ms"]["p99"] == 3.0 and r["stats"]["train_step_ms"]["count"] == 0
    assert r["workers"][0]["syncing_s"] == pytest.approx(0.004)
    assert r["workers"][0]["busy_s"] == 0  # the job in hand started at its last event
    validate_chrome_trace(json.loads(Path(r["trace"]).read_text()))


def test_report_defaults_to_the_latest_run(tmp_path, capsys, monkeypatch):
    syn = synthetic_run(tmp_path / "runs" / "a")
    monkeypatch.setenv("ASYNCGRPO_RUNS", str(tmp_path / "runs"))
    assert call_main(["report", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["run_dir"] == str(syn["run"].root)


# ------------------------------------------------------------------------------------ a real run

def sampled_utilisation(events: list[dict], resolution_s=1e-4) -> dict:
    """One worker process's busy / syncing / idle seconds, by sampling its life on a grid."""
    def spans(names, dur_key="dur_ms"):
        return [(e["mono"] - e[dur_key] / 1e3, e["mono"]) for e in events if e["event"] in names]
    claims, jobs = {}, []
    for e in sorted(events, key=lambda e: e["mono"]):
        if e["event"] == "job_claimed":
            claims[e["job_id"]] = e["mono"]
        elif e["event"] == "result_written":  # claimed -> written, claimed = the earlier measure of it
            jobs.append((min(claims.pop(e["job_id"]), e["mono"] - e["dur_ms"] / 1e3), e["mono"]))
        elif e["event"] in ("job_failed", "job_released") and e["job_id"] in claims:
            jobs.append((claims.pop(e["job_id"]), e["mono"]))
    sync = spans({"weights_synced", "weights_wait"})
    start = min([e["mono"] for e in events] + [s for s, _ in sync + jobs])
    end = max(e["mono"] for e in events)
    grid = np.arange(start, end, resolution_s) + resolution_s / 2
    in_sync, in_job = np.zeros(len(grid), bool), np.zeros(len(grid), bool)
    for s, e in sync:
        in_sync |= (grid >= s) & (grid < e)
    for s, e in jobs:
        in_job |= (grid >= s) & (grid < e)
    busy = (in_job & ~in_sync).sum() * resolution_s
    syncing = in_sync.sum() * resolution_s
    return {"life_s": end - start, "busy_s": busy, "syncing_s": syncing, "idle_s": (end - start) - busy - syncing}


@pytest.mark.process
def test_report_on_a_real_run(finished_demo_run, capsys):
    run_root = finished_demo_run  # a PS and two workers, 8 steps (tests/conftest.py)
    events = read_events(run_root)  # the figures below are computed here, independently of queue_tools.report
    r = report_json(capsys, run_root)
    assert r["corrupt_lines"] == 0 and r["events"] == len(events)
    from queue_tools.report import STATS
    for key, _label, event, fld in STATS:
        values = [e[fld] for e in events if e["event"] == event and fld in e]
        if key == "token_staleness":  # counts by staleness: one value per completion token
            values = [int(staleness) for counts in values for staleness, n in counts.items() for _ in range(n)]
            assert len(values) == sum(e["tokens"] for e in events if e["event"] == "result_consumed")
        if key == "weight_publish_kb":
            values = [v / 1e3 for v in values]
        if key.startswith("turn_"):  # the demo calls no tools: no turns, and no rows for them in the text
            assert not values and r["stats"][key]["count"] == 0, key
            continue
        assert values, key
        assert_stats_equal(r["stats"][key], values)
    assert r["stats"]["train_step_ms"]["count"] == 8
    starts = [e["mono"] for e in events if e["event"] == "train_step_start"]
    ends = sorted(e["mono"] for e in events if e["event"] == "train_step_end")
    span = ends[-1] - min(starts)
    consumed = [e for e in events if e["event"] == "result_consumed"]
    assert len(consumed) == 8
    t = r["training"]
    assert t["span_s"] == pytest.approx(span, rel=1e-9)
    assert t["samples_per_s"] == pytest.approx(sum(e["samples"] for e in consumed) / span, rel=1e-9)
    assert t["tokens_per_s"] == pytest.approx(sum(e["tokens"] for e in consumed) / span, rel=1e-9)
    waits = sum(e["wait_ms"] for e in events if e["event"] == "train_step_end") / 1e3
    assert t["trainer_idle_fraction"] == pytest.approx(waits / span, rel=1e-9)
    pids = {e["pid"] for e in events if e["role"] == "worker"}
    assert {w["pid"] for w in r["workers"]} == pids and len(pids) == 2
    for w in r["workers"]:
        want = sampled_utilisation([e for e in events if e["pid"] == w["pid"]])
        assert w["life_s"] == pytest.approx(want["life_s"], abs=1e-6)
        for k in ("busy_s", "syncing_s", "idle_s"):  # grid sampling: off by at most a step per boundary
            assert w[k] == pytest.approx(want[k], abs=0.01), k
    trace = json.loads((run_root / "report" / "trace.json").read_text())
    counts = validate_chrome_trace(trace)
    created = {e["job_id"] for e in events if e["event"] == "job_created"}
    assert counts["flows"] == len(created & {e["job_id"] for e in consumed}) == 8
    assert counts["pids"] == 3
    for p in r["plots"]:
        assert Path(p).read_bytes()[:8] == PNG_SIGNATURE


def test_steps_a_resumed_ps_trains_again_and_downtime_in_a_latency_count_once(tmp_path, capsys):
    """Life 1 trains steps 1-3 and dies; life 2 resumes from the checkpoint of step 2, trains step 3 again (with
    the same job, rolled back), then 4-5. A result written 1 s before the PS died is collected 0.5 s after the
    next one started training: its latency is those 1.5 s, not the minute between."""
    run = RunDir.create(tmp_path / "run")
    lines = []
    for step, (pid, start) in enumerate([(100, 10.0), (100, 11.0), (100, 12.0)], start=1):
        lines += make_track_events("ps", [
            ("train_step_start", start, {"step": step}),
            ("result_consumed", start + 0.2, {"job_id": f"000000_00{step}", "step": step, "samples": 32,
                                              "tokens": 100}),
            ("result_archived", start + 0.3, {"job_id": f"000000_00{step}", "reason": "consumed", "attempt": 1}),
            ("train_step_end", start + 0.8, {"step": step, "dur_ms": 800.0, "wait_ms": 0.0})], pid=pid)
    for step, start in [(3, 72.0), (4, 73.0), (5, 74.0)]:
        lines += make_track_events("ps", [
            ("train_step_start", start, {"step": step}),
            ("result_consumed", start + 0.2, {"job_id": f"000000_00{step}", "step": step, "samples": 32,
                                              "tokens": 100}),
            ("result_archived", start + 0.3, {"job_id": f"000000_00{step}", "reason": "consumed", "attempt": 1}),
            ("train_step_end", start + 0.8, {"step": step, "dur_ms": 800.0, "wait_ms": 0.0})], pid=300)
    lines += make_track_events("ps", [("result_collected", 72.5, {"job_id": "000000_009", "latency_ms": 60_700.0})],
                               pid=300)  # written at 11.8, 1.0 s before life 1's last step ended at 12.8
    # Step 3 of life 1 had a second result, which life 2 rolled back with the first and then found too stale.
    lines += make_track_events("ps", [("result_archived", 12.4, {"job_id": "000000_007", "reason": "consumed",
                                                                 "attempt": 1})], pid=100)
    lines += make_track_events("ps", [("result_rolled_back", 71.5, {"job_id": "000000_003"}),
                                      ("result_rolled_back", 71.6, {"job_id": "000000_007"}),
                                      ("result_archived", 72.1, {"job_id": "000000_007", "reason": "stale",
                                                                 "attempt": 1})], pid=300)
    (run.logs / "events-ps.jsonl").write_text("".join(json.dumps(e) + "\n" for e in lines))
    r = report_json(capsys, run.root)
    assert r["training"]["steps"] == 5 and r["training"]["samples"] == 5 * 32  # step 3 once
    assert r["archived"]["consumed"] == 5 and r["archived"]["stale"] == 1  # as done/ and `ls` count them
    assert r["stats"]["collect_latency_ms"]["max"] == pytest.approx(1000.0 + 500.0)


def test_the_report_says_whether_nvidia_mps_was_on(tmp_path, capsys, monkeypatch):
    from asyncgrpo.run.rundir import MPS_ENV, PSStatus

    run = two_ps_lives(tmp_path / "run")
    monkeypatch.setenv(MPS_ENV, "on")
    run.write_ps_status(PSStatus.starting("model", None, {}))
    assert report_json(capsys, run.root)["mps"] == "on"
    assert call_main(["report", run.root]) == 0
    assert "NVIDIA MPS: on\n" in capsys.readouterr().out


def test_token_staleness_is_weighted_by_the_tokens_each_result_gave():
    from queue_tools.report import token_staleness

    events = [{"event": "result_consumed", "token_staleness": {"0": 3, "2": 1}},
              {"event": "result_consumed", "token_staleness": {"1": 4}},
              {"event": "result_consumed"},  # from a PS before the field existed: nothing to count
              {"event": "train_step_end", "token_staleness": {"9": 9}}]
    # One value per token: 0 0 0 1 1 1 1 2.
    assert token_staleness(events) == {"count": 8, "mean": 0.75, "p50": 1, "p99": 2, "max": 2}


def test_the_diagnosis_says_when_the_steps_teach_nothing(tmp_path, capsys):
    syn = synthetic_run(tmp_path / "run")
    before = report_json(capsys, syn["run"].root)["diagnosis"]
    (syn["run"].root / "metrics.jsonl").write_text(json.dumps(
        {"step": 40, "reward": 0.0, "frac_reward_zero_std": 1.0, "steps_without_spread": 40}) + "\n")
    after = report_json(capsys, syn["run"].root)["diagnosis"]
    assert after == before + ("; for 40 steps every group's completions scored alike: the advantages are all 0 and "
                              "nothing is learned (the task learned already? else the reward, the model, or "
                              "--dynamic_sampling?)")


def test_evaluation_is_its_own_span_and_named_when_it_takes_the_trainer_s_time():
    """A PS that trained 10 quick steps over 10 s, 8 s of them in evaluation: busy, but not training; the
    diagnosis names evaluation, not training, as the bottleneck (it said "trainer busy 100%: training is the
    bottleneck" before)."""
    from queue_tools.report import diagnose, training_numbers

    life = [{"event": "train_step_start", "mono": 0.0, "step": 1}]
    for step in range(1, 11):
        life.append({"event": "train_step_end", "mono": float(step), "step": step, "dur_ms": 100.0, "wait_ms": 0.0})
    life.append({"event": "eval_end", "mono": 9.5, "step": 9, "dur_ms": 8000.0})
    # The final evaluation, after the last step: not the trainer's time between steps (it made evaluation 111%).
    life.append({"event": "eval_end", "mono": 14.0, "step": 10, "dur_ms": 3900.0})
    training = training_numbers([life])
    assert training["eval_s"] == 8.0 and abs(training["eval_fraction"] - 0.8) < 1e-9
    workers = {"busy_fraction": 0.5, "syncing_fraction": 0.0, "idle_fraction": 0.5}
    assert diagnose(training, workers).startswith("evaluation takes 80% of the trainer's time: it is the bottleneck")
    without = training_numbers([[e for e in life if e["event"] != "eval_end"]])
    assert diagnose(without, workers).startswith("trainer busy 100% after the first step: training is the bottleneck")
