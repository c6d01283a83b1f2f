"""The queue protocol in one process: claim order, fencing, no-clobber collect/consume/archive,
and recovery. Leases expire by back-dating mtimes, never by sleeping."""

import hashlib
import os
import socket
import subprocess
import sys

import pytest
from helpers import backdate, result_payload

from asyncgrpo.jobqueue import ArchiveReason, CollectedResult, JobQueue, make_job_id
from asyncgrpo.jobqueue.names import done_reason
from asyncgrpo.run import WorkerAlreadyRunning, WorkerPresence, fileops

LEASE_S = 30.0


def queue_files(run):
    return sorted(n for n in os.listdir(run.queue) if n != ".tmp")


def done_files(run):
    return sorted(os.listdir(run.done))


def sha(path):
    return hashlib.sha256(open(path, "rb").read()).hexdigest()


def test_claim_is_fifo_by_job_id(queue):
    for step, index in [(3, 0), (1, 1), (2, 0), (1, 0)]:
        queue.put_job(make_job_id(step, index), {"i": (step, index)}, created_step=step)
    order = []
    while (job := queue.claim(device=1)) is not None:
        order.append(job.job_id)
    assert order == ["000001_000", "000001_001", "000002_000", "000003_000"]


def test_put_job_never_overwrites(queue):
    queue.put_job("000001_000", {"first": True}, created_step=1)
    with pytest.raises(FileExistsError):
        queue.put_job("000001_000", {"first": False}, created_step=1)
    assert queue.claim(1).data == {"first": True}
    assert os.listdir(queue.run.tmp) == []


def test_full_lifecycle_archives_every_file(queue, run):
    queue.put_job("000001_000", {"prompt": "3:"}, created_step=1)
    job = queue.claim(device=2)
    assert queue_files(run) == ["000001_000_processing_by_dev2.pt"]
    assert queue.complete(job, {"text": "333"}, weights_version=5)
    assert queue_files(run) == ["000001_000_complete_from_dev2.pt"]
    [result] = queue.collect()
    assert result.payload["weights_version"] == 5 and result.data == {"text": "333"}
    assert result.payload["worker_device"] == 2 and result.attempt == 1
    assert queue_files(run) == ["000001_000_collected.pt"]
    assert queue.consume(result)
    assert queue_files(run) == []
    assert done_files(run) == ["000001_000_consumed.pt", "000001_000_processed.pt"]


def test_fenced_out_worker_drops_its_result(queue, run, caplog):
    queue.put_job("000001_000", {}, created_step=1)
    slow = queue.claim(device=1)
    # Its job is recovered while it runs (as if its lease expired) and done by another worker.
    assert [a.what for a in queue.recover(own_device=1)] == ["requeue"]
    fast = queue.claim(device=2)
    assert fast.attempt == 2
    assert queue.complete(fast, {"by": 2}, weights_version=0)
    assert not queue.complete(slow, {"by": 1}, weights_version=0)
    assert "dropping its result" in caplog.text
    assert queue_files(run) == ["000001_000_complete_from_dev2.pt"]
    assert os.listdir(run.tmp) == []
    [result] = queue.collect()
    assert result.data == {"by": 2} and result.attempt == 2
    assert done_files(run) == ["000001_000_processed_a2.pt"]


def test_two_results_for_one_job_one_consumed_one_duplicate(queue, run):
    job_id = "000004_002"
    first, second = run.queue / f"{job_id}_complete_from_dev1.pt", run.queue / f"{job_id}_complete_from_dev2.pt"
    fileops.write_payload(run.tmp, first, result_payload(job_id, 1, marker="one"))
    fileops.write_payload(run.tmp, second, result_payload(job_id, 2, marker="two"))
    digests = {sha(first), sha(second)}
    results = queue.collect()
    assert len(results) == 1
    assert queue.consume(results[0])
    assert queue_files(run) == []
    reasons = sorted(done_reason(n).value for n in done_files(run))
    assert reasons == ["consumed", "duplicate"]
    assert {sha(run.done / n) for n in done_files(run)} == digests  # both kept, nothing overwritten


