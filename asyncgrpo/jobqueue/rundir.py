"""The run directory: one folder holds everything a run writes (docs/design.md, "The run directory")."""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from pathlib import Path

# Where launch.sh puts runs when no --run-dir is given, and where `queue_tools ls`
# looks for the most recent one. Outside the source tree on purpose.
DEFAULT_RUNS_DIR = "~/asyncgrpo-runs"


# The consumed-job ledger the PS writes into each checkpoint folder, last: a folder without
# one is a save the PS did not finish.
LEDGER_FILE = "asyncgrpo_state.json"
_CHECKPOINT_RE = re.compile(r"checkpoint-(\d+)")


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
        if (folder / LEDGER_FILE).is_file():
            return folder
    return None


def runs_dir() -> Path:
    """The runs folder: $ASYNCGRPO_RUNS, else DEFAULT_RUNS_DIR."""
    return Path(os.environ.get("ASYNCGRPO_RUNS") or DEFAULT_RUNS_DIR).expanduser()


class RunDirError(Exception):
    """The path is missing or is not an asyncgrpo run directory."""


@dataclass(frozen=True)
class RunDir:
    root: Path

    @property
    def queue(self) -> Path:
        return self.root / "queue"

    @property
    def tmp(self) -> Path:
        return self.root / "queue" / ".tmp"

    @property
    def done(self) -> Path:
        return self.root / "done"

    @property
    def workers(self) -> Path:
        return self.root / "workers"

    @property
    def weights(self) -> Path:
        return self.root / "weights"

    @property
    def logs(self) -> Path:
        return self.root / "logs"

    @property
    def checkpoints(self) -> Path:
        return self.root / "checkpoints"

    @classmethod
    def create(cls, root: str | os.PathLike) -> RunDir:
        """Creates the layout (idempotent) and returns it."""
        run = cls(Path(root).expanduser().resolve())
        for d in (run.tmp, run.done, run.workers, run.weights, run.logs, run.checkpoints):
            d.mkdir(parents=True, exist_ok=True)
        return run

    @classmethod
    def open(cls, root: str | os.PathLike) -> RunDir:
        """An existing run directory; RunDirError with a one-line reason otherwise."""
        path = Path(root).expanduser()
        if not path.exists():
            raise RunDirError(f"run directory {path} does not exist")
        if not path.is_dir():
            raise RunDirError(f"{path} is not a directory")
        run = cls(path.resolve())
        if not run.queue.is_dir() or not run.done.is_dir():
            raise RunDirError(f"{path} is not an asyncgrpo run directory (no queue/ and done/ inside)")
        return run


def latest_run() -> RunDir:
    """The most recently modified run in the runs folder."""
    folder = runs_dir()
    if not folder.is_dir():
        raise RunDirError(f"no run directory given and the runs folder {folder} does not exist")
    runs = [p for p in folder.iterdir() if (p / "queue").is_dir()]
    if not runs:
        raise RunDirError(f"no run directory given and the runs folder {folder} holds no runs")
    return RunDir(max(runs, key=lambda p: p.stat().st_mtime).resolve())
