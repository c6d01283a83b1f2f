"""A worker on a simulated second host: its own hostname (UTS namespace) and its own /dev/shm
(mount namespace), so it cannot map the PS's weight buffers and reads safetensors snapshots;
it polls queue/ as it would on NFS. Beside a worker on the PS's host with the same device
number, it is SIGKILLed while it holds a job: the job comes back through the lease (not a
lock or a pid, which mean nothing across hosts), and every job is trained on exactly once.
With its clock 10 s behind, under launch.sh --join, it loses no job to recovery.

Skipped only where unshare cannot make the second host (it needs root)."""

import json
import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from helpers import (
    CLOCK_SKEW_DIR,
    PROCESS_ENV,
    PYTHON,
    REPO,
    RunProcesses,
    as_other_host,
    assert_exactly_once,
    expect_exit,
    ledger,
    log_tail,
    other_host_unavailable,
    run_flags,
    wait_for,
    wait_until_stopped,
)

from asyncgrpo.events import read_events

STEPS = 12
FLAGS = [*run_flags(STEPS, save_steps=4, lease_s=5), "--weight_transport", "safetensors"]
TIMEOUT_S = 300

pytestmark = pytest.mark.slow


@pytest.fixture(autouse=True)
def _second_host():
    if (why := other_host_unavailable()) is not None:
        pytest.skip(why)


def start_ps(run: RunProcesses):
    ps = run.ps()
    wait_for(lambda: (run.root / "queue").is_dir() and (run.root / "done").is_dir(), "a run to join", TIMEOUT_S,
             procs=(ps,), log=run.ps_log)
    return ps


def kill_while_holding_a_job(root: Path, worker: subprocess.Popen, ps: subprocess.Popen) -> str:
    """SIGKILLs ``worker`` (the only worker, of the joined host) at a moment it holds a job, checked
    with the process stopped; returns that job's file name."""

    def killed_holding_one() -> str | None:
        held = [n for n in os.listdir(root / "queue") if re.search(r"_(processing|committing)_by_dev1\.[0-9a-f]{8}", n)]
        if not held:
            return None
        os.kill(worker.pid, signal.SIGSTOP)
        wait_until_stopped(worker, TIMEOUT_S, poll_s=0.001)
        if still := [n for n in held if (root / "queue" / n).exists()]:
            os.kill(worker.pid, signal.SIGKILL)
            worker.wait()
            return still[0]
        os.kill(worker.pid, signal.SIGCONT)  # it finished that one meanwhile: wait for the next
        return None

    # The PS must not finish first: the second host's worker holds a job of its own name before that.
    return wait_for(killed_holding_one, "the second host's worker to hold a job", TIMEOUT_S, procs=(worker, ps),
                    poll_s=0.005)


def wait_for_ps(ps: subprocess.Popen, workers: list[subprocess.Popen], log: Path) -> int:
    """The PS's exit status; fails at once if a worker exits first (the PS would wait for it forever)."""
    wait_for(lambda: ps.poll() is not None, "the PS to finish", TIMEOUT_S, procs=workers, log=log, poll_s=0.1)
    return ps.returncode


def heartbeats(root: Path) -> dict[str, dict]:
    return {p.name: json.loads(p.read_text()) for p in (root / "workers").glob("dev*.json")}


