"""DistributedDataParallel: a real 2-process gloo run on the CPU, through the same `train` as one process."""

from __future__ import annotations

import os
import socket
from pathlib import Path

import torch
import torch.multiprocessing as mp
from group_threads import group_threads

from capsnet.models.checkpoint import load_checkpoint
from capsnet.training.options import TrainOptions
from capsnet.training.train import train


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def run_rank(rank: int, world_size: int, port: int, out: str, states_dir: str) -> None:
    """What torchrun does for each process: the environment names the rank, then the same training runs."""
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world_size),
                      LOCAL_WORLD_SIZE=str(world_size), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    # mid-epoch checkpoints every 10 of the 57 steps: all ranks sum their running totals for rank 0 to write
    checkpoint = train(TrainOptions(data="embedded", preset="tiny", epochs=1, batch_size=64, out=out,
                                    device="cpu", threads=1, checkpoint_every=10, progress=False))
    torch.save(checkpoint.state_dict, os.path.join(states_dir, f"rank{rank}.pt"))
    # what is left of the group once `train` returns: nothing may reach interpreter shutdown
    Path(states_dir, f"rank{rank}.threads").write_text("\n".join(group_threads()))


def test_two_gloo_processes_train_and_agree_on_the_weights(tmp_path):
    out = tmp_path / "run" / "model.ckpt"
    mp.spawn(run_rank, args=(2, free_port(), str(out), str(tmp_path)), nprocs=2, join=True)
    for rank in range(2):  # gloo's threads, alive past destroy_process_group, ended in interpreter shutdown
        assert (tmp_path / f"rank{rank}.threads").read_text() == "", f"rank {rank}: the group outlived train()"
    rank0 = torch.load(tmp_path / "rank0.pt", weights_only=True)
    rank1 = torch.load(tmp_path / "rank1.pt", weights_only=True)
    for name, value in rank0.items():
        # each rank saw a different half of the data: only all-reduced gradients keep them equal
        assert torch.equal(value, rank1[name]), name
    assert sorted(p.name for p in out.parent.iterdir()) == ["model.ckpt", "model.last.ckpt"]  # rank 0 writes
    checkpoint = load_checkpoint(out)
    assert all(torch.equal(checkpoint.state_dict[name], value) for name, value in rank0.items())
    metrics = checkpoint.metrics
    assert metrics["world_size"] == 2 and (metrics["train_images"], metrics["validation_images"]) == (3600, 400)
    assert metrics["test_accuracy"] > 0.2  # evaluated over both ranks' shards of the 1,000 test images
    # the validation split too: its per-class counts, summed over the ranks' shards, are all 40 digits of each class
    per_class = metrics["validation_per_class_accuracy"]
    assert all(round(accuracy * 40, 6).is_integer() for accuracy in per_class.values())


def run_rank_without_shifts(rank: int, world_size: int, port: int, out: str) -> None:
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world_size),
                      LOCAL_WORLD_SIZE=str(world_size), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    train(TrainOptions(data="embedded", preset="tiny", epochs=1, batch_size=64, max_shift=0, out=out, device="cpu",
                       threads=1, progress=False))


def test_two_processes_follow_one_process_with_the_same_global_batch_and_learning_rate(tmp_path):
    """--batch-size is the global batch and --lr is not scaled: without shifts (each rank draws its own), 2 processes
    take the 1-process run's steps, and the loss and accuracy summed over the ranks are that run's."""
    two = tmp_path / "two" / "model.ckpt"
    mp.spawn(run_rank_without_shifts, args=(2, free_port(), str(two)), nprocs=2, join=True)
    one = train(TrainOptions(data="embedded", preset="tiny", epochs=1, batch_size=64, max_shift=0,
                             out=tmp_path / "one" / "model.ckpt", device="cpu", threads=1, progress=False))
    distributed = load_checkpoint(two)
    for name, value in one.state_dict.items():  # float rounding apart (measured: 6e-8)
        torch.testing.assert_close(distributed.state_dict[name], value, rtol=0, atol=1e-5, msg=name)
    for split in ("train", "validation", "test"):  # one rank's shard alone: 4e-4 off (train)
        assert abs(distributed.metrics[f"{split}_loss"] / one.metrics[f"{split}_loss"] - 1) < 1e-5, split
        # an image on the edge may tip either way
        images = one.metrics["train_images" if split == "train" else f"{split}_images"]
        assert abs(distributed.metrics[f"{split}_accuracy"] - one.metrics[f"{split}_accuracy"]) <= 1 / images + 1e-9