def test_late_result_after_consumption_is_a_duplicate(queue, run):
    job_id = "000004_002"
    fileops.write_payload(run.tmp, run.queue / f"{job_id}_complete_from_dev1.pt", result_payload(job_id, 1))
    [result] = queue.collect()
    assert queue.consume(result)
    fileops.write_payload(run.tmp, run.queue / f"{job_id}_complete_from_dev3.pt", result_payload(job_id, 3))
    assert queue.collect() == []
    assert sorted(done_reason(n).value for n in done_files(run)) == ["consumed", "duplicate"]


def test_consume_is_at_most_once_per_job_id(queue, run):
    job_id = "000001_000"
    fileops.write_payload(run.tmp, run.queue / f"{job_id}_complete_from_dev1.pt", result_payload(job_id, 1))
    [result] = queue.collect()
    assert queue.consume(result)
    # A second copy reaches consume() without going through collect()'s check (a PS that
    # restarted and re-adopted a collected file): the done/ archive still refuses it.
    copy = run.queue / f"{job_id}_collected.pt"
    fileops.write_payload(run.tmp, copy, result_payload(job_id, 2))
    assert not queue.consume(CollectedResult(job_id, copy, result_payload(job_id, 2)))
    assert sorted(done_reason(n).value for n in done_files(run)) == ["consumed", "duplicate"]


def test_results_consumed_after_the_resumed_checkpoint_come_back_to_be_trained_again(run):
    from asyncgrpo.events import EventLog, read_events

    queue = JobQueue(run, events=EventLog(run.logs, "ps", "ps", "cpu"))
    for job_id in ("000001_000", "000002_000"):
        fileops.write_payload(run.tmp, run.queue / f"{job_id}_complete_from_dev1.pt", result_payload(job_id, 1))
    for result in queue.collect():
        assert queue.consume(result)
    # The PS resumes from a checkpoint whose ledger holds only the first: the second's training was lost.
    assert queue.roll_back_consumed({"000001_000"}) == ["000002_000"]
    assert queue_files(run) == ["000002_000_collected.pt"] and done_files(run) == ["000001_000_consumed.pt"]
    # Said in the timeline: the report counts what done/ holds (queue_tools/report.py)
    assert [e["job_id"] for e in read_events(run.root, event="result_rolled_back")] == ["000002_000"]
    [result] = queue.collect(readopt=True)
    assert result.job_id == "000002_000" and queue.consume(result)
    assert queue.roll_back_consumed({"000001_000", "000002_000"}) == []


def test_a_consume_cut_between_link_and_unlink_is_trained_again(queue, run):
    job_id = "000003_000"
    collected = run.queue / f"{job_id}_collected.pt"
    fileops.write_payload(run.tmp, collected, result_payload(job_id, device=1))
    os.link(collected, run.done / f"{job_id}_consumed.pt")  # the old PS died here, before the unlink
    assert queue.roll_back_consumed(set()) == [job_id]  # the checkpoint's ledger does not have the job
    assert os.listdir(run.done) == [] and collected.stat().st_nlink == 1
    [result] = queue.collect(readopt=True)  # no longer looks consumed: it is trained on again
    assert result.job_id == job_id


def test_a_second_result_waiting_collected_does_not_keep_a_consumed_one_from_coming_back(queue, run):
    """The job was consumed after the checkpoint; a second result of it was collected, and the PS died before
    archiving that one duplicate. The consumed one's training was lost with that PS: it must come back to be trained
    again, and the second result go as a duplicate. Kept in done/, the job would never be trained."""
    job_id = "000004_000"
    fileops.write_payload(run.tmp, run.queue / f"{job_id}_complete_from_dev1.pt", result_payload(job_id, 1))
    [result] = queue.collect()
    assert queue.consume(result)
    fileops.write_payload(run.tmp, run.queue / f"{job_id}_collected.pt", result_payload(job_id, 2))
    assert queue.roll_back_consumed(set()) == [job_id]
    assert done_files(run) == [f"{job_id}_duplicate.pt"] and queue_files(run) == [f"{job_id}_collected.pt"]
    [again] = queue.collect(readopt=True)
    assert again.payload["worker_device"] == 1 and queue.consume(again)


