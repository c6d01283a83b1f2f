"""Why the PS stops, in one line for the operator (``ps: error: ...``; the traceback stays in the log).

- ``first_cause``: a crash's first cause, not the last error raised while unwinding it; a full disk
  says which file it was writing and how much is free there.
- ``checkpoint_misfit``: a relaunch whose model is not the one the run's checkpoints were trained
  from says what differs and which flag to pass, instead of torch's size-mismatch traceback.
- ``check_disk_for_checkpoints``: a PS that cannot write one checkpoint stops before training,
  instead of failing at the first save (and again at every relaunch).
"""

from __future__ import annotations

import os
import shutil

from asyncgrpo.config import ConfigError
from asyncgrpo.messages import first_line
from asyncgrpo.run import RunDir
from asyncgrpo.run.fileops import DISK_FULL
from asyncgrpo.run.rundir import PSStatus

FULL_BELOW_MB = 1.0  # free space under which a crash's disk counts as full
ADAM_MOMENTS = 2  # the optimizer state a checkpoint holds per trained parameter (AdamW: two float32 moments)


def free_mb(path: str | os.PathLike) -> float | None:
    """Free space on the filesystem of ``path`` (or of its nearest existing parent), in MB."""
    path = os.path.abspath(path)
    while not os.path.exists(path) and os.path.dirname(path) != path:
        path = os.path.dirname(path)
    try:
        return shutil.disk_usage(path).free / 1e6
    except OSError:
        return None


def first_cause(err: BaseException, run_root: str | os.PathLike | None = None) -> str:
    """The earliest error of the chain ``err`` ended (an error raised while handling another keeps it as
    ``__context__``), in one line; a full disk names the file and the space left. Some writers do not say the
    disk is full (torch.save: "iostream error"): with ``run_root`` on a disk that is full, the line says so."""
    chain = [err]
    while (nxt := chain[-1].__cause__ or chain[-1].__context__) is not None and nxt not in chain:
        chain.append(nxt)
    full = [e for e in chain if isinstance(e, OSError) and e.errno in DISK_FULL]
    if full:
        where = next((e.filename for e in reversed(full) if e.filename), None)  # a re-raise may add the name
        free = free_mb(where) if where else None
        return (f"no space left on the disk writing {where or 'a file'}"
                + (f" ({free:,.1f} MB free there)" if free is not None else "")
                + ": free some space and relaunch (training resumes from the last checkpoint)")
    free = free_mb(run_root) if run_root is not None else None
    if free is not None and free < FULL_BELOW_MB:
        return (f"the disk of {run_root} is full ({free:,.1f} MB free) ({first_line(chain[-1])}): free some space "
                "and relaunch (training resumes from the last checkpoint)")
    return first_line(chain[-1])


def checkpoint_misfit(err: BaseException, checkpoint: str, model_path: str,
                      previous: PSStatus | None) -> ConfigError | None:
    """A one-line ConfigError when ``err`` is torch refusing ``checkpoint``'s tensors for the model loaded from
    ``model_path``; None for any other error."""
    lines = [line.strip() for line in str(err).splitlines()]
    if not lines or not lines[0].startswith("Error(s) in loading state_dict"):
        return None
    what = next((line for line in lines[1:] if line), lines[0]).rstrip(".")
    started_from = previous.model if previous is not None and previous.model != model_path else None
    hint = (f"this run was trained from {started_from}: relaunch with --model_name_or_path {started_from}"
            if started_from else "relaunch with the model this run was trained from")
    return ConfigError(f"{os.path.basename(checkpoint)} does not fit --model_name_or_path {model_path} ({what}); "
                       f"{hint}, or start a new run with another --run_dir")


def check_disk_for_checkpoints(run: RunDir, model, saves_checkpoints: bool) -> None:
    """ConfigError when the run's filesystem cannot hold one more checkpoint: the model's weights plus the
    optimizer's moments of every trained parameter (a LoRA run: the adapter's)."""
    if not saves_checkpoints:
        return
    trained = [p for p in model.parameters() if p.requires_grad]
    weights = sum(p.numel() * p.element_size() for p in (trained or model.parameters()))
    needed_mb = (weights + ADAM_MOMENTS * 4 * sum(p.numel() for p in trained)) / 1e6
    free = free_mb(run.checkpoints)
    if free is not None and free < needed_mb:
        raise ConfigError(f"{run.checkpoints} has {free:,.1f} MB free, and a checkpoint of this model needs about "
                          f"{needed_mb:,.1f} MB: free some space, or start the run on another disk (--run_dir)")
