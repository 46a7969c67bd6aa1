"""Child processes that do not outlive the process that started them.

`capsnet bench` and deploy/local_stack.py start servers in their own sessions, so that a Ctrl-C reaches only
the parent, which then stops them in order. A parent that is SIGKILLed (the OOM killer, a CI job's hard
timeout) stops nothing, and the servers would go on holding their ports and memory with nobody to stop them.
"""

from __future__ import annotations

import ctypes
import os
import signal
import sys
from collections.abc import Callable

_PR_SET_PDEATHSIG = 1
# Resolved before any fork: the child, between fork and exec, only calls it.
_prctl = ctypes.CDLL(None, use_errno=True).prctl if sys.platform.startswith("linux") else None


def terminate_with_parent() -> Callable[[], None] | None:
    """A `preexec_fn` for subprocess.Popen: the child gets SIGTERM (and drains as on any SIGTERM) when this
    process dies, however it dies. Linux only (prctl PR_SET_PDEATHSIG, which survives exec); None elsewhere.

    Call it in the thread that keeps running while the child should: the kernel sends the signal when the
    thread that forked the child exits.
    """
    if _prctl is None:
        return None
    parent = os.getpid()

    def preexec() -> None:
        _prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)
        if os.getppid() != parent:  # the parent died before prctl took effect: no signal will come
            os.kill(os.getpid(), signal.SIGTERM)

    return preexec
