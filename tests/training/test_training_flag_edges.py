"""Edges of the training flags: a resumed linear schedule with other steps an epoch, a validation share that takes a
whole class, --threads beyond any CPU, and a resume that leaves out the run's seed or augmentation."""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest

from capsnet.cli import main
from capsnet.errors import CapsNetError
from capsnet.training import train as train_module
from capsnet.models.checkpoint import load_checkpoint
from capsnet.training.data import load_dataset
from capsnet.training.options import TrainOptions

# 200 random training images make an epoch of 7 steps at batch 32 and 4 at batch 64, in well under a second
TRAIN = ["train", "--preset", "tiny", "--no-progress", "--threads", "1", "--val-fraction", "0"]


@pytest.fixture()
def small_data(idx_dataset):
    rng = np.random.default_rng(0)
    images = rng.integers(0, 256, size=(250, 28, 28), dtype=np.uint8)
    labels = np.arange(250) % 10
    return idx_dataset(images[:200], labels[:200], images[200:], labels[200:], name="small")


def assert_one_line_error(capsys, argv, message):
    code = main(argv)
    captured = capsys.readouterr()
    lines = captured.err.splitlines()
    assert code == 2 and len(lines) == 1, captured.err
    assert lines[0].startswith("capsnet train: error: ") and message in lines[0], lines[0]


def stop_after_first_epoch(monkeypatch) -> None:
    """Make the next run die (KeyboardInterrupt) right after it writes the last checkpoint of its first epoch."""
    real_save = train_module.save_checkpoint

    def save_then_stop(checkpoint, path):
        real_save(checkpoint, path)
        if checkpoint.epoch == 1 and checkpoint.epoch_progress is None and path.name.endswith(".last.ckpt"):
            raise KeyboardInterrupt

    monkeypatch.setattr(train_module, "save_checkpoint", save_then_stop)


def test_a_linear_schedule_resumes_only_with_the_same_steps_an_epoch(small_data, tmp_path, monkeypatch, capsys):
    # Before: --batch-size 64 on a run begun at 32 continued the scheduler's step count (7) on a 2 x 4-step
    # schedule, so the rate was 0 from the resumed epoch's second step on: an epoch that trained nothing, exit 0.
    out = tmp_path / "model.ckpt"
    run = [*TRAIN, "--data", str(small_data), "--lr-schedule", "linear", "--epochs", "2", "--out", str(out)]
    stop_after_first_epoch(monkeypatch)
    assert main([*run, "--batch-size", "32"]) == 130
    monkeypatch.undo()
    capsys.readouterr()
    assert_one_line_error(capsys, [*run, "--batch-size", "64", "--resume"],
                          f"{out.with_name('model.last.ckpt')} follows a linear learning-rate schedule of 7 steps an "
                          "epoch; this run takes 4: --batch-size 64 (checkpoint: 32)")
    # with its own batches it continues the documented schedule: S = 14 steps, W = round(0.1 * 14) = 1, so the
    # second epoch starts (step 7) at lr * (S - 7) / (S - W)
    assert main([*run, "--batch-size", "32", "--resume"]) == 0
    history = load_checkpoint(out.with_name("model.last.ckpt")).history
    assert [record["lr"] for record in history] == pytest.approx([1e-3 / 1, 1e-3 * 7 / 13])


def test_a_validation_share_that_takes_every_image_of_a_class_is_refused(idx_dataset, tmp_path, capsys):
    # class 9 has one training image: round(0.6 * 1) = 1 held it out, and the model trained without the class
    rng = np.random.default_rng(0)
    labels = np.array([k for k in range(10) for _ in range(1 if k == 9 else 10)])
    images = rng.integers(0, 256, size=(len(labels), 28, 28), dtype=np.uint8)
    data = idx_dataset(images, labels, images[:20], labels[:20], name="one-nine")
    assert_one_line_error(capsys, ["train", "--preset", "tiny", "--epochs", "1", "--no-progress", "--data", str(data),
                                   "--val-fraction", "0.6", "--out", str(tmp_path / "m.ckpt")],
                          "a validation fraction of 0.6 holds out every training image of class 9 in 'one-nine'")
    assert not (tmp_path / "m.ckpt").exists()
    # round(0.1 * 1) = 0: a class with no validation image is what the documented round(F * n_k) gives
    dataset = load_dataset(str(data), 0.1)
    assert 9 in dataset.train.labels and 9 not in dataset.validation.labels


def test_threads_beyond_any_cpu_are_a_one_line_error(tmp_path):
    with pytest.raises(CapsNetError, match=r"^--threads must be at most 1024$"):
        TrainOptions(threads=100_000)
    # before: torch's thread pool failed to start that many threads and the process died of a segmentation fault
    result = subprocess.run([sys.executable, "-m", "capsnet", *TRAIN, "--epochs", "1", "--threads", "100000",
                             "--out", str(tmp_path / "m.ckpt")], capture_output=True, text=True, timeout=120)
    assert (result.returncode, result.stderr) == (2, "capsnet train: error: --threads must be at most 1024\n")


def test_a_resume_keeps_the_runs_seed_and_augmentation(small_data, tmp_path, capsys):
    # Before: a resume that left out --seed/--hflip/--erase/--max-shift trained on with the defaults, exit 0, and
    # its checkpoints said the whole run had used them. Left out, they are now the checkpoint's, like --lr.
    out = tmp_path / "model.ckpt"
    run = [*TRAIN, "--data", str(small_data), "--out", str(out)]
    augmentation = ["--seed", "5", "--hflip", "--erase", "0.3", "--max-shift", "1"]
    assert main([*run, "--epochs", "1", *augmentation]) == 0
    assert main([*run, "--epochs", "2", "--resume"]) == 0
    metrics = load_checkpoint(out.with_name("model.last.ckpt")).metrics
    assert (metrics["seed"], metrics["hflip"], metrics["erase"], metrics["max_shift"]) == (5, True, 0.3, 1)
    capsys.readouterr()
    # given again, they must agree
    assert_one_line_error(capsys, [*run, "--epochs", "3", "--resume", "--seed", "0", "--max-shift", "2"],
                          "--resume continues the checkpoint's shuffling and augmentation: --seed 0 (checkpoint: 5), "
                          "--max-shift 2 (checkpoint: 1)")
    # the batch size may still change at an epoch's end, as documented for an exponential schedule
    assert main([*run, "--epochs", "3", "--resume", *augmentation, "--batch-size", "32"]) == 0


def test_a_runs_threads_are_given_back_to_the_process(small_data, tmp_path):
    """torch's thread count is the process's: a run in a caller's process (a test, a script) set it for good, and a
    later run there computed with other threads, so its sums, and a resumed run's weights, differed in the last bits."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(3)
    try:
        assert main([*TRAIN, "--data", str(small_data), "--epochs", "1", "--out", str(tmp_path / "m.ckpt")]) == 0
        assert torch.get_num_threads() == 3  # --threads 1 held for the run only
    finally:
        torch.set_num_threads(before)
