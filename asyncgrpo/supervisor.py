"""Nothing outlives its supervisor: a process that launch.sh or scripts/join.sh started stops when that script is
gone, however it went (``kill -9``, the out-of-memory killer, a session torn down).

The scripts export their own pid as ASYNCGRPO_SUPERVISOR_PID to the processes they start. Each process watches it
(``watch_supervisor``, a thread blocked on a pidfd: no polling where Linux has them) and, once it is gone, sends
itself SIGTERM: the PS then stops as on a scheduler's SIGTERM (at the next batch boundary, with a checkpoint where
``--checkpoint_on_sigterm`` says so) and a worker finishes or gives back the jobs in hand. Nothing restarts them:
the restarts were the supervisor's. A process started by hand has no supervisor and runs on as before.
"""

from __future__ import annotations

import logging
import os
import select
import signal
import socket
import threading
import time

from asyncgrpo.run.liveness import pid_alive

SUPERVISOR_PID_ENV = "ASYNCGRPO_SUPERVISOR_PID"
POLL_S = 1.0  # where pidfds are missing (Linux before 5.3): how often the pid is looked at

log = logging.getLogger("asyncgrpo")


def watch_supervisor(who: str) -> int | None:
    """Starts the watch when this process has a supervisor; its pid, or None (started by hand)."""
    text = os.environ.get(SUPERVISOR_PID_ENV, "").strip()
    if not text:
        return None
    try:
        pid = int(text)
    except ValueError:
        log.warning("%s: %s=%r is not a pid: not watching a supervisor", who, SUPERVISOR_PID_ENV, text)
        return None
    threading.Thread(target=_stop_when_gone, args=(pid, who), name="supervisor-watch", daemon=True).start()
    return pid


def _stop_when_gone(pid: int, who: str) -> None:
    try:
        fd = os.pidfd_open(pid)  # the supervisor started this process: the pid is still its own here
    except ProcessLookupError:
        fd = None  # gone already
    except OSError:  # no pidfds (an old kernel, a sandbox): poll
        while pid_alive(pid, socket.gethostname()):
            time.sleep(POLL_S)
        fd = None
    if fd is not None:
        waiting = select.poll()
        waiting.register(fd, select.POLLIN)
        waiting.poll()  # readable once the process has exited
        os.close(fd)
    log.warning("%s: its supervisor (launch.sh or join.sh, pid %d) is gone: stopping as on SIGTERM", who, pid)
    os.kill(os.getpid(), signal.SIGTERM)
