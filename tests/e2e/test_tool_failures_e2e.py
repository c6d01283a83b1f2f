"""Failed tool calls reach the operator: `bash launch.sh` with the tool-calling task and a user's tool that raises.
Each failure's text is on the terminal once (the workers' [tools]
lines, rate-limited), the [train] lines carry the failure rate, and `queue_tools ls` warns."""

from helpers import launch_sh

RAISING = '''
def lookup(key: int) -> str:
    """Look up the secret digit stored under a key.

    Args:
        key: The key to look up, a digit.
    """
    raise RuntimeError("database unavailable")
'''

def test_failed_tool_calls_are_on_the_terminal_in_the_train_lines_and_in_ls(tmp_path):
    # A tool of another name than the model calls fails the same way, counted and logged alike: see
    # tests/worker/test_multi_turn.py (its [tools] line names the tools the run has).
    failure = "[tools] lookup: RuntimeError: database unavailable (the first such failure"
    (tmp_path / "mytools.py").write_text(RAISING)
    result = launch_sh(tmp_path, "--workers", "2", "--run-dir", str(tmp_path / "run"), "--builtin_task", "lookup",
                       "--tools", "mytools:lookup", "--max-steps", "4", "--seed", "0")
    assert result.returncode == 0, result.stderr[-3000:]
    out = result.stdout
    shown = [line for line in out.splitlines() if " WARNING [tools] " in line]
    # One line per worker that met the failure (each logs its first at once; repeats wait for 60 s).
    assert shown and all(line.split(" WARNING ")[1].startswith(failure) for line in shown), shown
    assert len(shown) <= 2
    steps = [line for line in out.splitlines() if "[train] step=" in line]
    assert len(steps) == 4 and all(line.endswith(" tool_failures=100%") for line in steps), steps
    assert "health: WARN: 100% of the tool calls failed at step 4" in out


HANGING_FROM_THE_SECOND_JOB = '''
import time


class SlowAfterFirstJob:
    """The lookup tool, which hangs from each environment's second rollout on (TRL resets an environment of its
    pool once per job)."""

    def __init__(self):
        self.resets = 0

    def reset(self, key: int, secret: int, **row) -> None:
        self.resets += 1
        self.secret = secret

    def lookup(self, key: int) -> str:
        """Look up the secret digit stored under a key.

        Args:
            key: The key to look up, a digit.
        """
        if self.resets >= 2:
            time.sleep(3600)
        return str(self.secret)

    def get_reward(self) -> float:
        return 0.0
'''


def test_a_run_that_ends_while_tools_hang_leaves_no_job_behind(tmp_path):
    """The PS trains on the first jobs and finishes while both workers hang in a tool call of their next job (a
    bound of 600 s): stopped, each cuts its calls and gives its job back at once (not killed 30 s later with the
    job in hand), and launch.sh archives what is left unused: nothing pending or processing, health OK."""
    (tmp_path / "hangenv.py").write_text(HANGING_FROM_THE_SECOND_JOB)
    run = tmp_path / "run"
    result = launch_sh(tmp_path, "--workers", "2", "--run-dir", str(run), "--builtin_task", "lookup",
                       "--environment_factory", "hangenv:SlowAfterFirstJob", "--tool_timeout_s", "600",
                       "--lease_s", "4", "--max-steps", "2", "--seed", "0")
    assert result.returncode == 0, result.stderr[-3000:]
    out = result.stdout
    assert "queue: pending:0 processing:0 committing:0 complete:0 collected:0 (oldest pending -)" in out, out
    assert out.strip().splitlines()[-1].startswith("health: OK"), out
    for n in (1, 2):
        log = (run / "logs" / f"log_worker_{n}.txt").read_text()
        assert f"[queue] dev{n} gave job=" in log and f"[worker] dev{n} stopped" in log, log[-2000:]
    assert "pending after training was over" in (run / "logs" / "launch.txt").read_text()
