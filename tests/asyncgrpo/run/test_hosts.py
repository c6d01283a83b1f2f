"""Workers on several hosts: worker ids of their own per host, a host id that is more than
the hostname (and can be set), liveness of a worker on another host by its heartbeat alone,
safetensors snapshots kept while a live worker reads them, polling on network filesystems,
and launch.sh --join's refusal of a directory that is not a run.

The end-to-end runs with a simulated second host are in tests/e2e/test_second_host.py."""

import os
import re
import signal
import socket
import subprocess
import sys
import time

import pytest
import torch
from helpers import (
    PROCESS_ENV,
    REPO,
    backdate,
    fill,
    heartbeat_pid,
    held_values,
    pid_alive,
    process_state,
    wait_for,
)

from asyncgrpo.jobqueue import QueueWatcher, watcher
from asyncgrpo.jobqueue.names import JobState, QueueName, parse_queue_name
from asyncgrpo.run import RunDir, WorkerAlreadyRunning, WorkerPresence, fileops, hosts
from asyncgrpo.run.hosts import HOST_ID, HOST_ID_ENV, filesystem_type, host_id, network_filesystem
from asyncgrpo.run.liveness import fs_now, list_workers, worker_status
from asyncgrpo.run.rundir import worker_id
from asyncgrpo.weights import make_publisher, make_subscriber, snapshot
from asyncgrpo.weights.snapshot import READER_LEASE_S, snapshot_dir

LEASE_S = 30.0
OTHER = "0badc0de"  # another host's id


def remote_heartbeat(run, device, *, host_id=OTHER, **fields):
    """A heartbeat as a worker on another host writes it. Its hostname is ours on purpose:
    two hosts (or containers) may share one."""
    fileops.write_json(run.heartbeat_file(device), {"device": device, "pid": dead_pid(), "host": socket.gethostname(),
                                                     "host_id": host_id, "state": "busy", **fields})


def dead_pid() -> int:
    gone = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    return int(gone.stdout)  # that process has exited


def test_a_worker_whose_lock_cannot_be_probed_is_judged_by_its_heartbeat(run, queue, monkeypatch, caplog):
    # On NFS flock is emulated with POSIX locks: the probe can fail (EBADF, ENOLCK, ...) where it works locally.
    import errno

    from asyncgrpo.run import liveness

    queue.put_job("000001_000", {}, created_step=1)
    presence = WorkerPresence(run, 1, interval_s=3600).start()  # beats once, now
    try:
        job = queue.claim(1)
        presence.update(job_id=job.job_id, job_ids=[job.job_id])
        presence.beat()

        def nfs_flock(fd, operation):
            raise OSError(errno.ENOLCK, os.strerror(errno.ENOLCK))

        monkeypatch.setattr(liveness.fcntl, "flock", nfs_flock)
        assert liveness.worker_status(run, 1, fs_now(run), LEASE_S).alive  # a fresh heartbeat
        assert queue.recover(lease_s=LEASE_S) == []
        backdate(run.heartbeat_file(1), 2 * LEASE_S)
        assert not liveness.worker_status(run, 1, fs_now(run), LEASE_S).alive
        [action] = queue.recover(lease_s=LEASE_S)
        assert action.what == "requeue" and action.job_id == job.job_id
        assert "cannot probe the worker lock" in caplog.text
    finally:
        monkeypatch.undo()
        presence.stop()


@pytest.mark.process
def test_a_process_that_exited_and_was_not_reaped_is_dead():
    from asyncgrpo.run.liveness import pid_alive as library_pid_alive

    child = subprocess.Popen(["sleep", "30"])
    try:
        assert library_pid_alive(child.pid, socket.gethostname(), HOST_ID)
        os.kill(child.pid, signal.SIGKILL)
        wait_for(lambda: process_state(child.pid) == "Z", "the killed child to be a zombie (not reaped)", 10,
                 poll_s=0.01)
        assert not library_pid_alive(child.pid, socket.gethostname(), HOST_ID)
    finally:
        child.kill()
        child.wait()


# ---------------------------------------------------------------------- identities


