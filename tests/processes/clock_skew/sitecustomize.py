"""Test only: a process started with this folder on PYTHONPATH reads a wall clock shifted by
$ASYNCGRPO_TEST_CLOCK_OFFSET_S seconds (time.time and time.time_ns), as on a host whose clock
is off. The kernel's clock, which stamps file times, is untouched. (In a fork of the test zygote it runs after the
libraries' import: asyncgrpo's modules, imported after it, and every caller of time.time() read the shifted clock.)"""

# asyncgrpo.forkserver: runs in a fork too

import os
import time

_offset = float(os.environ.get("ASYNCGRPO_TEST_CLOCK_OFFSET_S") or 0)
if _offset:
    _time, _time_ns = time.time, time.time_ns
    time.time = lambda: _time() + _offset
    time.time_ns = lambda: _time_ns() + int(_offset * 1e9)
