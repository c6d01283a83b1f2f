"""What each node of a Slurm job starts: ``scripts/slurm/asyncgrpo.sbatch`` runs one task per node (the first
node in one ``srun`` step, the others in a second, which the batch script stops when the first ends), and each
task runs ``python -m asyncgrpo.slurm [the batch script's arguments]``, which reads its part from Slurm's
variables and replaces itself with launch.sh:

- the job's first node (the first of ``SLURM_JOB_NODELIST``): the parameter server on its first GPU
  (``--ps-procs K``: its first K, a data-parallel PS through torchrun on that node) and a worker on each other
  GPU of the node;
- every other node (``SLURMD_NODENAME``): ``launch.sh --join RUN``, a worker on each of its GPUs;
- with ``--join RUN`` (a job array of workers added to a running run): every node joins, and leaves when the
  run's PS has finished (also when it had finished before they came).

A node's slots are its GPUs (the ``CUDA_VISIBLE_DEVICES`` Slurm sets, else ``SLURM_GPUS_ON_NODE``), or on a CPU
cluster its tasks: the job's ``--ntasks-per-node`` (``SLURM_TASKS_PER_NODE``, which the batch script passes on as
``ASYNCGRPO_SLURM_TASKS_PER_NODE``: the step's own says 1). launch.sh keeps doing what it does on one host: it
restarts a worker that dies, stops the workers when the PS finishes, and places each process on its GPU among
those Slurm gave the job.

The run folder is ``--run-dir``, else ``$ASYNCGRPO_RUNS/slurm-$SLURM_JOB_ID`` (a requeued job keeps its id, so it
resumes its own run). The PS publishes its weights as safetensors snapshots (``--weight_transport safetensors``
unless given: workers on other nodes, and job arrays, read them) and saves a checkpoint when Slurm's SIGTERM comes
(``--checkpoint_on_sigterm true`` unless given). Each node's processes carry a host id of their own per job
(``ASYNCGRPO_HOST_ID`` from this host's id, the node's name and the job id), so that the workers of two jobs on one
node, or of a requeued job, never share a name.
"""

from __future__ import annotations

import os
import re
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from asyncgrpo.run.hosts import HOST_ID, HOST_ID_ENV

TASKS_PER_NODE_ENV = "ASYNCGRPO_SLURM_TASKS_PER_NODE"
RUN_WAIT_S = 900.0  # how long another node waits for the first node to create the run folder
REPO = Path(__file__).resolve().parent.parent


class SlurmError(ValueError):
    """A job whose shape or arguments cannot make a run (one line for the job's output)."""


@dataclass
class NodeTask:
    """What one node runs: ``argv`` (launch.sh and its arguments) with ``env`` added to the environment; a node
    that joins the job's own run first waits for ``wait_for`` (the run folder the first node creates)."""

    argv: list[str]
    env: dict[str, str] = field(default_factory=dict)
    wait_for: Path | None = None


def per_node(spec: str) -> list[int]:
    """Slurm's per-node counts, ``2(x3),1`` -> ``[2, 2, 2, 1]`` (SLURM_TASKS_PER_NODE, SLURM_JOB_CPUS_PER_NODE)."""
    counts = []
    for part in spec.split(","):
        match = re.fullmatch(r"\s*(\d+)(?:\(x(\d+)\))?\s*", part)
        if not match:
            raise SlurmError(f"cannot read the per-node counts {spec!r}")
        counts += [int(match[1])] * int(match[2] or 1)
    return counts


def expand_nodelist(spec: str) -> list[str]:
    """Slurm's host list, ``a[1-3,07],b`` -> ``["a1", "a2", "a3", "a07", "b"]`` (what scontrol show hostnames
    prints; digits keep their zero padding)."""
    names, depth, start = [], 0, 0
    for i, char in enumerate(spec + ","):
        depth += {"[": 1, "]": -1}.get(char, 0)
        if char == "," and depth == 0:
            if spec[start:i]:
                names += _expand_name(spec[start:i])
            start = i + 1
    if depth != 0 or not names:
        raise SlurmError(f"cannot read the node list {spec!r}")
    return names


def _expand_name(name: str) -> list[str]:
    match = re.match(r"([^\[]*)\[([^\]]*)\](.*)$", name)
    if not match:
        return [name]
    prefix, ranges, rest = match.groups()
    names = []
    for part in ranges.split(","):
        low, _, high = part.partition("-")
        if not low.isdigit() or (high and not high.isdigit()):
            raise SlurmError(f"cannot read the node list part {name!r}")
        for number in range(int(low), int(high or low) + 1):
            names += [f"{prefix}{number:0{len(low)}d}{tail}" for tail in _expand_name(rest)]
    return names


def _take(args: list[str], name: str) -> tuple[str | None, list[str]]:
    """The value of ``name VALUE`` or ``name=VALUE`` in ``args`` (the last wins), and the other arguments."""
    value, rest, i = None, [], 0
    while i < len(args):
        if args[i] == name:
            if i + 1 >= len(args):
                raise SlurmError(f"{name} needs a value")
            value, i = args[i + 1], i + 2
            continue
        if args[i].startswith(name + "="):
            value = args[i].split("=", 1)[1]
        else:
            rest.append(args[i])
        i += 1
    return value, rest


def _given(args: list[str], flag: str) -> bool:
    return any(a == flag or a.startswith(flag + "=") for a in args)


