"""EventLog: one JSON line per event with the common fields; spans carry dur_ms; a failed
write (full disk) drops events with one warning and never raises into the hot path. read_events
reads them back, filtered by process, role and event name, past a torn line."""

import errno
import json
import logging
import os
import threading

from asyncgrpo.events import EventLog, read_events


def event_log(run_root, process, role):
    (run_root / "logs").mkdir(exist_ok=True)
    return EventLog(run_root / "logs", process, role, "cpu")


def test_events_are_json_lines_with_common_fields(tmp_path):
    events = event_log(tmp_path, "worker-dev1", "worker")
    events.emit("job_claimed", job_id="000001_000", queue_wait_ms=3.5)
    with events.span("generate", job_id="000001_000") as end:
        end["tokens"] = 7
    events.close()
    claimed, start, stop = read_events(tmp_path, process="worker-dev1")
    for record in (claimed, start, stop):
        assert record["pid"] == os.getpid() and record["process"] == "worker-dev1"
        assert record["role"] == "worker" and record["device"] == "cpu" and record["job_id"] == "000001_000"
    assert claimed["event"] == "job_claimed" and claimed["queue_wait_ms"] == 3.5
    assert (start["event"], stop["event"]) == ("generate_start", "generate_end")
    assert stop["tokens"] == 7 and "tokens" not in start
    assert 0 <= stop["dur_ms"] <= (stop["mono"] - start["mono"]) * 1e3 + 1e-3


def test_a_failed_write_warns_once_and_never_raises(tmp_path, monkeypatch, caplog):
    events = event_log(tmp_path, "ps", "ps")

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
    assert [r["step"] for r in read_events(tmp_path, process="ps")] == [3]


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


def test_read_events_filters_by_process_role_and_event_past_torn_lines(tmp_path):
    assert read_events(tmp_path) == []  # no logs folder yet
    ps, dev1, dev2 = (event_log(tmp_path, process, role)
                      for process, role in (("ps", "ps"), ("worker-dev1", "worker"), ("worker-dev2", "worker")))
    ps.emit("job_created", job_id="000000_000")
    dev2.emit("job_claimed", job_id="000000_000")
    dev1.emit("weights_synced", weights_version=0)
    dev2.emit("result_written", job_id="000000_000")
    ps.emit("result_collected", job_id="000000_000")
    for log in (ps, dev1, dev2):
        log.close()
    with open(tmp_path / "logs" / "events-ps.jsonl", "a") as f:  # lines that are not events, one torn (full disk)
        f.write('garbage\n{"event": "no_mono"}\n\n{"event": "job_created", "mono": 1\n')
    relaunched = event_log(tmp_path, "ps", "ps")  # a relaunched PS appends to the same file
    relaunched.emit("job_created", job_id="000001_000")
    relaunched.close()
    with open(tmp_path / "logs" / "events-worker-dev1.jsonl", "a") as f:  # a worker killed mid-write
        f.write('{"event": "weights_synced", "mono": 2')

    def names(**filters):
        return [(e["process"], e["event"]) for e in read_events(tmp_path, **filters)]

    assert names() == [("ps", "job_created"), ("ps", "result_collected"), ("ps", "job_created"),
                       ("worker-dev1", "weights_synced"), ("worker-dev2", "job_claimed"),
                       ("worker-dev2", "result_written")]  # each file in file order, files in name order
    assert names(process="ps") == [("ps", "job_created"), ("ps", "result_collected"), ("ps", "job_created")]
    assert names(process="worker-dev2") == [("worker-dev2", "job_claimed"), ("worker-dev2", "result_written")]
    assert names(process="worker-dev3") == []
    assert names(role="worker") == names()[3:]
    assert names(role="ps", event="job_created") == [("ps", "job_created")] * 2
    assert names(event={"job_claimed", "weights_synced"}) == [("worker-dev1", "weights_synced"),
                                                              ("worker-dev2", "job_claimed")]
    assert [e["job_id"] for e in read_events(tmp_path, event="job_created")] == ["000000_000", "000001_000"]
