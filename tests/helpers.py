"""Helpers shared by the tests: the demo task's config and the flags of a short real run, starting
the PS and workers as real processes (or launch.sh, from a user's folder), waiting for a condition
(wait_for: bounded, and failing early when a process it depends on exits), back-dating file mtimes
(leases expire without sleeping), a few small file readers, and the exactly-once check that compares
the ledger, done/ and the jobs the PS threw.

The exactly-once helpers read the run directory directly (folder names, file names, JSON),
never through the library code they check.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import json
import os
import re
import signal
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

from zygote import FORK, ForkedProcess

from asyncgrpo.jobqueue.queue import SCHEMA_VERSION

REPO = Path(__file__).resolve().parents[1]
TESTS = REPO / "tests"
# One thread per process: the tests start several on a machine with few cores.
PROCESS_ENV = {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false", "PYTHONUNBUFFERED": "1"}


def run_flags(max_steps: int | None = None, *, save_steps: int | None = None, lease_s: float | None = 4,
              seed: int = 0) -> list[str]:
    """The flags of a short real run: ``max_steps`` (left out: None), a lease short enough to recover a killed
    worker's job quickly (``lease_s``; None: the default lease), a checkpoint every ``save_steps`` steps (None:
    the run's default checkpoints), and a seed."""
    flags = [] if max_steps is None else ["--max_steps", str(max_steps)]
    if lease_s is not None:
        flags += ["--lease_s", f"{lease_s:g}"]
    if save_steps is not None:
        flags += ["--save_strategy", "steps", "--save_steps", str(save_steps)]
    return [*flags, "--seed", str(seed)]


# The demo task, 8 steps, checkpoints at steps 3 and 6 (and the final one).
DEMO_RUN_FLAGS = run_flags(8, save_steps=3)
LEDGER_FILE = "asyncgrpo_state.json"  # in each checkpoint folder; written last, it marks the checkpoint complete


# ---------------------------------------------------------------------- the demo task's config


def demo_config(tmp_path, *flags: str, **fields):
    """The demo task's AsyncGRPOConfig as every process parses it: ``parse_config`` with no model, dataset or
    reward flag, so the demo module's table (asyncgrpo.tasks.demo.DEMO_DEFAULTS, and the demo's checkpoints)
    fills the rest; on CPU, seed 0, no progress bars, output in ``tmp_path/out``. Then ``flags`` (command-line
    words) and ``fields`` (name=value, passed as flags: a list as several words, a dict as JSON, None not at all,
    leaving the field's default): they win."""
    from asyncgrpo.config import parse_config

    argv = ["--device_type", "cpu", "--seed", "0", "--disable_tqdm", "true",
            "--output_dir", str(Path(tmp_path) / "out"), *flags]
    for name, value in fields.items():
        if value is None:
            continue
        if isinstance(value, (list, tuple)):
            argv += [f"--{name}", *map(str, value)]
        else:
            argv.append(f"--{name}={json.dumps(value) if isinstance(value, dict) else value}")
    return parse_config(argv)


def demo_flags() -> list[str]:
    """The demo task's settings (DEMO_DEFAULTS) as command-line flags, for a run that names its own model,
    dataset or reward function: any of them turns the demo's defaults off (asyncgrpo.config). max_steps is left
    out (a test's run has its own length)."""
    from asyncgrpo.tasks.demo import DEMO_DEFAULTS

    return [f"--{name}={value}" for name, value in DEMO_DEFAULTS.items() if name != "max_steps"]


# ---------------------------------------------------------------------- waiting


