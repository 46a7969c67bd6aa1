"""`capsnet serve --workers N`: one server as N front-end processes and one engine process, so that the Python
request path (decoding, checks, encoding, gRPC and HTTP themselves) spreads over the host's cores while one batcher
per model version keeps the backend's batches full.

    supervisor (this module)
      ├─ engine process (serving/processes/engine_process.py): the models, their batchers and backends; /metrics
      └─ N front-end processes (serving/processes/front_end.py): gRPC and REST on the server's ports, shared through
         SO_REUSEPORT (the kernel spreads connections over them); images and outputs pass to and from the engine
         through shared memory (serving/processes/engine_link.py)

What holds across the processes:
- metrics: every process writes its series in prometheus-client's multiprocess mode; the engine's /metrics sums them
  (process_* and python_* are left out: they describe one process each);
- statistics: the engine records every request it is given; ModelStatistics on any front end answers its figures;
- health and readiness: each front end's, SERVING once the engine serves;
- deadlines and queue limits: the engine's batcher judges them for all (one queue per version, as in one process);
- SIGTERM or SIGINT: the front ends drain as a single-process server does (the drain window, then refusals, and the
  requests already taken are answered), then the engine finishes its queues and stops; a second signal cuts the
  front ends' waits;
- a front end that dies is restarted; its clients' connections close with it, so their calls end UNAVAILABLE;
- an engine that dies stops the server: an ERROR line names its exit, the front ends stop, and the supervisor exits
  ENGINE_FAILED.

Not served with more than one front end, and refused at startup: model control (--model-control explicit or poll:
the models are the engine's as loaded at start) and clients' shared memory (a region registered on one front end
would be unknown to the others: --no-allow-client-shm).

The default (--workers not given) is one front end per CORES_PER_FRONT_END cores the process may use, when the
server needs neither of those: 1 on a 2- or 3-core host, so that small hosts keep a single process (the engine's
backend threads need the cores more than a second front end).
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import dataclasses
import logging
import os
import pickle
import shutil
import signal
import socket
import sys
import tempfile
import time

from capsnet.errors import CapsNetError
from capsnet.serving.config import ServerConfig
from capsnet.serving.observability.metrics import MULTIPROCESS_DIR

log = logging.getLogger(__name__)

CORES_PER_FRONT_END = 2
ENGINE_FAILED = 3  # the supervisor's exit code when the engine process stopped by itself
# A front end that dies this soon after starting, this many times in a row, is not restarted again: the server stops.
QUICK_EXIT_S = 10.0
QUICK_EXITS = 3
STARTUP_TIMEOUT_S = 600.0  # loading and warming a model up; a front end starts in seconds
_PR_SET_PDEATHSIG = 1


def front_ends(config: ServerConfig) -> int:
    """How many front-end processes serve: --workers, or the host's default (see the module's docstring)."""
    if config.workers is not None:
        return config.workers
    if config.model_control != "none" or config.allow_client_shm:
        return 1
    return max(1, len(os.sched_getaffinity(0)) // CORES_PER_FRONT_END)


def _hold_port(host: str, port: int) -> socket.socket:
    """A bound, not listening, SO_REUSEPORT socket on host:port: it resolves port 0, and a port that another server
    holds is an error here; the front ends bind beside it, and only listening sockets are given connections."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    held = socket.socket(family, socket.SOCK_STREAM)
    held.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    held.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    try:
        held.bind((host, port))
    except OSError as err:
        held.close()
        raise CapsNetError(f"cannot listen on {host}:{port}: {err.strerror or err}") from None
    return held


class _Child:
    """One child process: the engine (index -1) or a front end."""

    def __init__(self, role: str, index: int, process: asyncio.subprocess.Process, slots: str):
        self.role, self.index, self.process, self.slots = role, index, process, slots
        self.started = time.monotonic()
        self.exited = asyncio.ensure_future(process.wait())

    @property
    def name(self) -> str:
        return "the engine process" if self.role == "engine" else f"front end {self.index}"


