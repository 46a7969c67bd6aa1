"""Resident memory of a process (Linux /proc): now, and its peak since it started."""

from __future__ import annotations

from pathlib import Path

from capsnet.errors import CapsNetError


def memory_mib(pid: int | str = "self") -> dict[str, float]:
    """{"rss_mib": VmRSS, "peak_rss_mib": VmHWM} of `pid`, in MiB."""
    status = Path(f"/proc/{pid}/status")
    try:
        lines = status.read_text().splitlines()
    except OSError as err:
        raise CapsNetError(f"cannot read the memory of process {pid}: {err.strerror or err}") from None
    fields = {}
    for line in lines:
        key, _, value = line.partition(":")
        if key in ("VmRSS", "VmHWM"):
            fields[key] = int(value.split()[0]) / 1024  # kB -> MiB
    return {"rss_mib": fields["VmRSS"], "peak_rss_mib": fields["VmHWM"]}
