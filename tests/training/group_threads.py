"""The threads a torch process group runs in this process (gloo's, its TCP store's), by the names torch gives them.

gloo has no shutdown of its own: its threads end only when the last reference to the group goes. Alive once the
group is destroyed, they end during interpreter shutdown, where a rank could abort instead of exiting with its code.
"""

from __future__ import annotations

import os
from pathlib import Path

# pt_gloo_runloop (gloo's work queue), gloo_tcp_loop (its transport), pt_tcpstore_* (the rendezvous store)
GROUP_THREAD_PREFIXES = ("pt_gloo", "gloo_", "pt_tcpstore")


def group_threads() -> list[str]:
    """The names of this process's process-group threads (Linux's /proc/self/task)."""
    names = []
    for task in os.listdir("/proc/self/task"):
        try:
            names.append(Path(f"/proc/self/task/{task}/comm").read_text().strip())
        except OSError:  # the thread ended meanwhile
            continue
    return sorted(name for name in names if name.startswith(GROUP_THREAD_PREFIXES))