def test_worker_1_of_two_hosts_has_names_of_its_own():
    here, joined = worker_id(1), worker_id(1, "3f9a2c1d")
    assert (here, joined) == (1, "1.3f9a2c1d")
    job = QueueName("000042_003")
    names = {w: [job.moved_to(s, w).filename for s in (JobState.PROCESSING, JobState.COMMITTING, JobState.COMPLETE)]
             for w in (here, joined)}
    assert names[joined] == ["000042_003_processing_by_dev1.3f9a2c1d.pt", "000042_003_committing_by_dev1.3f9a2c1d.pt",
                             "000042_003_complete_from_dev1.3f9a2c1d.pt"]
    assert not set(names[here]) & set(names[joined])
    for name in names[here] + names[joined]:  # the grammar parses both, old names as before
        assert parse_queue_name(name).filename == name
    assert parse_queue_name("000042_003_processing_by_dev1.pt").device == 1
    assert parse_queue_name("000042_003_processing_by_dev1.3f9a2c1d_a2.pt").device == "1.3f9a2c1d"
    assert parse_queue_name("000042_003_processing_by_dev1.3f9a_2c1d.pt") is None  # "_" is the separator
    assert parse_queue_name("000042_003_processing_by_dev1.pt.pt").device == "1.pt"  # a tag like any other


def test_results_of_two_hosts_workers_for_one_job_sort_without_error():
    # A job recovered from a worker that had fenced it gets two results; collect sorts them.
    names = [parse_queue_name("000001_000_complete_from_dev1.3f9a2c1d.pt"),
             parse_queue_name("000001_000_complete_from_dev2.pt"), parse_queue_name("000000_009_pending.pt")]
    assert [n.filename for n in sorted(names)] == [
        "000000_009_pending.pt", "000001_000_complete_from_dev1.3f9a2c1d.pt", "000001_000_complete_from_dev2.pt"]


def test_two_hosts_worker_1_claims_complete_and_beat_side_by_side(run, queue):
    joined = worker_id(1, OTHER)
    for i in range(2):
        queue.put_job(f"000001_00{i}", {}, created_step=1)
    here = WorkerPresence(run, 1).start()
    there = WorkerPresence(run, joined).start()  # no clash over the lock or the heartbeat
    try:
        jobs = [queue.claim(1), queue.claim(joined)]
        assert [j.path.name for j in jobs] == ["000001_000_processing_by_dev1.pt",
                                               f"000001_001_processing_by_dev1.{OTHER}.pt"]
        for job in jobs:
            assert queue.complete(job, {}, weights_version=0)
        assert sorted(n.filename for n in queue.scan()[0]) == [
            "000001_000_complete_from_dev1.pt", f"000001_001_complete_from_dev1.{OTHER}.pt"]
        assert [w.device for w in list_workers(run, fs_now(run), LEASE_S)] == [1, joined]
    finally:
        here.stop(), there.stop()


# ---------------------------------------------------------------------- host id


HOST_ID_RE = r"[0-9a-f]{8}"  # a hashed host id: 8 hex digits, no "_", "-" or "." (the file names' separators)
MACHINE = {"hostname": "gpu07", "boot_id": "5e0f3c2a-8d1b-4f6e-9a7c-0b1d2e3f4a5b", "pid_namespace": "pid:[4026531836]"}


def host_id_of(monkeypatch, environ=None, **identity) -> str:
    """host_id() on a machine of this identity (MACHINE, changed by ``identity``): its hostname, the kernel's
    boot id and this process's PID namespace, as the module reads them."""
    machine = {**MACHINE, **identity}
    real_readlink = os.readlink
    monkeypatch.setattr(hosts.socket, "gethostname", lambda: machine["hostname"])
    monkeypatch.setattr(hosts, "_read", lambda path: machine["boot_id"] if path.endswith("/boot_id") else "")
    monkeypatch.setattr(hosts.os, "readlink", lambda path: machine["pid_namespace"] if path == "/proc/self/ns/pid"
                        else real_readlink(path))
    return host_id({} if environ is None else environ)