def wait_for(condition, what: str, timeout: float = 60, *, procs=(), log=None, poll_s: float = 0.05):
    """Calls ``condition()`` every ``poll_s`` seconds until it returns something truthy, and returns that.

    Fails (AssertionError) naming ``what`` and the timeout after ``timeout`` seconds, and at once, with its
    exit status, when a process in ``procs`` (subprocess.Popen) has exited while the condition does not hold
    (it would never come true). ``log``: a file (a process's output) whose last 3000 characters end the message."""
    deadline = time.monotonic() + timeout
    while True:
        value = condition()
        if value:
            return value
        exited = [proc for proc in procs if proc.poll() is not None]
        if exited or time.monotonic() >= deadline:
            why = "; ".join(f"{_process_name(p)} (pid {p.pid}) exited with status {p.returncode}" for p in exited)
            message = f"{why} while waiting for {what}" if why else f"waited {timeout:g} s for {what}"
            if log is not None and Path(log).exists():
                message += "\n" + Path(log).read_text(errors="replace")[-3000:]
            raise AssertionError(message)
        time.sleep(poll_s)


def _process_name(proc: subprocess.Popen) -> str:
    args = [proc.args] if isinstance(proc.args, (str, bytes, os.PathLike)) else list(proc.args)
    return " ".join(os.path.basename(str(a)) if i == 0 else str(a) for i, a in enumerate(args[:3]))


