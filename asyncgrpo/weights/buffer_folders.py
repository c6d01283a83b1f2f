"""Where the mmap transport keeps a PS run's two buffer files, and freeing those of dead PS runs.

Each PS run (publisher) of a run directory gets one folder,
``{base}/asyncgrpo-weights-{hash of the run dir}-{publisher_id}/``, holding ``owner.json``
(pid, host, run) and ``slot0.bin``, ``slot1.bin``; ``base`` is /dev/shm, or the run's
``weights/`` folder when /dev/shm is missing or too small. A PS that exits cleanly removes
its folder; one that is SIGKILLed leaves it, and with it RAM in /dev/shm, until the next PS
of that run starts or ``queue_tools cleanup`` frees it.

No torch here: ``queue_tools`` imports this module and stays quick to start.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import os
import shutil
import time
from dataclasses import dataclass
from pathlib import Path

from asyncgrpo.run import fileops
from asyncgrpo.run.liveness import pid_alive
from asyncgrpo.run.rundir import RunDir

SHM_ROOT = Path("/dev/shm")
PREFIX = "asyncgrpo-weights-"
ORPHAN_GRACE_S = 60.0  # a folder without owner.json may be one being created right now

log = logging.getLogger("asyncgrpo.weights")


def run_tag(run: RunDir) -> str:
    return hashlib.sha1(str(run.root.resolve()).encode()).hexdigest()[:12]


def buffer_dir(base: Path, run: RunDir, publisher_id: str) -> Path:
    return base / f"{PREFIX}{run_tag(run)}-{publisher_id}"


@dataclass
class DeadFolder:
    """A buffer folder whose PS is gone: its pid (None: it never wrote owner.json), files, bytes."""

    path: Path
    pid: int | None
    buffers: int
    nbytes: int


def _contents(folder: Path) -> tuple[int, int]:
    buffers = nbytes = 0
    for entry in fileops.scan(folder):
        if entry.name.endswith(".bin"):
            buffers += 1
            with contextlib.suppress(OSError):
                nbytes += entry.stat().st_blocks * 512  # what tmpfs holds, not the sparse size
    return buffers, nbytes


def dead_folders(run: RunDir, bases: tuple[Path, ...], keep: Path | None = None) -> list[DeadFolder]:
    """The run's buffer folders under ``bases`` whose owner is certainly dead on this host.
    A folder of a PS on another host, or a live one, is never listed."""
    found = []
    for base in dict.fromkeys(bases):
        for folder in sorted(base.glob(f"{PREFIX}{run_tag(run)}-*")):
            if folder == keep or not folder.is_dir():
                continue
            owner = fileops.read_json(folder / "owner.json")
            if owner is not None and pid_alive(owner.get("pid"), owner.get("host"), owner.get("host_id")):
                continue
            try:
                if owner is None and time.time() - folder.stat().st_mtime < ORPHAN_GRACE_S:
                    continue
            except OSError:
                continue  # removed meanwhile
            pid = owner.get("pid") if owner is not None and isinstance(owner.get("pid"), int) else None
            found.append(DeadFolder(folder, pid, *_contents(folder)))
    return found


def remove_dead_folders(run: RunDir, bases: tuple[Path, ...], keep: Path | None = None,
                        dry_run: bool = False) -> list[DeadFolder]:
    """Removes (unless ``dry_run``) the folders ``dead_folders`` lists; returns them.
    A worker that still maps a removed file keeps valid pages (tmpfs frees them at the
    last unmap), and the version file no longer names that publisher's slots."""
    found = dead_folders(run, bases, keep)
    if not dry_run:
        for dead in found:
            shutil.rmtree(dead.path, ignore_errors=True)
            log.info("[weights] removed %s (its PS is gone)", dead.path)
    return [d for d in found if dry_run or not os.path.exists(d.path)]