@pytest.mark.process
def test_the_host_id_is_8_hex_digits_the_same_in_every_process_of_the_host():
    machine = host_id({})  # this machine's own id, whatever ASYNCGRPO_HOST_ID says here
    assert re.fullmatch(HOST_ID_RE, machine), machine
    assert host_id(os.environ) == HOST_ID  # computed again: the same
    env = {k: v for k, v in PROCESS_ENV.items() if k != HOST_ID_ENV}
    other_process = subprocess.run([sys.executable, "-c", "from asyncgrpo.run.hosts import HOST_ID; print(HOST_ID)"],
                                   capture_output=True, text=True, cwd=REPO, env=env, check=True)
    assert other_process.stdout.strip() == machine
    # It names the host in a worker's file names, and the queue's grammar reads it back.
    device = worker_id(1, machine)
    name = QueueName("000042_003").moved_to(JobState.PROCESSING, device).filename
    assert parse_queue_name(name).device == device


def test_the_host_id_is_the_hostname_the_boot_and_the_pid_namespace(monkeypatch):
    here = host_id_of(monkeypatch)
    assert re.fullmatch(HOST_ID_RE, here) and host_id_of(monkeypatch) == here  # the same machine: the same id
    # Another machine of the same name (another boot id), a container on this one (its own PID namespace, the
    # same hostname), another hostname on the same kernel: each is another host.
    others = [host_id_of(monkeypatch, boot_id="0d9e8f7a-6b5c-4d3e-2f1a-0b9c8d7e6f5a"),
              host_id_of(monkeypatch, pid_namespace="pid:[4026532290]"),
              host_id_of(monkeypatch, hostname="gpu08")]
    assert len({here, *others}) == 4, (here, others)


def test_the_environment_variable_overrides_the_host_id(monkeypatch):
    # Letters and digits (at most 16) are the id as they are, whatever the machine.
    for plain in ("node07", "A" * 16):
        assert host_id_of(monkeypatch, {HOST_ID_ENV: plain}) == plain
        assert host_id_of(monkeypatch, {HOST_ID_ENV: plain}, hostname="other") == plain
    # Anything else is hashed: 8 hex digits, the same for the same value on any machine, others for others.
    for unsafe in ("gpu-node_07", "rack1.node7", "A" * 17):
        hashed = host_id_of(monkeypatch, {HOST_ID_ENV: unsafe})
        assert re.fullmatch(HOST_ID_RE, hashed), (unsafe, hashed)
        assert host_id_of(monkeypatch, {HOST_ID_ENV: unsafe}, hostname="other", boot_id="other") == hashed
        assert hashed not in (host_id_of(monkeypatch, {HOST_ID_ENV: unsafe + "x"}), host_id_of(monkeypatch))
    assert host_id_of(monkeypatch, {HOST_ID_ENV: ""}) == host_id_of(monkeypatch)  # empty: not set


