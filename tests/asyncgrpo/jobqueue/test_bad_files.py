"""Bad files (docs/design.md, "The file protocol").

* Loaders reject files that are not plain, well-formed payloads under a grammar name
  (truncated, wrong schema or job id, symlinks, path tricks, pickled code, non-regular
  files): each goes to done/ as failed_load with a log line, nothing crashes, nothing is
  overwritten, and good files next to it still go through.

Full disks are in tests/asyncgrpo/jobqueue/test_full_disk.py.

No sleeps: bounded waits only (Event.wait / Thread.join with a timeout).
"""

import collections
import io
import logging
import os
import pathlib
import random
import re
import stat
import threading

import pytest
import torch
from helpers import demo_config, entries

from asyncgrpo.jobqueue import ArchiveReason, JobQueue, JobState, QueueName, make_job_id
from asyncgrpo.jobqueue.names import done_reason, shown_name
from asyncgrpo.run import RunDir

BAD = make_job_id(1, 0)  # "000001_000": the job id every bad file claims
GOOD = make_job_id(2, 0)  # a good job next to it
OTHER = make_job_id(3, 0)
LOGGER = "asyncgrpo.queue"
WAIT_S = 5.0  # bound on every wait for another thread (a healthy call takes milliseconds)


# --------------------------------------------------------------------------- helpers


def complete_name(job_id, device=1):
    return QueueName(job_id, state=JobState.COMPLETE, device=device).filename


def pending_name(job_id):
    return QueueName(job_id).filename


def fingerprint(path):
    """What a file is, without following links: compares a file before and after a move."""
    st = os.lstat(path)
    if stat.S_ISLNK(st.st_mode):
        return ("symlink", os.readlink(path))
    if stat.S_ISDIR(st.st_mode):
        return ("dir", tuple(sorted(os.listdir(path))))
    if stat.S_ISFIFO(st.st_mode):
        return ("fifo",)
    with open(path, "rb") as f:
        return ("file", f.read())


def snapshot(directory):
    return {name: fingerprint(os.path.join(directory, name)) for name in entries(directory)}


def queue_logs(caplog, level=logging.WARNING):
    return [r.getMessage() for r in caplog.records if r.name == LOGGER and r.levelno >= level]


def real_result(q, job_id, device=1, text="111"):
    """A result produced by the real worker path (put, claim, complete); returns its path."""
    q.put_job(job_id, {"prompt": "1:"}, created_step=int(job_id[:6]))
    job = q.claim(device)
    assert job is not None and job.job_id == job_id
    assert q.complete(job, {"text": text}, weights_version=0)
    path = q.run.queue / complete_name(job_id, device)
    assert path.is_file()
    return path


def scratch_queue(tmp_path, tag):
    return JobQueue(RunDir.create(tmp_path / f"scratch_{tag}"))


def valid_result_bytes(tmp_path, job_id, tag="result"):
    """The bytes of a valid result payload for ``job_id``, made by a real worker in a scratch run."""
    return real_result(scratch_queue(tmp_path, f"{tag}_{job_id}"), job_id).read_bytes()


def valid_job_bytes(tmp_path, job_id, data=None):
    q = scratch_queue(tmp_path, f"job_{job_id}")
    return q.put_job(job_id, {"prompt": "1:"} if data is None else data, created_step=int(job_id[:6])).read_bytes()


def load_plain(data: bytes):
    return torch.load(io.BytesIO(data), weights_only=True)


def save(obj) -> bytes:
    buffer = io.BytesIO()
    torch.save(obj, buffer)
    return buffer.getvalue()


class RunsCode:
    """Unpickling this runs ``pathlib.Path.touch(sentinel)``: a stand-in for arbitrary code."""

    def __init__(self, sentinel):
        self.sentinel = pathlib.Path(sentinel)

    def __reduce__(self):
        return (pathlib.Path.touch, (self.sentinel,))


