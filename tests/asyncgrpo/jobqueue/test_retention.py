"""Archive retention: done/'s bytes are bounded, its names (the ledger, the counts) are not touched.

Real files in a real run directory. File timestamps have a coarse clock (a few ms), so the
tests sleep between "archived before the checkpoint", "the checkpoint" and "archived after".
"""

import json
import logging
import os
import time

import pytest
import torch
from safetensors.torch import save_file

from asyncgrpo.config import ConfigError
from asyncgrpo.config_parser import parse_config
from asyncgrpo.jobqueue import ArchiveReason, make_job_id
from asyncgrpo.jobqueue.names import done_name
from asyncgrpo.jobqueue.retention import ArchiveRetention, compact_archive, read_boundary
from asyncgrpo.run import fileops
from asyncgrpo.run.checkpoints import LEDGER_FILE, newest_complete_checkpoint
from queue_tools.cli import inspect_run, main

TICK_S = 0.05  # longer than the filesystem clock's granularity


def tick():
    time.sleep(TICK_S)


def put_done(run, job_index, reason=ArchiveReason.CONSUMED, size=1000):
    job_id = make_job_id(1, job_index)
    path = run.done / done_name(job_id, reason)
    path.write_bytes(b"x" * size)
    return path


def save_checkpoint(run, step, consumed):
    """What the PS leaves: a checkpoint folder whose ledger, written last, marks it complete."""
    folder = run.checkpoints / f"checkpoint-{step}"
    folder.mkdir()
    save_file({"w": torch.zeros(2)}, folder / "model.safetensors")
    fileops.write_json(folder / LEDGER_FILE, {"consumed": sorted(consumed), "global_step": step}, fsync=True)
    return folder


def consumed_id(path):
    return path.name[: -len("_consumed.pt")]


def sizes(run):
    return {p.name: p.stat().st_size for p in run.done.iterdir()}


def done_bytes(run):
    return sum(sizes(run).values())


def test_keep_files_bounds_the_bytes_and_keeps_every_name(run, queue):
    files = [put_done(run, i, ArchiveReason.CONSUMED if i % 3 else ArchiveReason.STALE) for i in range(30)]
    tick()
    save_checkpoint(run, 100, [consumed_id(p) for p in files if p.name.endswith("_consumed.pt")])
    tick()
    names_before, counts_before = sorted(sizes(run)), inspect_run(run)["done"]

    report = compact_archive(run, keep_files=10)

    assert len(report.compacted) == 20 and report.freed_bytes == 20_000
    assert (report.kept_files, report.kept_bytes, report.protected) == (10, 10_000, 0)
    after = sizes(run)
    assert sorted(after) == names_before  # no name added, removed or renamed
    assert [after[p.name] for p in files] == [0] * 20 + [1000] * 10  # the oldest were emptied
    assert done_bytes(run) == 10_000
    assert inspect_run(run)["done"] == counts_before
    assert all(queue.was_consumed(consumed_id(p)) for p in files if p.name.endswith("_consumed.pt"))
    # Idempotent: a second pass finds nothing to do.
    again = compact_archive(run, keep_files=10)
    assert again.compacted == [] and again.empty == 20 and sizes(run) == after


