"""queue_tools ls and cleanup: what they report and do, and their errors."""

import dataclasses
import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
from helpers import backdate, dead_pid

from asyncgrpo.jobqueue import ArchiveReason, make_job_id
from asyncgrpo.run import RunDir, WorkerPresence
from asyncgrpo.run.rundir import PSStatus
from queue_tools.cli import main

LEASE_S = 30.0


def call_main(argv) -> int:
    try:
        return main([str(a) for a in argv])
    except SystemExit as exited:  # argparse's errors
        return exited.code


def run_cli(capsys, *argv):
    code = call_main(argv)
    out, err = capsys.readouterr()
    return code, out, err


def snapshot(root: Path):
    return sorted((str(p.relative_to(root)), p.stat().st_mtime_ns) for p in root.rglob("*"))


@pytest.fixture
def busy_run(run, queue):
    """Pending 000001_003 and 000001_004 (100 s old); live dev1 on 000001_000; 000001_001 held by
    dev2, which never ran (stale); 000001_002's result waiting, its job file archived."""
    for i in range(5):
        queue.put_job(make_job_id(1, i), {}, created_step=1)
    live = WorkerPresence(run, 1).start()
    job = queue.claim(1)
    live.update(job_id=job.job_id, state="busy", weights_version=3)
    live.beat()  # what the next heartbeat tick writes
    queue.claim(2)  # device 2 never ran a worker: its job is stale
    done = queue.claim(1)
    queue.complete(done, {}, weights_version=3)
    backdate(run.queue / "000001_004_pending.pt", 100)
    (run.root / "global_step.txt").write_text("17\n")
    yield run
    live.stop()


def test_ls_json_reports_the_queue(busy_run, capsys):
    code, out, err = run_cli(capsys, "ls", busy_run.root, "--json")
    assert code == 0 and err == ""
    report = json.loads(out)
    assert (report["pending"], report["processing"], report["complete"], report["collected"]) == (2, 2, 1, 0)
    assert report["done"]["processed"] == 1 and report["done"]["consumed"] == 0
    assert report["stale"] == ["000001_001"]
    assert 99 <= report["oldest_pending_age_s"] < 200
    assert report["global_step"] == 17
    [worker] = report["workers"]
    assert (worker["device"], worker["alive"], worker["job_id"], worker["pid"]) == (1, True, "000001_000", os.getpid())
    assert worker["heartbeat_age_s"] < LEASE_S
    assert report["health"].startswith("WARN: 1 stale job(s)")


def test_ls_text_has_a_health_verdict(busy_run, queue, capsys):
    code, out, _ = run_cli(capsys, "ls", busy_run.root)
    assert code == 0
    assert "pending:2" in out and "dev1" in out and "000001_001" in out
    assert out.strip().splitlines()[-1].startswith("health: WARN")
    queue.recover(lease_s=LEASE_S)
    _, out, _ = run_cli(capsys, "ls", busy_run.root)
    assert out.strip().splitlines()[-1] == "health: OK: 1 worker(s) alive, no stale jobs"


def archive_failed(queue, job_id: str, message: str) -> None:
    """A job given up after 3 attempts, as the PS archives its failure report."""
    queue.put_job(job_id, {"rows": []}, created_step=1)
    error = {"type": "ValueError", "message": message, "reward_function": "my_reward", "stage": "scoring"}
    for _ in range(3):
        queue.fail(queue.claim(1), error, max_attempts=3, weights_version=0)
    [report] = queue.collect()
    queue.archive(report.path, job_id, ArchiveReason.FAILED, report.attempt)


