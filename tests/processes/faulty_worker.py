"""The real worker with one fault injected at a chosen point, where a timed kill would miss it (a test's tool):

    WORKER_FAULT="FAULT" python -m faulty_worker WORKER-FLAGS...     (tests/ and the repository on the path)

kill-mid-sync-in-job   SIGKILLed inside its first weight sync between decoding steps (--in_flight_updates): a
                       job held, half generated, the weights slot's lock taken, its copy not yet made
deadline-cannot-act    its job deadline (worker/deadline.py) blocks when it comes, as behind a lock the stuck
                       thread holds: the worker lives, beats and holds its jobs past their deadline
"""

import os
import signal
import sys
import threading

from asyncgrpo.weights import mmap_file
from worker import deadline, in_flight

FAULT = os.environ["WORKER_FAULT"]

if FAULT == "kill-mid-sync-in-job":
    before_token, copy_out = in_flight.InFlightWeights.before_token, mmap_file.MmapReader.copy_out
    inside = {"before_token": False}

    def _before_token(self, index):
        inside["before_token"] = True
        try:
            return before_token(self, index)
        finally:
            inside["before_token"] = False

    def _copy_out(self, info, dsts, idx):
        if inside["before_token"]:
            os.kill(os.getpid(), signal.SIGKILL)
        return copy_out(self, info, dsts, idx)

    in_flight.InFlightWeights.before_token = _before_token
    mmap_file.MmapReader.copy_out = _copy_out
elif FAULT == "deadline-cannot-act":
    deadline.JobDeadline.expire = lambda self, overdue: threading.Event().wait()
else:
    sys.exit(f"faulty_worker: WORKER_FAULT: unknown fault {FAULT!r}")

from worker.__main__ import main  # noqa: E402  (after the patches)

sys.exit(main(sys.argv[1:]))