def test_a_second_hosts_worker_killed_holding_a_job_loses_nothing(tmp_path):
    root = tmp_path / "run"
    with RunProcesses(root, *FLAGS) as run, open(tmp_path / "remote.log", "ab") as remote_log:
        ps = start_ps(run)
        remote = run.add(subprocess.Popen(as_other_host([PYTHON, "-m", "worker", "--join", "--device", "1",
                                                         "--run_dir", str(root), *FLAGS, "--poll_only"]),
                                          cwd=REPO, env=PROCESS_ENV, stdout=remote_log, stderr=subprocess.STDOUT))
        held = kill_while_holding_a_job(root, remote, ps)
        # The job comes back once the lease has expired; a worker started sooner could finish the run first.
        wait_for(lambda: f"recover: requeue {held} -> " in (tmp_path / "ps.log").read_text(), "the job's recovery",
                 TIMEOUT_S, procs=(ps,))
        local = run.worker(1, log="local.log")
        assert wait_for_ps(ps, [local], tmp_path / "ps.log") == 0, log_tail(tmp_path / "ps.log")
    ps_log = (tmp_path / "ps.log").read_text()
    # Worker 1 of each host had names of its own: two heartbeats, one per host.
    beats = heartbeats(root)
    [there] = [b for b in beats.values() if b["host"] == "otherhost"]
    assert beats["dev1.json"]["host"] != "otherhost" and there["host_id"] != beats["dev1.json"]["host_id"], beats
    assert there["device"] == f"1.{there['host_id']}" and f"_by_dev1.{there['host_id']}" in held
    # The job it held came back through the lease: its heartbeat went silent or, killed before its
    # heartbeat named the job, the file outlived the lease. Never as "dead" by a lock or a pid.
    recovered = [line for line in ps_log.splitlines() if f"recover: requeue {held} -> " in line]
    assert len(recovered) == 1, recovered
    assert re.search(r"on host otherhost went silent: heartbeat|moved on to \S+ and this file is", recovered[0])
    assert held[:10] in ledger(root)
    # It read safetensors snapshots (a mapping of the PS's /dev/shm is impossible from its host).
    assert "opened safetensors weights" in (tmp_path / "remote.log").read_text()
    assert_exactly_once(root, jobs=STEPS)


def test_a_second_hosts_bfloat16_worker_reads_each_version_as_a_delta_of_what_changed(tmp_path):
    """--worker_dtype bfloat16 on a float32 PS: the joined worker loads bfloat16, the PS writes bfloat16 files, a
    full anchor first and each later version as what changed; every job is trained once and `queue_tools report`
    shows the bytes written per version."""
    root = tmp_path / "run"
    flags = [*FLAGS, "--worker_dtype", "bfloat16", "--learning_rate", "1e-5"]  # a step of a large model's size
    with RunProcesses(root, *flags) as run, open(tmp_path / "remote.log", "ab") as remote_log:
        ps = start_ps(run)
        remote = run.add(subprocess.Popen(as_other_host([PYTHON, "-m", "worker", "--join", "--device", "1",
                                                         "--run_dir", str(root), *flags, "--poll_only"]),
                                          cwd=REPO, env=PROCESS_ENV, stdout=remote_log, stderr=subprocess.STDOUT))
        assert wait_for_ps(ps, [remote], tmp_path / "ps.log") == 0, log_tail(tmp_path / "ps.log")
    remote_text = (tmp_path / "remote.log").read_text()
    assert re.search(r"\[model\] loaded \S+: dtype=bfloat16", remote_text), remote_text[-2000:]
    assert re.search(r"\[model\] loaded \S+: dtype=float32", (tmp_path / "ps.log").read_text())
    published = [e for e in read_events(root) if e["event"] == "weights_published"]
    assert [e["weights_version"] for e in published] == list(range(STEPS + 1))  # the first weights: version 0
    anchor = published[0]["bytes"]  # the whole model in bfloat16, about half of its float32 bytes
    layout = json.loads(next((root / "weights").glob("layout-*.json")).read_text())
    assert 0.45 * layout["total_bytes"] < anchor < 0.55 * layout["total_bytes"] + 4096
    assert all(e["bytes"] < 0.5 * anchor for e in published[1:]), [e["bytes"] for e in published]
    snapshots = sorted(os.listdir(root / "weights" / "snapshots"))
    assert snapshots[0] == "d00000001.safetensors" and snapshots[-1] == "v00000000.safetensors", snapshots
    assert_exactly_once(root, jobs=STEPS)
    report = subprocess.run([sys.executable, "-m", "queue_tools", "report", str(root)], cwd=REPO, env=PROCESS_ENV,
                            capture_output=True, text=True, timeout=120)
    assert re.search(r"weight publish \(KB\)\s+13\s", report.stdout), report.stdout