def test_ls_warns_about_failed_jobs_with_their_count_and_the_newest_error(run, queue, capsys):
    archive_failed(queue, "000001_000", "an older error")
    archive_failed(queue, "000001_001", "the newest error")  # archived later (or in the same clock tick)
    code, out, _ = run_cli(capsys, "ls", run.root, "--json")
    report = json.loads(out)
    assert code == 0 and report["done"]["failed"] == 2 and report["done"]["retried"] == 4
    assert report["last_failure"] == "reward function 'my_reward' raised ValueError: the newest error"
    assert report["health"] == ("WARN: 2 job(s) failed on every attempt and were not trained on (last error: reward "
                                "function 'my_reward' raised ValueError: the newest error)")
    os.truncate(run.done / "000001_001_failed_a3.pt", 0)  # emptied by archive retention
    _, out, _ = run_cli(capsys, "ls", run.root)
    assert out.strip().splitlines()[-1].endswith("(last error: not kept)")


def test_ls_shows_names_outside_the_grammar_escaped_on_one_line(run, capsys):
    (run.queue / "evil\nname.pt").write_bytes(b"junk")
    (run.queue / os.fsdecode(b"bad\xff.pt")).write_bytes(b"junk")  # a name that is not UTF-8
    code, out, _ = run_cli(capsys, "ls", run.root)
    [line] = [line for line in out.splitlines() if line.startswith("outside the grammar: ")]
    assert sorted(line.removeprefix("outside the grammar: ").split(", ")) == ["'bad\\udcff.pt'", "'evil\\nname.pt'"]
    assert code == 0 and line.isascii()


def test_jobs_that_failed_before_the_running_ps_started_are_history_not_health(run, queue, capsys):
    """A relaunch after a reward function was fixed: the failures of the launch before stay counted in done/ and
    said as history, and health goes by the failures since this PS started."""
    archive_failed(queue, "000001_000", "the bug fixed since")
    run.write_ps_status(dataclasses.replace(PSStatus.starting("model", None, {}), started_at=time.time() + 1))
    _, out, _ = run_cli(capsys, "ls", run.root)
    lines = out.strip().splitlines()
    assert lines[-1] == "health: OK: 0 worker(s) alive, no stale jobs", out
    assert lines[-2] == ("history: 1 job(s) failed on every attempt before this parameter server started (their "
                         "errors are in done/; a relaunch after a fix no longer meets them)")
    run.write_ps_status(dataclasses.replace(PSStatus.starting("model", None, {}), started_at=time.time() - 60))
    _, out, _ = run_cli(capsys, "ls", run.root)
    assert out.strip().splitlines()[-1].startswith("health: WARN: 1 job(s) failed on every attempt")


def test_ls_warns_about_files_that_could_not_be_read(run, queue, capsys):
    """Results emptied by compaction and re-adopted, or hostile files, were archived failed_load and never trained
    on while health said OK."""
    (run.queue / "000001_000_complete_from_dev1.pt").write_bytes(b"")
    queue.collect(validate=lambda data: None)
    _, out, _ = run_cli(capsys, "ls", run.root)
    assert out.strip().splitlines()[-1] == (
        "health: WARN: 1 file(s) could not be read and were archived failed_load (corrupt, hostile, or a result "
        "emptied by compaction: the PS's log names each)"), out


def test_ls_warns_about_orphaned_jobs(run, queue, capsys):
    queue.put_job("000001_000", {}, created_step=1)
    queue.claim(1)
    queue.recover(lease_s=LEASE_S, max_attempts=1)  # dev1 is dead, and that was the job's only attempt
    _, out, _ = run_cli(capsys, "ls", run.root)
    assert out.strip().splitlines()[-1] == (
        "health: WARN: 1 job(s) orphaned (their workers died on every attempt) and not trained on")


def ps_status(run, *, state="training", pid=None, started_ago_s=0.0, job_timeout_s=None) -> PSStatus:
    status = PSStatus(pid=os.getpid() if pid is None else pid, host=socket.gethostname(), model="m", state=state,
                      started_at=time.time() - started_ago_s, job_timeout_s=job_timeout_s)
    run.write_ps_status(status)
    return status