def test_a_job_has_files_while_queued_and_once_archived_only_then(queue, run):
    queue.put_job("000005_001", {}, created_step=5)
    assert queue.active_job_ids() == {"000005_001"} and queue.has_files_of("000005_001")
    job = queue.claim(device=1)
    queue.complete(job, {}, weights_version=0)
    [result] = queue.collect()
    assert queue.consume(result)
    assert queue.active_job_ids() == set() and queue.has_files_of("000005_001")  # its files are in done/
    # A file outside the grammar whose name merely starts with a job id is not that job's.
    (run.done / "000005_000_notes.txt").write_bytes(b"")
    assert not queue.has_files_of("000005_000")


def test_archive_never_overwrites(queue, run):
    for i in range(3):
        path = run.queue / f"junk{i}"
        path.write_text(str(i))
        queue.archive(path, "000001_000", ArchiveReason.FAILED)
    assert done_files(run) == ["000001_000_failed.1.pt", "000001_000_failed.2.pt", "000001_000_failed.pt"]
    assert sorted((run.done / n).read_text() for n in done_files(run)) == ["0", "1", "2"]


def test_live_worker_keeps_its_job_until_its_heartbeat_is_stale(queue, run):
    queue.put_job("000001_000", {}, created_step=1)
    presence = WorkerPresence(run, 1).start()
    try:
        job = queue.claim(1)
        presence.update(job_id=job.job_id, state="busy")
        presence.beat()  # what the next heartbeat tick writes
        assert queue.recover(lease_s=LEASE_S) == []
        backdate(run.workers / "dev1.json", 2 * LEASE_S)
        backdate(job.path, 2 * LEASE_S)
        [action] = queue.recover(lease_s=LEASE_S)
        assert action.what == "requeue" and "heartbeat" in action.why
        assert queue_files(run) == ["000001_000_pending_a2.pt"]
    finally:
        presence.stop()


def test_leftover_of_a_live_worker_that_moved_on_is_recovered(queue, run):
    queue.put_job("000001_000", {}, created_step=1)
    queue.put_job("000001_001", {}, created_step=1)
    presence = WorkerPresence(run, 1).start()
    try:
        old, new = queue.claim(1), queue.claim(1)
        presence.update(job_id=new.job_id)
        presence.beat()  # what the next heartbeat tick writes
        assert queue.recover(lease_s=LEASE_S) == []  # young file: the claim may just have happened
        backdate(old.path, 2 * LEASE_S)
        [action] = queue.recover(lease_s=LEASE_S)
        assert action.job_id == old.job_id and "moved on" in action.why
    finally:
        presence.stop()


def test_every_job_a_live_worker_holds_for_one_generate_call_is_left_to_it(queue, run):
    queue.put_job("000001_000", {}, created_step=1)
    queue.put_job("000001_001", {}, created_step=1)
    presence = WorkerPresence(run, 1).start()
    try:
        first, second = queue.claim(1), queue.claim(1)  # --jobs_per_generate 2: one call generates both
        presence.update(job_id=first.job_id, job_ids=[first.job_id, second.job_id])
        presence.beat()
        backdate(first.path, 2 * LEASE_S)  # a long call: both files older than the lease
        backdate(second.path, 2 * LEASE_S)
        assert queue.recover(lease_s=LEASE_S) == []
    finally:
        presence.stop()


