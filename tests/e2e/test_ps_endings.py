"""However the parameter server ends, its weight buffers in /dev/shm go: a PS killed outright (launch.sh frees
what it left), and a scheduler's SIGTERM to every process. (Ctrl-C in a terminal, SIGINT to the whole process
group: tests/e2e/test_e2e.py test_launch_restarts_a_dead_worker_and_ctrl_c_stops_everything.) Real processes,
started as a user starts them."""

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

from helpers import (
    OWN_SERVER_ENV,
    PROCESS_ENV,
    REPO,
    assert_exactly_once,
    backdate,
    expect_exit,
    heartbeat_pid,
    kill_run,
    log_tail,
    metrics,
    parent_of,
    pid_alive,
    process_state,
    ps_events,
    read_json,
    run_flags,
    start_process,
    wait_for,
    wait_until_stopped,
)

from asyncgrpo.events import read_events
from asyncgrpo.jobqueue.names import JobState, parse_queue_name
from asyncgrpo.run import fileops
from asyncgrpo.run.checkpoints import LEDGER_FILE, newest_complete_checkpoint

TIMEOUT_S = 300
JOB_STATES = (JobState.PENDING, JobState.PROCESSING)  # a job's file, not a result's


def buffers_of(run_root: Path) -> list[Path]:
    root = str(run_root.resolve())
    return [d for d in Path("/dev/shm").glob("asyncgrpo-weights-*")
            if (fileops.read_json(d / "owner.json") or {}).get("run") == root]


def launch_in_a_terminal(run_root: Path, *args: str, env: dict = PROCESS_ENV) -> subprocess.Popen:
    """launch.sh as the leader of its own process group, as a terminal runs a command."""
    return subprocess.Popen(["bash", str(REPO / "launch.sh"), "--run-dir", str(run_root), *args], cwd=REPO,
                            env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)


def relaunch_to_the_end(run_root: Path, flags: list[str]) -> None:
    """launch.sh again on the run, with 2 workers, until it finishes (exit 0)."""
    relaunch = launch_in_a_terminal(run_root, "--workers", "2", *flags)
    try:
        out, _ = relaunch.communicate(timeout=TIMEOUT_S)
    finally:
        kill_run(run_root, relaunch)
    assert relaunch.returncode == 0, out[-3000:]


def relaunch_hint(run_root: Path) -> str:
    """What launch.sh says a relaunch does after its PS died, by the complete checkpoint the PS left, if any."""
    if (saved := newest_complete_checkpoint(run_root / "checkpoints")) is not None:
        return f"Relaunch with --run-dir {run_root} to resume from {saved.name}"
    return f"No checkpoint was saved: a relaunch with --run-dir {run_root} starts from the beginning"


def wait_for_training(run_root: Path, proc: subprocess.Popen) -> None:
    deadline = time.monotonic() + TIMEOUT_S
    while len(metrics(run_root)) < 3 or not buffers_of(run_root):
        assert proc.poll() is None, proc.stdout.read()[-3000:]
        assert time.monotonic() < deadline, "no training steps"
        time.sleep(0.1)


def test_a_ctrl_c_while_the_inputs_are_checked_ends_the_launch_at_once_saying_so(tmp_path):
    """The check waits seconds for the libraries' import (a fork server's, or its own interpreter's): a Ctrl-C then
    ends launch.sh at once, with one line, and the folder it made goes."""
    run_root = tmp_path / "run"
    proc = launch_in_a_terminal(run_root, "--workers", "1", *run_flags(20), env=OWN_SERVER_ENV)
    try:
        check = wait_for(lambda: next((pid for pid, argv in run_processes(run_root).items() if "--check_only" in argv),
                                      None), "the input check to start", TIMEOUT_S, procs=[proc])
        wait_for(lambda: process_state(check) == "S", "the input check to wait for the libraries", TIMEOUT_S)
        os.killpg(proc.pid, signal.SIGINT)
        assert proc.wait(timeout=TIMEOUT_S) == 130
    finally:
        kill_run(run_root, proc)
    out = proc.stdout.read()
    assert out.splitlines()[-1] == (
        "[launch] interrupted before the run started (while its inputs were checked): nothing was started"), out
    assert not run_root.exists()