def test_ls_without_a_run_dir_takes_the_run_started_last(tmp_path, monkeypatch, capsys):
    """By its PS's start, not by the newest file: the workers of an older run left running write heartbeats."""
    runs = tmp_path / "runs"
    old, newest = RunDir.create(runs / "old"), RunDir.create(runs / "new")
    ps_status(old, started_ago_s=600)
    ps_status(newest, started_ago_s=60)
    presence = WorkerPresence(old, 1).start()  # beating now, in the old run
    os.utime(old.root, (time.time() + 1, time.time() + 1))  # its files the newest
    try:
        monkeypatch.setenv("ASYNCGRPO_RUNS", str(runs))
        code, out, _ = run_cli(capsys, "ls", "--json")
    finally:
        presence.stop()
    assert code == 0 and json.loads(out)["run_dir"] == str(newest.root)


def holding(run, queue, held_for_s: float) -> WorkerPresence:
    """A live dev1 holding job 000001_000, claimed ``held_for_s`` ago."""
    queue.put_job("000001_000", {}, created_step=1)
    presence = WorkerPresence(run, 1).start()
    job = queue.claim(1)
    presence.update(job_id=job.job_id, job_ids=[job.job_id], state="busy")
    presence.beat()
    backdate(job.path, held_for_s)
    return presence


def test_ls_warns_about_a_job_held_past_its_deadline(run, queue, capsys):
    ps_status(run, job_timeout_s=100)
    presence = holding(run, queue, 120)  # (past the deadline, not yet past the lease too: not yet stale)
    try:
        _, out, _ = run_cli(capsys, "ls", run.root, "--json")
    finally:
        presence.stop()
    health = json.loads(out)["health"]
    assert re.fullmatch(r"WARN: job 000001_000 held by dev1 for 12\ds, past its deadline \(--job_timeout_s 100\): "
                        r"stuck where the worker cannot act on it; recovery takes it back after the lease "
                        rf"\(`kill -USR1 {os.getpid()}` logs where each thread is\)", health), health


def test_ls_warns_when_no_step_trains_while_a_worker_holds_a_job_for_long(run, queue, capsys):
    ps_status(run, started_ago_s=300)  # no deadline, no step yet
    presence = holding(run, queue, 200)
    try:
        _, out, _ = run_cli(capsys, "ls", run.root, "--json")
        run.write_global_step(1)  # a step just trained
        _, stepped, _ = run_cli(capsys, "ls", run.root, "--json")
        os.utime(run.global_step_file, (time.time() - 300, time.time() - 300))
        claimed = time.time() - 30  # a job of a slow step, not a stall
        os.utime(run.queue / "000001_000_processing_by_dev1.pt", (claimed, claimed))
        _, quiet, _ = run_cli(capsys, "ls", run.root, "--json")
    finally:
        presence.stop()
    health = json.loads(out)["health"]
    assert re.match(r"WARN: no step trained for 3\d\ds while workers hold jobs: the oldest, 000001_000, held by "
                    r"dev1 for 2\d\ds \(a reward function or tool that does not return\?", health), health
    assert json.loads(stepped)["health"].startswith("OK"), stepped
    assert json.loads(quiet)["health"].startswith("OK"), quiet


@pytest.mark.process
@pytest.mark.parametrize("ps_state", ["finished", "dead"])
def test_ls_warns_about_workers_nobody_will_stop_beside_a_ps_that_has_ended(run, capsys, ps_state):
    ps_status(run, state="finished" if ps_state == "finished" else "training", pid=dead_pid())
    presence = WorkerPresence(run, 1).start()
    try:
        _, out, _ = run_cli(capsys, "ls", run.root, "--json")
        presence.update(supervisor_pid=os.getpid())  # a launch.sh that lives: it stops them itself
        presence.beat()
        _, supervised, _ = run_cli(capsys, "ls", run.root, "--json")
    finally:
        presence.stop()
    ended = "finished" if ps_state == "finished" else "stopped"
    assert (f"1 worker(s) alive beside a parameter server that has {ended}, with no launch.sh to stop them: stop "
            f"them (kill {os.getpid()})") in json.loads(out)["health"]
    assert "no launch.sh to stop them" not in json.loads(supervised)["health"]


