"""The exactly-once check the end-to-end and chaos tests use (tests/helpers/checks.py), on run
directories made by hand: it passes on a consistent run and fails for each way a run can
break exactly-once."""

import json

import pytest
from helpers import LEDGER_FILE, assert_exactly_once

CREATED = ["000000_000", "000001_000", "000002_000", "000002_001"]


def make_run(root, *, ledger, consumed_files, created, checkpoints=(2, 4)):
    """A run directory: checkpoints whose ledgers hold ``ledger`` (the newest) and its first half
    (older ones), done/ with ``consumed_files`` and a processed file per created job, and the PS's
    events with one job_created line per entry of ``created``."""
    for name in ("done", "checkpoints", "logs"):
        (root / name).mkdir(parents=True)
    for i, step in enumerate(sorted(checkpoints)):
        folder = root / "checkpoints" / f"checkpoint-{step}"
        folder.mkdir()
        held = ledger if i == len(checkpoints) - 1 else ledger[: len(ledger) // 2]
        (folder / LEDGER_FILE).write_text(json.dumps({"global_step": step, "consumed": held, "producer": {}}))
    for name in consumed_files:
        (root / "done" / name).write_bytes(b"x")
    for job_id in created:
        (root / "done" / f"{job_id}_processed.pt").write_bytes(b"x")
    lines = [{"event": "job_created", "job_id": job_id, "t": 0.0, "mono": 0.0} for job_id in created]
    lines.insert(1, {"event": "result_consumed", "job_id": created[0], "t": 0.0, "mono": 0.0})
    (root / "logs" / "events-ps.jsonl").write_text("".join(json.dumps(line) + "\n" for line in lines))
    return root


def consumed(*job_ids):
    return [f"{job_id}_consumed.pt" for job_id in job_ids]


def test_a_consistent_run_passes(tmp_path):
    run = make_run(tmp_path, ledger=CREATED, consumed_files=consumed(*CREATED), created=CREATED)
    assert sorted(assert_exactly_once(run, jobs=4)) == CREATED


@pytest.mark.parametrize("case, ledger, consumed_files, created, message", [
    ("a job twice in the ledger", CREATED[:3] + CREATED[:1], consumed(*CREATED), CREATED, "twice in the ledger"),
    ("a job archived as consumed twice (collision suffix)", CREATED, consumed(*CREATED) + ["000001_000_consumed.1.pt"],
     CREATED, "archived as consumed more than once"),
    ("a job archived as consumed twice (attempt suffix)", CREATED, consumed(*CREATED) + ["000001_000_consumed_a2.pt"],
     CREATED, "archived as consumed more than once"),
    ("a consumption missing from the ledger", CREATED[:3], consumed(*CREATED), CREATED, "holds 3 job ids"),
    ("a consumption missing from done/", CREATED, consumed(*CREATED[:3]), CREATED, "ledger and done/ disagree"),
    ("a consumed job never thrown", CREATED, consumed(*CREATED), CREATED[:3], "consumed but never thrown"),
    ("a job id thrown twice", CREATED, consumed(*CREATED), CREATED + CREATED[1:2], "thrown more than once"),
])
def test_each_way_of_breaking_exactly_once_fails(tmp_path, case, ledger, consumed_files, created, message):
    run = make_run(tmp_path, ledger=ledger, consumed_files=consumed_files, created=created)
    with pytest.raises(AssertionError, match=message):
        assert_exactly_once(run, jobs=4)


def test_the_newest_checkpoint_is_the_one_compared(tmp_path):
    """An older checkpoint's ledger (half the jobs) is not the one the final model trained on."""
    run = make_run(tmp_path, ledger=CREATED, consumed_files=consumed(*CREATED), created=CREATED,
                   checkpoints=(2, 10, 4))
    assert len(assert_exactly_once(run, jobs=4)) == 4


def test_a_newest_checkpoint_without_its_ledger_fails(tmp_path):
    run = make_run(tmp_path, ledger=CREATED, consumed_files=consumed(*CREATED), created=CREATED)
    (run / "checkpoints" / "checkpoint-6").mkdir()  # a save the PS never finished, left behind
    with pytest.raises(AssertionError, match="checkpoint-6 has no ledger"):
        assert_exactly_once(run, jobs=4)