def test_a_job_held_past_its_deadline_and_the_lease_is_recovered_whatever_the_heartbeat_says(queue, run):
    """The backstop for a worker that cannot act on its own deadline (worker/deadline.py): alive, beating, naming
    the job, and still it comes back once held past --job_timeout_s and the lease."""
    queue.put_job("000001_000", {}, created_step=1)
    presence = WorkerPresence(run, 1).start()
    try:
        job = queue.claim(1)
        presence.update(job_id=job.job_id, job_ids=[job.job_id], state="busy")
        presence.beat()
        backdate(job.path, 100 + LEASE_S - 1)  # not yet past both
        assert queue.recover(lease_s=LEASE_S, job_timeout_s=100) == []
        backdate(job.path, 100 + LEASE_S + 1)
        assert queue.recover(lease_s=LEASE_S) == []  # without a deadline: the live worker keeps it
        [action] = queue.recover(lease_s=LEASE_S, job_timeout_s=100)
        assert action.what == "requeue" and "past its deadline (--job_timeout_s 100)" in action.why
        assert queue_files(run) == ["000001_000_pending_a2.pt"]
        assert not queue.complete(job, {}, weights_version=0)  # its late result is fenced out
    finally:
        presence.stop()


def test_the_jobs_a_process_holds_are_those_it_claimed_and_has_not_ended(queue, run):
    for i in range(4):
        queue.put_job(f"000001_00{i}", {}, created_step=1)
    jobs = [queue.claim(1) for _ in range(4)]
    assert [j.job_id for j in queue.held()] == [j.job_id for j in jobs]
    assert queue.complete(jobs[0], {}, weights_version=0)
    assert queue.fail(jobs[1], {"type": "E"}, max_attempts=3, weights_version=0)
    assert queue.release(jobs[2])
    assert [j.job_id for j in queue.held()] == [jobs[3].job_id]


def test_a_job_recovered_between_claim_rename_and_lease_start_is_let_go(queue, run, monkeypatch):
    """Until the claim sets its mtime, a processing file carries the job's creation time; a PS
    recovery then, while the heartbeat still names the worker's previous job, requeues it."""
    queue.put_job("000001_000", {}, created_step=1)
    queue.put_job("000001_001", {}, created_step=1)
    backdate(run.queue / "000001_000_pending.pt", 2 * LEASE_S)  # it waited longer than a lease
    presence = WorkerPresence(run, 1).start()
    real_stamp_now = fileops.stamp_now
    ps_side = JobQueue(run)

    def recovery_runs_first(path):
        if "_processing_" not in os.fspath(path):
            return real_stamp_now(path)  # a heartbeat
        monkeypatch.setattr(fileops, "stamp_now", real_stamp_now)
        [action] = ps_side.recover(lease_s=LEASE_S)
        assert action.what == "requeue" and "moved on" in action.why
        return real_stamp_now(path)

    try:
        presence.update(job_id="000000_009")  # the job it finished before
        presence.beat()
        monkeypatch.setattr(fileops, "stamp_now", recovery_runs_first)
        job = queue.claim(1)
        assert job.job_id == "000001_001"  # it let the recovered one go and took the next
        assert queue_files(run) == ["000001_000_pending_a2.pt", "000001_001_processing_by_dev1.pt"]
    finally:
        presence.stop()


def test_dead_worker_jobs_requeue_then_orphan_after_max_attempts(queue, run):
    queue.put_job("000001_000", {}, created_step=1)
    for attempt in (1, 2):
        job = queue.claim(device=attempt)
        assert job.attempt == attempt
        [action] = queue.recover(lease_s=LEASE_S, max_attempts=3)  # no worker holds dev lock: dead
        assert action.what == "requeue"
    job = queue.claim(device=3)
    [action] = queue.recover(lease_s=LEASE_S, max_attempts=3)
    assert action.what == "archive" and "attempt 3 of 3" in action.why
    assert queue_files(run) == []
    assert done_files(run) == ["000001_000_orphaned_a3.pt"]


def test_existing_result_wins_over_requeue(queue, run):
    queue.put_job("000001_000", {}, created_step=1)
    job = queue.claim(device=1)
    fence = run.queue / "000001_000_committing_by_dev1.pt"
    fileops.move(job.path, fence)  # the worker fenced, published, then died before archiving
    fileops.write_payload(run.tmp, run.queue / "000001_000_complete_from_dev1.pt", result_payload(job.job_id, 1))
    [action] = queue.recover(lease_s=LEASE_S)
    assert action.what == "archive" and "result exists" in action.why
    assert done_files(run) == ["000001_000_processed.pt"]
    assert queue_files(run) == ["000001_000_complete_from_dev1.pt"]


