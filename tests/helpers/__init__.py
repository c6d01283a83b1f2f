"""Helpers shared by the tests: the demo task's config and the flags of a short real run, starting
the PS and workers as real processes (or launch.sh, from a user's folder), waiting for a condition
(wait_for: bounded, and failing early when a process it depends on exits), back-dating file mtimes
(leases expire without sleeping), a few small file readers, and the exactly-once check that compares
the ledger, done/ and the jobs the PS threw.

They live in submodules by subject: ``configs`` (the demo task's config and a run's flags, a user's folder),
``processes`` (the repository's paths and the processes' environment, starting, stopping and waiting for processes:
RunProcesses, a run's PS and workers stopped however the test ends; expect_exit, a status checked with the log's end),
``files`` (back-dated mtimes, file modes, small readers of a run's files), ``checks`` (the exactly-once check,
the ledger, the PS's events, a model's values), ``models`` (a real small chat model, made once into a cache
folder) and ``faults`` (a full disk, a second host, a skewed clock).
Every public name of these is re-exported here: tests write ``from helpers import X`` or ``helpers.X``. Two more,
``decoding`` (the decoders' test builders) and ``pipelines`` (the PS's job pipeline in process), import torch,
transformers and TRL, which the processes that import ``helpers`` alone need not pay for: tests import them as
``helpers.decoding`` and ``helpers.pipelines``.
"""

from __future__ import annotations

from .checks import (
    LEDGER_FILE,
    assert_exactly_once,
    assert_groups_exactly_once,
    consumed_in_done,
    duplicates,
    fill,
    held_values,
    ledger,
    newest_checkpoint,
    ps_events,
)
from .configs import DEMO_RUN_FLAGS, REWARDS_PY, demo_config, demo_flags, run_flags, write_user_folder
from .faults import CLOCK_SKEW_DIR, as_other_host, inject_disk_full, other_host_unavailable, tmpfs
from .files import NOBODY, backdate, entries, metrics, modes_beyond, open_as_nobody, read_json, result_payload
from .models import smollm2_instruct
from .processes import (
    OWN_SERVER_ENV,
    PROCESS_ENV,
    PROCESSES,
    PYTHON,
    REPO,
    TESTS,
    RunProcesses,
    dead_pid,
    expect_exit,
    faulty_ps_env,
    heartbeat_pid,
    kill_run,
    launch_in_group,
    launch_sh,
    log_tail,
    parent_of,
    pid_alive,
    process_state,
    start_faulty_ps,
    start_faulty_worker,
    start_process,
    start_ps_ranks,
    start_script,
    start_zygote,
    stopped_status,
    wait_for,
    wait_until_stopped,
)

__all__ = [
    "CLOCK_SKEW_DIR",
    "DEMO_RUN_FLAGS",
    "LEDGER_FILE",
    "NOBODY",
    "OWN_SERVER_ENV",
    "PROCESS_ENV",
    "PROCESSES",
    "PYTHON",
    "REPO",
    "REWARDS_PY",
    "TESTS",
    "RunProcesses",
    "as_other_host",
    "assert_exactly_once",
    "assert_groups_exactly_once",
    "backdate",
    "consumed_in_done",
    "dead_pid",
    "demo_config",
    "demo_flags",
    "duplicates",
    "entries",
    "expect_exit",
    "faulty_ps_env",
    "fill",
    "heartbeat_pid",
    "held_values",
    "inject_disk_full",
    "kill_run",
    "launch_in_group",
    "launch_sh",
    "ledger",
    "log_tail",
    "metrics",
    "modes_beyond",
    "newest_checkpoint",
    "open_as_nobody",
    "other_host_unavailable",
    "parent_of",
    "pid_alive",
    "process_state",
    "ps_events",
    "read_json",
    "result_payload",
    "run_flags",
    "start_faulty_ps",
    "start_faulty_worker",
    "start_zygote",
    "start_process",
    "start_ps_ranks",
    "start_script",
    "stopped_status",
    "tmpfs",
    "wait_for",
    "wait_until_stopped",
    "smollm2_instruct",
    "write_user_folder",
]
