"""Archive retention: bound the bytes in ``done/`` without changing a single name in it.

``done/`` is the archive and also the exactly-once ledger: ``done/{job_id}_consumed.pt``
existing means that job was trained on (``JobQueue.was_consumed``, the no-clobber consume),
``queue_tools ls`` counts the archive by reason from the names alone, and a resumed PS moves
the consumed files whose job ids are *not* in its checkpoint's ledger back into the queue to
train on them again (it loads their payloads). So compaction keeps every name and only
empties files (truncates them to 0 bytes) that nothing will ever read again:

* Only names in ``done/``'s grammar (``names.done_reason``), only regular files with a
  single link (``fileops.truncate_archived``): never a foreign file, a symlink's target, a
  file hard-linked from elsewhere or one in the middle of a move.
* The newest files are kept whole, newest first by archive time (the inode's ctime: a move
  into ``done/`` is a link + unlink, which sets it; userspace cannot set it back), up to
  ``keep_files`` files and ``keep_mb`` MB (10^6 bytes) of payloads, whichever is reached
  first (0: no limit of that kind). Files beyond are emptied, except protected ones.
* Protected, never emptied: every file archived at or after the moment the newest complete
  checkpoint's ledger was written (its mtime), and every consumed file whose job id is not
  in that ledger (a resumed PS re-adopts exactly those). With no complete checkpoint,
  everything is protected and a pass changes nothing. The PS always resumes from the newest
  complete checkpoint, and a ledger only grows from one checkpoint to the next, so a file
  emptied once is never re-adopted.

So ``done/`` holds at most ``keep_files`` files / ``keep_mb`` MB of payloads plus what was
archived since the newest checkpoint; its number of names still grows by one or a few per
job (0-byte files: an inode and a directory entry each, no data blocks).

An empty file is its own tombstone: a payload written by ``torch.save`` is never empty, so
no extra marker is needed, and the name keeps meaning what it meant. Passes are idempotent
(empty files are skipped) and crash-safe (a truncate is all-or-nothing for this purpose; an
interrupted pass leaves some files whole, which the next pass empties), and safe next to a
running PS, workers and another pass: a file that changed since the scan is left alone.
"""

from __future__ import annotations

import logging
import os
import stat
from dataclasses import dataclass, field
from pathlib import Path

from asyncgrpo.jobqueue.names import ArchiveReason, done_reason
from asyncgrpo.run import fileops
from asyncgrpo.run.checkpoints import LEDGER_FILE, LedgerError, newest_complete_checkpoint, read_ledger
from asyncgrpo.run.rundir import RunDir

MB = 1_000_000
_CONSUMED_SUFFIX = f"_{ArchiveReason.CONSUMED.value}.pt"

log = logging.getLogger("asyncgrpo.queue")


@dataclass(frozen=True)
class Boundary:
    """The newest complete checkpoint, as far as compaction is concerned."""

    checkpoint: Path
    saved_at_ns: int  # its ledger's mtime: files archived at or after this are protected
    consumed: frozenset[str]  # the job ids in its ledger


def read_boundary(checkpoints: str | os.PathLike) -> Boundary | None:
    """The newest complete checkpoint's ledger, or None when there is none (or it is unreadable)."""
    for _ in range(3):  # the folder may be rotated away (save_total_limit) between finding and reading it
        folder = newest_complete_checkpoint(checkpoints)
        if folder is None:
            return None
        try:
            ledger = read_ledger(folder)
        except FileNotFoundError:
            continue
        except (OSError, LedgerError) as err:
            log.warning("[queue] retention: cannot read %s (%s); compacting nothing", folder / LEDGER_FILE, err)
            return None
        return Boundary(folder, ledger.written_at_ns, ledger.consumed)
    return None


@dataclass
class CompactionReport:
    checkpoint: str | None  # the newest complete checkpoint the pass went by (None: nothing was compacted)
    dry_run: bool = False
    compacted: list[str] = field(default_factory=list)  # names emptied (or that would be, dry run)
    freed_bytes: int = 0
    kept_files: int = 0  # non-empty files left in done/'s grammar
    kept_bytes: int = 0
    protected: int = 0  # files beyond the limits kept whole: archived after the checkpoint, or to be re-adopted
    empty: int = 0  # names already empty before this pass (earlier compactions)
    skipped: int = 0  # chosen but not emptied: changed, gone, linked elsewhere or not writable

    def line(self) -> str:
        verb = "would compact" if self.dry_run else "compacted"
        if self.checkpoint is None:
            return "archive retention: no complete checkpoint yet, nothing compacted"
        return (f"archive retention: {verb} {len(self.compacted)} file(s) in done/, {self.freed_bytes / MB:.2f} MB; "
                f"{self.kept_files} payload(s) kept, {self.kept_bytes / MB:.2f} MB ({self.protected} protected "
                f"beyond the limits), {self.empty} emptied earlier; by {Path(self.checkpoint).name}"
                + (f"; {self.skipped} skipped" if self.skipped else ""))

    def as_dict(self) -> dict:
        return {**self.__dict__, "compacted": len(self.compacted)}


