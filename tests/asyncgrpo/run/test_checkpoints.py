"""The checkpoints and their ledgers through their one owner, asyncgrpo/run/checkpoints.py: the ledger written
last marks a checkpoint complete, what it holds, and which checkpoint is the newest complete one."""

import json
import os

import pytest
import torch
from safetensors.torch import save_file

from asyncgrpo.run import checkpoints
from asyncgrpo.run.checkpoints import LEDGER_FILE, LedgerError, SavedLedger

PIPELINE_STATE = {"consumed": ["000001_000", "000001_001"], "groups_done": {"000001_002": [0, 1]},
                  "producer": {"next_index": 3}}


def save(run, step: int, *, ledger: bool = True):
    """A checkpoint folder as the PS leaves it: TRL's files, then (unless killed before) its ledger."""
    folder = run.checkpoints / f"checkpoint-{step}"
    folder.mkdir()
    save_file({"w": torch.zeros(4)}, folder / "model.safetensors")
    torch.save({"state": {}}, folder / "optimizer.pt")
    (folder / "trainer_state.json").write_text(json.dumps({"global_step": step}))
    if ledger:
        checkpoints.write_ledger(folder, step, {**PIPELINE_STATE, "consumed": [f"000001_{step:03d}"]})
    return folder


def test_a_ledger_reads_back_as_written(run):
    folder = run.checkpoints / "checkpoint-8"
    folder.mkdir()
    checkpoints.write_ledger(folder, 8, PIPELINE_STATE)
    ledger = checkpoints.read_ledger(folder)
    assert ledger == SavedLedger(global_step=8, pipeline_state=PIPELINE_STATE,
                            written_at_ns=(folder / LEDGER_FILE).stat().st_mtime_ns)
    assert ledger.consumed == {"000001_000", "000001_001"}
    # On disk one flat object, the step beside the pipeline's state (what checkpoints of earlier versions hold).
    assert json.loads((folder / LEDGER_FILE).read_text()) == {"global_step": 8, **PIPELINE_STATE}
    assert [p.name for p in folder.iterdir()] == [LEDGER_FILE]  # no temp file left


def test_consumed_ignores_what_is_not_a_job_id(run):
    folder = run.checkpoints / "checkpoint-2"
    folder.mkdir()
    checkpoints.write_ledger(folder, 2, {"consumed": ["000001_000", 7, None]})
    assert checkpoints.read_ledger(folder).consumed == {"000001_000"}


def test_a_checkpoint_without_a_ledger_is_not_complete(run):
    folder = save(run, 4, ledger=False)
    assert not checkpoints.is_complete(folder)
    with pytest.raises(FileNotFoundError):
        checkpoints.read_ledger(folder)
    checkpoints.write_ledger(folder, 4, PIPELINE_STATE)
    assert checkpoints.is_complete(folder)


@pytest.mark.parametrize("text, reason", [
    ('{"global_step": 4, "consumed": ["a"', "not JSON"),
    ('["a"]', "no global_step"),
    ('{"consumed": ["a"]}', "no global_step"),
    ('{"global_step": 4}', "no consumed list"),
    ('{"global_step": 4, "consumed": "a"}', "no consumed list"),
])
def test_a_ledger_file_that_holds_no_ledger_is_refused(run, text, reason):
    folder = save(run, 4, ledger=False)
    (folder / LEDGER_FILE).write_text(text)
    with pytest.raises(LedgerError, match=reason):
        checkpoints.read_ledger(folder)


def test_the_newest_complete_checkpoint_is_chosen(run):
    assert checkpoints.newest_complete_checkpoint(run.checkpoints) is None  # none saved yet
    for step in (2, 4, 10):
        save(run, step)
    save(run, 12, ledger=False)  # the PS was killed while saving it
    (run.checkpoints / "checkpoint-20-old").mkdir()  # not a checkpoint's name
    (run.checkpoints / "README.md").write_text("TRL's model card")
    # By step, not by name: checkpoint-10 sorts before checkpoint-4 as text.
    assert checkpoints.newest_complete_checkpoint(run.checkpoints) == run.checkpoints / "checkpoint-10"
    assert checkpoints.read_ledger(run.checkpoints / "checkpoint-10").global_step == 10