def hostile_bytes(valid: bytes, sentinel) -> bytes:
    """A payload shaped like ``valid`` (so it would pass validation if loaded) whose data runs code."""
    payload = load_plain(valid)
    payload["data"] = {"text": RunsCode(sentinel)}
    return save(payload)


def assert_hostile_control(data: bytes, sentinel):
    """Control: an unsafe load of the same bytes does run the code (so the test can fail)."""
    assert not os.path.lexists(sentinel)
    torch.load(io.BytesIO(data), weights_only=False)
    assert os.path.exists(sentinel), "the hostile payload is not hostile: the test proves nothing"


def escape_listing(paths):
    """For each directory a traversal could reach, the names in it that mention 'escape'."""
    out = {}
    for d in paths:
        try:
            out[d] = sorted(n for n in os.listdir(d) if "escape" in n)
        except FileNotFoundError:
            out[d] = None
    return out


# --------------------------------------------------------------------------- bad results


def _write(path, data: bytes):
    with open(path, "xb") as f:
        f.write(data)


def bad_truncated(q, path, tmp_path):
    data = valid_result_bytes(tmp_path, BAD)
    assert load_plain(data)["job_id"] == BAD  # control: whole, it loads
    _write(path, data[: len(data) // 2])


def bad_empty(q, path, tmp_path):
    _write(path, b"")


def bad_random_bytes(q, path, tmp_path):
    _write(path, random.Random(1234).randbytes(4096))


def bad_job_id_mismatch(q, path, tmp_path):
    data = valid_result_bytes(tmp_path, OTHER)  # a valid result, for another job
    assert load_plain(data)["job_id"] == OTHER
    _write(path, data)

    def check(q, archived):
        assert not any(n.startswith(OTHER) for n in os.listdir(q.run.done))  # not mistaken for OTHER's
    return check


def _edited(tmp_path, edit):
    payload = load_plain(valid_result_bytes(tmp_path, BAD))
    edited = edit(payload)
    return save(payload if edited is None else edited)


def bad_schema_999(q, path, tmp_path):
    _write(path, _edited(tmp_path, lambda p: p.update(schema=999)))


def bad_list_payload(q, path, tmp_path):
    _write(path, _edited(tmp_path, lambda p: [p]))


def bad_tensor_payload(q, path, tmp_path):
    _write(path, save(torch.arange(16)))


def bad_missing_keys(q, path, tmp_path):
    def edit(p):
        del p["data"], p["attempt"]
    _write(path, _edited(tmp_path, edit))


def bad_job_payload_as_result(q, path, tmp_path):
    _write(path, valid_job_bytes(tmp_path, BAD))  # a kind="job" payload under a complete name


def bad_symlink(q, path, tmp_path):
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    target = elsewhere / "result.pt"
    target.write_bytes(valid_result_bytes(tmp_path, BAD))  # valid: only the link makes it bad
    before = fingerprint(target)
    os.symlink(target, path)

    def check(q, archived):
        assert os.path.islink(archived), "the symlink itself must be archived, not its target"
        assert os.readlink(archived) == str(target)
        assert fingerprint(target) == before, "the link's target was touched"
        assert sorted(os.listdir(elsewhere)) == ["result.pt"]
    return check


def bad_directory(q, path, tmp_path):
    os.mkdir(path)
    _write(path / "inside.pt", valid_result_bytes(tmp_path, BAD))


def _traversal(job_id_for):
    def build(q, path, tmp_path):
        job_id = job_id_for(tmp_path)
        payload = load_plain(valid_result_bytes(tmp_path, BAD))
        payload["job_id"] = job_id
        _write(path, save(payload))
        # every directory a path built from this job id could land in
        reachable = sorted({os.path.dirname(os.path.abspath(os.path.join(base, job_id)))
                            for base in (q.run.queue, q.run.done, q.run.tmp, q.run.root)}
                           | {str(tmp_path), "/tmp"})
        before = escape_listing(reachable)

        def check(q, archived):
            assert escape_listing(reachable) == before, "a file was created outside the run directory"
            assert [p for p in tmp_path.rglob("*") if "escape" in p.name] == []
            assert all(os.path.dirname(os.path.abspath(q.run.done / n)) == str(q.run.done)
                       for n in os.listdir(q.run.done))
        return check
    return build


BAD_RESULTS = {
    "truncated": bad_truncated,
    "empty": bad_empty,
    "random_bytes": bad_random_bytes,
    "job_id_mismatch": bad_job_id_mismatch,
    "schema_999": bad_schema_999,
    "list_payload": bad_list_payload,
    "tensor_payload": bad_tensor_payload,
    "missing_keys": bad_missing_keys,
    "job_payload_as_result": bad_job_payload_as_result,
    "symlink": bad_symlink,
    "directory": bad_directory,
    "job_id_traversal": _traversal(lambda tmp_path: "../../escape"),  # queue/../../ is tmp_path
    "job_id_traversal_tmp": _traversal(lambda tmp_path: "../../../tmp/escape"),
    "job_id_absolute": _traversal(lambda tmp_path: str(tmp_path / "escape_abs")),
}


@pytest.mark.parametrize("case", list(BAD_RESULTS))
def test_bad_result_is_archived_failed_load_and_good_result_still_collected(case, tmp_path, caplog):
    caplog.set_level(logging.INFO, logger=LOGGER)
    q = JobQueue(RunDir.create(tmp_path / "run"))
    real_result(q, GOOD, text="good")
    bad_path = q.run.queue / complete_name(BAD)
    check = BAD_RESULTS[case](q, bad_path, tmp_path)
    bad_before = fingerprint(bad_path)
    queue_before = entries(q.run.queue)
    assert queue_before == {complete_name(GOOD), complete_name(BAD)}
    done_before = snapshot(q.run.done)

    results = q.collect()  # must not raise

    assert [(r.job_id, r.data) for r in results] == [(GOOD, {"text": "good"})]
    assert entries(q.run.queue) == {f"{GOOD}_collected.pt"}, "the bad file did not leave queue/"
    assert entries(q.run.tmp) == set()
    done_after = snapshot(q.run.done)
    assert {n: done_after[n] for n in done_before} == done_before, "an earlier archive was overwritten"
    new = sorted(set(done_after) - set(done_before))
    assert len(new) + len(results) == len(queue_before), f"files not conserved: {new}"
    assert len(new) == 1
    assert done_reason(new[0]) is ArchiveReason.FAILED_LOAD and new[0].startswith(BAD + "_")
    assert done_after[new[0]] == bad_before, "the archive is not the bad file as it was"
    assert any("[queue]" in m and complete_name(BAD) in m for m in queue_logs(caplog)), queue_logs(caplog)
    if check is not None:
        check(q, q.run.done / new[0])

    # Nothing left to do, and the good result goes all the way.
    assert q.recover() == []
    assert q.consume(results[0])
    assert entries(q.run.queue) == set()


@pytest.mark.parametrize(("case", "reason"), [
    ("random_bytes", "is not a plain-data torch payload: "),
    ("truncated", "is not a plain-data torch payload: "),
    ("empty", "is empty"),
    ("directory", "is a directory"),
    ("symlink", "is a symlink"),
])
def test_a_bad_result_is_rejected_in_one_line_of_what_is_wrong(case, reason, tmp_path, caplog):
    """Not torch's advice to load the file again unsafely (its safe loader's first line), nor a descriptor's number
    for a name ("[Errno 21] Is a directory: 17")."""
    caplog.set_level(logging.INFO, logger=LOGGER)
    q = JobQueue(RunDir.create(tmp_path / "run"))
    BAD_RESULTS[case](q, q.run.queue / complete_name(BAD), tmp_path)
    assert q.collect() == []
    [line] = [m for m in queue_logs(caplog) if "rejected" in m]
    assert line.startswith(f"[queue] result {complete_name(BAD)} rejected: ") and reason in line, line
    assert "weights_only" not in line and "Errno" not in line and "\n" not in line, line


def test_a_payload_torch_s_safe_loader_refuses_is_named_without_its_advice(tmp_path):
    from asyncgrpo.run.fileops import PayloadLoadError, load_payload

    path = tmp_path / "code.pt"
    path.write_bytes(save(RunsCode(tmp_path / "sentinel")))
    with pytest.raises(PayloadLoadError) as refused:
        load_payload(path)
    assert str(refused.value).startswith(f"{path} is not a plain-data torch payload: torch's safe loader refused it (")
    assert "weights_only" not in str(refused.value) and "\n" not in str(refused.value)
    assert not (tmp_path / "sentinel").exists()


def test_hostile_pickle_result_never_runs_code(tmp_path, caplog):
    q = JobQueue(RunDir.create(tmp_path / "run"))
    real_result(q, GOOD, text="good")
    sentinel = tmp_path / "SENTINEL"
    data = hostile_bytes(valid_result_bytes(tmp_path, BAD), sentinel)
    _write(q.run.queue / complete_name(BAD), data)
    queue_before = entries(q.run.queue)
    done_before = snapshot(q.run.done)

    results = q.collect()

    assert not os.path.lexists(sentinel), "loading a result ran code from the file"
    assert [(r.job_id, r.data) for r in results] == [(GOOD, {"text": "good"})]
    assert entries(q.run.queue) == {f"{GOOD}_collected.pt"}
    done_after = snapshot(q.run.done)
    new = sorted(set(done_after) - set(done_before))
    assert len(new) + len(results) == len(queue_before)
    assert [done_reason(n) for n in new] == [ArchiveReason.FAILED_LOAD]
    assert done_after[new[0]] == ("file", data)
    assert any("[queue]" in m and complete_name(BAD) in m for m in queue_logs(caplog))
    assert_hostile_control(data, sentinel)


def test_bad_result_then_good_result_for_the_same_job(tmp_path, caplog):
    """A corrupt result from dev1 does not block dev2's good result for the same job."""
    q = JobQueue(RunDir.create(tmp_path / "run"))
    good = valid_result_bytes(tmp_path, BAD)
    _write(q.run.queue / complete_name(BAD, device=1), good[: len(good) // 3])
    _write(q.run.queue / complete_name(BAD, device=2), good)

    results = q.collect()

    assert [r.job_id for r in results] == [BAD]
    assert entries(q.run.queue) == {f"{BAD}_collected.pt"}
    assert [done_reason(n) for n in os.listdir(q.run.done)] == [ArchiveReason.FAILED_LOAD]
    assert any(complete_name(BAD, device=1) in m for m in queue_logs(caplog))


def test_failed_load_archive_never_overwrites_an_earlier_archive(tmp_path):
    q = JobQueue(RunDir.create(tmp_path / "run"))
    earlier = q.run.done / f"{BAD}_failed_load.pt"
    earlier.write_bytes(b"an earlier failed_load archive")
    for round_, payload in enumerate([b"first bad result", b"second bad result"], start=1):
        _write(q.run.queue / complete_name(BAD), payload)
        assert q.collect() == []
        assert entries(q.run.queue) == set()
        assert len(os.listdir(q.run.done)) == 1 + round_
    assert earlier.read_bytes() == b"an earlier failed_load archive"
    archived = {n: (q.run.done / n).read_bytes() for n in os.listdir(q.run.done)}
    assert all(done_reason(n) is ArchiveReason.FAILED_LOAD for n in archived)
    assert sorted(archived.values()) == [b"an earlier failed_load archive", b"first bad result",
                                         b"second bad result"]


# --------------------------------------------------------------------------- bad job files


def bad_job_hostile(tmp_path, job_id, sentinel):
    return ("file", hostile_bytes(valid_job_bytes(tmp_path, job_id), sentinel))


def bad_job_truncated(tmp_path, job_id, sentinel):
    data = valid_job_bytes(tmp_path, job_id)
    return ("file", data[: len(data) // 2])


def bad_job_traversal(tmp_path, job_id, sentinel):
    payload = load_plain(valid_job_bytes(tmp_path, job_id))
    payload["job_id"] = "../../escape"
    return ("file", save(payload))


def bad_job_result_as_job(tmp_path, job_id, sentinel):
    return ("file", valid_result_bytes(tmp_path, job_id))  # kind="result" under a pending name


def bad_job_schema_999(tmp_path, job_id, sentinel):
    payload = load_plain(valid_job_bytes(tmp_path, job_id))
    payload["schema"] = 999
    return ("file", save(payload))


def bad_job_symlink(tmp_path, job_id, sentinel):
    target = tmp_path / f"elsewhere_{job_id}.pt"
    target.write_bytes(valid_job_bytes(tmp_path, job_id))
    return ("symlink", target)


BAD_JOBS = {
    "hostile_pickle": bad_job_hostile,
    "truncated": bad_job_truncated,
    "job_id_traversal": bad_job_traversal,
    "result_as_job": bad_job_result_as_job,
    "schema_999": bad_job_schema_999,
    "symlink": bad_job_symlink,
}


def _place(path, made):
    kind, what = made
    if kind == "symlink":
        os.symlink(what, path)
    else:
        _write(path, what)


@pytest.mark.parametrize("case", list(BAD_JOBS))
def test_bad_job_file_is_rejected_by_claim(case, tmp_path, caplog):
    caplog.set_level(logging.INFO, logger=LOGGER)
    q = JobQueue(RunDir.create(tmp_path / "run"))
    sentinel = tmp_path / "SENTINEL"
    made = BAD_JOBS[case](tmp_path, BAD, sentinel)
    _place(q.run.queue / pending_name(BAD), made)  # oldest: claimed first
    bad_before = fingerprint(q.run.queue / pending_name(BAD))
    target_before = fingerprint(made[1]) if made[0] == "symlink" else None
    q.put_job(GOOD, {"prompt": "2:"}, created_step=2)

    job = q.claim(1)

    assert job is not None and job.job_id == GOOD and job.data == {"prompt": "2:"}
    assert not os.path.lexists(sentinel), "claiming a job ran code from the file"
    assert entries(q.run.queue) == {job.path.name}
    done = snapshot(q.run.done)
    assert list(done) == [f"{BAD}_failed_load.pt"] and done_reason(f"{BAD}_failed_load.pt") is ArchiveReason.FAILED_LOAD
    assert done[f"{BAD}_failed_load.pt"] == bad_before
    assert any("[queue]" in m and BAD in m for m in queue_logs(caplog)), queue_logs(caplog)
    if made[0] == "symlink":
        assert os.path.islink(q.run.done / f"{BAD}_failed_load.pt")
        assert os.readlink(q.run.done / f"{BAD}_failed_load.pt") == str(made[1])
        assert fingerprint(made[1]) == target_before, "the link's target was touched"
    assert [p for p in tmp_path.rglob("*") if "escape" in p.name] == []

    # A queue holding only a bad job: claim() archives it and returns None.
    made2 = BAD_JOBS[case](tmp_path / "second", OTHER, sentinel) if case != "symlink" else \
        ("symlink", made[1])
    _place(q.run.queue / pending_name(OTHER), made2)
    assert q.claim(1) is None
    assert not os.path.lexists(sentinel)
    assert entries(q.run.queue) == {job.path.name}
    assert sorted(os.listdir(q.run.done)) == [f"{BAD}_failed_load.pt", f"{OTHER}_failed_load.pt"]

    if case == "hostile_pickle":
        assert_hostile_control(made[1], sentinel)


# --------------------------------------------------------------------------- non-regular files


def _unblock_fifos(directory):
    """Opens every FIFO in ``directory`` for writing and closes it: a reader blocked in
    open() then returns and reads EOF."""
    for entry in os.scandir(directory):
        if stat.S_ISFIFO(entry.stat(follow_symlinks=False).st_mode):
            try:
                os.close(os.open(entry.path, os.O_WRONLY | os.O_NONBLOCK))
            except OSError:
                pass  # no reader on this one


@pytest.mark.parametrize("op", ["collect", "claim"])
def test_fifo_named_like_a_queue_file_is_rejected_without_blocking(op, tmp_path, caplog):
    q = JobQueue(RunDir.create(tmp_path / "run"))
    if op == "collect":
        real_result(q, GOOD, text="good")
        os.mkfifo(q.run.queue / complete_name(BAD))
        call = q.collect
    else:
        os.mkfifo(q.run.queue / pending_name(BAD))
        q.put_job(GOOD, {"prompt": "2:"}, created_step=2)
        call = lambda: q.claim(1)  # noqa: E731
    out = {}

    def target():
        try:
            out["value"] = call()
        except BaseException as err:  # reported below
            out["error"] = err

    thread = threading.Thread(target=target, daemon=True)
    thread.start()
    thread.join(WAIT_S)
    blocked = thread.is_alive()
    if blocked:  # free the thread so the rest of the run is not left with it stuck
        _unblock_fifos(q.run.queue)
        thread.join(WAIT_S)
    assert not blocked, f"{op}() blocked for {WAIT_S:g}s opening a FIFO named like a queue file"
    assert "error" not in out, out.get("error")
    if op == "collect":
        assert [r.job_id for r in out["value"]] == [GOOD]
    else:
        assert out["value"].job_id == GOOD
    done = os.listdir(q.run.done)
    assert [n for n in done if n.startswith(BAD)] == [f"{BAD}_failed_load.pt"]
    assert stat.S_ISFIFO(os.lstat(q.run.done / f"{BAD}_failed_load.pt").st_mode)


# --------------------------------------------------------------------------- names outside the grammar


JUNK_NAMES = [
    "..000001_000_pending.pt",
    ".000001_000_pending.pt",  # same sanitized stem as the one above: must not collide
    "000001_000_pending.pt.bak",
    "000001_000_pending_a1.pt",
    "000001_000_complete_from_dev01.pt",
    "000001_000_PENDING.pt",
    "evil name.pt",
    "evil\nname.pt",
    "999999_999_pending.pt\n",  # a regex's "$" matches before a final newline: names are matched whole
    "000001_000_complete_from_dev1.pt\n",
    "ünïcødé.pt",
    "x" * 250 + ".pt",
    "invalid_x_failed_load.pt",
]


def test_a_pending_name_with_a_trailing_newline_is_not_claimed_and_claims_do_not_spin(tmp_path, monkeypatch):
    q = JobQueue(RunDir.create(tmp_path / "run"))
    _write(q.run.queue / (pending_name(OTHER) + "\n"), b"junk")
    scans = []
    real_scan = q.scan

    def counted_scan():
        scans.append(1)
        assert len(scans) < 100, "claim() rescans the queue without end"
        return real_scan()

    monkeypatch.setattr(q, "scan", counted_scan)
    assert q.claim(1) is None
    assert len(scans) == 1
    [action] = q.recover()
    assert action.what == "archive" and done_reason(action.dst.removeprefix("done/")) is ArchiveReason.FAILED_LOAD
    assert entries(q.run.queue) == set()


def test_recover_archives_names_outside_the_grammar_under_sanitized_names(tmp_path, caplog):
    caplog.set_level(logging.INFO, logger=LOGGER)
    q = JobQueue(RunDir.create(tmp_path / "run"))
    real_result(q, GOOD, text="good")
    queue = q.run.queue
    for i, name in enumerate(JUNK_NAMES):
        _write(queue / name, f"junk {i}".encode())
    raw = os.path.join(os.fsencode(queue), b"evil\xff.pt")  # not valid UTF-8
    fd = os.open(raw, os.O_WRONLY | os.O_CREAT | os.O_EXCL)
    os.write(fd, b"junk bytes name")
    os.close(fd)
    os.mkdir(queue / "junkdir")
    _write(queue / "junkdir" / pending_name(OTHER), b"nested")
    outside = tmp_path / "outside.txt"
    outside.write_bytes(b"outside the run")
    os.symlink(outside, queue / "link.pt")
    os.symlink("../../outside.txt", queue / "000001_000_pending.pt~")  # relative, resolves the same from done/

    junk = entries(queue) - {complete_name(GOOD)}
    junk_fingerprints = collections.Counter(fingerprint(queue / n) for n in junk)
    assert len(junk_fingerprints) == len(junk)  # all distinct, so the comparison below is exact
    done_before = snapshot(q.run.done)

    actions = q.recover()

    assert entries(queue) == {complete_name(GOOD)}, "junk left in queue/"
    assert os.listdir(q.run.tmp) == []
    assert sorted(a.src for a in actions) == sorted(junk)
    assert all(a.what == "archive" and a.dst and a.dst.startswith("done/") for a in actions)
    done_after = snapshot(q.run.done)
    assert {n: done_after[n] for n in done_before} == done_before
    new = set(done_after) - set(done_before)
    assert len(new) == len(junk), "files not conserved"
    assert collections.Counter(done_after[n] for n in new) == junk_fingerprints, "an archive was overwritten"
    for name in new:
        assert done_reason(name) is ArchiveReason.FAILED_LOAD, name
        assert re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9_.-]*", name), f"unsanitized archive name {name!r}"
        assert len(os.fsencode(name)) <= 255
        assert os.path.dirname(os.path.abspath(q.run.done / name)) == str(q.run.done)
        assert f"done/{name}" in {a.dst for a in actions}
    assert outside.read_bytes() == b"outside the run"
    assert sorted(p.name for p in tmp_path.iterdir() if p.is_file()) == ["outside.txt"]
    logs = queue_logs(caplog)
    for name in junk:  # each named in its one line, escaped where it would break the line or the log file's encoding
        assert any("[queue]" in m and shown_name(name) in m for m in logs), name
    assert any("recover: archive 'evil\\nname.pt' -> done/" in m for m in logs), logs
    assert all("\n" not in m and m.encode() for m in logs), logs

    assert q.recover() == []  # idempotent
    results = q.collect()
    assert [(r.job_id, r.data) for r in results] == [(GOOD, {"text": "good"})]
    assert q.consume(results[0])
    assert os.listdir(queue) == [".tmp"]


def test_an_oversized_result_is_archived_unread_and_the_next_one_collected(tmp_path, caplog):
    import resource

    cap = demo_config(tmp_path).max_payload_bytes
    assert 64 << 20 < cap < 128 << 20  # the demo's: 64 MB and 32 rows of (8 + 4096) tokens at 64 bytes
    q = JobQueue(RunDir.create(tmp_path / "run"), max_payload_bytes=cap)
    real_result(q, GOOD, text="good")
    huge = q.run.queue / complete_name(BAD)
    with open(huge, "wb") as f:
        f.truncate(20 << 30)  # a sparse 20 GB file: reading it would take 20 GB of memory
    peak_kb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    results = q.collect()
    assert resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - peak_kb < 200_000  # never read
    assert [(r.job_id, r.data) for r in results] == [(GOOD, {"text": "good"})]
    [archived] = [n for n in os.listdir(q.run.done) if n.startswith(BAD)]
    assert done_reason(archived) is ArchiveReason.FAILED_LOAD
    assert any("21,474.8 MB, over the" in m and "--max_payload_mb" in m for m in queue_logs(caplog))
    assert q.collect() == []  # archived once: a restarted PS does not meet it again
