"""EventLog: one JSON line per event with the common fields; spans carry dur_ms; a failed
write (full disk) drops events with one warning and never raises into the hot path."""

import errno
import json
import logging
import os
import threading

from asyncgrpo.events import EventLog


def read(path):
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_events_are_json_lines_with_common_fields(tmp_path):
    events = EventLog(tmp_path, "worker-dev1", "worker", "cpu")
    events.emit("job_claimed", job_id="000001_000", queue_wait_ms=3.5)
    with events.span("generate", job_id="000001_000") as end:
        end["tokens"] = 7
    events.close()
    claimed, start, stop = read(tmp_path / "events-worker-dev1.jsonl")
    for record in (claimed, start, stop):
        assert record["pid"] == os.getpid() and record["process"] == "worker-dev1"
        assert record["role"] == "worker" and record["device"] == "cpu" and record["job_id"] == "000001_000"
    assert claimed["event"] == "job_claimed" and claimed["queue_wait_ms"] == 3.5
    assert (start["event"], stop["event"]) == ("generate_start", "generate_end")
    assert stop["tokens"] == 7 and "tokens" not in start
    assert 0 <= stop["dur_ms"] <= (stop["mono"] - start["mono"]) * 1e3 + 1e-3


def test_a_failed_write_warns_once_and_never_raises(tmp_path, monkeypatch, caplog):
    events = EventLog(tmp_path, "ps", "ps", "cpu")

    def full_disk(fd, data):
        raise OSError(errno.ENOSPC, "No space left on device")

    with monkeypatch.context() as patch:
        patch.setattr(os, "write", full_disk)
        with caplog.at_level(logging.WARNING, logger="asyncgrpo.events"):
            for step in range(3):
                events.emit("train_step_end", step=step)
    warnings = [r.getMessage() for r in caplog.records if r.name == "asyncgrpo.events"]
    assert len(warnings) == 1 and "No space left" in warnings[0]
    events.emit("train_step_end", step=3)  # the disk has room again
    events.close()
    assert [r["step"] for r in read(tmp_path / "events-ps.jsonl")] == [3]


def test_an_event_log_that_is_off_writes_nothing(tmp_path, monkeypatch):
    """No file appears (the working directory is an empty folder here) and nothing is opened or
    written: every os.open and os.write of this thread is recorded while the log is used."""
    monkeypatch.chdir(tmp_path)
    opened, written = [], []
    real_open, real_write = os.open, os.write
    this_thread = threading.get_ident()  # other threads of the test process are not the log's

    def record_open(path, *args, **kwargs):
        if threading.get_ident() == this_thread:
            opened.append(os.fspath(path))
        return real_open(path, *args, **kwargs)

    def record_write(fd, data):
        if threading.get_ident() == this_thread:
            written.append(bytes(data))
        return real_write(fd, data)

    with monkeypatch.context() as patch:
        patch.setattr(os, "open", record_open)
        patch.setattr(os, "write", record_write)
        events = EventLog.off()
        events.emit("job_created", job_id="000001_000")
        with events.span("generate"):
            pass
        events.close()
    assert (opened, written) == ([], [])
    assert list(tmp_path.iterdir()) == []


def test_a_write_cut_short_loses_only_its_own_line(tmp_path, monkeypatch, caplog):
    events = EventLog(tmp_path, "ps", "ps", "cpu")
    events.emit("train_step_end", step=1)
    real_write = os.write

    def half_then_full_disk(fd, data):  # a filling disk: part of the line lands, then ENOSPC
        real_write(fd, data[: len(data) // 2])
        return len(data) // 2

    with monkeypatch.context() as patch:
        patch.setattr(os, "write", half_then_full_disk)
        events.emit("train_step_end", step=2)
    events.emit("train_step_end", step=3)  # space again
    events.emit("train_step_end", step=4)
    events.close()
    lines = (tmp_path / "events-ps.jsonl").read_text().splitlines()
    parsed = []
    for line in lines:
        try:
            parsed.append(json.loads(line)["step"])
        except ValueError:
            parsed.append("torn")
    assert parsed == [1, "torn", 3, 4]
    assert sum("cannot append" in r.getMessage() for r in caplog.records) == 1
