"""Failures under torchrun, through the real `capsnet train` CLI in 2 gloo processes on the CPU: a user mistake is
one line from rank 0 and exit 2 on every rank; a mistake on one rank only, or ranks given different data, stop
them all instead of leaving them waiting for each other; a rank that dies leaves the others one line, not a
traceback."""

from __future__ import annotations

import multiprocessing
import os
import signal
import socket
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from group_threads import group_threads

from capsnet.training.options import TrainOptions
from capsnet.training.train import train

WORLD_SIZE = 2
# a spawned process imports torch and joins the group in a few seconds; a gloo group waits 30 minutes for a peer
DEADLINE_S = 120


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def run_cli(rank: int, port: int, argv: list[str], logs: str) -> None:
    """What torchrun does for each process (the environment names the rank), with stdout and stderr to files."""
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(WORLD_SIZE),
                      LOCAL_WORLD_SIZE=str(WORLD_SIZE), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    for stream, name in ((sys.stdout, "out"), (sys.stderr, "err")):
        with open(os.path.join(logs, f"rank{rank}.{name}"), "w") as file:
            os.dup2(file.fileno(), stream.fileno())
    from capsnet.cli import main

    code = main(argv)  # an exception that escapes main prints its traceback and exits 1
    # the group's threads still alive here end during interpreter shutdown, where the rank could abort
    Path(logs, f"rank{rank}.threads").write_text("\n".join(group_threads()))
    sys.exit(code)


def start_ranks(tmp_path: Path, argv_of_rank) -> list[multiprocessing.Process]:
    spawn = multiprocessing.get_context("spawn")
    port = free_port()
    ranks = [spawn.Process(target=run_cli, args=(rank, port, argv_of_rank(rank), str(tmp_path)))
             for rank in range(WORLD_SIZE)]
    for process in ranks:
        process.start()
    return ranks


def wait(ranks: list[multiprocessing.Process]) -> list[int]:
    """Each rank's exit status; a rank still running at the deadline is killed and fails the test."""
    deadline = time.monotonic() + DEADLINE_S
    for process in ranks:
        process.join(max(0.0, deadline - time.monotonic()))
    hung = [rank for rank, process in enumerate(ranks) if process.is_alive()]
    for process in ranks:
        if process.is_alive():
            process.kill()
            process.join()
    assert not hung, f"ranks {hung} were still running after {DEADLINE_S} s"
    return [process.exitcode for process in ranks]


def threads_left(tmp_path: Path, ranks: range = range(WORLD_SIZE)) -> list[str]:
    """The process-group threads each rank had once `capsnet train` returned: none, or its exit may be an abort."""
    return [(tmp_path / f"rank{rank}.threads").read_text() for rank in ranks]


def stderr_of(tmp_path: Path) -> list[str]:
    return [(tmp_path / f"rank{rank}.err").read_text() for rank in range(WORLD_SIZE)]


def error_lines(text: str) -> list[str]:
    return [line for line in text.splitlines() if "error:" in line]


def train_argv(out: Path, *extra: str) -> list[str]:
    return ["train", "--data", "embedded", "--preset", "tiny", "--batch-size", "64", "--device", "cpu",
            "--threads", "1", "--no-progress", "--out", str(out), *extra]


@pytest.mark.parametrize("mistake", ["another --lr", "a damaged optimizer state"])
def test_a_resume_mistake_is_one_line_from_rank_0_and_every_rank_exits_2(tmp_path, mistake):
    out = tmp_path / "model.ckpt"
    train(TrainOptions(data="embedded", preset="tiny", epochs=1, batch_size=64, out=out, device="cpu", threads=1,
                       progress=False))
    last = out.with_name("model.last.ckpt")
    if mistake == "another --lr":  # found before the model is built
        extra = ("--lr", "0.01")
        expected = "--resume continues the checkpoint's learning rate: --lr 0.01 (checkpoint: 0.001)"
    else:  # found while the optimizer state loads
        torch.save({**torch.load(last, weights_only=True), "optimizer_state": {}}, last)
        extra = ()
        expected = f"checkpoint {last} is damaged: its optimizer state does not load (KeyError: 'param_groups')"
    ranks = start_ranks(tmp_path, lambda rank: train_argv(out, "--epochs", "2", "--resume", *extra))
    assert wait(ranks) == [2, 2]
    assert threads_left(tmp_path) == ["", ""]
    rank0, rank1 = stderr_of(tmp_path)
    # every rank made the same mistake: rank 0 says it once (it said it on every rank, N lines for N processes)
    assert error_lines(rank0) == [f"capsnet train: error: {expected}"]
    assert error_lines(rank1) == [] and "Traceback" not in rank0 + rank1


