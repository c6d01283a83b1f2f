"""Once the PS's trainer is built, no environment variable is added or removed.

From then on other threads run that read the environment in C (TRL's telemetry thread resolving a
host name calls glibc's getenv): adding or removing a variable can make glibc move the environment
array and free the old one under such a reader, a rare SIGSEGV. Replacing a value is safe (glibc
swaps one pointer and frees nothing). A real PS and worker train two steps with ``os.putenv`` and
``os.unsetenv`` (what every ``os.environ`` write calls) wrapped to record what they do.
"""

import json
import os

import pytest
from helpers import PROCESS_ENV, REPO, expect_exit, run_flags, start_process

TIMEOUT_S = 600
FLAGS = run_flags(2, save_steps=2)

RECORD_WRITES = """\
# asyncgrpo.forkserver: runs in a fork too
import json, os, threading, traceback
from ps import trainer

_log = os.environ["TEST_ENV_WRITES_LOG"]  # read now: accelerate empties os.environ for a moment while it builds
_built = False


def _record(what, key=None):
    entry = {"what": what, "key": key, "threads": [t.name for t in threading.enumerate()],
             "stack": traceback.format_stack()[-8:-2]}
    with open(_log, "a") as f:
        f.write(json.dumps(entry) + "\\n")


_init = trainer.AsyncGRPOTrainer.__init__


def __init__(self, *args, **kwargs):
    global _built
    _init(self, *args, **kwargs)
    _built = True
    _record("trainer built")


_putenv, _unsetenv = os.putenv, os.unsetenv


def putenv(key, value):  # os.environ calls it before it updates its own mapping
    if _built and os.fsdecode(key) not in os.environ:
        _record("added", os.fsdecode(key))
    _putenv(key, value)


def unsetenv(key):
    if _built and os.fsdecode(key) in os.environ:
        _record("removed", os.fsdecode(key))
    _unsetenv(key)


trainer.AsyncGRPOTrainer.__init__ = __init__
os.putenv, os.unsetenv = putenv, unsetenv
"""


@pytest.mark.process
def test_no_environment_variable_is_added_or_removed_once_the_trainer_is_built(tmp_path):
    inject = tmp_path / "inject"
    inject.mkdir()
    (inject / "sitecustomize.py").write_text(RECORD_WRITES)
    writes = tmp_path / "env_writes.jsonl"
    env = {**PROCESS_ENV, "PYTHONPATH": os.pathsep.join([str(inject), str(REPO)]), "TEST_ENV_WRITES_LOG": str(writes)}
    run_root = tmp_path / "run"
    ps = start_process(run_root, tmp_path / "ps.log", "ps", *FLAGS, env=env)
    worker = start_process(run_root, tmp_path / "w1.log", "worker", "--device", "1", *FLAGS)
    try:
        expect_exit(ps, 0, tmp_path / "ps.log", TIMEOUT_S)
    finally:
        worker.terminate()
        worker.wait(timeout=120)
    records = [json.loads(line) for line in writes.read_text().splitlines()]
    assert records[0]["what"] == "trainer built"  # the hook ran in the PS
    assert (run_root / "global_step.txt").read_text().strip() == "2"  # it trained and published weights
    changes = records[1:]
    assert not changes, "\n".join(f"{r['what']} {r['key']} (threads {r['threads']}):\n{''.join(r['stack'])}"
                                  for r in changes)
