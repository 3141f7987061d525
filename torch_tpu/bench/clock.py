"""The host's share of a step's time, on a machine whose device may be the host's own cores.

Why: on XLA:CPU the "device" is threads of this process, so process CPU time mixes the host's
work (Python, dispatch, tracing) with the device's (XLA's compute threads). On a TPU only the
first would stay on the host, so the projections (``bench train --target``, ``bench decode
--target``) need it alone.
"""

from __future__ import annotations

import os
import threading
import time


def host_ns() -> int:
    """CPU nanoseconds used so far by this thread and by autograd's device threads (``pt_autograd_*``,
    which run backward): the host's work, without XLA:CPU's own threads."""
    me = threading.get_native_id()
    total = 0
    try:
        tids = os.listdir("/proc/self/task")
    except OSError:  # no procfs: this thread alone
        return time.thread_time_ns()
    for tid in tids:
        try:
            with open(f"/proc/self/task/{tid}/comm") as f:
                name = f.read().strip()
            if int(tid) == me or name.startswith("pt_autograd"):
                with open(f"/proc/self/task/{tid}/schedstat") as f:
                    total += int(f.read().split()[0])
        except (OSError, ValueError, IndexError):  # a thread that just ended
            continue
    return total


__all__ = ["host_ns"]