def process_state(pid: int) -> str | None:
    """The state letter of ``pid`` in /proc (R, S, T stopped, Z zombie, ...), or None when it is gone."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, ProcessLookupError):
        return None


def wait_until_stopped(proc: subprocess.Popen, timeout: float, poll_s: float = 0.01) -> None:
    """Waits until ``proc`` is stopped (SIGSTOP: state T); fails if it exits first."""
    wait_for(lambda: process_state(proc.pid) == "T", f"{_process_name(proc)} (pid {proc.pid}) to stop (SIGSTOP)",
             timeout, procs=(proc,), poll_s=poll_s)


# ---------------------------------------------------------------------- processes


def start_process(run_root, log_path, module: str, *args: str, env: dict | None = None):
    """``python -m module --run_dir RUN args...`` from the repository, its output appended to ``log_path``;
    ``env`` defaults to PROCESS_ENV. With the suite's environment the process is forked from the zygote
    (tests/zygote.py: the libraries already imported), else a new interpreter (subprocess.Popen)."""
    argv = ["--run_dir", str(run_root), *args]
    if env is None and FORK:
        return ForkedProcess(module, argv, log_path, cwd=REPO, env=PROCESS_ENV)
    with open(log_path, "ab") as log:
        return subprocess.Popen([sys.executable, "-m", module, *argv], cwd=REPO,
                                env=PROCESS_ENV if env is None else env, stdout=log, stderr=subprocess.STDOUT)


def faulty_ps_env(fault: str, arg: int) -> dict:
    """The environment of ``python -m faulty_ps``: the PS with ``fault`` injected (tests/faulty_ps.py says
    which: "kill-mid-save", "full-metrics", ...)."""
    return {**PROCESS_ENV, "PS_FAULT": f"{fault} {arg}",
            "PYTHONPATH": os.pathsep.join(p for p in (str(TESTS), str(REPO), PROCESS_ENV.get("PYTHONPATH")) if p)}


def start_faulty_ps(run_root, log_path, fault: str, arg: int, *args: str):
    if FORK:  # the fault is read when faulty_ps starts: the zygote's child sets it
        return ForkedProcess("faulty_ps", ["--run_dir", str(run_root), *args], log_path, cwd=REPO, env=PROCESS_ENV,
                             extra_env={"PS_FAULT": f"{fault} {arg}"})
    return start_process(run_root, log_path, "faulty_ps", *args, env=faulty_ps_env(fault, arg))


def start_ps_ranks(run_root, log_path, processes: int, *args: str) -> subprocess.Popen:
    """The PS as ``processes`` data-parallel ranks: ``torchrun --standalone --nproc_per_node N -m ps`` (gloo on
    CPU), with --ps_processes N; its output appended to ``log_path``."""
    with open(log_path, "ab") as log:
        return subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--standalone",
                                 "--nproc_per_node", str(processes), "--log-dir",
                                 str(Path(log_path).parent / "torchrun"), "-m", "ps", "--run_dir", str(run_root),
                                 "--ps_processes", str(processes), *args],
                                cwd=REPO, env=PROCESS_ENV, stdout=log, stderr=subprocess.STDOUT)


def start_script(script, *args: str, env: dict | None = None, **popen) -> subprocess.Popen:
    """``python script args...`` (a test file that is also its subprocesses' script, ...), stdout piped as text.
    PROCESS_ENV plus ``env``; tests/ and the repository on the path, so the script imports helpers and
    asyncgrpo as a test does. ``env`` values of None remove a variable."""
    env = {**PROCESS_ENV, **(env or {})}
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(TESTS), str(REPO), env.get("PYTHONPATH")) if p)
    env = {k: v for k, v in env.items() if v is not None}
    return subprocess.Popen([sys.executable, str(script), *args], stdout=subprocess.PIPE, text=True, env=env, **popen)


def launch_sh(cwd, *args: str, timeout: float = 600) -> subprocess.CompletedProcess:
    """``bash launch.sh args...`` run from ``cwd`` (as a user runs it from their folder), to its end."""
    return subprocess.run(["bash", str(REPO / "launch.sh"), *args], cwd=cwd, env=PROCESS_ENV, capture_output=True,
                          text=True, timeout=timeout)


REWARDS_PY = """\
import os
from pathlib import Path


def ones(prompts, completions, **kwargs):
    with open(Path(__file__).parent / "reward_calls.txt", "a") as f:  # who called: the PS (evaluation), workers
        f.write(f"{os.getpid()}\\n")
    return [c.count("1") / max(1, len(c)) for c in completions]
"""


def write_user_folder(folder) -> Path:
    """A TRL user's folder: ``mymodel/`` (the tiny demo Llama, float32, with its tokenizer), ``data/`` with a
    train and a test split (train.jsonl: prompts "0:".."7:", test.jsonl: two), and ``rewards.py`` whose
    ``ones`` appends the calling process's pid to ``reward_calls.txt``."""
    from asyncgrpo.tasks.demo import write_demo_model

    folder = Path(folder)
    write_demo_model(folder / "mymodel")
    (folder / "data").mkdir()
    (folder / "data" / "train.jsonl").write_text("".join(json.dumps({"prompt": f"{i}:"}) + "\n" for i in range(8)))
    (folder / "data" / "test.jsonl").write_text("".join(json.dumps({"prompt": f"{i}:"}) + "\n" for i in (1, 2)))
    (folder / "rewards.py").write_text(REWARDS_PY)
    return folder


CLOCK_SKEW_DIR = REPO / "tests" / "clock_skew"  # its sitecustomize shifts time.time() by $ASYNCGRPO_TEST_CLOCK_OFFSET_S
_OTHER_HOST_SHELL = 'hostname "$0" && mount -t tmpfs tmpfs /dev/shm && exec "$@"'


def as_other_host(argv: list[str], hostname: str = "otherhost") -> list[str]:
    """``argv`` run as on a second host: its own hostname (a UTS namespace) and its own, empty
    /dev/shm (a mount namespace); the same kernel, pids and run directory. Needs root."""
    return ["unshare", "-u", "-m", "--propagation", "private", "sh", "-c", _OTHER_HOST_SHELL, hostname, *argv]


def other_host_unavailable() -> str | None:
    """Why ``as_other_host`` cannot work here (for pytest.skip), or None when it can."""
    try:
        result = subprocess.run(as_other_host(["true"]), capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired) as err:
        return f"unshare cannot run: {err}"
    if result.returncode != 0:
        return f"unshare -u -m cannot make a second host here: {result.stderr.strip()[:200]}"
    return None


def pid_alive(pid: int) -> bool:
    """True while ``pid`` runs (a zombie counts as gone)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return process_state(pid) not in (None, "Z")


def heartbeat_pid(run_root, device, timeout: float, not_pid: int | None = None, procs=()) -> int:
    """The pid in worker ``device``'s heartbeat (RUN/workers/devN.json), once it beats with one (other than
    ``not_pid``: a restarted worker beats with its own); ``procs`` as for wait_for."""
    path = Path(run_root) / "workers" / f"dev{device}.json"

    def beating_pid():
        pid = read_json(path).get("pid")
        return pid if pid and pid != not_pid else None

    return wait_for(beating_pid, f"worker {device} to beat" + (f" with a pid other than {not_pid}" if not_pid else ""),
                    timeout, procs=procs, poll_s=0.1)


def kill_run(run_root, launcher: subprocess.Popen) -> None:
    """Cleanup after a launch.sh test: SIGKILLing bash would leave its children running."""
    launcher.kill()
    for path in [Path(run_root) / "ps.json", *Path(run_root).glob("workers/dev*.json")]:
        pid = read_json(path).get("pid")
        if pid and pid_alive(pid):
            os.kill(pid, signal.SIGKILL)


# ---------------------------------------------------------------------- files


def backdate(path, seconds: float) -> None:
    """Moves a file's mtime (and atime) ``seconds`` into the past, without following symlinks."""
    st = os.lstat(path)
    os.utime(path, (st.st_atime - seconds, st.st_mtime - seconds), follow_symlinks=False)


