"""The real parameter server with one fault injected at a chosen point, where a timed kill or a disk that
fills up by itself may miss it (a test's tool):

    PS_FAULT="FAULT ARG" python -m faulty_ps PS-FLAGS...     (tests/ and the repository on the path)

kill-mid-save STEP       SIGKILLed in the save of checkpoint-STEP: its model written, not yet its optimizer,
                         trainer state or ledger
kill-after-split STEP    SIGKILLed in the save of the first checkpoint from checkpoint-STEP on whose previous
                         checkpoint holds a result partly trained (dynamic sampling's groups_done): a resume
                         takes the rest of its groups
kill-before-ledger STEP  SIGKILLed when all of checkpoint-STEP is written but the ledger that marks it
                         complete (older checkpoints not yet rotated out)
full-metrics N           the disk is full for metrics.jsonl from its N-th line on (the write fails, ENOSPC)
full-ledger STEP         the disk is full for checkpoint-STEP's ledger
full-snapshot VERSION    the disk is full for the weights file of VERSION (--weight_transport safetensors),
                         failing as safetensors does
"""

import errno
import json
import os
import signal
import sys

from safetensors import SafetensorError
from transformers import Trainer

from asyncgrpo.run.checkpoints import LEDGER_FILE, newest_complete_checkpoint
from asyncgrpo.weights import snapshot

FAULT, ARG = os.environ["PS_FAULT"].split()
FOLDER = f"checkpoint-{ARG}"
calls = {"metrics": 0}


def _in_folder(path) -> bool:
    return os.path.basename(os.path.dirname(os.fspath(path))) == FOLDER


if FAULT == "kill-mid-save":
    save_optimizer = Trainer._save_optimizer_and_scheduler

    def _save_optimizer_and_scheduler(self, output_dir):
        if os.path.basename(output_dir) == FOLDER:
            os.kill(os.getpid(), signal.SIGKILL)
        return save_optimizer(self, output_dir)

    Trainer._save_optimizer_and_scheduler = _save_optimizer_and_scheduler
elif FAULT == "kill-after-split":
    save_optimizer = Trainer._save_optimizer_and_scheduler

    def _save_optimizer_and_scheduler(self, output_dir):
        step = int(os.path.basename(output_dir).split("-")[1])
        previous = newest_complete_checkpoint(os.path.dirname(output_dir))
        if step >= int(ARG) and previous is not None:
            with open(os.path.join(previous, LEDGER_FILE)) as f:
                if json.load(f).get("groups_done"):
                    os.kill(os.getpid(), signal.SIGKILL)
        return save_optimizer(self, output_dir)

    Trainer._save_optimizer_and_scheduler = _save_optimizer_and_scheduler
elif FAULT in ("kill-before-ledger", "full-ledger", "full-metrics"):
    real_write = os.write
    ledger_temp = f".{LEDGER_FILE}."  # fileops.replace_file's temp file for it

    def _write(fd, data):  # below fileops, as a full disk fails a write
        path = os.readlink(f"/proc/self/fd/{fd}")
        if FAULT == "full-metrics" and os.path.basename(path) == "metrics.jsonl":
            calls["metrics"] += 1
            if calls["metrics"] >= int(ARG):
                raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        elif FAULT != "full-metrics" and _in_folder(path) and os.path.basename(path).startswith(ledger_temp):
            if FAULT == "kill-before-ledger":
                os.kill(os.getpid(), signal.SIGKILL)
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return real_write(fd, data)

    os.write = _write
elif FAULT == "full-snapshot":
    save_file = snapshot.save_file

    def _save_file(tensors, filename, metadata=None):
        if metadata and metadata.get("version") == ARG:
            raise SafetensorError("Error while serializing: I/O error: No space left on device (os error 28)")
        return save_file(tensors, filename, metadata=metadata)

    snapshot.save_file = _save_file
else:
    sys.exit(f"faulty_ps: PS_FAULT: unknown fault {FAULT!r}")

from ps.__main__ import main  # noqa: E402  (after the patches)

sys.exit(main(sys.argv[1:]))
