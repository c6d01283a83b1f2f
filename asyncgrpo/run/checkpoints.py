"""The checkpoints in ``RUN/checkpoints/`` and the ledger file in each (docs/design.md, "Checkpoints and resume").

A checkpoint folder ``checkpoint-N`` holds TRL's files and, written last by the PS (ps/trainer.py), its
ledger ``LEDGER_FILE``: a folder without one is a save the PS did not finish. The newest folder holding its
ledger is the one the PS resumes from, and the one archive retention (asyncgrpo/jobqueue/retention.py) goes by.
"""

from __future__ import annotations

import json
import logging
import os
import re
import shutil
import zipfile
from dataclasses import dataclass
from pathlib import Path

from asyncgrpo.messages import first_line
from asyncgrpo.run import fileops

LEDGER_FILE = "asyncgrpo_state.json"
_CHECKPOINT_RE = re.compile(r"checkpoint-(\d+)")
log = logging.getLogger("asyncgrpo.ps")


class LedgerError(ValueError):
    """A ledger file that does not hold a ledger."""


@dataclass(frozen=True)
class SavedLedger:
    """A checkpoint's ledger, as saved (ps/ledger.py's Ledger is the running PS's). On disk one JSON object:
    ``{"global_step": N, **pipeline_state}``.

    ``pipeline_state`` is the PS pipeline's state at the save (ps/pipeline.py JobPipeline.state_dict), which the
    resumed PS starts its pipeline from: ``consumed``, the ids of the jobs trained into the checkpoint's
    weights; ``groups_done``, the groups trained of a result split across batches; ``producer``, the
    producer's state (ps/producer.py); and ``flags``, the flags it was trained with (ps/flag_changes.py).
    """

    global_step: int
    pipeline_state: dict
    written_at_ns: int  # the file's mtime

    @property
    def consumed(self) -> frozenset[str]:
        return frozenset(job_id for job_id in self.pipeline_state["consumed"] if isinstance(job_id, str))


def write_ledger(folder: str | os.PathLike, global_step: int, pipeline_state: dict) -> None:
    """Writes ``folder``'s ledger, which marks the checkpoint complete: call it once everything else of the
    checkpoint is on disk. Replaced atomically, fsynced before the rename."""
    fileops.write_json(Path(folder) / LEDGER_FILE, {"global_step": global_step, **pipeline_state}, fsync=True)


def read_ledger(folder: str | os.PathLike) -> SavedLedger:
    """``folder``'s ledger. FileNotFoundError: the checkpoint is incomplete (or was deleted since it was found);
    LedgerError: the file holds no ledger; any other OSError: it cannot be read."""
    path = Path(folder) / LEDGER_FILE
    with open(path, "rb") as f:
        written_at_ns = os.fstat(f.fileno()).st_mtime_ns
        try:
            obj = json.load(f)
        except ValueError as err:
            raise LedgerError(f"{path} is not JSON: {err}") from err
    if not isinstance(obj, dict) or not isinstance(obj.get("global_step"), int):
        raise LedgerError(f"{path} holds no global_step")
    if not isinstance(obj.get("consumed"), list):
        raise LedgerError(f"{path} holds no consumed list")
    global_step = obj.pop("global_step")
    return SavedLedger(global_step=global_step, pipeline_state=obj, written_at_ns=written_at_ns)


def is_complete(folder: str | os.PathLike) -> bool:
    """Whether the checkpoint in ``folder`` was saved to the end: its ledger is there."""
    return (Path(folder) / LEDGER_FILE).is_file()


def checkpoint_folders(checkpoints: str | os.PathLike) -> list[tuple[int, Path]]:
    """``(step, folder)`` of every ``checkpoint-N`` folder, newest first."""
    try:
        names = os.listdir(checkpoints)
    except FileNotFoundError:
        return []
    found = [(int(m.group(1)), Path(checkpoints) / n) for n in names if (m := _CHECKPOINT_RE.fullmatch(n))]
    return sorted(found, reverse=True)


def newest_complete_checkpoint(checkpoints: str | os.PathLike) -> Path | None:
    """The newest checkpoint folder holding its ledger. Read-only."""
    for _, folder in checkpoint_folders(checkpoints):
        if is_complete(folder):
            return folder
    return None


class DamagedCheckpoint(ValueError):
    """The checkpoint a relaunch would resume from has a file that cannot be read; the message says which, and
    what the operator can do."""


def damage(folder: str | os.PathLike) -> str | None:
    """Why a complete checkpoint cannot be loaded, in a few words naming the file, or None. Reads each file's
    structure only (safetensors headers and their extent, the zip directories of torch.save files, JSON), not the
    tensors: a file cut short or overwritten is caught before anything is loaded from the checkpoint."""
    from safetensors import safe_open

    for path in sorted(Path(folder).iterdir()):
        try:
            if not path.is_file():
                continue
            if path.name == LEDGER_FILE:
                read_ledger(folder)
            elif path.suffix == ".safetensors":
                with safe_open(path, "pt"):
                    pass
            elif path.suffix == ".json":
                json.loads(path.read_bytes())
            elif path.suffix in (".pt", ".pth", ".bin"):
                zipfile.ZipFile(path).close()  # (torch.save's format: its directory is at the file's end)
        except Exception as err:  # (each library's own error for a bad file)
            return f"{path.name}: {first_line(err)}"
    return None


def checkpoint_to_resume(checkpoints: str | os.PathLike) -> str | None:
    """The checkpoint the PS resumes from: the newest complete one. Newer folders without a ledger are saves the
    old PS was killed in: removed, never resumed from (one PS per run, so no save is in progress here).
    DamagedCheckpoint where it has a file that cannot be read. It stays where it is, for the operator to move:
    resuming from an older one unasked would re-adopt results that archive compaction may have emptied
    (asyncgrpo/jobqueue/retention.py goes by the newest complete checkpoint)."""
    complete = newest_complete_checkpoint(checkpoints)
    for _, folder in checkpoint_folders(checkpoints):
        if folder == complete:
            break
        log.warning("[train] %s is incomplete (the PS died while saving it): removed", folder)
        shutil.rmtree(folder)
    if (refusal := damaged_newest(checkpoints)) is not None:
        raise DamagedCheckpoint(refusal)
    return str(complete) if complete else None


def damaged_newest(checkpoints: str | os.PathLike) -> str | None:
    """The line refusing a relaunch whose newest complete checkpoint has a file that cannot be read (``damage``),
    with what the operator can do; None where it can be read, or there is none. Read-only: the launch's input check
    asks too, before any process starts."""
    complete = newest_complete_checkpoint(checkpoints)
    if complete is None or (why := damage(complete)) is None:
        return None
    older = next((folder for _, folder in checkpoint_folders(checkpoints)
                  if folder != complete and is_complete(folder) and damage(folder) is None), None)
    then = (f"to resume from {older.name} (the steps after it are trained again)" if older is not None
            else "to train from the beginning")
    return (f"{complete} is damaged ({why}): move it aside (mv {complete} "
            f"{complete.parent / ('damaged-' + complete.name)}) and relaunch {then}")


def name_local_base_in_card(folder: str | os.PathLike, base: str | None) -> None:
    """TRL's model card (``folder``/README.md) names the hub model it was fine-tuned from, and a local folder (the
    demo's, a user's) as "[None]": the card names the folder ``base`` instead."""
    card = Path(folder) / "README.md"
    if base and os.path.isdir(base) and card.is_file():
        card.write_text(card.read_text().replace("[None](https://huggingface.co/None)", f"`{base}` (a local folder)"))
