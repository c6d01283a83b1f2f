"""The run directory: one folder holds everything a run writes (docs/design.md, "The run directory").

``RunDir`` names every file and folder at the top of a run, and reads and writes the small
files there (``ps.json``, ``global_step.txt``). The names inside ``queue/`` and ``done/`` are
the queue's grammar (asyncgrpo/jobqueue/names.py); the files inside ``weights/`` are the
transports' (asyncgrpo/weights/base.py). The checkpoint folders and the ledger in each are read and
written by asyncgrpo/run/checkpoints.py, the lines of ``metrics.jsonl`` by asyncgrpo/run/metrics.py.
"""

from __future__ import annotations

import dataclasses
import os
import re
import socket
import time
from dataclasses import dataclass, field
from pathlib import Path

from asyncgrpo.run import fileops
from asyncgrpo.run.hosts import HOST_ID

# Where launch.sh puts runs when no --run-dir is given, and where `queue_tools ls`
# looks for the most recent one. Outside the source tree on purpose.
DEFAULT_RUNS_DIR = "~/asyncgrpo-runs"


# A worker id: a device number, then ".{host id}" for a worker that joined from another host.
WORKER_ID = r"(?:0|[1-9]\d{0,2})(?:\.[A-Za-z0-9]{1,16})?"
WorkerId = int | str  # 3, or "3.{host id}" for a worker that joined from another host


def worker_id(device: int, host_id: str | None = None) -> WorkerId:
    """The id of worker ``device``; with ``host_id``, of that worker on a joined host."""
    return device if host_id is None else f"{device}.{host_id}"


def parse_worker_id(text: str) -> WorkerId | None:
    """``"3"`` -> 3, ``"3.3f9a2c1d"`` -> itself, anything else -> None."""
    if not re.fullmatch(WORKER_ID, text):
        return None
    return text if "." in text else int(text)


def runs_dir() -> Path:
    """The runs folder: $ASYNCGRPO_RUNS, else DEFAULT_RUNS_DIR."""
    return Path(os.environ.get("ASYNCGRPO_RUNS") or DEFAULT_RUNS_DIR).expanduser()


MPS_ENV = "ASYNCGRPO_MPS"  # set by launch.sh for the processes it starts: "on", or "off: why"


@dataclass(frozen=True)
class PSStatus:
    """``RUN/ps.json``: which parameter server the run has (or had) and where it stands.

    The PS writes it when it starts training (``state="training"``) and when it has saved the final
    model (``state="finished"``); a worker waits for it before loading the model and refuses a job
    whose ``generation`` settings differ from its own (AsyncGRPOConfig.generation_mismatch).
    """

    pid: int
    host: str
    model: str  # the model folder the PS loaded
    state: str  # "training" | "finished"
    started_at: float
    resumed_from: str | None = None  # the checkpoint this PS life started from
    generation: dict = field(default_factory=dict)  # AsyncGRPOConfig.generation_settings()
    finished_at: float | None = None
    global_step: int | None = None
    final_model: str | None = None
    # Whether the GPU's processes run under NVIDIA MPS, as launch.sh found it ("on", or "off: why"); None when
    # the PS was not started by launch.sh.
    mps: str | None = None
    job_timeout_s: float | None = None  # its --job_timeout_s (None: no deadline): what recovery and ls go by
    lease_s: float | None = None  # its --lease_s and --max_attempts: what queue_tools ls and cleanup go by
    max_attempts: int | None = None
    # The largest --max_attempts of the run's PSs so far: a job's attempts may have gone up to it under an earlier PS,
    # so archives in done/ are looked up to it (JobQueue.was_archived) when --max_attempts was lowered since.
    most_attempts: int | None = None
    host_id: str | None = None  # where its pid means something (asyncgrpo/run/hosts.py); None from older versions
    max_steps: int | None = None  # the run's last step (--max_steps, or its epochs'): what rewards see on a worker

    @classmethod
    def starting(cls, model: str, resumed_from: str | None, generation: dict, job_timeout_s: float | None = None,
                 lease_s: float | None = None, max_attempts: int | None = None,
                 previous: PSStatus | None = None, max_steps: int | None = None) -> PSStatus:
        """This process's status as it starts training; ``previous``: the run's PS before it, if any."""
        earlier = (previous.most_attempts, previous.max_attempts) if previous else ()
        attempts = [a for a in (max_attempts, *earlier) if a]
        return cls(pid=os.getpid(), host=socket.gethostname(), model=model, state="training",
                   started_at=time.time(), resumed_from=resumed_from, generation=generation,
                   mps=os.environ.get(MPS_ENV) or None, job_timeout_s=job_timeout_s, lease_s=lease_s,
                   max_attempts=max_attempts, most_attempts=max(attempts, default=None), host_id=HOST_ID,
                   max_steps=max_steps)

    def finished(self, global_step: int, final_model: str) -> PSStatus:
        return dataclasses.replace(self, state="finished", finished_at=time.time(), global_step=global_step,
                                   final_model=final_model)

    @classmethod
    def from_json(cls, obj: dict) -> PSStatus | None:
        """The status a ps.json holds, or None for one this version cannot read."""
        known = {f.name for f in dataclasses.fields(cls)}
        try:
            return cls(**{k: v for k, v in obj.items() if k in known})
        except TypeError:  # a required field missing
            return None


class RunDirError(Exception):
    """The path is missing or is not an asyncgrpo run directory."""