def modes_beyond(root, allowed: int) -> list[str]:
    """``root`` and everything under it whose permission bits go beyond ``allowed`` (0o700: the owner's alone),
    as "path 0oMODE"; symbolic links have no mode of their own and are left out."""
    found = []
    for path in [Path(root), *Path(root).rglob("*")]:
        try:
            st = path.lstat()
        except FileNotFoundError:  # replaced while we walk a live run
            continue
        if not path.is_symlink() and st.st_mode & 0o777 & ~allowed:
            found.append(f"{path} {oct(st.st_mode & 0o7777)}")
    return found


NOBODY = 65534


def open_as_nobody(folder, name: str, groups: tuple[int, ...] = ()) -> bool:
    """Whether the user nobody (member of ``groups``) can open ``folder/name`` for reading. It starts inside
    ``folder`` (an open descriptor passed down), so that only the folder's and the file's modes are in
    question, not those of the folders above. Needs root; /bin/sh, as nobody cannot run root's Python."""
    fd = os.open(folder, os.O_RDONLY | os.O_DIRECTORY)
    try:
        result = subprocess.run(["/bin/sh", "-c", f'cd /proc/self/fd/{fd} && exec 9< "$0"', name], pass_fds=(fd,),
                                user=NOBODY, group=NOBODY, extra_groups=list(groups), capture_output=True,
                                text=True, timeout=60, cwd="/")
    finally:
        os.close(fd)
    assert result.returncode == 0 or "can't cd" in result.stderr or "Permission denied" in result.stderr, result.stderr
    return result.returncode == 0


def read_json(path) -> dict:
    """A JSON object file, or {} when it is missing, empty or unreadable (being rewritten)."""
    try:
        return json.loads(Path(path).read_text() or "{}")
    except (OSError, ValueError):
        return {}


def metrics(run_root) -> list[dict]:
    """The lines of RUN/metrics.jsonl ([] before the first step)."""
    path = Path(run_root) / "metrics.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def entries(directory) -> set[str]:
    """Names in a directory, queue/.tmp excluded."""
    return set(os.listdir(directory)) - {".tmp"}


def result_payload(job_id, device, attempt=1, marker=""):
    """A valid result payload as a worker writes it, with ``marker`` as its data."""
    return {"schema": SCHEMA_VERSION, "kind": "result", "job_id": job_id, "attempt": attempt,
            "worker_device": device, "weights_version": 0, "claimed_at": 0.0, "completed_at": 0.0,
            "data": {"marker": marker}}


# ---------------------------------------------------------------------- exactly once

_CONSUMED_RE = re.compile(r"^(?P<job_id>\d{6}_\d{3})_consumed(?:_a\d+)?(?:\.\d+)?\.pt$")
_CHECKPOINT_RE = re.compile(r"^checkpoint-(\d+)$")


def newest_checkpoint(run_root) -> Path:
    """The checkpoint folder with the highest step, which must hold its ledger (it is the one
    a finished PS saved last)."""
    folders = [(int(m[1]), p) for p in (Path(run_root) / "checkpoints").iterdir()
               if (m := _CHECKPOINT_RE.match(p.name))]
    assert folders, f"no checkpoint in {run_root}/checkpoints"
    folder = max(folders)[1]
    assert (folder / LEDGER_FILE).is_file(), f"the newest checkpoint {folder.name} has no ledger"
    return folder


