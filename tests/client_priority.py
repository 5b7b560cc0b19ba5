"""Attacking clients yield the CPU to the worker they attack.

These tests and `make soak` run the attackers, the worker and the health probe on the same few cores. An attacker
at the worker's priority is measured as worker stall: its threads take the core the worker's loop is waiting for
(on 2 cores, HTTP health's slowest probe was 208-258 ms with the attackers at the worker's priority and 63-109 ms
with them at nice +10, at the same request rates). Deployed, attackers run on other machines, so their CPU is theirs.
"""

from __future__ import annotations

import contextlib
import os
import threading

ATTACKER_NICENESS = 10


def lower_this_threads_priority() -> None:
    """The calling thread (and the threads it starts later) runs ATTACKER_NICENESS nicer. On Linux niceness is
    per thread (setpriority on its thread id); raising it needs no privilege. Elsewhere: nothing."""
    with contextlib.suppress(OSError, AttributeError):
        tid = threading.get_native_id()
        os.setpriority(os.PRIO_PROCESS, tid, min(19, os.getpriority(os.PRIO_PROCESS, tid) + ATTACKER_NICENESS))
