"""Resident memory under glibc malloc settings, for the allocator diagnosis in docs/experiments/README.md.

`loop`: allocate a torch tensor of --mib MiB (every page touched), free it, --passes times; print the RSS in MiB
before and after each allocation. `train ARGS...`: run `capsnet train ARGS...` and print its peak RSS and the
RSS every 2 s. Set the malloc settings in the environment (MALLOC_MMAP_THRESHOLD_, MALLOC_TRIM_THRESHOLD_,
MALLOC_TOP_PAD_), or with `loop --mallopt` through mallopt in the process itself.

Usage: python scripts/experiments/malloc_reuse.py loop [--mib 256] [--passes 8] [--mallopt]
       python scripts/experiments/malloc_reuse.py train --data embedded --arch em --epochs 1 --threads 1 ...
"""

from __future__ import annotations

import argparse
import ctypes
import json
import subprocess
import sys
import time

from capsnet.bench.memory import memory_mib
from capsnet.errors import CapsNetError

# <malloc.h>: M_TRIM_THRESHOLD, M_TOP_PAD, M_MMAP_THRESHOLD and the values the docs' table names
MALLOPT_SETTINGS = ((-1, 2**31 - 1), (-2, 64 << 20), (-3, 1 << 30))


def loop(mib: int, passes: int, mallopt: bool) -> dict:
    import torch

    if mallopt:
        libc = ctypes.CDLL(None)
        if not all(libc.mallopt(parameter, value) == 1 for parameter, value in MALLOPT_SETTINGS):
            sys.exit("malloc_reuse.py: glibc refused a mallopt setting")
    figures = [int(memory_mib()["rss_mib"])]
    for _ in range(passes):
        buffer = torch.ones(mib << 18)  # float32: mib MiB
        figures.append(int(memory_mib()["rss_mib"]))
        del buffer
    return {"mode": "loop", "mib": mib, "mallopt": mallopt, "rss_mib_start_then_each_pass": figures}


def train(arguments: list[str]) -> dict:
    child = subprocess.Popen([sys.executable, "-m", "capsnet", "train", *arguments])
    samples = []
    while child.poll() is None:
        try:
            samples.append(int(memory_mib(child.pid)["rss_mib"]))
        except CapsNetError:  # the child exited between poll and read
            break
        time.sleep(2)
    return {"mode": "train", "arguments": arguments, "exit": child.wait(), "peak_rss_mib": max(samples, default=0),
            "rss_mib_every_2s": samples}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    modes = parser.add_subparsers(dest="mode", required=True)
    loop_parser = modes.add_parser("loop")
    loop_parser.add_argument("--mib", type=int, default=256)
    loop_parser.add_argument("--passes", type=int, default=8)
    loop_parser.add_argument("--mallopt", action="store_true", help="apply the settings through mallopt first")
    modes.add_parser("train", prefix_chars="\0").add_argument("arguments", nargs=argparse.REMAINDER)
    args = parser.parse_args()
    result = loop(args.mib, args.passes, args.mallopt) if args.mode == "loop" else train(args.arguments)
    print(json.dumps(result))


if __name__ == "__main__":
    main()
