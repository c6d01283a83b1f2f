"""Run by every Python process whose PYTHONPATH starts with this folder (tests/ps/test_data_parallel.py): a rank of
a torchrun group (LOCAL_RANK set) that begins the interpreter's finalisation leaves a file named after its rank in
``$FINALISATION_MARKS``.

A data-parallel PS rank must leave with ``os._exit`` once done (ps/__main__.py): in the finalisation, gloo's threads
abort the process now and then (SIGABRT, "terminate called without an active exception"; DDP over gloo, 2 ranks:
3 exits in 16 on the project's CPU machine), and torchrun then reports the whole run failed. The abort itself is
too rare to test for; whether a rank enters the finalisation at all is not (``atexit`` handlers run at its start).
"""

# asyncgrpo.forkserver: runs in a fork too

import atexit
import os
from pathlib import Path


def _mark() -> None:
    Path(os.environ["FINALISATION_MARKS"], f"rank-{os.environ['LOCAL_RANK']}-pid-{os.getpid()}").touch()


if os.environ.get("FINALISATION_MARKS") and "LOCAL_RANK" in os.environ:
    atexit.register(_mark)