@pytest.mark.process
def test_a_process_in_another_pid_namespace_has_another_host_id():
    """A real second PID namespace (what a container has), with the same hostname and kernel. Needs unshare:
    as root, or with unprivileged user namespaces."""
    code = "from asyncgrpo.run.hosts import HOST_ID; print(HOST_ID)"
    env = {k: v for k, v in PROCESS_ENV.items() if k != HOST_ID_ENV}
    failures = []
    for unshare in (["unshare", "-p", "-f", "--mount-proc"],
                    ["unshare", "--user", "--map-root-user", "-p", "-f", "--mount-proc"]):
        try:
            there = subprocess.run([*unshare, sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO,
                                   env=env, timeout=120)
        except OSError as err:
            failures.append(f"{' '.join(unshare)}: {err}")
            continue
        if there.returncode == 0:
            assert re.fullmatch(HOST_ID_RE, there.stdout.strip()) and there.stdout.strip() != host_id({})
            return
        failures.append(f"{' '.join(unshare)}: {there.stderr.strip()[-200:]}")
    pytest.skip(f"unshare cannot make a PID namespace here ({'; '.join(failures)})")


@pytest.mark.process
def test_the_environment_variable_names_the_host_of_a_process(run):
    env = {**PROCESS_ENV, "ASYNCGRPO_HOST_ID": "node07"}
    code = ("from asyncgrpo.run import fileops; from asyncgrpo.run.hosts import HOST_ID; "
            f"print(HOST_ID, fileops.stage_bytes({str(run.tmp)!r}, b'x'))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO, env=env, check=True)
    host, temp_file = out.stdout.split()
    assert host == "node07" and os.path.basename(temp_file).startswith("node07-")


# ---------------------------------------------------------------------- liveness


@pytest.mark.process
def test_a_worker_on_another_host_is_alive_while_it_beats_whatever_its_pid(run, queue):
    device = worker_id(1, OTHER)
    queue.put_job("000001_000", {}, created_step=1)
    job = queue.claim(device)
    remote_heartbeat(run, device, job_id=job.job_id)  # our hostname, a pid dead here, no lock held
    status = worker_status(run, device, fs_now(run), LEASE_S)
    assert status.alive and status.remote and status.job_id == job.job_id
    assert queue.recover(lease_s=LEASE_S) == []
    backdate(run.heartbeat_file(device), 2 * LEASE_S)
    assert not worker_status(run, device, fs_now(run), LEASE_S).alive
    [action] = queue.recover(lease_s=LEASE_S)
    assert action.what == "requeue" and action.why == (
        f"worker dev1.{OTHER} on host {status.host} went silent: heartbeat 60s old (lease 30s)")


@pytest.mark.process
def test_a_worker_of_this_host_is_judged_by_its_lock_at_once(run, queue):
    queue.put_job("000001_000", {}, created_step=1)
    job = queue.claim(1)
    remote_heartbeat(run, 1, host_id=HOST_ID, job_id=job.job_id)  # fresh, but nobody holds dev1's lock
    assert not worker_status(run, 1, fs_now(run), LEASE_S).alive
    [action] = queue.recover(lease_s=LEASE_S)
    assert action.why == "worker dev1 is dead"


@pytest.mark.process
def test_temp_files_of_another_host_are_judged_by_age_alone(run, queue):
    pid = dead_pid()
    mine, theirs = f"{HOST_ID}-{pid}-{'a' * 32}.tmp", f"{OTHER}-{pid}-{'b' * 32}.tmp"
    for name in (mine, theirs):
        (run.tmp / name).write_bytes(b"x")
    assert [a.src for a in queue.recover(lease_s=LEASE_S)] == [f".tmp/{mine}"]
    backdate(run.tmp / theirs, 2 * LEASE_S)
    assert [a.src for a in queue.recover(lease_s=LEASE_S)] == [f".tmp/{theirs}"]


@pytest.mark.process
def test_a_worker_id_beating_on_another_host_is_not_started_twice(run):
    remote_heartbeat(run, 1, state="idle")
    with pytest.raises(WorkerAlreadyRunning, match="from host .* heartbeat 0s ago.*launch.sh --join"):
        WorkerPresence(run, 1, lease_s=LEASE_S).start()
    assert os.path.exists(run.worker_lock_file(1))
    backdate(run.heartbeat_file(1), 2 * LEASE_S)  # that worker is gone
    WorkerPresence(run, 1, lease_s=LEASE_S).start().stop()


def test_claims_and_fences_are_stamped_by_the_filesystem_clock(run, queue, monkeypatch):
    """A worker whose clock is 10 s behind stamps no claim or fence 10 s old. (A heartbeat is a new
    file, stamped by the filesystem when written; its extra utime matters where a client caches
    writes, on NFS, and is not tested here.)"""
    real_time = time.time
    monkeypatch.setattr(time, "time", lambda: real_time() - 10.0)
    queue.put_job("000001_000", {}, created_step=1)
    presence = WorkerPresence(run, 1, interval_s=3600).start()
    try:
        job = queue.claim(1)
        assert fs_now(run) - os.stat(job.path).st_mtime < 5, "the claim was stamped with the local clock"
        assert queue.complete(job, {}, weights_version=0)
        fence = run.done / "000001_000_processed.pt"  # the fenced file, archived: a link keeps its mtime
        assert fs_now(run) - os.stat(fence).st_mtime < 5, "the fence was stamped with the local clock"
        assert time.time() < fs_now(run) - 9  # the clock really was off
    finally:
        presence.stop()


# ---------------------------------------------------------------------- safetensors snapshots


def tiny_model(value: int) -> torch.nn.Module:
    model = torch.nn.Linear(4, 4)
    fill(model, value)
    return model


def snapshots(run) -> list[str]:
    return sorted(n for n in os.listdir(snapshot_dir(run)) if not n.startswith("."))


@pytest.mark.process
def test_a_snapshot_a_live_worker_reads_is_kept(run, monkeypatch):
    monkeypatch.setattr(snapshot, "ANCHOR_EVERY", 1)  # every version an anchor, the start of a chain
    publisher = make_publisher(run, tiny_model(1), "safetensors")
    presence = WorkerPresence(run, 1, interval_s=3600).start()
    try:
        publisher.publish(1, 1)
        presence.announce_read((publisher.publisher_id, 1))
        remote_heartbeat(run, worker_id(1, OTHER), reading=[publisher.publisher_id, 2], state="idle")
        for version in range(2, 6):
            publisher.publish(version, version)
        # the newest two, and the two a local and a remote live worker are reading
        assert snapshots(run) == [f"v0000000{v}.safetensors" for v in (1, 2, 4, 5)]
        presence.announce_read(None)
        presence.beat()
        backdate(run.heartbeat_file(worker_id(1, OTHER)), 2 * READER_LEASE_S)  # that worker went silent
        publisher.publish(6, 6)
        assert snapshots(run) == ["v00000005.safetensors", "v00000006.safetensors"]
    finally:
        presence.stop()
        publisher.close()


def test_a_reader_announces_each_snapshot_before_opening_it(run):
    publisher = make_publisher(run, tiny_model(3), "safetensors")
    announced = []

    def on_read(snapshot):
        if snapshot is not None:
            assert os.path.exists(snapshot_dir(run) / f"v{snapshot[1]:08d}.safetensors")
        announced.append(snapshot)

    subscriber = make_subscriber(run, on_read=on_read)
    worker = tiny_model(0)
    try:
        publisher.publish(7, 7)
        assert subscriber.sync(worker) == 7 and held_values(worker) == [3.0]
        assert announced == [(publisher.publisher_id, 7), None]
    finally:
        subscriber.close()
        publisher.close()


def test_a_snapshot_deleted_under_a_reader_sends_it_to_the_newer_one(run, monkeypatch):
    publisher = make_publisher(run, tiny_model(4), "safetensors")
    subscriber = make_subscriber(run)  # announces nothing: the PS does not know it reads v1
    worker = tiny_model(0)

    def open_after_the_ps_moved_on(path, *args, **kwargs):
        if str(path).endswith("v00000001.safetensors"):  # the PS publishes and prunes meanwhile
            fill(publisher.model, 5)
            publisher.publish(2, 2), publisher.publish(3, 3)
        return open(path, *args, **kwargs)

    try:
        publisher.publish(1, 1)
        monkeypatch.setattr(snapshot, "open", open_after_the_ps_moved_on, raising=False)
        assert subscriber.sync(worker) == 3 and held_values(worker) == [5.0]
    finally:
        subscriber.close()
        publisher.close()


def test_a_worker_on_another_host_says_in_one_line_that_it_needs_safetensors(run):
    """It would wait for weights for the whole run: its sync raises, for the worker to exit 2 with the line."""
    from asyncgrpo.weights import WeightsOutOfReach

    publisher = make_publisher(run, tiny_model(1), "mmap")
    try:
        publisher.publish(1, 1)
        version_file = run.weights / "published_version.json"
        fileops.write_json(version_file, {**fileops.read_json(version_file), "host_id": OTHER})
        subscriber = make_subscriber(run)
        worker = tiny_model(0)
        with pytest.raises(WeightsOutOfReach) as out_of_reach:
            subscriber.sync(worker)
        assert held_values(worker) == [0.0]
        assert str(out_of_reach.value) == (
            f"the parameter server on host {socket.gethostname()} publishes its weights through mmap, which only its "
            "own host can read: workers on other hosts need the PS started with --weight_transport safetensors")
        subscriber.close()
    finally:
        publisher.close()


# ---------------------------------------------------------------------- polling


MOUNTS = """\
/dev/vda / ext4 rw,relatime 0 0
server:/export /mnt/shared nfs4 rw,hard,lookupcache=positive 0 0
tmpfs /mnt/shared/scratch tmpfs rw 0 0
sshfs#me@box: /mnt/my\\040box fuse.sshfs rw 0 0
fuse-overlayfs /var/lib/overlay fuse.fuse-overlayfs rw 0 0
"""


@pytest.mark.parametrize("path, kind, network", [
    ("/home/me/runs", "ext4", None),
    ("/mnt/shared/runs/r1", "nfs4", "nfs4"),
    ("/mnt/shared", "nfs4", "nfs4"),
    ("/mnt/sharedother", "ext4", None),
    ("/mnt/shared/scratch/r1", "tmpfs", None),
    ("/mnt/my box/r1", "fuse.sshfs", "fuse.sshfs"),
    ("/var/lib/overlay/r1", "fuse.fuse-overlayfs", None),
])
def test_network_filesystems_are_told_from_the_mount_table(path, kind, network):
    assert filesystem_type(path, MOUNTS) == kind
    assert network_filesystem(path, MOUNTS) == network


def test_the_watcher_polls_on_a_network_filesystem_and_says_so(run, monkeypatch, caplog):
    assert network_filesystem(run.queue) is None
    with QueueWatcher(run.queue, {JobState.PENDING}) as local:
        assert local.use_events
    monkeypatch.setattr(watcher, "network_filesystem", lambda path: "nfs4")
    for _ in range(2):
        with QueueWatcher(run.queue, {JobState.PENDING}) as shared:
            assert not shared.use_events and shared.rescan_s == watcher.POLL_S
    lines = [r.getMessage() for r in caplog.records if "inotify cannot see" in r.getMessage()]
    assert len(lines) == 1 and "nfs4" in lines[0]


# ---------------------------------------------------------------------- launch.sh --join


@pytest.mark.process
@pytest.mark.parametrize("make", ["missing", "plain folder"])
def test_join_refuses_a_folder_that_is_not_a_run(tmp_path, make):
    target = tmp_path / "target"
    if make == "plain folder":
        target.mkdir()
    result = subprocess.run(["bash", str(REPO / "launch.sh"), "--join", str(target), "--workers", "2"], cwd=REPO,
                            env=PROCESS_ENV, capture_output=True, text=True, timeout=60)
    assert result.returncode == 2 and result.stdout == ""
    assert result.stderr == f"launch.sh: error: {target} is not an asyncgrpo run directory (no queue/ and done/ " \
                            "inside)\n"
    assert not (target / "workers").exists()


@pytest.mark.process
@pytest.mark.slow
def test_join_restarts_a_dead_worker_and_ctrl_c_stops_them(tmp_path):
    run = RunDir.create(tmp_path / "run")  # its PS has not started: the workers wait for it
    proc = subprocess.Popen(["bash", str(REPO / "launch.sh"), "--join", str(run.root), "--workers", "2",
                             "--device", "cpu"], cwd=REPO, env=PROCESS_ENV, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    one, two = worker_id(1, HOST_ID), worker_id(2, HOST_ID)
    pids = []
    try:
        first = heartbeat_pid(run.root, one, 300)
        pids += [first, heartbeat_pid(run.root, two, 300)]
        os.kill(first, signal.SIGKILL)
        pids.append(heartbeat_pid(run.root, one, 300, not_pid=first))  # restarted: it beats with its own pid
        proc.send_signal(signal.SIGINT)  # Ctrl-C
        assert proc.wait(timeout=120) == 130
    finally:
        proc.kill()
        for pid in pids:
            if pid_alive(pid):
                os.kill(pid, signal.SIGKILL)
    out = proc.stdout.read()
    assert f"worker 1 (pid {first}) exited with status 137: restarting it" in out, out  # (its own pid)
    assert "interrupted: stopping the workers" in out
    assert not [pid for pid in pids if pid_alive(pid)]
    assert sorted(p.name for p in (run.root / "logs").glob("log_worker_*")) == [
        f"log_worker_1.{HOST_ID}.txt", f"log_worker_2.{HOST_ID}.txt"]