@dataclass(frozen=True)
class RunDir:
    root: Path

    @property
    def queue(self) -> Path:
        return self.root / "queue"

    @property
    def tmp(self) -> Path:
        return self.root / "queue" / ".tmp"

    @property
    def done(self) -> Path:
        return self.root / "done"

    @property
    def workers(self) -> Path:
        return self.root / "workers"

    @property
    def weights(self) -> Path:
        return self.root / "weights"

    @property
    def logs(self) -> Path:
        return self.root / "logs"

    @property
    def checkpoints(self) -> Path:
        return self.root / "checkpoints"

    # The files at the top of the run.
    @property
    def ps_status_file(self) -> Path:
        return self.root / "ps.json"

    @property
    def ps_heartbeat_file(self) -> Path:
        """Touched every second by the running PS (asyncgrpo/run/liveness.py PSHeartbeat)."""
        return self.root / "ps.heartbeat"

    @property
    def ps_lock_file(self) -> Path:
        """Held (flock) by the running PS: one PS per run directory."""
        return self.root / "ps.lock"

    @property
    def metrics_file(self) -> Path:
        """One JSON line per logged training step (reward, loss, staleness, waits), appended by the PS; read and
        written through asyncgrpo/run/metrics.py."""
        return self.root / "metrics.jsonl"

    @property
    def global_step_file(self) -> Path:
        return self.root / "global_step.txt"

    @property
    def producer_journal(self) -> Path:
        """The PS producer's journal: the jobs it is about to throw (ps/producer.py)."""
        return self.root / "producer.json"

    @property
    def demo_model(self) -> Path:
        """The built-in demo model, written by the PS for its workers."""
        return self.root / "demo_model"

    @property
    def lookup_model(self) -> Path:
        """The built-in tool-calling task's model (--builtin_task lookup), written by the PS for its workers."""
        return self.root / "lookup_model"

    @property
    def final_model(self) -> Path:
        """Where the PS saves the trained model when --output_dir is not given."""
        return self.root / "final_model"

    def heartbeat_file(self, device: WorkerId) -> Path:
        return self.workers / f"dev{device}.json"

    def worker_lock_file(self, device: WorkerId) -> Path:
        """Held (flock) by the live worker ``device``: its liveness, next to its heartbeat."""
        return self.workers / f"dev{device}.lock"

    def read_ps_status(self) -> PSStatus | None:
        """The PS's status, or None before a PS has written one (or when it cannot be read)."""
        obj = fileops.read_json(self.ps_status_file)
        return None if obj is None else PSStatus.from_json(obj)

    def write_ps_status(self, status: PSStatus) -> None:
        fileops.write_json(self.ps_status_file, dataclasses.asdict(status))

    def read_global_step(self) -> int | None:
        """The PS's last completed optimizer step, or None before the first."""
        try:
            return int(self.global_step_file.read_text().strip())
        except (OSError, ValueError):
            return None

    def write_global_step(self, step: int) -> None:
        fileops.replace_file(self.global_step_file, f"{step}\n".encode())

    @classmethod
    def create(cls, root: str | os.PathLike, share_with_group: bool = False) -> RunDir:
        """Creates the layout (idempotent) and returns it. From here on this process creates files that only
        their owner can open, or, ``share_with_group``, that the run directory's group can too."""
        fileops.set_file_modes(share_with_group)
        run = cls(Path(root).expanduser().resolve())
        layout = (run.tmp, run.done, run.workers, run.weights, run.logs, run.checkpoints)
        for d in layout:
            d.mkdir(parents=True, exist_ok=True)
        # The folders an earlier life or launch.sh made take the mode too; setgid: what the group's members
        # create inside belongs to the run's group. Only the owner may chmod (a group member's worker may not).
        mode = 0o2770 if share_with_group else 0o700
        for d in (run.root, run.queue, *layout):
            if d.stat().st_uid == os.getuid():
                d.chmod(mode)
        return run

    @property
    def shared_with_group(self) -> bool:
        """Whether the run's owner opened it to its group (the PS's --share_with_group)."""
        return bool(self.root.stat().st_mode & 0o070)

    @classmethod
    def open(cls, root: str | os.PathLike) -> RunDir:
        """An existing run directory; RunDirError with a one-line reason otherwise."""
        path = Path(root).expanduser()
        if not path.exists():
            raise RunDirError(f"run directory {path} does not exist")
        if not path.is_dir():
            raise RunDirError(f"{path} is not a directory")
        run = cls(path.resolve())
        if not run.queue.is_dir() or not run.done.is_dir():
            started = ""
            if (path / "launch.lock").exists():
                started = (f": a launch.sh started there and its parameter server has not made them (it is starting, "
                           f"was interrupted, or failed at start: see {path / 'logs'})")
            raise RunDirError(f"{path} is not an asyncgrpo run directory (no queue/ and done/ inside){started}")
        return run


def latest_run() -> RunDir:
    """The most recently started run in the runs folder: by its PS's last start (``ps.json``), else by its queue's
    last change. Not by the newest file: the workers of an old run left running keep writing heartbeats."""
    folder = runs_dir()
    if not folder.is_dir():
        raise RunDirError(f"no run directory given and the runs folder {folder} does not exist")
    runs = [RunDir(p.resolve()) for p in folder.iterdir() if (p / "queue").is_dir()]
    if not runs:
        raise RunDirError(f"no run directory given and the runs folder {folder} holds no runs")

    def started(run: RunDir) -> float:
        status = run.read_ps_status()
        return status.started_at if status is not None else (run.root / "queue").stat().st_mtime

    return max(runs, key=started)