TAKEN_AS = [ArchiveReason.STALE, ArchiveReason.FILTERED, ArchiveReason.FAILED]


@pytest.mark.parametrize("taken_as", TAKEN_AS)
def test_a_result_the_ps_archived_stale_filtered_or_failed_wins_over_requeue(queue, run, taken_as):
    """The worker published and died before archiving its job; the PS collected the result and archived it stale (its
    prompts thrown again in new jobs), filtered (every group dropped) or failed (a failure report) before recovery
    ran. Its job going back to pending would be generated and trained again (seen in the chaos test); a report's
    job archived orphaned would count its drop twice."""
    queue.put_job("000001_000", {}, created_step=1)
    queue.claim(device=1)
    queue.recover(lease_s=LEASE_S)  # its first worker died too: this is attempt 2
    job = queue.claim(device=2)
    assert job.attempt == 2
    fileops.move(job.path, run.queue / "000001_000_committing_by_dev2_a2.pt")
    fileops.write_payload(run.tmp, run.queue / "000001_000_complete_from_dev2.pt", result_payload(job.job_id, 2, 2))
    [collected] = queue.collect()
    queue.archive_if_present(collected.path, collected.job_id, taken_as, collected.attempt)
    [action] = queue.recover(lease_s=LEASE_S)
    assert action.what == "archive" and "result exists" in action.why, action.line()
    assert queue_files(run) == []
    assert sorted(done_files(run)) == sorted(["000001_000_processed_a2.pt", f"000001_000_{taken_as.value}_a2.pt"])


@pytest.mark.parametrize("taken_as", TAKEN_AS)
def test_a_later_attempts_result_the_ps_took_wins_over_requeue(queue, run, taken_as):
    """dev1's job failed: it published attempt 2 (fail()) and died before archiving its attempt 1. dev2 generated
    attempt 2 and the PS took its result (stale: its prompts thrown again) before recovery looked at attempt 1.
    Attempt 1 going back to pending (attempt 2's name is free again) would be generated and trained again."""
    queue.put_job("000001_000", {}, created_step=1)
    first = queue.claim(device=1)
    fileops.move(first.path, run.queue / "000001_000_committing_by_dev1.pt")
    fileops.write_payload(run.tmp, run.queue / "000001_000_pending_a2.pt", first.payload)
    second = queue.claim(device=2)
    assert second.attempt == 2
    assert queue.complete(second, {"batch": None}, weights_version=0)
    [collected] = queue.collect()
    queue.archive_if_present(collected.path, collected.job_id, taken_as, collected.attempt)
    [action] = queue.recover(lease_s=LEASE_S)
    assert action.what == "archive" and "result exists" in action.why, action.line()
    assert queue_files(run) == []


def test_recovery_is_idempotent(queue, run):
    for i in range(3):
        queue.put_job(make_job_id(1, i), {}, created_step=1)
        queue.claim(device=i)
    assert len(queue.recover(lease_s=LEASE_S)) == 3
    assert queue.recover(lease_s=LEASE_S) == []
    assert queue.counts()["pending"] == 3


def test_dry_run_changes_nothing(queue, run):
    queue.put_job("000001_000", {}, created_step=1)
    queue.claim(device=1)
    (run.tmp / "old.tmp").write_bytes(b"partial")
    backdate(run.tmp / "old.tmp", 2 * LEASE_S)
    before = (queue_files(run), os.listdir(run.tmp), done_files(run))
    actions = queue.recover(lease_s=LEASE_S, dry_run=True)
    assert sorted(a.what for a in actions) == ["reap", "requeue"]
    assert (queue_files(run), os.listdir(run.tmp), done_files(run)) == before