def test_the_ps_resumes_from_the_newest_complete_checkpoint_and_removes_the_saves_it_died_in(run):
    for step in (2, 4):
        save(run, step)
    for step in (6, 8):
        save(run, step, ledger=False)
    assert checkpoints.checkpoint_to_resume(run.checkpoints) == str(run.checkpoints / "checkpoint-4")
    assert sorted(p.name for p in run.checkpoints.iterdir()) == ["checkpoint-2", "checkpoint-4"]


@pytest.mark.parametrize("name, cut, said", [
    ("model.safetensors", 40, "model.safetensors: SafetensorError: Error while deserializing header: "),
    ("optimizer.pt", 100, "optimizer.pt: BadZipFile: File is not a zip file"),
    ("trainer_state.json", 5, "trainer_state.json: JSONDecodeError: "),
    (LEDGER_FILE, 5, f"{LEDGER_FILE}: LedgerError: "),
])
def test_a_damaged_newest_checkpoint_stops_the_relaunch_naming_its_file_and_the_one_to_resume_from(
        run, name, cut, said):
    """A file cut short in the newest complete checkpoint: the relaunch says which and what to do (move it aside,
    to resume from the newest one that can be read), and changes nothing; without an older one, from the start."""
    for step in (2, 4, 6):
        save(run, step)
    for step in (4, 6):
        os.truncate(run.checkpoints / f"checkpoint-{step}" / name, cut)
    newest = run.checkpoints / "checkpoint-6"
    with pytest.raises(checkpoints.DamagedCheckpoint) as refused:
        checkpoints.checkpoint_to_resume(run.checkpoints)
    assert str(refused.value).startswith(f"{newest} is damaged ({said}"), refused.value
    assert str(refused.value).endswith(
        f"): move it aside (mv {newest} {run.checkpoints / 'damaged-checkpoint-6'}) and relaunch to resume from "
        "checkpoint-2 (the steps after it are trained again)")
    assert sorted(p.name for p in run.checkpoints.iterdir()) == ["checkpoint-2", "checkpoint-4", "checkpoint-6"]
    assert checkpoints.damage(run.checkpoints / "checkpoint-2") is None
    newest.rename(run.checkpoints / "damaged-checkpoint-6")
    (run.checkpoints / "checkpoint-2" / LEDGER_FILE).unlink()  # (incomplete: none older to resume from)
    with pytest.raises(checkpoints.DamagedCheckpoint, match="and relaunch to train from the beginning$"):
        checkpoints.checkpoint_to_resume(run.checkpoints)


def test_checkpoint_folders_are_newest_first_and_only_checkpoints(run):
    for step in (2, 10, 4):
        save(run, step, ledger=step != 4)
    (run.checkpoints / "checkpoint-x").mkdir()
    assert checkpoints.checkpoint_folders(run.checkpoints) == [
        (10, run.checkpoints / "checkpoint-10"), (4, run.checkpoints / "checkpoint-4"),
        (2, run.checkpoints / "checkpoint-2")]
    assert checkpoints.checkpoint_folders(run.root / "no such folder") == []


def test_without_any_complete_checkpoint_there_is_none(run):
    save(run, 2, ledger=False)
    assert checkpoints.newest_complete_checkpoint(run.checkpoints) is None
    assert checkpoints.newest_complete_checkpoint(run.root / "no such folder") is None


def test_the_ledger_is_fsynced_before_it_takes_its_name(run, monkeypatch):
    # Written last, it marks the checkpoint complete: its content must be on disk before its name is.
    calls = []
    real_fsync, real_replace = os.fsync, os.replace
    monkeypatch.setattr(os, "fsync", lambda fd: (calls.append("fsync"), real_fsync(fd))[1])
    monkeypatch.setattr(os, "replace", lambda src, dst: (calls.append(("replace", os.path.basename(dst))),
                                                         real_replace(src, dst))[1])
    folder = save(run, 6, ledger=False)
    checkpoints.write_ledger(folder, 6, PIPELINE_STATE)
    assert calls == ["fsync", ("replace", LEDGER_FILE)]
