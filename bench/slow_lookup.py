"""The lookup task's environment with a slow tool, for bench/tool_latency.py: each call sleeps a uniform random
0..$TOOL_LATENCY_MS milliseconds (seeded by $TOOL_LATENCY_SEED and the call's order in this process) before it
answers. Sleeping waits without using a CPU, as a sandbox, a web request or a database would."""

from __future__ import annotations

import os
import random
import threading
import time

from asyncgrpo.tasks.lookup import LookupEnv

_rng = random.Random(int(os.environ.get("TOOL_LATENCY_SEED", "0")))
_lock = threading.Lock()


class SlowLookup(LookupEnv):
    def lookup(self, key: int) -> str:
        """Look up the secret digit stored under a key.

        Args:
            key: The key to look up (a digit).
        """
        with _lock:
            delay = _rng.uniform(0.0, float(os.environ.get("TOOL_LATENCY_MS", "200")) / 1e3)
        time.sleep(delay)
        return super().lookup(key)