def compact_archive(run: RunDir, keep_files: int = 0, keep_mb: float = 0.0, *, dry_run: bool = False,
                    boundary: Boundary | None | bool = True) -> CompactionReport:
    """Empties the files in ``done/`` beyond the newest ``keep_files`` files / ``keep_mb`` MB that
    are not protected (module docstring). Both 0: keeps everything. ``boundary``: True reads the
    newest complete checkpoint now; a Boundary (or None) is used as given."""
    if keep_files < 0 or keep_mb < 0:
        raise ValueError(f"keep_files and keep_mb must be >= 0, got {keep_files} and {keep_mb}")
    if boundary is True:
        boundary = read_boundary(run.checkpoints)  # before the scan: a file archived later is protected by time
    report = CompactionReport(checkpoint=str(boundary.checkpoint) if boundary else None, dry_run=dry_run)
    files = []  # the payloads not emptied yet: about keep_files of them, and what was archived since the last pass
    for entry in fileops.scan_one_by_one(run.done):
        if done_reason(entry.name) is None:
            continue  # outside done/'s grammar: not ours
        try:
            st = entry.stat(follow_symlinks=False)
        except FileNotFoundError:
            continue
        if not stat.S_ISREG(st.st_mode):
            continue
        if st.st_size == 0:
            report.empty += 1
            continue
        files.append((st.st_ctime_ns, entry.name, st))
    files.sort(reverse=True)  # newest first; ties by name, so job order
    limit_bytes = int(keep_mb * MB)
    beyond = False  # with no limit nothing ever is
    for ctime_ns, name, st in files:
        if not beyond and (keep_files and report.kept_files >= keep_files
                           or keep_mb and report.kept_bytes + st.st_size > limit_bytes):
            beyond = True  # from here on, everything older is beyond the limits too
        if beyond and not _protected(name, ctime_ns, boundary):
            freed = st.st_size if dry_run else _truncate(run.done / name, st)
            if freed is not None:
                report.compacted.append(name)
                report.freed_bytes += freed
                continue
            report.skipped += 1
        elif beyond:
            report.protected += 1
        report.kept_files += 1
        report.kept_bytes += st.st_size
    return report


def _protected(name: str, ctime_ns: int, boundary: Boundary | None) -> bool:
    if boundary is None or ctime_ns >= boundary.saved_at_ns:
        return True  # archived after the newest complete checkpoint: it may be re-adopted on resume
    if name.endswith(_CONSUMED_SUFFIX):
        return name[: -len(_CONSUMED_SUFFIX)] not in boundary.consumed  # a resumed PS re-adopts it
    return False


def _truncate(path: Path, st: os.stat_result) -> int | None:
    """Bytes freed, or None when the file was not emptied (changed, gone, linked elsewhere, not writable)."""
    try:
        freed = fileops.truncate_archived(path, st)
    except OSError as err:
        log.warning("[queue] retention: cannot empty %s: %s", path.name, err)
        return None
    return freed or None


class ArchiveRetention:
    """The PS's periodic pass: compacts ``done/`` once for each new complete checkpoint.

    The protected window only moves when a checkpoint completes, so passing more often would
    mostly rescan ``done/`` for nothing. ``maybe_compact`` is cheap otherwise (one listing of
    ``checkpoints/``), never raises (a failed pass is logged and tried again next time), and
    does nothing when both limits are 0.
    """

    def __init__(self, run: RunDir, keep_files: int = 0, keep_mb: float = 0.0):
        self.run, self.keep_files, self.keep_mb = run, keep_files, keep_mb
        self._done_for: tuple[str, int] | None = None  # (checkpoint, ledger mtime) of the last pass

    @property
    def enabled(self) -> bool:
        return bool(self.keep_files or self.keep_mb)

    def maybe_compact(self) -> CompactionReport | None:
        if not self.enabled:
            return None
        try:
            boundary = read_boundary(self.run.checkpoints)
            if boundary is None or (str(boundary.checkpoint), boundary.saved_at_ns) == self._done_for:
                return None
            report = compact_archive(self.run, self.keep_files, self.keep_mb, boundary=boundary)
        except OSError as err:
            log.warning("[queue] retention: pass failed (%s); trying again at the next one", err)
            return None
        self._done_for = (str(boundary.checkpoint), boundary.saved_at_ns)
        (log.info if report.compacted or report.skipped else log.debug)("[queue] %s", report.line())
        return report