def _env_int(environ: dict, name: str, default: int | None = None) -> int:
    value = environ.get(name)
    if value is None or value == "":
        if default is None:
            raise SlurmError(f"${name} is not set: run this through srun inside a Slurm job "
                             "(sbatch scripts/slurm/asyncgrpo.sbatch ...)")
        return default
    try:
        return int(value)
    except ValueError:
        raise SlurmError(f"${name}={value!r} is not a number") from None


def node_slots(environ: dict, node: int, device: str) -> tuple[int, str]:
    """How many processes this node runs, and what they are counted in ("GPU(s)" or "task(s)")."""
    if device != "cpu":
        visible = [d for d in environ.get("CUDA_VISIBLE_DEVICES", "").split(",") if d.strip()]
        gpus = len(visible) or _env_int(environ, "SLURM_GPUS_ON_NODE", 0)
        if gpus:
            return gpus, "GPU(s)"
        if device == "cuda":
            raise SlurmError("--device cuda, but Slurm gave this node no GPU (sbatch --gpus-per-node G)")
    spec = environ.get(TASKS_PER_NODE_ENV) or environ.get("SLURM_TASKS_PER_NODE") or "1"
    counts = per_node(spec)
    if node >= len(counts):
        raise SlurmError(f"node {node} of the job has no task count in {spec!r}")
    return counts[node], "task(s)"


def node_task(environ: dict, args: list[str], launch_sh: str | os.PathLike = REPO / "launch.sh") -> NodeTask:
    """This node's part of the job, from Slurm's variables in ``environ`` and the batch script's ``args``."""
    join, args = _take(args, "--join")
    run_dir, args = _take(args, "--run-dir")
    ps_procs, args = _take(args, "--ps-procs")
    for own in ("--workers", "--run_dir"):
        if _given(args, own):
            raise SlurmError(f"{own}: under Slurm the run is --run-dir and the workers are one per GPU (or per "
                             "task on CPU) that the job was given; the batch script's header says how")
    device = _take(list(args), "--device")[0] or "auto"
    job = _env_int(environ, "SLURM_JOB_ID")
    nodes = expand_nodelist(environ.get("SLURM_JOB_NODELIST") or environ.get("SLURM_NODELIST") or "")
    node_name = environ.get("SLURMD_NODENAME", "")
    if node_name not in nodes:
        raise SlurmError(f"this node ({node_name or '$SLURMD_NODENAME not set'}) is not in the job's node list "
                         f"{nodes}: run this through srun inside the job")
    node = nodes.index(node_name)
    slots, unit = node_slots(environ, node, device)
    env = {HOST_ID_ENV: f"{HOST_ID}-{node_name}-slurm{job}"}  # not plain: hashed to 8 hex digits (hosts.py)
    if join is not None:  # a job of workers only, for a run that exists; it must not hold its nodes once it ended
        return NodeTask(["bash", str(launch_sh), "--join", join, "--workers", str(slots), "--exit-when-finished",
                         *args], env)
    if run_dir is None:
        runs = environ.get("ASYNCGRPO_RUNS") or os.path.join(environ.get("HOME", "~"), "asyncgrpo-runs")
        run_dir = os.path.join(runs, f"slurm-{job}")
    run_dir = os.path.abspath(os.path.expanduser(run_dir))
    if node > 0:
        return NodeTask(["bash", str(launch_sh), "--join", run_dir, "--workers", str(slots), *args], env,
                        wait_for=Path(run_dir))
    k = 1 if ps_procs is None else ps_procs
    try:
        k = int(k)
    except ValueError:
        raise SlurmError(f"--ps-procs needs a positive integer, got {ps_procs!r}") from None
    if k < 1 or k > slots:
        raise SlurmError(f"--ps-procs {k}: the job's first node has {slots} {unit}, and the parameter server's "
                         "processes run there (one each)")
    if slots - k == 0 and len(nodes) == 1:
        print(f"[slurm] the job's one node has {slots} {unit}, all for the parameter server: no worker runs until "
              "workers join (sbatch --array=... scripts/slurm/asyncgrpo.sbatch --join RUN)", file=sys.stderr)
    defaults = []
    if not _given(args, "--weight_transport"):
        defaults += ["--weight_transport", "safetensors"]
    if not _given(args, "--checkpoint_on_sigterm"):
        defaults += ["--checkpoint_on_sigterm", "true"]
    return NodeTask(["bash", str(launch_sh), "--run-dir", run_dir, "--workers", str(slots - k),
                     "--ps-procs", str(k), *defaults, *args], env)


def wait_for_run(run: Path, timeout_s: float = RUN_WAIT_S, poll_s: float = 1.0) -> None:
    """Until the first node's launch.sh has made ``run`` a run folder (its queue/ and done/)."""
    started = said = time.monotonic()
    while not ((run / "queue").is_dir() and (run / "done").is_dir()):
        now = time.monotonic()
        if now - started > timeout_s:
            raise SlurmError(f"{run} was not created within {timeout_s / 60:.0f} min by the job's first node "
                             "(its launch.sh output says why)")
        if now - said >= 60:
            print(f"[slurm] waiting for the job's first node to create {run}", file=sys.stderr)
            said = now
        time.sleep(poll_s)


def main(argv: list[str] | None = None) -> int:
    try:
        task = node_task(dict(os.environ), list(sys.argv[1:] if argv is None else argv))
        if task.wait_for is not None:
            wait_for_run(task.wait_for)
    except SlurmError as err:
        print(f"asyncgrpo.slurm: error: {err}", file=sys.stderr)
        return 2
    sys.stdout.flush()
    os.execvpe(task.argv[0], task.argv, {**os.environ, **task.env})
    return 0  # (not reached)


if __name__ == "__main__":
    sys.exit(main())
