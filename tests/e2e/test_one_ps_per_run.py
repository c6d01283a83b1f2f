"""One parameter server per run directory: a second `launch.sh` on a run in use is refused before it starts
anything, in its own terminal, with the running PS named; the running PS's log shows nothing of it."""

import signal
import socket
import subprocess

from helpers import PROCESS_ENV, REPO, launch_sh, start_process, wait_for

TIMEOUT_S = 300


def test_a_second_launch_on_a_run_in_use_is_refused_up_front(tmp_path):
    root = tmp_path / "run"
    ps = start_process(root, tmp_path / "ps.log", "ps", "--max_steps", "100000", "--seed", "0")  # no workers: it waits
    try:
        # ps.json is written once the PS holds the run's lock and trains.
        wait_for((root / "ps.json").exists, "the first PS to start", TIMEOUT_S, procs=(ps,), log=tmp_path / "ps.log",
                 poll_s=0.1)
        ps_log_before = (tmp_path / "ps.log").read_text()

        second = launch_sh(tmp_path, "--workers", "2", "--run-dir", str(root), "--max-steps", "5", timeout=TIMEOUT_S)

        assert second.returncode == 3, second.stderr[-3000:]
        errors = [line for line in second.stderr.splitlines() if "error" in line]
        assert errors == [f"ps: error: another parameter server is running on {root} (pid {ps.pid} on "
                          f"{socket.gethostname()})"], second.stderr
        assert "[launch]" not in second.stdout  # it started nothing: no run announced, no process, no log
        assert not (root / "logs" / "log_parameter_server.txt").exists()
        assert not list((root / "logs").glob("log_worker_*"))
        assert ps.poll() is None  # the running PS goes on, its log untouched by the refusal
        assert "another parameter server" not in (tmp_path / "ps.log").read_text()[len(ps_log_before):]
    finally:
        ps.terminate()
        ps.wait(timeout=120)


def test_launches_at_the_same_instant_start_one_run_and_the_others_nothing(tmp_path):
    """All pass the check that no PS runs (none does yet); the run folder is claimed before anything starts, so
    one trains and the others exit 3 naming it, having started and written nothing. Three at a time."""
    host = socket.gethostname()
    root = tmp_path / "run"
    cmd = ["bash", str(REPO / "launch.sh"), "--workers", "1", "--run-dir", str(root), "--max-steps", "100000"]
    launches = [subprocess.Popen(cmd, cwd=tmp_path, env=PROCESS_ENV, stdout=subprocess.PIPE,
                                 stderr=subprocess.PIPE, text=True, start_new_session=True) for _ in range(3)]
    try:
        def two_exited(launches=launches):
            exited = [p for p in launches if p.poll() is not None]
            return exited if len(exited) >= 2 else None

        exited = wait_for(two_exited, "two launches of three to exit", TIMEOUT_S)
        assert len(exited) == 2, [p.communicate() for p in exited]
        winner = next(p for p in launches if p not in exited)
        wait_for((root / "ps.json").exists, "the winner's PS to start", TIMEOUT_S, procs=(winner,))
        for loser in exited:
            out, err = loser.communicate()
            assert loser.returncode == 3, err[-3000:]
            assert err.splitlines() == [f"launch.sh: error: another launch.sh is running on {root} "
                                        f"(pid {winner.pid} on {host}); nothing started"], err
            assert "[launch]" not in out
        # Only the winner's run: one announcement, one PS, one worker (no second worker took its slot).
        announced = (root / "logs" / "launch.txt").read_text()
        assert announced.count("run directory") == 1, announced
        assert [p.name for p in (root / "logs").glob("log_worker_*")] == ["log_worker_1.txt"]
        assert winner.poll() is None
    finally:
        for p in launches:
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)  # launch.sh stops its PS and workers
        for p in launches:
            p.communicate(timeout=120)