def test_only_old_temp_files_are_reaped(queue, run):
    (run.tmp / "young.tmp").write_bytes(b"still being written")
    (run.tmp / "old.tmp").write_bytes(b"abandoned")
    backdate(run.tmp / "old.tmp", 2 * LEASE_S)
    [action] = queue.recover(lease_s=LEASE_S)
    assert action.what == "reap" and action.src == ".tmp/old.tmp"
    assert os.listdir(run.tmp) == ["young.tmp"]


def test_the_temp_file_of_a_live_writer_is_never_reaped_whatever_its_age(queue, run):
    """queue_tools cleanup --stale-after 0 --force reaped the PS's temp file as it wrote it: the PS stopped ("cannot
    link ... No such file or directory")."""
    live = fileops.stage_bytes(run.tmp, b"being written by this live process, slowly")
    backdate(live, 2 * LEASE_S)
    assert queue.recover(lease_s=0) == []
    assert os.path.exists(live)


@pytest.mark.process
def test_a_young_temp_file_of_a_dead_writer_is_reaped_at_once(queue, run):
    gone = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    dead_pid = int(gone.stdout)  # that process has exited
    orphan = f"{fileops.HOST_ID}-{dead_pid}-{'a' * 32}.tmp"
    other_host = f"0badc0de-{dead_pid}-{'b' * 32}.tmp"  # another host's writer: only age decides
    (run.tmp / orphan).write_bytes(b"its writer was killed")
    (run.tmp / other_host).write_bytes(b"partial")
    live = os.path.basename(fileops.stage_bytes(run.tmp, b"being written by this live process"))
    actions = queue.recover(lease_s=LEASE_S)
    assert [(a.what, a.src, a.why) for a in actions] == [("reap", f".tmp/{orphan}", "temp file of a dead process")]
    assert sorted(os.listdir(run.tmp)) == sorted([other_host, live])


def test_end_of_training_recovery_archives_instead_of_requeueing(queue, run):
    queue.put_job("000001_000", {}, created_step=1)
    queue.claim(device=1)  # no process holds dev1's lock: its worker is dead
    [action] = queue.recover(lease_s=LEASE_S, requeue=False)
    assert action.what == "archive" and "training is over" in action.why
    assert queue_files(run) == [] and done_files(run) == ["000001_000_unused.pt"]


def test_worker_on_another_host_is_judged_by_heartbeat_age(queue, run):
    queue.put_job("000001_000", {}, created_step=1)
    job = queue.claim(device=7)
    fileops.write_json(run.workers / "dev7.json", {"device": 7, "pid": 1, "host": socket.gethostname() + "-other",
                                                   "job_id": job.job_id, "state": "busy"})
    assert queue.recover(lease_s=LEASE_S) == []  # no local lock, but a fresh remote heartbeat
    backdate(run.workers / "dev7.json", 2 * LEASE_S)
    [action] = queue.recover(lease_s=LEASE_S)
    assert action.what == "requeue" and "went silent: heartbeat 60s old" in action.why


def test_one_worker_per_device(run):
    first = WorkerPresence(run, 1).start()
    try:
        with pytest.raises(WorkerAlreadyRunning, match="dev1 is already running"):
            WorkerPresence(run, 1).start()
    finally:
        first.stop()
    WorkerPresence(run, 1).start().stop()  # the lock is free again


def test_release_gives_the_job_back(queue, run):
    queue.put_job("000001_000", {}, created_step=1)
    job = queue.claim(device=1)
    assert queue.release(job)
    assert queue_files(run) == ["000001_000_pending.pt"]
    assert queue.claim(device=2).job_id == "000001_000"


def test_requeued_old_job_is_claimed_before_newer_ones(queue, run):
    queue.put_job("000001_000", {}, created_step=1)
    queue.claim(device=1)
    queue.recover(lease_s=LEASE_S)  # dev1 is dead: back to pending as attempt 2
    queue.put_job("000002_000", {}, created_step=2)
    assert (queue.claim(device=2).job_id, queue.claim(device=2).job_id) == ("000001_000", "000002_000")
    assert queue.counts()["pending"] == 0