def test_a_pass_over_done_takes_memory_for_the_payloads_it_keeps_not_for_every_name(run):
    # A long run archives three names a step, never deleted (they are the ledger): a pass that held them all,
    # stat results and all, grew the PS by about 1 KB a name at every checkpoint (30 MB in a 30-minute soak).
    import tracemalloc

    for i in range(5_000):
        (run.done / done_name(make_job_id(i // 1000, i % 1000), ArchiveReason.PROCESSED)).touch()  # emptied ones
    tracemalloc.start()
    try:
        report = compact_archive(run, keep_files=10, boundary=None)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert report.empty == 5_000
    assert peak < 1_000_000, f"{peak / 1e6:.1f} MB for 5,000 names"  # about 4.5 MB if it held them all


def test_keep_mb_bounds_the_bytes(run):
    files = [put_done(run, i, ArchiveReason.PROCESSED, size=100_000) for i in range(20)]
    tick()
    save_checkpoint(run, 10, [])
    report = compact_archive(run, keep_mb=0.35)
    assert done_bytes(run) == 300_000 <= 350_000
    assert report.kept_files == 3 and len(report.compacted) == 17
    assert [p.stat().st_size for p in files[-3:]] == [100_000] * 3
    # Both limits: whichever is reached first.
    compact_archive(run, keep_files=2, keep_mb=10)
    assert done_bytes(run) == 200_000


def test_nothing_archived_after_the_newest_complete_checkpoint_is_touched(run):
    old = [put_done(run, i) for i in range(10)]
    tick()
    save_checkpoint(run, 5, [])  # an older complete one
    save_checkpoint(run, 10, [consumed_id(p) for p in old])
    tick()
    new = [put_done(run, 10 + i, reason) for i, reason in enumerate(
        [ArchiveReason.CONSUMED, ArchiveReason.STALE, ArchiveReason.PROCESSED, ArchiveReason.DUPLICATE])]
    saving = run.checkpoints / "checkpoint-15"  # a save in progress: no ledger yet
    saving.mkdir()

    report = compact_archive(run, keep_files=1)

    assert report.checkpoint == str(run.checkpoints / "checkpoint-10")
    assert all(p.stat().st_size == 1000 for p in new)  # beyond the limit, but protected
    assert all(p.stat().st_size == 0 for p in old)
    assert report.protected == 3 and report.kept_files == 4
    assert saving.is_dir()  # read-only: a save in progress is not "cleaned up"


def test_a_consumed_file_missing_from_the_ledger_is_untouched(run):
    """A PS died between archiving a result as consumed and saving a checkpoint with it:
    the next PS will re-adopt that file and load it, so it must stay whole."""
    in_ledger, not_in_ledger = put_done(run, 0), put_done(run, 1)
    stale = put_done(run, 2, ArchiveReason.STALE)
    tick()
    save_checkpoint(run, 10, [consumed_id(in_ledger)])
    tick()
    put_done(run, 3, ArchiveReason.PROCESSED)
    compact_archive(run, keep_files=1)
    assert (in_ledger.stat().st_size, not_in_ledger.stat().st_size, stale.stat().st_size) == (0, 1000, 0)


def test_without_a_complete_checkpoint_nothing_is_compacted(run):
    files = [put_done(run, i, reason) for i, reason in enumerate(ArchiveReason)]
    (run.checkpoints / "checkpoint-3").mkdir()  # killed while saving
    tick()
    assert newest_complete_checkpoint(run.checkpoints) is None and read_boundary(run.checkpoints) is None
    report = compact_archive(run, keep_files=1, keep_mb=0.001)
    assert report.compacted == [] and report.checkpoint is None
    assert all(p.stat().st_size == 1000 for p in files)
    assert "no complete checkpoint" in report.line()


def test_foreign_files_symlinks_links_and_fifos_are_untouched(run, tmp_path):
    outside = tmp_path / "precious.bin"
    outside.write_bytes(b"p" * 1000)
    linked = tmp_path / "linked.bin"
    linked.write_bytes(b"l" * 1000)
    foreign = run.done / "notes.txt"
    foreign.write_bytes(b"n" * 1000)
    os.symlink(outside, run.done / "000001_050_consumed.pt")
    os.link(linked, run.done / "000001_051_failed_load.pt")  # a hostile queue file was a hard link
    (run.done / "000001_052_failed_load.pt").mkdir()
    os.mkfifo(run.done / "000001_053_failed_load.pt")
    invalid = put_done(run, 54, ArchiveReason.FAILED_LOAD)
    invalid = invalid.rename(run.done / "invalid_junk.txt_failed_load.pt")  # in the grammar: compactable
    tick()
    save_checkpoint(run, 10, ["000001_050"])
    tick()
    put_done(run, 60, ArchiveReason.PROCESSED)

    report = compact_archive(run, keep_files=1)

    assert report.compacted == [invalid.name] and invalid.stat().st_size == 0
    assert outside.read_bytes() == b"p" * 1000 and (run.done / "000001_050_consumed.pt").is_symlink()
    assert linked.read_bytes() == b"l" * 1000 and report.skipped == 1
    assert foreign.stat().st_size == 1000
    assert (run.done / "000001_052_failed_load.pt").is_dir()


def test_dry_run_changes_nothing(run):
    files = [put_done(run, i) for i in range(5)]
    tick()
    save_checkpoint(run, 10, [consumed_id(p) for p in files])
    before = {p.name: (p.stat().st_size, p.stat().st_mtime_ns) for p in run.done.iterdir()}
    report = compact_archive(run, keep_files=2, dry_run=True)
    assert len(report.compacted) == 3 and report.freed_bytes == 3000 and "would compact" in report.line()
    assert {p.name: (p.stat().st_size, p.stat().st_mtime_ns) for p in run.done.iterdir()} == before


def _train_on(queue, job_ids):
    """Each job's full round trip through the queue: put, claim, complete, collect, consume."""
    for job_id in job_ids:
        queue.put_job(job_id, {"prompt": job_id}, created_step=1)
        job = queue.claim(1)
        assert queue.complete(job, {"rows": [job_id], "pad": "y" * 5000}, weights_version=0)
        (result,) = queue.collect()
        assert queue.consume(result)


def test_a_resumed_ps_readopts_only_results_that_compaction_never_touched(run, queue):
    from asyncgrpo.run.checkpoints import checkpoint_to_resume

    before = [make_job_id(1, i) for i in range(8)]
    after = [make_job_id(2, i) for i in range(4)]
    _train_on(queue, before)
    tick()
    save_checkpoint(run, 8, before)
    tick()
    _train_on(queue, after)  # consumed after the checkpoint: the old PS's training on them is lost

    report = compact_archive(run, keep_files=1)
    assert len(report.compacted) == 16  # 8 consumed + their 8 processed job files
    assert all((run.done / done_name(j, ArchiveReason.CONSUMED)).stat().st_size == 0 for j in before)
    assert all(queue.was_consumed(j) for j in before + after)

    # The PS restarts: it resumes from the newest complete checkpoint and re-adopts what it
    # consumed after it (ps/trainer.py, unchanged); compaction left all of those whole.
    resume = checkpoint_to_resume(run.checkpoints)
    assert resume == str(newest_complete_checkpoint(run.checkpoints))
    ledger = set(json.loads((run.checkpoints / "checkpoint-8" / LEDGER_FILE).read_text())["consumed"])
    assert sorted(queue.roll_back_consumed(ledger)) == after
    readopted = queue.collect(readopt=True)
    assert sorted(r.job_id for r in readopted) == after
    assert [r.data["rows"] for r in sorted(readopted, key=lambda r: r.job_id)] == [[j] for j in after]
    assert not any(name.endswith("_failed_load.pt") for name in os.listdir(run.done))
    for result in readopted:  # trained on again by the new PS
        assert queue.consume(result)
    assert all(queue.was_consumed(j) for j in before + after)


def test_the_ps_pass_runs_once_per_new_checkpoint(run):
    assert ArchiveRetention(run).maybe_compact() is None  # both limits 0: disabled
    retention = ArchiveRetention(run, keep_files=2)
    files = [put_done(run, i) for i in range(5)]
    assert retention.maybe_compact() is None  # no checkpoint yet
    tick()
    save_checkpoint(run, 10, [consumed_id(p) for p in files])
    tick()
    first = retention.maybe_compact()
    assert first is not None and len(first.compacted) == 3
    more = [put_done(run, 10 + i) for i in range(3)]
    assert retention.maybe_compact() is None  # same checkpoint: no rescan
    tick()
    save_checkpoint(run, 20, [consumed_id(p) for p in files + more])
    second = retention.maybe_compact()
    assert second is not None and len(second.compacted) == 3 and done_bytes(run) == 2000


@pytest.fixture
def _restore_queue_log_level():
    """queue_tools' main() quiets the library's queue logger; later tests' caplog needs it back."""
    logger = logging.getLogger("asyncgrpo.queue")
    level = logger.level
    yield
    logger.setLevel(level)


@pytest.mark.usefixtures("_restore_queue_log_level")
def test_queue_tools_cleanup_keep_files(run, capsys):
    files = [put_done(run, i) for i in range(6)]
    tick()
    save_checkpoint(run, 10, [consumed_id(p) for p in files])
    assert main(["cleanup", str(run.root), "--keep-files", "4", "--dry-run"]) == 0
    out = capsys.readouterr().out
    assert "would compact 2 file(s)" in out and done_bytes(run) == 6000
    assert out.splitlines()[-1] == "cleanup: 2 action(s) (dry run: nothing changed)"  # (not "nothing to do")
    assert main(["cleanup", str(run.root), "--keep-files", "4", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["retention"]["compacted"] == 2 and done_bytes(run) == 4000
    assert main(["cleanup", str(run.root), "--keep-mb", "0.002"]) == 0
    assert "compacted 2 file(s) in done/" in capsys.readouterr().out and done_bytes(run) == 2000
    assert main(["cleanup", str(run.root)]) == 0  # no retention flag: no retention pass
    assert "archive retention" not in capsys.readouterr().out
    with pytest.raises(SystemExit) as exited:
        main(["cleanup", str(run.root), "--keep-files", "-1"])
    assert exited.value.code == 2


def test_config_fields():
    cfg = parse_config(["--archive_keep_files", "100", "--archive_keep_mb", "50", "--device_type", "cpu"])
    assert (cfg.archive_keep_files, cfg.archive_keep_mb) == (100, 50.0)
    default = parse_config(["--device_type", "cpu"])
    assert (default.archive_keep_files, default.archive_keep_mb) == (0, 0.0)
    with pytest.raises(ConfigError, match="archive_keep_mb"):
        parse_config(["--archive_keep_mb", "-1", "--device_type", "cpu"])