def test_a_second_host_whose_clock_is_behind_loses_no_job_to_recovery(tmp_path):
    root = tmp_path / "run"
    run = RunProcesses(root, *FLAGS)
    ps = start_ps(run)
    skewed = {**PROCESS_ENV, "ASYNCGRPO_TEST_CLOCK_OFFSET_S": "-10",
              "PYTHONPATH": os.pathsep.join(filter(None, [str(CLOCK_SKEW_DIR), PROCESS_ENV.get("PYTHONPATH")]))}
    join = subprocess.Popen(as_other_host(["bash", str(REPO / "launch.sh"), "--join", str(root), "--workers", "1",
                                           "--device", "cpu", *FLAGS, "--poll_only"]),
                            cwd=REPO, env=skewed, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        expect_exit(ps, 0, tmp_path / "ps.log", TIMEOUT_S)
        out, _ = join.communicate(timeout=120)  # it stops its workers once the PS has finished
    finally:
        run.stop()
        if join.poll() is None:
            join.send_signal(signal.SIGINT)
            join.wait(timeout=120)
    assert join.returncode == 0, out
    assert "the parameter server finished: stopping the workers" in out
    [worker_log] = (root / "logs").glob("log_worker_1.*.txt")
    assert re.search(r"this host's clock is 10\.\d s behind", worker_log.read_text())
    assert [line for line in (tmp_path / "ps.log").read_text().splitlines() if "recover:" in line] == []
    assert [n for n in os.listdir(root / "done") if "_a2" in n] == []  # every job had one attempt
    assert_exactly_once(root, jobs=STEPS)


def test_a_second_hosts_join_against_a_ps_on_mmap_says_why_and_exits_2(tmp_path):
    """A PS whose weights only its own host can read (the default mmap): the joined worker claims nothing, exits 2
    with one line, and launch.sh --join prints it and exits 2, not waiting out the run in silence."""
    root = tmp_path / "run"
    run = RunProcesses(root, *run_flags(STEPS, lease_s=5))  # (mmap: the default on a CPU)
    ps = start_ps(run)
    wait_for(lambda: (root / "weights" / "published_version.json").exists(), "the PS's first weights", TIMEOUT_S,
             procs=(ps,), log=run.ps_log)
    join = subprocess.Popen(as_other_host(["bash", str(REPO / "launch.sh"), "--join", str(root), "--workers", "1",
                                           "--device", "cpu", *run_flags(STEPS, lease_s=5)]),
                            cwd=REPO, env=PROCESS_ENV, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    other_flags = subprocess.Popen(as_other_host(["bash", str(REPO / "launch.sh"), "--join", str(root), "--workers",
                                                  "1", "--device", "cpu", *run_flags(STEPS, lease_s=5),
                                                  "--temperature", "0.7"]),
                                   cwd=REPO, env={**PROCESS_ENV, "ASYNCGRPO_HOST_ID": "0badf1a9"},  # (a third host)
                                   stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        out, _ = join.communicate(timeout=TIMEOUT_S)
        flags_out, _ = other_flags.communicate(timeout=TIMEOUT_S)
    finally:
        run.stop()
        for proc in (join, other_flags):
            if proc.poll() is None:
                proc.kill()
    # A flag that differs from the PS's is said first, whatever else stops the worker.
    assert other_flags.returncode == 2, flags_out
    assert ("worker: error: this worker's flags are not the parameter server's: --temperature 0.7 (the parameter "
            "server's: 1.0)") in flags_out, flags_out
    assert join.returncode == 2, out
    line = ("worker: error: the parameter server on host {} publishes its weights through mmap, which only its own "
            "host can read: workers on other hosts need the PS started with --weight_transport safetensors")
    assert line.format(os.uname().nodename) in out, out
    assert "exited with status 2, bad input: not restarted" in out
    assert ("[launch --join] no worker left (each exited with bad input): this host stops; the run goes on with the "
            "others") in out
    assert not [n for n in os.listdir(root / "queue") if "_by_dev1." in n]  # it claimed nothing