class Supervisor:
    def __init__(self, config: ServerConfig, workers: int):
        self.config, self.workers = config, workers
        self._runtime = tempfile.mkdtemp(prefix="capsnet-serve-")
        self._socket = os.path.join(self._runtime, "engine.sock")
        self._generation = 0
        self.engine: _Child | None = None
        self.front: dict[int, _Child] = {}
        self._quick_exits = 0

    async def _spawn(self, role: str, index: int, config: ServerConfig) -> tuple[_Child, str]:
        """Start a child and wait for its ready message; CapsNetError if it exits first."""
        self._generation += 1
        slots = f"capsnet-{os.getpid()}-{index}-{self._generation}"
        read_fd, write_fd = os.pipe()
        try:
            process = await asyncio.create_subprocess_exec(
                sys.executable, "-m", "capsnet.serving.processes.supervisor", role, str(index), self._socket, slots,
                str(write_fd), stdin=asyncio.subprocess.PIPE, pass_fds=(write_fd,), start_new_session=True)
        finally:
            os.close(write_fd)
        child = _Child(role, index, process, slots)
        assert process.stdin is not None
        process.stdin.write(pickle.dumps((config, logging.getLogger().level)))
        process.stdin.close()
        try:
            ready = await asyncio.wait_for(asyncio.to_thread(_read_all, read_fd), STARTUP_TIMEOUT_S)
        finally:
            os.close(read_fd)
        if not ready:
            code = await child.exited
            raise CapsNetError(f"{child.name} exited with code {code} while starting (its log says why)")
        return child, ready

    async def run(self, stopping: asyncio.Event) -> int:
        config = self.config
        os.makedirs(os.path.join(self._runtime, "metrics"))
        os.environ[MULTIPROCESS_DIR] = os.path.join(self._runtime, "metrics")
        held = [_hold_port(config.host, config.grpc_port)]
        if config.http:
            held.append(_hold_port(config.host, config.http_port))
        config = dataclasses.replace(config, grpc_port=held[0].getsockname()[1],
                                     http_port=held[1].getsockname()[1] if config.http else config.http_port)
        self.config = config
        try:
            self.engine, metrics_port = await self._spawn("engine", -1, config)
            for index in range(self.workers):
                self.front[index], served = await self._spawn("front-end", index, config)
            if stopping.is_set():
                log.info("a signal arrived during startup: stopping without serving")
                return await self._stop()
            secure = "s" if config.tls_cert else ""
            rest = f" rest http{secure}://{config.host}:{config.http_port}" if config.http else ""
            print(f"capsnet serve: ready: {served.split('; ')[0].removeprefix('capsnet serve: ready: ')}; "
                  f"grpc{secure}://{config.host}:{config.grpc_port} metrics http://{config.host}:{metrics_port}"
                  f"/metrics{rest}; {self.workers} front-end processes", flush=True)
            return await self._watch(stopping)
        except CapsNetError:
            await self._stop()
            raise
        finally:
            for sock in held:
                sock.close()
            shutil.rmtree(self._runtime, ignore_errors=True)

    async def _watch(self, stopping: asyncio.Event) -> int:
        stop = asyncio.ensure_future(stopping.wait())
        while True:
            assert self.engine is not None
            children = [self.engine.exited, *(child.exited for child in self.front.values())]
            await asyncio.wait([stop, *children], return_when=asyncio.FIRST_COMPLETED)
            if stop.done():
                log.info("shutting down: the front ends drain, then the engine finishes its queues")
                return await self._stop()
            if self.engine.exited.done():
                log.error("the engine process exited with code %s: the server stops (its front ends can no longer "
                          "answer requests)", self.engine.exited.result())
                await self._stop()
                return ENGINE_FAILED
            for child in list(self.front.values()):
                if child.exited.done():
                    await self._restart(child)

    async def _restart(self, child: _Child) -> None:
        from prometheus_client import multiprocess

        code = child.exited.result()
        multiprocess.mark_process_dead(child.process.pid)  # its live gauges go; its counts stay in the sums
        _unlink_slots(child.slots)
        self._quick_exits = self._quick_exits + 1 if time.monotonic() - child.started < QUICK_EXIT_S else 0
        if self._quick_exits >= QUICK_EXITS:
            raise CapsNetError(f"{child.name} exited {QUICK_EXITS} times within {QUICK_EXIT_S:g} s of starting "
                               f"(last exit code {code}): the server stops")
        log.error("%s (pid %d) exited with code %s: its clients' calls ended UNAVAILABLE; restarting it", child.name,
                  child.process.pid, code)
        self.front[child.index], _ = await self._spawn("front-end", child.index, self.config)

    async def _stop(self) -> int:
        """SIGTERM to the front ends, and once they have drained, to the engine; 0 when the engine stopped cleanly."""
        fronts = list(self.front.values())
        for child in fronts:
            _signal(child, signal.SIGTERM)
        await asyncio.gather(*(child.exited for child in fronts))
        for child in fronts:
            _unlink_slots(child.slots)
        if self.engine is None:
            return 0
        _signal(self.engine, signal.SIGTERM)
        code = await self.engine.exited
        return 0 if code == 0 else ENGINE_FAILED

    def stop_now(self) -> None:
        """A second signal: the front ends' waits are cut (their own second signal)."""
        for child in self.front.values():
            _signal(child, signal.SIGTERM)


