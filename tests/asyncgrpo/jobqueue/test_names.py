"""The file-name grammar: every state round-trips; anything else is rejected unparsed."""

import pytest

from asyncgrpo.jobqueue.names import (
    ArchiveReason,
    JobState,
    QueueName,
    done_name,
    done_reason,
    invalid_name_stem,
    make_job_id,
    next_job_id,
    parse_done_name,
    parse_queue_name,
)


@pytest.mark.parametrize("name", [
    "000042_003_pending.pt",
    "000042_003_pending_a2.pt",
    "000042_003_processing_by_dev2.pt",
    "000042_003_processing_by_dev0_a3.pt",
    "000042_003_committing_by_dev12_a10.pt",
    "000042_003_complete_from_dev1.pt",
    "000042_003_collected.pt",
])
def test_valid_names_round_trip(name):
    parsed = parse_queue_name(name)
    assert parsed is not None
    assert parsed.filename == name


@pytest.mark.parametrize("name", [
    ".000042_003_pending.pt",  # dot-file
    "000042_003_pending.pt.tmp",
    "000042_003_pending_a1.pt",  # attempt 1 has one spelling: no suffix
    "000042_003_pending_a0.pt",
    "000042_003_processing_by_dev02.pt",  # one spelling per device
    "000042_003_complete_from_dev1_a2.pt",
    "00042_003_pending.pt",
    "000042_0031_pending.pt",
    "000042_003_processing.pt",  # owned states need their device
    "000042_003_exploded.pt",
    "..",
    "",
])
def test_names_outside_the_grammar_are_rejected(name):
    assert parse_queue_name(name) is None


def test_fifo_order_is_job_id_then_attempt():
    names = [QueueName("000002_000"), QueueName("000001_001", attempt=2), QueueName("000001_001"),
             QueueName("000001_000", attempt=3)]
    assert [(n.job_id, n.attempt) for n in sorted(names)] == [
        ("000001_000", 3), ("000001_001", 1), ("000001_001", 2), ("000002_000", 1)]


def test_transitions_keep_job_and_attempt():
    pending = parse_queue_name("000007_001_pending_a2.pt")
    processing = pending.moved_to(JobState.PROCESSING, device=3)
    assert processing.filename == "000007_001_processing_by_dev3_a2.pt"
    assert processing.moved_to(JobState.PENDING, attempt=3).filename == "000007_001_pending_a3.pt"


def test_job_id_format_and_range():
    assert make_job_id(42, 3) == "000042_003"
    with pytest.raises(ValueError):
        make_job_id(1_000_000, 0)
    with pytest.raises(ValueError):
        make_job_id(0, 1000)


def test_done_names_carry_reason_attempt_and_collision():
    assert done_name("000001_002", ArchiveReason.CONSUMED) == "000001_002_consumed.pt"
    name = done_name("000001_002", ArchiveReason.PROCESSED, attempt=2, collision=1)
    assert name == "000001_002_processed_a2.1.pt"
    assert done_reason(name) is ArchiveReason.PROCESSED
    assert done_reason(done_name(invalid_name_stem("../../etc/passwd"), ArchiveReason.FAILED_LOAD)) \
        is ArchiveReason.FAILED_LOAD
    assert "/" not in invalid_name_stem("../../etc/passwd")
    assert done_reason("notes.txt") is None


def test_job_ids_only_grow_also_when_the_step_goes_back():
    assert next_job_id(None, 7) == "000007_000"
    assert next_job_id("000003_004", 7) == "000007_000"  # a later step starts its own indices
    assert next_job_id("000007_004", 7) == "000007_005"
    assert next_job_id("000009_004", 7) == "000009_005"  # a resumed PS behind the journal's last id
    assert next_job_id("000007_999", 7) == "000008_000"


def test_done_names_parse_to_job_id_and_reason():
    assert parse_done_name("000001_002_consumed.pt") == ("000001_002", ArchiveReason.CONSUMED)
    assert parse_done_name("000001_002_stale_a2.3.pt") == ("000001_002", ArchiveReason.STALE)
    assert parse_done_name("invalid_x_failed_load.pt") == ("invalid_x", ArchiveReason.FAILED_LOAD)
    assert parse_done_name("000001_002_consumed.pt.tmp") is None
