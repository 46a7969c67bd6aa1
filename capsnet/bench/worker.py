"""A benchmark worker process: holds one engine (capsnet.bench.engines) and answers timing commands from
`inprocess.py`.

Started as `python -m capsnet.bench.worker FD NAME MODEL_DIR THREADS MAX_BATCH` with one end of a
socket pair as FD, so it imports nothing but this module and its engine (its memory is its own).
Commands: ("time", images, seconds) -> per-call seconds; ("predict", images) -> argmax classes;
("stop",) -> memory. Replies are ("ok", payload), ("unavailable", reason) or ("error", message).
"""

from __future__ import annotations

import contextlib
import functools
import sys
import traceback
from multiprocessing.connection import Connection
from pathlib import Path

from capsnet.bench.memory import memory_mib
from capsnet.bench.timing import time_calls

WARMUP_CALLS = 3
MIN_CALLS_PER_CHUNK = 1  # after the warm-up; the rounds give every cell several calls


def serve(conn: Connection, name: str, model_dir: str, threads: int, max_batch: int) -> None:
    from capsnet.bench.engines import EngineUnavailable, build_engine

    try:
        start = memory_mib()
        try:
            engine = build_engine(name, Path(model_dir), threads=threads, max_batch=max_batch)
        except EngineUnavailable as err:
            conn.send(("unavailable", str(err)))
            return

        def infer(images):
            return engine.run(images)["probabilities"]

        conn.send(("ok", {"description": engine.description, "start": start, "loaded": memory_mib()}))
        warm = set()
        while True:
            try:
                command, *args = conn.recv()
            except EOFError:  # the parent is gone (killed, or stopped without a "stop"): nothing to answer
                return
            if command == "time":
                images, seconds = args
                if len(images) not in warm:
                    for _ in range(WARMUP_CALLS):
                        infer(images)
                    warm.add(len(images))
                conn.send(("ok", time_calls(functools.partial(infer, images), min_calls=MIN_CALLS_PER_CHUNK,
                                            min_seconds=seconds)))
            elif command == "predict":
                conn.send(("ok", infer(args[0]).argmax(axis=1)))
            else:  # stop
                conn.send(("ok", memory_mib()))
                return
    except (BrokenPipeError, ConnectionResetError):  # the parent is gone while this answered: nobody to tell
        return
    except Exception as err:  # the parent turns this into a one-line error; the traceback goes to stderr
        traceback.print_exc()
        with contextlib.suppress(OSError):
            conn.send(("error", f"{type(err).__name__}: {err}"))


if __name__ == "__main__":
    fd, name, model_dir, threads, max_batch = sys.argv[1:]
    serve(Connection(int(fd)), name, model_dir, int(threads), int(max_batch))