def _signal(child: _Child, signum: int) -> None:
    if child.process.returncode is None:
        with contextlib.suppress(ProcessLookupError):
            child.process.send_signal(signum)


def _unlink_slots(name: str) -> None:
    from capsnet.serving.processes.engine_link import unlink_slots

    unlink_slots(name)


def _read_all(fd: int) -> str:
    """What a child writes to its ready pipe before closing it ("" when it exited first)."""
    chunks = []
    while chunk := os.read(fd, 4096):
        chunks.append(chunk)
    return b"".join(chunks).decode()


async def supervise(config: ServerConfig, workers: int) -> int:
    """`capsnet serve` with `workers` front ends: the server's exit code."""
    stopping = asyncio.Event()
    loop = asyncio.get_running_loop()
    supervisor = Supervisor(config, workers)

    def on_signal() -> None:
        if stopping.is_set():
            supervisor.stop_now()
        stopping.set()

    for signum in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(signum, on_signal)
    # SIGHUP rescans a single-process server's repository; here the models are the engine's as loaded at start
    loop.add_signal_handler(signal.SIGHUP, log.warning, "SIGHUP ignored: model control is off with front-end processes")
    code = await supervisor.run(stopping)
    print("capsnet serve: stopped", file=sys.stderr, flush=True)
    return code


def _child_main(argv: list[str]) -> int:
    role, index, socket_path, slots, ready_fd = argv
    config, level = pickle.loads(sys.stdin.buffer.read())
    logging.basicConfig(level=level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if config.log_format == "json":
        from capsnet.serving.observability.observe import use_json_logs

        use_json_logs()
    # the supervisor's children stop with it, however it ends (Linux)
    ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)

    def announce(line: object) -> None:
        os.write(int(ready_fd), str(line).encode())
        os.close(int(ready_fd))

    if role == "engine":
        from capsnet.serving.processes.engine_process import run_engine

        return asyncio.run(run_engine(config, socket_path, announce))
    try:
        return asyncio.run(_run_front_end(config, socket_path, slots, announce))
    except CapsNetError as err:
        log.error("front end %s: %s", index, err)
        return 2


async def _run_front_end(config: ServerConfig, socket_path: str, slots: str, announce) -> int:
    from capsnet.serving.processes.front_end import EngineLink, FrontEnd
    from capsnet.serving.transports.server import serve

    link = await EngineLink.connect(socket_path, slots, config)

    async def stop_when_engine_gone() -> None:
        await link.lost.wait()
        os.kill(os.getpid(), signal.SIGTERM)  # the drain refuses new requests; those waiting fail UNAVAILABLE

    watch = asyncio.ensure_future(stop_when_engine_gone())
    try:
        return await serve(config, FrontEnd(config, link), announce)
    finally:
        watch.cancel()
        await link.close()


if __name__ == "__main__":
    sys.exit(_child_main(sys.argv[1:]))