def ledger(run_root) -> list[str]:
    """The ``consumed`` list of the newest checkpoint's asyncgrpo_state.json, as saved (a list)."""
    consumed = json.loads((newest_checkpoint(run_root) / LEDGER_FILE).read_text())["consumed"]
    assert isinstance(consumed, list), consumed
    return consumed


def consumed_in_done(run_root) -> list[str]:
    """One job id per file in done/ archived as consumed, whatever its suffixes (attempt,
    collision): a job archived as consumed twice shows up twice here."""
    return [m["job_id"] for name in os.listdir(Path(run_root) / "done") if (m := _CONSUMED_RE.match(name))]


def ps_events(run_root, event: str) -> list[dict]:
    """Every ``event`` line in RUN/logs/events-ps.jsonl, in file order, over all PS processes of the
    run (a relaunched PS appends to the same file). A line a killed PS left torn is skipped."""
    path = Path(run_root) / "logs" / "events-ps.jsonl"
    records = []
    for line in path.read_text().splitlines():
        try:
            record = json.loads(line)
        except ValueError:
            continue
        if record.get("event") == event:
            records.append(record)
    return records


def duplicates(values: list) -> dict:
    return {value: n for value, n in Counter(values).items() if n > 1}


def assert_exactly_once(run_root, jobs: int) -> list[str]:
    """The newest checkpoint's ledger holds ``jobs`` job ids, none twice; done/ holds exactly one
    consumed file for each of them and for no other job; each is a job the PS threw (a
    ``job_created`` event), and no job id was thrown twice. Returns the ledger."""
    in_ledger = ledger(run_root)
    in_done = consumed_in_done(run_root)
    created = [r["job_id"] for r in ps_events(run_root, "job_created")]
    assert not duplicates(in_ledger), f"job ids twice in the ledger: {duplicates(in_ledger)}"
    assert not duplicates(in_done), f"job ids archived as consumed more than once: {duplicates(in_done)}"
    assert not duplicates(created), f"job ids thrown more than once: {duplicates(created)}"
    assert len(in_ledger) == jobs, f"the ledger holds {len(in_ledger)} job ids, expected {jobs}"
    assert sorted(in_done) == sorted(in_ledger), (
        f"ledger and done/ disagree: only in the ledger {sorted(set(in_ledger) - set(in_done))}, "
        f"only in done/ {sorted(set(in_done) - set(in_ledger))}")
    assert set(in_ledger) <= set(created), f"consumed but never thrown: {sorted(set(in_ledger) - set(created))}"
    return in_ledger


def assert_groups_exactly_once(run_root, steps: int) -> dict:
    """Exactly-once per group (dynamic sampling): over steps 1..``steps``, each as the last PS life to train it
    trained it (``result_consumed`` events; a killed PS's steps after its checkpoint were trained again), no
    group of any result trains twice; every group of each result in the final ledger was trained or dropped
    (``groups_dropped``), never both; done/ holds one consumed file per ledger entry. Returns
    {"trained": {(job, group), ...}, "dropped": {...}, "split": job ids whose groups trained in two steps}."""
    by_step: dict[int, dict[int, list]] = {}
    for e in ps_events(run_root, "result_consumed"):
        by_step.setdefault(e["step"], {}).setdefault(e["pid"], []).append(e)
    assert sorted(by_step) == list(range(1, steps + 1)), sorted(by_step)
    trained, of_groups, steps_of = [], {}, {}
    for step, lives in by_step.items():
        for e in list(lives.values())[-1]:
            trained += [(e["job_id"], g) for g in e["groups"]]
            of_groups[e["job_id"]] = e["of_groups"]
            steps_of.setdefault(e["job_id"], set()).add(step)
    assert not duplicates(trained), f"groups trained twice: {duplicates(trained)}"
    created = [r["job_id"] for r in ps_events(run_root, "job_created")]
    assert not duplicates(created), f"job ids thrown more than once: {duplicates(created)}"
    dropped = {(e["job_id"], g) for e in ps_events(run_root, "groups_dropped") for g in e["groups"]}
    assert not set(trained) & dropped, f"groups both trained and dropped: {sorted(set(trained) & dropped)}"
    in_ledger, in_done = ledger(run_root), consumed_in_done(run_root)
    assert not duplicates(in_ledger) and sorted(in_done) == sorted(in_ledger), (in_ledger, in_done)
    assert {job for job, _ in trained} <= set(in_ledger), "a result trained from is missing in the ledger"
    for job in in_ledger:
        missing = [g for g in range(of_groups[job]) if (job, g) not in dropped and (job, g) not in trained]
        assert not missing or max(steps_of[job]) == steps, f"{job}: groups {missing} neither trained nor dropped"
    return {"trained": set(trained), "dropped": dropped,
            "split": {job for job, at in steps_of.items() if len(at) > 1}}