def test_a_killed_ps_stops_the_launch_and_its_workers_and_leaves_no_weight_buffers_behind(tmp_path):
    run_root = tmp_path / "run"
    proc = launch_in_a_terminal(run_root, "--workers", "2", "--max-steps", "100000")
    try:
        workers = [heartbeat_pid(run_root, device, TIMEOUT_S, procs=(proc,)) for device in (1, 2)]
        wait_for_training(run_root, proc)
        [folder] = buffers_of(run_root)
        os.kill(json.loads((run_root / "ps.json").read_text())["pid"], signal.SIGKILL)  # it cannot free them itself
        assert proc.wait(timeout=180) != 0
        assert not [pid for pid in workers if pid_alive(pid)]  # stopped by launch.sh (before the cleanup below)
    finally:
        kill_run(run_root, proc)
    out = proc.stdout.read()
    assert (f"the parameter server exited with status 137 (killed: SIGKILL, by kill -9 or the kernel's "
            f"out-of-memory killer); workers stopped. {relaunch_hint(run_root)}.") in out, out
    assert "Killed" not in out  # bash's own job line ("launch.sh: line N: PID Killed ...") is not shown
    assert "{'" not in out  # not the log's last lines: TRL's metric dictionaries
    assert f"of weight buffers the parameter server left in {folder}" in out
    assert buffers_of(run_root) == []


def test_sigterm_with_checkpoint_on_sigterm_saves_the_last_step_and_the_relaunch_resumes_there(tmp_path):
    """What a scheduler does before it preempts or requeues a job: SIGTERM to every process at once (the PS, its
    workers, launch.sh). With --checkpoint_on_sigterm the PS saves the step it trained last, though no save_steps
    falls there, and the next launch resumes from it: nothing trained twice, nothing lost. (The first launch runs
    its own fork server, as a user's does: it outlives the SIGTERM and waits for its children.)"""
    run_root = tmp_path / "run"
    steps = 200  # the demo trains tens of steps a second: the SIGTERM comes long before the last
    # (on CPU: the launch runs its own fork server on a GPU machine too)
    flags = [*run_flags(steps, save_steps=1000, seed=3), "--checkpoint_on_sigterm", "true", "--device", "cpu"]
    proc = launch_in_a_terminal(run_root, "--workers", "2", *flags, env=OWN_SERVER_ENV)
    try:
        wait_for_training(run_root, proc)
        os.killpg(proc.pid, signal.SIGTERM)
        assert proc.wait(timeout=120) == 128 + signal.SIGTERM  # (launch.sh's status says which signal stopped it)
    finally:
        kill_run(run_root, proc)
    trained = len(metrics(run_root))
    assert 3 <= trained < steps
    log = (run_root / "logs" / "log_parameter_server.txt").read_text()
    assert f"stopped after step {trained} on SIGTERM, its checkpoint saved: {run_root / 'checkpoints'}" in log, log
    out = proc.stdout.read()  # the terminal's: the line reaches it too (the log follower outlives the SIGTERM)
    assert f"stopped after step {trained} on SIGTERM, its checkpoint saved: {run_root / 'checkpoints'}" in out, out
    assert [p.name for p in (run_root / "checkpoints").glob("checkpoint-*")] == [f"checkpoint-{trained}"]
    assert not [p.name for p in (run_root / "logs").glob("log_*.txt") if "the fork server died" in p.read_text()]
    assert_exactly_once(run_root, jobs=trained)  # the ledger of the step saved: every result trained, once

    relaunch_to_the_end(run_root, flags)
    assert f"resuming from {run_root / 'checkpoints' / f'checkpoint-{trained}'}" in \
        (run_root / "logs" / "log_parameter_server.txt").read_text()
    # launch.sh's first line says which the folder was: a mistyped --run-dir shows as a new run
    said = [line.split(" ", 2)[2] for line in (run_root / "logs" / "launch.txt").read_text().splitlines()
            if "run directory" in line]
    assert [line.split(" (")[0] for line in said] == [f"run directory {run_root}, a new run",
                                                      f"run directory {run_root}, an existing run"], said
    assert [m["step"] for m in metrics(run_root)] == list(range(1, steps + 1))
    assert_exactly_once(run_root, jobs=steps)


