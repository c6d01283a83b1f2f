"""The exactly-once check the end-to-end and chaos tests use, and what it reads: the newest checkpoint and
its ledger (LEDGER_FILE, ledger), the jobs archived as consumed in done/, the PS's events (ps_events);
assert_exactly_once compares the ledger, done/ and the jobs the PS threw, assert_groups_exactly_once does the
same per group (dynamic sampling). Also fill and held_values, to set and check every value of a model.

The exactly-once helpers read the run directory directly (folder names, file names, JSON),
never through the library code they check; the events through the timeline's one reader
(asyncgrpo.events.read_events), which they do not check.
"""

from __future__ import annotations

import json
import os
import re
from collections import Counter
from pathlib import Path

from asyncgrpo.events import read_events

LEDGER_FILE = "asyncgrpo_state.json"  # in each checkpoint folder; written last, it marks the checkpoint complete

_CONSUMED_RE = re.compile(r"^(?P<job_id>\d{6}_\d{3})_consumed(?:_a\d+)?(?:\.\d+)?\.pt$")
_CHECKPOINT_RE = re.compile(r"^checkpoint-(\d+)$")


def newest_checkpoint(run_root) -> Path:
    """The checkpoint folder with the highest step, which must hold its ledger (it is the one
    a finished PS saved last)."""
    folders = [(int(m[1]), p) for p in (Path(run_root) / "checkpoints").iterdir()
               if (m := _CHECKPOINT_RE.match(p.name))]
    assert folders, f"no checkpoint in {run_root}/checkpoints"
    folder = max(folders)[1]
    assert (folder / LEDGER_FILE).is_file(), f"the newest checkpoint {folder.name} has no ledger"
    return folder


def ledger(run_root, step: int | None = None) -> list[str]:
    """The ``consumed`` list of the newest checkpoint's asyncgrpo_state.json (of checkpoint-``step``), as saved."""
    folder = newest_checkpoint(run_root) if step is None else Path(run_root) / "checkpoints" / f"checkpoint-{step}"
    consumed = json.loads((folder / LEDGER_FILE).read_text())["consumed"]
    assert isinstance(consumed, list), consumed
    return consumed


def consumed_in_done(run_root) -> list[str]:
    """One job id per file in done/ archived as consumed, whatever its suffixes (attempt,
    collision): a job archived as consumed twice shows up twice here."""
    return [m["job_id"] for name in os.listdir(Path(run_root) / "done") if (m := _CONSUMED_RE.match(name))]


def ps_events(run_root, event: str) -> list[dict]:
    """Every ``event`` line in RUN/logs/events-ps.jsonl, in file order, over all PS processes of the
    run (a relaunched PS appends to the same file). A line a killed PS left torn is skipped."""
    return read_events(run_root, process="ps", event=event)


def duplicates(values: list) -> dict:
    return {value: n for value, n in Counter(values).items() if n > 1}


def assert_exactly_once(run_root, jobs: int) -> list[str]:
    """The newest checkpoint's ledger holds ``jobs`` job ids, none twice; done/ holds exactly one
    consumed file for each of them and for no other job; each is a job the PS threw (a
    ``job_created`` event), and no job id was thrown twice. Returns the ledger."""
    in_ledger = ledger(run_root)
    in_done = consumed_in_done(run_root)
    created = [r["job_id"] for r in ps_events(run_root, "job_created")]
    assert not duplicates(in_ledger), f"job ids twice in the ledger: {duplicates(in_ledger)}"
    assert not duplicates(in_done), f"job ids archived as consumed more than once: {duplicates(in_done)}"
    assert not duplicates(created), f"job ids thrown more than once: {duplicates(created)}"
    assert len(in_ledger) == jobs, f"the ledger holds {len(in_ledger)} job ids, expected {jobs}"
    assert sorted(in_done) == sorted(in_ledger), (
        f"ledger and done/ disagree: only in the ledger {sorted(set(in_ledger) - set(in_done))}, "
        f"only in done/ {sorted(set(in_done) - set(in_ledger))}")
    assert set(in_ledger) <= set(created), f"consumed but never thrown: {sorted(set(in_ledger) - set(created))}"
    return in_ledger


def assert_groups_exactly_once(run_root, steps: int) -> dict:
    """Exactly-once per group (dynamic sampling): over steps 1..``steps``, each as the last PS life to train it
    trained it (``result_consumed`` events; a killed PS's steps after its checkpoint were trained again), no
    group of any result trains twice; every group of each result in the final ledger was trained or dropped
    (``groups_dropped``), never both; done/ holds one consumed file per ledger entry. Returns
    {"trained": {(job, group), ...}, "dropped": {...}, "split": job ids whose groups trained in two steps}."""
    by_step: dict[int, dict[int, list]] = {}
    for e in ps_events(run_root, "result_consumed"):
        by_step.setdefault(e["step"], {}).setdefault(e["pid"], []).append(e)
    assert sorted(by_step) == list(range(1, steps + 1)), sorted(by_step)
    trained, of_groups, steps_of = [], {}, {}
    for step, lives in by_step.items():
        for e in list(lives.values())[-1]:
            trained += [(e["job_id"], g) for g in e["groups"]]
            of_groups[e["job_id"]] = e["of_groups"]
            steps_of.setdefault(e["job_id"], set()).add(step)
    assert not duplicates(trained), f"groups trained twice: {duplicates(trained)}"
    created = [r["job_id"] for r in ps_events(run_root, "job_created")]
    assert not duplicates(created), f"job ids thrown more than once: {duplicates(created)}"
    dropped = {(e["job_id"], g) for e in ps_events(run_root, "groups_dropped") for g in e["groups"]}
    assert not set(trained) & dropped, f"groups both trained and dropped: {sorted(set(trained) & dropped)}"
    in_ledger, in_done = ledger(run_root), consumed_in_done(run_root)
    assert not duplicates(in_ledger) and sorted(in_done) == sorted(in_ledger), (in_ledger, in_done)
    assert {job for job, _ in trained} <= set(in_ledger), "a result trained from is missing in the ledger"
    for job in in_ledger:
        missing = [g for g in range(of_groups[job]) if (job, g) not in dropped and (job, g) not in trained]
        assert not missing or max(steps_of[job]) == steps, f"{job}: groups {missing} neither trained nor dropped"
    return {"trained": set(trained), "dropped": dropped,
            "split": {job for job, at in steps_of.items() if len(at) > 1}}


# ---------------------------------------------------------------------- a model's values


def fill(model, value: int) -> None:
    """Every tensor of ``model`` (parameters and buffers) set to ``value``."""
    import torch

    with torch.no_grad():
        for t in model.state_dict().values():
            t.fill_(value)


def held_values(model) -> list[float]:
    """The distinct values in ``model``, sorted (one value per tensor is checked exactly)."""
    return sorted({float(v) for t in model.state_dict().values() for v in (t.min().item(), t.max().item())})
