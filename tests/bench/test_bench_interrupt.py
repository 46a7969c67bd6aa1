"""`capsnet bench` stopped part-way, as a user or a scheduler stops it: Ctrl-C in a terminal, SIGTERM (`timeout`,
`kill`), or the server it measures dying. Each must end with one line and its exit code, no traceback, no
`capsnet serve` or benchmark worker left running, no temporary export left behind and no report half written."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow
ROW_MARKER = "gRPC capsnet, dynamic batching on, concurrency 1"  # logged as the first gRPC row starts


def children(pid: int) -> list[int]:
    """Processes whose parent is `pid` (the bench's server and workers), from /proc."""
    found = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:  # ended meanwhile
            continue
        if int(fields[1]) == pid:
            found.append(int(stat.parent.name))
    return found


def alive(pid: int) -> bool:
    """Running: neither gone nor a zombie waiting to be reaped."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state != "Z"


def start_bench(model: Path, tmp_path: Path) -> tuple[subprocess.Popen, Path, Path, Path]:
    """A small real run whose first gRPC row lasts long enough to be stopped in; its own session and process group,
    as a shell gives a foreground job, and its own TMPDIR, to see what it leaves there."""
    tmpdir, out, log = tmp_path / "tmp", tmp_path / "out", tmp_path / "bench.log"
    tmpdir.mkdir()
    command = [sys.executable, "-m", "capsnet", "bench", str(model), "--out", str(out), "--quick",
               "--backends", "onnxruntime:fp32", "--batch-sizes", "1", "--concurrency", "1", "--seconds", "0.05",
               "--peak-seconds", "0.05", "--accuracy-images", "10", "--profile-runs", "1", "--grpc-seconds", "8"]
    with open(log, "wb") as stream:
        proc = subprocess.Popen(command, stdout=stream, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                env={**os.environ, "TMPDIR": str(tmpdir)}, start_new_session=True)
    deadline = time.monotonic() + 240
    while ROW_MARKER not in log.read_text(errors="replace"):
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            pytest.fail(f"the bench never reached its gRPC rows (exit {proc.poll()}):\n{log.read_text()[-3000:]}")
        time.sleep(0.1)
    time.sleep(1.0)  # inside the row, in its first 4 s: the reference worker times the batch, the server waits
    return proc, tmpdir, out, log


def finish(proc: subprocess.Popen, log: Path, helpers: list[int]) -> tuple[int, str]:
    try:
        code = proc.wait(timeout=90)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
        for pid in helpers:  # never leave them to the next test, whatever the verdict
            if alive(pid):
                os.kill(pid, signal.SIGKILL)
    return code, log.read_text(errors="replace")


@pytest.mark.parametrize("how, code, last_line", [
    # a terminal's Ctrl-C goes to the whole foreground process group
    ("ctrl-c", 130, "capsnet bench: interrupted"),
    ("sigterm", 143, "capsnet bench: terminated by SIGTERM; {out} was left as it was"),
])
def test_bench_stopped_mid_grpc_stops_its_server_and_workers(tiny_export, tmp_path, how, code, last_line):
    proc, tmpdir, out, log = start_bench(tiny_export, tmp_path)
    helpers = children(proc.pid)
    assert len(helpers) == 2, helpers  # `capsnet serve` and the in-process reference worker
    if how == "ctrl-c":
        os.killpg(proc.pid, signal.SIGINT)
    else:
        proc.send_signal(signal.SIGTERM)
    returncode, output = finish(proc, log, helpers)
    left = [pid for pid in helpers if alive(pid)]
    assert returncode == code, output[-3000:]
    assert output.rstrip().splitlines()[-1] == last_line.format(out=out)
    assert "Traceback" not in output, output[-3000:]
    assert left == [], f"still running after the bench exited: {left}"
    assert list(tmpdir.glob("capsnet-bench-*")) == [] and not out.exists()  # the temporary export


def test_bench_server_dying_mid_run_is_a_one_line_error(tiny_export, tmp_path):
    proc, tmpdir, out, log = start_bench(tiny_export, tmp_path)
    helpers = children(proc.pid)
    (server,) = [pid for pid in helpers if " serve " in Path(f"/proc/{pid}/cmdline").read_text().replace("\0", " ")]
    os.kill(server, signal.SIGKILL)
    returncode, output = finish(proc, log, helpers)
    assert returncode == 2, output[-3000:]
    assert output.rstrip().splitlines()[-1].startswith(
        "capsnet bench: error: capsnet serve exited during the benchmark (killed by signal 9)")
    assert "Traceback" not in output, output[-3000:]
    assert [pid for pid in helpers if alive(pid)] == []
    assert list(tmpdir.glob("capsnet-bench-*")) == [] and not out.exists()  # the temporary export


def test_bench_killed_outright_leaves_no_server_running(tiny_export, tmp_path):
    """SIGKILL (the OOM killer, a CI job's hard timeout) runs no handler in the bench; the server it started in
    its own session gets SIGTERM from the kernel instead of serving on with nobody to stop it."""
    script = ("import sys, time\n"
              "from capsnet.bench.server_process import ServerProcess\n"
              f"with ServerProcess(['--model', {str(tiny_export)!r}]) as server:\n"
              "    print(server.pid, flush=True)\n"
              "    time.sleep(120)\n")
    bench = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    server = None
    try:
        server = int(bench.stdout.readline())  # once it is ready
        assert alive(server)
        bench.kill()
        bench.wait()
        deadline = time.monotonic() + 20  # the server drains for up to 10 s
        while alive(server) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not alive(server), "capsnet serve outlived the process that started it"
    finally:
        bench.kill()
        if server is not None and alive(server):  # never leave it to the next test
            os.kill(server, signal.SIGKILL)