def test_a_mistake_on_one_rank_stops_every_rank_with_one_line_naming_it(tmp_path):
    # a data folder missing on one node: were that rank to exit before joining the group, the others would wait
    # for it in init_process_group for the group's 30-minute timeout
    ranks = start_ranks(tmp_path, lambda rank: train_argv(
        tmp_path / "model.ckpt", "--epochs", "1", *(("--data", str(tmp_path / "missing")) if rank == 1 else ())))
    assert wait(ranks) == [2, 2]
    assert threads_left(tmp_path) == ["", ""]
    rank0, rank1 = stderr_of(tmp_path)
    assert error_lines(rank0) == [f"capsnet train: error: process 1 of 2: data directory {tmp_path / 'missing'} "
                                  "does not exist"]
    assert error_lines(rank1) == [] and "Traceback" not in rank0 + rank1
    assert not (tmp_path / "model.ckpt").exists()


def test_a_rank_that_dies_mid_training_leaves_the_others_one_line_not_a_traceback(tmp_path):
    ranks = start_ranks(tmp_path, lambda rank: train_argv(tmp_path / "model.ckpt", "--epochs", "4"))
    deadline = time.monotonic() + DEADLINE_S
    rank0_out = tmp_path / "rank0.out"
    # once rank 0 reports epoch 1, both are training epoch 2 in lockstep (a collective every step)
    while not (rank0_out.exists() and "epoch 1/4" in rank0_out.read_text()):
        assert time.monotonic() < deadline and ranks[0].is_alive(), "rank 0 never finished epoch 1"
        time.sleep(0.1)
    os.kill(ranks[1].pid, signal.SIGKILL)  # a crash: out of memory, a lost node
    assert wait(ranks) == [2, -signal.SIGKILL]  # rank 0 leaves at once: tearing gloo down waited for the dead peer
    rank0 = stderr_of(tmp_path)[0]
    assert "Traceback" not in rank0  # it was gloo's "Connection closed by peer" RuntimeError with its traceback
    [line] = error_lines(rank0)
    assert line.startswith("capsnet train: error: process 0 of 2 stopped: another process of the run ended"), line


def test_ranks_given_other_data_stop_with_one_line_instead_of_waiting_for_each_other(tmp_path, idx_dataset):
    # another copy of the data on one node: its rank made fewer steps per epoch, finished its epoch first and waited
    # in a collective that the other rank never joined
    rng = np.random.default_rng(0)
    images, labels = rng.integers(0, 256, size=(120, 28, 28), dtype=np.uint8), np.arange(120) % 10
    folders = [idx_dataset(images[:100], labels[:100], images[100:], labels[100:], name="full"),
               idx_dataset(images[:60], labels[:60], images[100:], labels[100:], name="short")]
    ranks = start_ranks(tmp_path, lambda rank: train_argv(tmp_path / "model.ckpt", "--epochs", "2", "--batch-size",
                                                          "8", "--data", str(folders[rank])))
    assert wait(ranks) == [2, 2]
    assert threads_left(tmp_path) == ["", ""]
    rank0, rank1 = stderr_of(tmp_path)
    assert error_lines(rank0) == ["capsnet train: error: the processes' data or checkpoints differ: "
                                  "training/validation/test images 90/10/20 in process 0 but 50/10/20 in process 1 "
                                  "of 2; give every process the same"]
    assert error_lines(rank1) == [] and "Traceback" not in rank0 + rank1
