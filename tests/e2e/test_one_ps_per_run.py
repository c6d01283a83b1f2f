"""One parameter server per run directory: a second `launch.sh` on a run in use is refused before it starts
anything, in its own terminal, with the running PS named; the running PS's log shows nothing of it."""

import socket

from helpers import launch_sh, start_process, wait_for

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