def fill(model, value: int) -> None:
    """Every tensor of ``model`` (parameters and buffers) set to ``value``."""
    import torch

    with torch.no_grad():
        for t in model.state_dict().values():
            t.fill_(value)


def held_values(model) -> list[float]:
    """The distinct values in ``model``, sorted (one value per tensor is checked exactly)."""
    return sorted({float(v) for t in model.state_dict().values() for v in (t.min().item(), t.max().item())})


# ---------------------------------------------------------------------- faults


_libc = ctypes.CDLL(None, use_errno=True)
_libc.mount.argtypes = [ctypes.c_char_p, ctypes.c_char_p, ctypes.c_char_p, ctypes.c_ulong, ctypes.c_char_p]
_libc.umount2.argtypes = [ctypes.c_char_p, ctypes.c_int]
_MNT_DETACH = 2


@contextlib.contextmanager
def tmpfs(path, size: str):
    """A real filesystem of ``size`` (e.g. "64k") mounted at ``path`` for the block: a disk that fills up. Skips
    the test where mounting is not allowed (it needs root / CAP_SYS_ADMIN)."""
    import pytest

    if _libc.mount(b"tmpfs", os.fsencode(path), b"tmpfs", 0, f"size={size}".encode()) != 0:
        code = ctypes.get_errno()
        if code in (errno.EPERM, errno.EACCES):
            pytest.skip(f"cannot mount a tmpfs here: {os.strerror(code)} (needs root / CAP_SYS_ADMIN)")
        raise OSError(code, f"mount tmpfs at {path}: {os.strerror(code)}")
    try:
        yield Path(path)
    finally:
        if _libc.umount2(os.fsencode(path), 0) != 0:
            _libc.umount2(os.fsencode(path), _MNT_DETACH)


def _fd_in(fd, directory) -> bool:
    try:
        return os.readlink(f"/proc/self/fd/{fd}").startswith(str(directory) + os.sep)
    except OSError:
        return False


def inject_disk_full(m, run, where):
    """Makes writes of temp files in ``run.tmp`` fail like a full disk (other fds untouched).

    write:  a short write of half the first chunk, then ENOSPC (what a filling disk does)
    quota:  the same with EDQUOT
    fsync:  all data written, then fsync fails with ENOSPC (delayed allocation, NFS)
    """
    real_write, real_fsync = os.write, os.fsync
    code = errno.EDQUOT if where == "quota" else errno.ENOSPC
    state = {"writes": 0, "failed": 0}

    def write(fd, data):
        if where in ("write", "quota") and _fd_in(fd, run.tmp):
            state["writes"] += 1
            if state["writes"] == 1 and len(data) > 1:
                return real_write(fd, memoryview(data)[: len(data) // 2])
            state["failed"] += 1
            raise OSError(code, os.strerror(code))
        return real_write(fd, data)

    def fsync(fd):
        if where == "fsync" and _fd_in(fd, run.tmp):
            state["failed"] += 1
            raise OSError(code, os.strerror(code))
        return real_fsync(fd)

    from asyncgrpo.run import fileops

    m.setattr(fileops.os, "write", write)
    m.setattr(fileops.os, "fsync", fsync)
    return state