def run_processes(run_root: Path) -> dict[int, str]:
    """{pid: command line} of every live process whose command line names the run folder (its PS, workers, tail)."""
    found = {}
    for proc in Path("/proc").iterdir():
        if proc.name.isdigit() and int(proc.name) != os.getpid():
            try:
                argv = (proc / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            except OSError:
                continue
            if str(run_root) in argv and pid_alive(int(proc.name)):
                found[int(proc.name)] = argv
    return found


def fork_server_of(launcher: subprocess.Popen) -> int:
    """The pid of the fork server a launch.sh runs (asyncgrpo/forkserver.py: its child, not a client)."""
    servers = [pid for pid, argv in children_of(launcher.pid).items()
               if "asyncgrpo/forkserver.py" in argv and "--client" not in argv]
    assert len(servers) == 1, children_of(launcher.pid)
    return servers[0]


def children_of(pid: int) -> dict[int, str]:
    found = {}
    for proc in Path("/proc").iterdir():
        try:
            if proc.name.isdigit() and parent_of(int(proc.name)) == pid:
                found[int(proc.name)] = (proc / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:  # (gone meanwhile)
            continue
    return found


def run_pids(run_root: Path) -> list[int]:
    """The PS's and the workers' pids, from their own files."""
    return [read_json(path)["pid"] for path in [run_root / "ps.json", *run_root.glob("workers/dev*.json")]]


def test_nothing_outlives_a_launch_sh_killed_outright_and_the_relaunch_loses_nothing(tmp_path):
    """kill -9 of launch.sh (nothing of it runs to stop its children): its PS and workers see it gone and stop as on
    a scheduler's SIGTERM, the PS with its checkpoint (--checkpoint_on_sigterm), the workers giving back their jobs;
    the fork server they were forked from (a user's launch.sh runs its own) ends after them. The relaunch trains the
    rest: every step once, every job once."""
    run_root = tmp_path / "run"
    steps = 100
    # (on CPU: the launch runs its own fork server on a GPU machine too)
    flags = [*run_flags(steps, save_steps=1000, seed=3), "--checkpoint_on_sigterm", "true", "--device", "cpu"]
    proc = launch_in_a_terminal(run_root, "--workers", "2", *flags, env=OWN_SERVER_ENV)
    try:
        wait_for_training(run_root, proc)
        started = run_processes(run_root)
        assert len([argv for argv in started.values() if " -m worker " in argv]) == 2, started
        server = fork_server_of(proc)
        assert [parent_of(pid) for pid in run_pids(run_root)] == [server] * 3  # the PS and both workers: its forks
        proc.kill()
        proc.wait(timeout=10)
        deadline = time.monotonic() + 60
        while ((left := run_processes(run_root)) or pid_alive(server)) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not left, f"still running {time.monotonic() - deadline + 60:.0f} s after launch.sh died: {left}"
        assert not pid_alive(server), "the fork server outlived launch.sh and its children"
    finally:
        kill_run(run_root, proc)
    trained = len(metrics(run_root))
    assert 3 <= trained < steps
    logs = run_root / "logs"
    for log in [logs / "log_parameter_server.txt", *logs.glob("log_worker_*.txt")]:
        assert "its supervisor (launch.sh or join.sh, pid" in log.read_text(), log.name
        assert "the fork server died" not in log.read_text(), log.name  # it waited for its children to stop
    assert f"stopped after step {trained} on SIGTERM" in (logs / "log_parameter_server.txt").read_text()

    relaunch_to_the_end(run_root, flags)
    assert [m["step"] for m in metrics(run_root)] == list(range(1, steps + 1))
    assert_exactly_once(run_root, jobs=steps)


def test_a_killed_fork_server_ends_the_run_as_a_killed_ps_does(tmp_path):
    """The fork server killed outright (the out-of-memory killer): the processes forked from it are killed with it
    (none runs on unseen), launch.sh says the PS was killed and how to resume, and nothing of the run is left."""
    run_root = tmp_path / "run"
    proc = launch_in_a_terminal(run_root, "--workers", "2", "--device", "cpu", *run_flags(100000),
                                env=OWN_SERVER_ENV)
    try:
        wait_for_training(run_root, proc)
        pids = run_pids(run_root)
        os.kill(fork_server_of(proc), signal.SIGKILL)
        out, _ = proc.communicate(timeout=TIMEOUT_S)
    finally:
        kill_run(run_root, proc)
    assert proc.returncode == 137, out[-3000:]
    assert "the parameter server exited with status 137 (killed: SIGKILL" in out
    assert f"workers stopped. {relaunch_hint(run_root)}." in out, out
    assert "forked_python: the fork server died while it ran ps: its process killed" in \
        (run_root / "logs" / "log_parameter_server.txt").read_text()
    assert not [pid for pid in pids if pid_alive(pid)] and not run_processes(run_root)
    assert not buffers_of(run_root)


def queue_tools_ls(run_root: Path) -> dict:
    ls = subprocess.run([sys.executable, "-m", "queue_tools", "ls", str(run_root), "--json"], cwd=REPO,
                        env=PROCESS_ENV, capture_output=True, text=True, timeout=60, check=True)
    return json.loads(ls.stdout)


def test_queue_tools_ls_says_when_the_ps_is_silent_or_gone(tmp_path):
    run_root = tmp_path / "run"
    ps = start_process(run_root, tmp_path / "ps.log", "ps", "--max_steps", "100000", "--seed", "0")  # no workers
    try:
        deadline = time.monotonic() + TIMEOUT_S
        while not (run_root / "ps.json").exists() or not (run_root / "ps.heartbeat").exists():
            assert ps.poll() is None and time.monotonic() < deadline, log_tail(tmp_path / "ps.log")
            time.sleep(0.1)
        # Waiting for workers is not silence. (Once the PS has thrown its first jobs, ls rightly warns that no worker
        # is alive to take them: whether it has yet when ls looks is a race.)
        health = queue_tools_ls(run_root)["health"]
        assert "parameter server" not in health, health
        ps.send_signal(signal.SIGSTOP)
        wait_until_stopped(ps, timeout=60)
        backdate(run_root / "ps.heartbeat", 7.0)  # as if stopped 7 s: past the 5 s a heartbeat may be late
        health = queue_tools_ls(run_root)["health"]
        silent = f"WARN: the parameter server (pid {ps.pid} on {socket.gethostname()}) silent for "
        assert health.startswith(silent), health
        ps.send_signal(signal.SIGKILL)
        ps.wait(timeout=60)
        health = queue_tools_ls(run_root)["health"]
        gone = f"WARN: the parameter server (pid {ps.pid}) is not running: relaunch on this run directory"
        assert health.startswith(f"{gone} (no checkpoint saved yet: it starts from the beginning)"), health
        (run_root / "checkpoints" / "checkpoint-40").mkdir(parents=True)
        (run_root / "checkpoints" / "checkpoint-40" / LEDGER_FILE).write_text("{}")  # (complete: its ledger is there)
        (run_root / "checkpoints" / "checkpoint-60").mkdir()  # (incomplete: a save the PS died in, never resumed)
        health = queue_tools_ls(run_root)["health"]
        assert health.startswith(f"{gone} to resume from checkpoint-40"), health
    finally:
        ps.send_signal(signal.SIGCONT)
        ps.kill()
        ps.wait(timeout=60)
        subprocess.run([sys.executable, "-m", "queue_tools", "cleanup", str(run_root)], cwd=REPO, env=PROCESS_ENV,
                       capture_output=True, timeout=60)  # frees the killed PS's weight buffers


def test_a_worker_beside_a_ps_relaunched_without_a_checkpoint_takes_its_version_0(tmp_path):
    """A PS killed before its first checkpoint and relaunched starts again from step 0 and publishes version 0. The
    worker that stayed up syncs it, and labels its next results with the new PS's versions, not with the version it
    held from the old PS. One job of the old PS stays in the queue: its floor (its step less max_staleness) counts
    in the old PS's steps, above any version the new PS publishes before it trains on that job; the worker
    generates it with the newest weights rather than wait for ever. (The worker is paused meanwhile, and the old
    PS's other jobs and results set aside, so that the new PS waits for it at version 0 rather than training again
    what the old one trained.)"""
    run_root = tmp_path / "run"
    flags = run_flags(100000, save_steps=100000)
    first = start_process(run_root, tmp_path / "ps1.log", "ps", *flags)
    worker = start_process(run_root, tmp_path / "worker.log", "worker", "--device", "1", *flags)
    second = None
    try:
        deadline = time.monotonic() + TIMEOUT_S
        while True:  # until, with both paused, the queue holds a job whose floor the new PS does not reach
            assert first.poll() is None and worker.poll() is None, log_tail(tmp_path / "worker.log")
            assert time.monotonic() < deadline, "no job thrown at step 8 or later, or no version 4 synced"
            if len(metrics(run_root)) >= 5:
                worker.send_signal(signal.SIGSTOP)
                first.send_signal(signal.SIGSTOP)
                kept = newest_job(run_root)
                held = max(e["weights_version"] for e in worker_events(run_root) if e["event"] == "weights_synced")
                if kept is not None and fileops.load_payload(kept)["data"]["min_weights_version"] > 3 and held > 3:
                    break  # (above the versions of the new PS's 3 steps)
                first.send_signal(signal.SIGCONT)
                worker.send_signal(signal.SIGCONT)
            time.sleep(0.1)
        first.kill()
        first.wait(timeout=60)
        aside = tmp_path / "set_aside"
        aside.mkdir()
        leftovers = list(run_root.glob("queue/*.pt"))
        kept_id = parse_queue_name(kept.name).job_id  # the new PS trains it: no checkpoint says it was trained
        kept.rename(run_root / "queue" / f"{kept_id}_pending.pt")  # (one the paused worker held: given back)
        for leftover in [*(path for path in leftovers if path != kept), *(run_root / "done").glob("*.pt")]:
            leftover.rename(aside / leftover.name)  # (the new PS would train them again: no checkpoint says not to)
        second = start_process(run_root, tmp_path / "ps2.log", "ps", *run_flags(3, save_steps=100000))
        version_file = run_root / "weights" / "published_version.json"
        deadline = time.monotonic() + TIMEOUT_S
        while (fileops.read_json(version_file) or {}).get("pid") != second.pid:
            assert second.poll() is None and time.monotonic() < deadline, log_tail(tmp_path / "ps2.log")
            time.sleep(0.1)
        resumed = time.time()
        worker.send_signal(signal.SIGCONT)
        expect_exit(second, 0, tmp_path / "ps2.log", TIMEOUT_S)
        assert worker.poll() is None  # it stayed up beside both
    finally:
        for proc in (first, worker, second):
            if proc is not None and proc.poll() is None:
                proc.send_signal(signal.SIGCONT)
                proc.kill()
                proc.wait()
    after = [e for e in worker_events(run_root) if e["t"] > resumed]
    synced = [e["weights_version"] for e in after if e["event"] == "weights_synced"]
    # The new PS's jobs' results. (A job of the old PS the worker had fenced when it was paused is published as it
    # resumes, with the old version: under load the pause can land there.)
    new_jobs = {e["job_id"] for e in ps_events(run_root, "job_created") if e["pid"] == second.pid}
    written = [e["weights_version"] for e in after
               if e["event"] == "result_written" and e["published"] and e["job_id"] in new_jobs]
    # (A sync of the old PS's weights under way as the worker was paused ends after it resumes.)
    assert 0 in synced and max(synced[synced.index(0):]) <= 3, synced
    assert written and max(written) <= 3 < held, (written, held)  # the new PS's versions: it trained 3 steps
    kept_results = [e for e in after if e["event"] == "result_written" and e["job_id"] == kept_id and e["published"]]
    assert kept_results and kept_results[-1]["weights_version"] <= 3, kept_results


def newest_job(run_root: Path) -> Path | None:
    """The queue's job file (pending or held) thrown at the latest step."""
    jobs = [path for path in run_root.glob("queue/*.pt") if parse_queue_name(path.name).state in JOB_STATES]
    return max(jobs, key=lambda path: fileops.load_payload(path)["created_step"], default=None)


def worker_events(run_root: Path) -> list[dict]:
    return read_events(run_root, process="worker-dev1")