def test_cleanup_prints_each_file_it_touches_and_is_idempotent(busy_run, capsys):
    (busy_run.tmp / "abandoned.tmp").write_bytes(b"x")
    backdate(busy_run.tmp / "abandoned.tmp", 2 * LEASE_S)
    (busy_run.tmp / "in-flight.tmp").write_bytes(b"x")
    (busy_run.queue / "notes.txt").write_text("not a job")
    code, out, _ = run_cli(capsys, "cleanup", busy_run.root, "--stale-after", LEASE_S)
    assert code == 0
    lines = out.strip().splitlines()
    assert lines[-1] == "cleanup: 3 action(s)"
    assert "requeue 000001_001_processing_by_dev2.pt -> 000001_001_pending_a2.pt: worker dev2 is dead" in lines
    assert any(line.startswith("reap .tmp/abandoned.tmp") for line in lines)
    assert any(line.startswith("archive notes.txt -> done/invalid_notes.txt_failed_load.pt") for line in lines)
    assert os.listdir(busy_run.tmp) == ["in-flight.tmp"]  # the live worker's job and young temp files stay
    assert (busy_run.queue / "000001_000_processing_by_dev1.pt").exists()
    code, out, _ = run_cli(capsys, "cleanup", busy_run.root)
    assert (code, out.strip()) == (0, "cleanup: nothing to do")


def test_cleanup_dry_run_and_json_touch_nothing(busy_run, capsys):
    before = snapshot(busy_run.root / "queue"), snapshot(busy_run.done)
    code, out, _ = run_cli(capsys, "cleanup", busy_run.root, "--dry-run", "--json")
    assert code == 0
    report = json.loads(out)
    assert report["dry_run"] is True
    assert [(a["what"], a["job_id"]) for a in report["actions"]] == [("requeue", "000001_001")]
    assert (snapshot(busy_run.root / "queue"), snapshot(busy_run.done)) == before


def test_cleanup_orphans_after_max_attempts(run, queue, capsys):
    queue.put_job("000001_000", {}, created_step=1)
    queue.claim(4)
    code, out, _ = run_cli(capsys, "cleanup", run.root, "--max-attempts", "1")
    assert code == 0 and "done/000001_000_orphaned.pt" in out


@pytest.mark.parametrize("argv, message", [
    (["ls", "{tmp}/missing"], "does not exist"),
    (["cleanup", "{tmp}/plain"], "is not an asyncgrpo run directory"),
    (["ls", "{tmp}/plain/file.txt"], "is not a directory"),
    (["ls", "{run}", "--frobnicate"], "unrecognized arguments: --frobnicate"),
    (["cleanup", "{run}", "--stale-after", "-5"], "must be >= 0"),
    (["cleanup", "{run}", "--max-attempts", "0"], "must be >= 1"),
    (["cleanup", "{run}", "--stale-after", "soon"], "invalid _nonnegative value"),
    (["explode"], "invalid choice: 'explode'"),
])
def test_errors_are_one_line_exit_2_and_touch_nothing(tmp_path, run, capsys, argv, message):
    (tmp_path / "plain").mkdir()
    (tmp_path / "plain" / "file.txt").write_text("x")
    before = snapshot(tmp_path)
    code, out, err = run_cli(capsys, *[a.format(tmp=tmp_path, run=run.root) for a in argv])
    assert code == 2
    assert out == ""
    assert len(err.strip().splitlines()) == 1 and message in err and err.startswith("queue_tools: error:")
    assert snapshot(tmp_path) == before


@pytest.mark.process
def test_console_script_is_installed(busy_run):
    script = Path(sys.executable).with_name("queue_tools")
    result = subprocess.run([script, "ls", busy_run.root, "--json"], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout)["pending"] == 2


