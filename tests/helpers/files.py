"""Files of a run as the tests touch and read them: back-dating a file's mtime (leases expire without
sleeping), the permission bits beyond what is allowed (modes_beyond) and whether the user nobody can open a file
(open_as_nobody), small readers (read_json, tolerant of a file being rewritten; metrics, RUN/metrics.jsonl;
entries of a directory), and a valid result payload as a worker writes it.
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

from asyncgrpo.jobqueue.queue import SCHEMA_VERSION


def backdate(path, seconds: float) -> None:
    """Moves a file's mtime (and atime) ``seconds`` into the past, without following symlinks."""
    st = os.lstat(path)
    os.utime(path, (st.st_atime - seconds, st.st_mtime - seconds), follow_symlinks=False)


def modes_beyond(root, allowed: int) -> list[str]:
    """``root`` and everything under it whose permission bits go beyond ``allowed`` (0o700: the owner's alone),
    as "path 0oMODE"; symbolic links have no mode of their own and are left out."""
    found = []
    for path in [Path(root), *Path(root).rglob("*")]:
        try:
            st = path.lstat()
        except FileNotFoundError:  # replaced while we walk a live run
            continue
        if not path.is_symlink() and st.st_mode & 0o777 & ~allowed:
            found.append(f"{path} {oct(st.st_mode & 0o7777)}")
    return found


NOBODY = 65534


def open_as_nobody(folder, name: str, groups: tuple[int, ...] = ()) -> bool:
    """Whether the user nobody (member of ``groups``) can open ``folder/name`` for reading. It starts inside
    ``folder`` (an open descriptor passed down), so that only the folder's and the file's modes are in
    question, not those of the folders above. Needs root; /bin/sh, as nobody cannot run root's Python."""
    fd = os.open(folder, os.O_RDONLY | os.O_DIRECTORY)
    try:
        result = subprocess.run(["/bin/sh", "-c", f'cd /proc/self/fd/{fd} && exec 9< "$0"', name], pass_fds=(fd,),
                                user=NOBODY, group=NOBODY, extra_groups=list(groups), capture_output=True,
                                text=True, timeout=60, cwd="/")
    finally:
        os.close(fd)
    assert result.returncode == 0 or "can't cd" in result.stderr or "Permission denied" in result.stderr, result.stderr
    return result.returncode == 0


def read_json(path) -> dict:
    """A JSON object file, or {} when it is missing, empty or unreadable (being rewritten)."""
    try:
        return json.loads(Path(path).read_text() or "{}")
    except (OSError, ValueError):
        return {}


def metrics(run_root) -> list[dict]:
    """The steps' lines of RUN/metrics.jsonl ([] before the first step; an evaluation's lines left out)."""
    path = Path(run_root) / "metrics.jsonl"
    lines = [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []
    return [line for line in lines if line.get("kind") != "eval"]


def entries(directory) -> set[str]:
    """Names in a directory, queue/.tmp excluded."""
    return set(os.listdir(directory)) - {".tmp"}


def result_payload(job_id, device, attempt=1, marker=""):
    """A valid result payload as a worker writes it, with ``marker`` as its data."""
    return {"schema": SCHEMA_VERSION, "kind": "result", "job_id": job_id, "attempt": attempt,
            "worker_device": device, "weights_version": 0, "claimed_at": 0.0, "completed_at": 0.0,
            "data": {"marker": marker}}