@pytest.mark.process
def test_ls_does_not_import_torch(busy_run):
    """ls scans names only: it must answer without importing torch (fast on big runs)."""
    code = ("import sys; from queue_tools.cli import main; main(['ls', sys.argv[1], '--json']); "
            "assert 'torch' not in sys.modules, 'ls imported torch'")
    result = subprocess.run([sys.executable, "-c", code, str(busy_run.root)], capture_output=True, text=True,
                            timeout=60)
    assert result.returncode == 0, result.stderr


def metrics_line(step, reward, staleness):
    return json.dumps({"step": step, "reward": reward, "loss": 0.1, "staleness_mean": staleness,
                       "staleness_max": staleness, "trainer_wait_s": 0.012, "time": 0.0}) + "\n"


@pytest.mark.process
def test_ls_watch_refreshes_until_ctrl_c_with_the_last_step(busy_run):
    metrics = busy_run.root / "metrics.jsonl"
    metrics.write_text(metrics_line(16, 0.5, 1.0))
    proc = subprocess.Popen([sys.executable, "-m", "queue_tools", "ls", str(busy_run.root), "--watch"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        frames, shown = 0, []
        for line in proc.stdout:  # each frame ends with the refresh hint
            if line.startswith("training:"):
                shown.append(line.strip())
            if "Ctrl-C to stop" in line:
                frames += 1
                if frames == 1:  # training goes on between two frames
                    with open(metrics, "a") as f:
                        f.write(metrics_line(17, 0.75, 2.0))
                if "step 17" in shown[-1] or frames == 5:
                    break
        # The terminal's step line, from metrics.jsonl (asyncgrpo/run/metrics.py step_words): one format for both.
        assert shown[0] == "training: step=16 reward=0.500 staleness=1.0 wait_ms=12 loss=0.1000"
        assert shown[-1] == "training: step=17 reward=0.750 staleness=2.0 wait_ms=12 loss=0.1000"
        proc.send_signal(signal.SIGINT)
        assert proc.wait(timeout=60) == 0
    finally:
        proc.kill()
    assert proc.stderr.read() == ""


@pytest.mark.parametrize("mps", ["on", "off: nvidia-cuda-mps-control is not on PATH", None])
def test_ls_says_whether_nvidia_mps_is_on(run, capsys, monkeypatch, mps):
    """What launch.sh found (ASYNCGRPO_MPS, into ps.json by the PS); nothing for a PS launch.sh did not start."""
    from asyncgrpo.run.rundir import MPS_ENV, PSStatus

    if mps is None:
        monkeypatch.delenv(MPS_ENV, raising=False)
    else:
        monkeypatch.setenv(MPS_ENV, mps)
    run.write_ps_status(PSStatus.starting("model", None, {}))
    _, out, _ = run_cli(capsys, "ls", run.root, "--json")
    assert json.loads(out)["ps"]["mps"] == mps
    _, out, _ = run_cli(capsys, "ls", run.root)
    assert (f"NVIDIA MPS: {mps}\n" in out) if mps else ("NVIDIA MPS" not in out)


@pytest.mark.parametrize("rate, warned", [(1.0, True), (0.5, True), (0.2, False), (None, False)])
def test_ls_shows_the_tool_failure_rate_and_warns_from_half_the_calls_failing(run, capsys, rate, warned):
    line = json.loads(metrics_line(40, 0.25, 1.0))
    (run.root / "metrics.jsonl").write_text(json.dumps({**line, "tool_failure_rate": rate}) + "\n")
    _, out, _ = run_cli(capsys, "ls", run.root)
    [training] = [x for x in out.splitlines() if x.startswith("training:")]
    assert training.endswith(f" tool_failures={rate:.0%}" if rate is not None else " wait_ms=12 loss=0.1000")
    health = out.strip().splitlines()[-1]
    warning = (f"health: WARN: {rate:.0%} of the tool calls failed at step 40 (the workers' logs name the errors: "
               "their [tools] lines)") if warned else None
    assert (health == warning) if warned else health.startswith("health: OK")


def finished_ps(run) -> None:
    """ps.json as a PS that finished training and exited leaves it."""
    status = PSStatus.starting("model", None, {}).finished(global_step=10, final_model="final_model")
    run.write_ps_status(dataclasses.replace(status, pid=dead_pid()))


@pytest.mark.process
def test_cleanup_on_a_finished_run_archives_what_is_left_unused_and_requeues_nothing(run, queue, capsys):
    for i in range(4):
        queue.put_job(make_job_id(9, i), {}, created_step=9)
    queue.claim(1)  # held by dev1, which is gone (killed at the end with the job in hand)
    queue.complete(queue.claim(2), {}, weights_version=9)  # a result written after the PS's last collect
    finished_ps(run)
    code, out, _ = run_cli(capsys, "cleanup", run.root)
    assert code == 0
    assert queue.counts() == {state: 0 for state in queue.counts()}
    assert sorted(p.name for p in run.done.iterdir()) == [
        "000009_000_unused.pt", "000009_001_processed.pt", "000009_001_unused.pt", "000009_002_unused.pt",
        "000009_003_unused.pt"]
    assert "requeue" not in out and "training is over" in out and "pending after training was over" in out
    _, out, _ = run_cli(capsys, "ls", run.root)
    assert out.strip().splitlines()[-1].startswith("health: OK")


def test_cleanup_on_a_run_whose_ps_is_still_training_requeues_a_dead_workers_job(run, queue, capsys):
    queue.put_job(make_job_id(9, 0), {}, created_step=9)
    queue.claim(1)
    run.write_ps_status(PSStatus.starting("model", None, {}))  # this process: alive, training
    code, out, _ = run_cli(capsys, "cleanup", run.root)
    assert code == 0 and out.startswith("requeue 000009_000_processing_by_dev1.pt -> 000009_000_pending_a2.pt")


def test_cleanup_finds_the_stale_archive_of_an_attempt_only_an_earlier_ps_allowed(run, queue, capsys):
    """A PS relaunched with --max_attempts 2 after one with 3, which archived attempt 3's result stale and threw its
    prompts again: attempt 2, held by a dead worker, must not go back to pending (its prompts would train twice)."""
    earlier = PSStatus.starting("model", None, {}, max_attempts=3)
    run.write_ps_status(PSStatus.starting("model", None, {}, max_attempts=2, previous=earlier))  # this process: alive
    queue.put_job(make_job_id(9, 0), {}, created_step=9)
    os.rename(run.queue / "000009_000_pending.pt", run.queue / "000009_000_pending_a2.pt")
    queue.claim(1)
    (run.done / "000009_000_stale_a3.pt").write_bytes(b"")
    code, out, _ = run_cli(capsys, "cleanup", run.root)
    assert code == 0 and out.startswith("archive 000009_000_processing_by_dev1_a2.pt -> "
                                        "done/000009_000_processed_a2.pt: worker dev1 is dead; its result exists"), out


@pytest.mark.process
def test_ls_names_the_parameter_server_and_its_state(run, capsys):
    _, out, _ = run_cli(capsys, "ls", run.root)
    assert "parameter server: none yet (no ps.json)\n" in out
    run.write_ps_status(PSStatus.starting("model", None, {}))  # this process, alive
    run.ps_heartbeat_file.touch()
    _, out, _ = run_cli(capsys, "ls", run.root)
    [line] = [x for x in out.splitlines() if x.startswith("parameter server:")]
    assert line.startswith(f"parameter server: pid {os.getpid()} on {os.uname().nodename}, training, alive "
                           "(heartbeat ") and line.endswith(" ago)")
    finished_ps(run)
    _, out, _ = run_cli(capsys, "ls", run.root)
    assert ", finished, not running\n" in out


@pytest.mark.process
def test_ls_into_a_pipe_closed_early_ends_quietly(busy_run):
    """`queue_tools ls RUN --watch | head -1`: the reader leaves after one line; the next frame meets a closed pipe."""
    result = subprocess.run(f"{sys.executable} -m queue_tools ls {busy_run.root} --watch | head -1",
                            shell=True, capture_output=True, text=True, timeout=60)
    assert result.stdout.startswith("\033[H\033[Jrun: ") and result.stderr == "", result.stderr


@pytest.mark.parametrize(("line", "warning"), [
    ({"steps_without_spread": 25, "frac_reward_zero_std": 1.0},
     "for 25 steps every group's completions scored alike: the advantages are all 0 and nothing is learned"),
    ({"steps_without_reward": 3, "steps_without_spread": 3, "reward": None},
     "the last 3 step(s) had no reward: every reward function returned None (or NaN) for every completion"),
    ({"steps_without_spread": 19, "frac_reward_zero_std": 1.0}, None),  # not yet
])
def test_ls_warns_about_steps_that_teach_nothing(run, capsys, line, warning):
    (run.root / "metrics.jsonl").write_text(json.dumps({"step": 40, "reward": 0.0, "time": time.time(), **line}) + "\n")
    _, out, _ = run_cli(capsys, "ls", run.root, "--json")
    health = json.loads(out)["health"]
    assert (warning in health) if warning else health.startswith("OK"), health


def remote_worker_holding(run, queue, device: int, silent_s: float) -> str:
    """A job held by worker ``device`` on another host whose heartbeat is ``silent_s`` old; its job id."""
    held = queue.claim(device)
    beat = {"pid": 4242, "host": "elsewhere", "host_id": "another-host", "state": "busy", "job_id": held.job_id,
            "job_ids": [held.job_id]}
    run.heartbeat_file(device).write_text(json.dumps(beat))
    backdate(run.heartbeat_file(device), silent_s)
    return held.job_id


def test_ls_and_cleanup_go_by_the_runs_own_lease_and_attempts(run, queue, capsys):
    """A job held by a worker on another host silent for 36 s: within the run's --lease_s 120 it is not stale (ls
    sees it alive and advises nothing, cleanup takes nothing); a lease given on the command line wins; the run's
    --max_attempts decides what is re-thrown and what orphaned."""
    queue.put_job(make_job_id(1, 0), {}, created_step=1)
    job_id = remote_worker_holding(run, queue, 3, 36)
    run.write_ps_status(dataclasses.replace(PSStatus.starting("model", None, {}, lease_s=120.0, max_attempts=1),
                                            pid=999_999))  # (a PS that is gone: ls would advise cleanup)
    report = json.loads(run_cli(capsys, "ls", run.root, "--json")[1])
    assert report["stale"] == [] and report["workers"][0]["alive"]
    assert "cleanup" not in report["health"]
    assert json.loads(run_cli(capsys, "cleanup", run.root, "--dry-run", "--json")[1])["actions"] == []
    report = json.loads(run_cli(capsys, "ls", run.root, "--json", "--lease", "30")[1])
    assert report["stale"] == [job_id] and report["health"].endswith("; run `queue_tools cleanup`")
    # Past the lease given: at attempt 1 of the run's 1, orphaned, not re-thrown.
    actions = json.loads(run_cli(capsys, "cleanup", run.root, "--stale-after", "30", "--dry-run", "--json")[1])
    assert [(a["what"], a["job_id"], "orphaned" in a["dst"]) for a in actions["actions"]] == [
        ("archive", job_id, True)]


def test_cleanup_refuses_a_lease_under_the_heartbeat_interval_unless_forced(run, queue, capsys):
    queue.put_job(make_job_id(1, 0), {}, created_step=1)
    job_id = remote_worker_holding(run, queue, 3, 0.5)  # (a healthy worker: it beat half a second ago)
    code, out, err = run_cli(capsys, "cleanup", run.root, "--stale-after", "0.2")
    assert (code, out) == (2, "")
    assert err == ("queue_tools: error: --stale-after 0.2 is under the workers' heartbeat interval (1 s): every job a "
                   "worker on another host holds would count as stale, a live worker's too; pass --force to "
                   "recover them anyway\n")
    assert (run.queue / f"{job_id}_processing_by_dev3.pt").exists()
    code, out, _ = run_cli(capsys, "cleanup", run.root, "--stale-after", "0.2", "--force")
    assert code == 0 and f"requeue {job_id}_processing_by_dev3.pt" in out


def test_ls_leaves_stale_jobs_to_a_running_parameter_server(run, queue, capsys):
    queue.put_job(make_job_id(1, 0), {}, created_step=1)
    remote_worker_holding(run, queue, 3, 60)
    run.write_ps_status(PSStatus.starting("model", None, {}))  # this process: alive, training
    health = json.loads(run_cli(capsys, "ls", run.root, "--json")[1])["health"]
    assert health.startswith("WARN: 1 stale job(s)") and health.endswith(
        "; the running parameter server recovers them itself"), health


def test_ls_says_a_silent_worker_of_another_host_is_counted_dead_only_past_the_lease(run, queue, capsys):
    """A worker on another host killed with -9: no lock or pid to go by, its heartbeat's age alone. ls says how old
    it is against the lease, and health warns while it is silent."""
    WorkerPresence(run, 1).start().stop()  # (a worker of this host, stopped: no news)
    beat = {"pid": 4242, "host": "elsewhere", "host_id": "another-host", "state": "idle", "job_ids": []}
    run.heartbeat_file(3).write_text(json.dumps(beat))
    backdate(run.heartbeat_file(3), 12)
    _, out, _ = run_cli(capsys, "ls", run.root)
    [line] = [line for line in out.splitlines() if line.strip().startswith("dev3")]
    assert "heartbeat 12.0s ago (on host elsewhere: counted dead once 30s old)" in line, line
    assert ("dev3 on host elsewhere silent for 12s (killed, or cut off?): counted dead once its heartbeat is 30s old "
            "(the lease)") in out.splitlines()[-1]


def test_ls_warns_about_a_live_worker_silent_past_the_lease(run, capsys):
    """A worker stopped with kill -STOP, its job taken back after the lease: alive by its lock, silent, and health
    said OK."""
    presence = WorkerPresence(run, 1, interval_s=3600).start()  # (its lock held; no beat after the first)
    try:
        backdate(run.heartbeat_file(1), LEASE_S + 10)
        _, out, _ = run_cli(capsys, "ls", run.root)
    finally:
        presence.stop()
    assert out.strip().splitlines()[-1] == (
        f"health: WARN: dev1 silent for {LEASE_S + 10:.0f}s, past the lease (stopped or swapped out? kill -CONT "
        f"{os.getpid()} resumes a stopped process)"), out


def test_ls_warns_about_a_worker_behind_a_delta_bad_on_disk(run, capsys):
    presence = WorkerPresence(run, 1, interval_s=3600).start()
    try:
        presence.announce_bad_delta(("a-publisher", 213))
        _, out, _ = run_cli(capsys, "ls", run.root)
    finally:
        presence.stop()
    assert out.strip().splitlines()[-1] == (
        "health: WARN: dev1 found v213's weights delta bad on disk: it keeps older weights until the next anchor (the "
        "parameter server publishes one while it waits)"), out


def test_an_age_a_few_ms_in_the_future_reads_as_zero():
    """A heartbeat written after the fs clock was read is a few ms younger than now: ls showed "-0.0s ago"."""
    from queue_tools.cli import _age

    assert (_age(-0.004), _age(0.04), _age(12.34), _age(None)) == ("0.0s", "0.0s", "12.3s", "-")
