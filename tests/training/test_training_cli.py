"""User mistakes in `capsnet train` / `capsnet eval`: one line on stderr, exit 2, no traceback, no training."""

from __future__ import annotations

import shutil
import subprocess
import sys

import numpy as np
import pytest
import torch

from capsnet.cli import main
from capsnet.models.checkpoint import load_checkpoint

# Every run that gets past validation would train tiny for one epoch: the errors below must come first.
TRAIN = ["train", "--preset", "tiny", "--epochs", "1", "--no-progress"]


def assert_one_line_error(capsys, argv, message):
    code = main(argv)
    captured = capsys.readouterr()
    assert code == 2
    lines = captured.err.splitlines()
    assert len(lines) == 1, captured.err
    assert lines[0].startswith(f"capsnet {argv[0]}: error: ") and message in lines[0], lines[0]
    assert captured.out == ""


@pytest.mark.parametrize("flags, message", [
    (["--data", "/nonexistent/mnist"], "data directory /nonexistent/mnist does not exist"),
    (["--preset", "huge"], "unknown preset 'huge'; choose one of paper, paper-half, paper-pose, paper-quarter, tiny"),
    (["--epochs", "0"], "--epochs must be at least 1"),
    (["--batch-size", "-4"], "--batch-size must be at least 1"),
    (["--lr", "0"], "--lr must be a positive number"),
    (["--lr", "nan"], "--lr must be a positive number"),
    (["--lr-decay", "1.5"], "--lr-decay must be in (0, 1]"),
    (["--warmup", "1"], "--warmup must be at least 0 and below 1"),
    (["--warmup", "0.2"], "--warmup belongs to --lr-schedule linear; the exponential schedule has none"),
    (["--lr-schedule", "linear", "--lr-decay", "0.5"], "--lr-decay belongs to --lr-schedule exponential"),
    (["--val-fraction", "1"], "--val-fraction must be at least 0 and below 1"),
    (["--val-fraction", "-0.1"], "--val-fraction must be at least 0 and below 1"),
    (["--val-fraction", "0.0001"], "a validation fraction of 0.0001 leaves 4000 training and 0 validation images"),
    (["--max-shift", "-1"], "--max-shift must be 0 or more"),
    (["--max-shift", "28"], "--max-shift 28 is not smaller than the 28x28 images"),
    (["--erase", "1.5"], "--erase must be in [0, 1]"),
    (["--erase", "nan"], "--erase must be in [0, 1]"),
    (["--routing", "dynamic"], "routing must be one of sabour, leaky, su"),
    (["--routing-iterations", "0"], "--routing-iterations must be at least 1"),
    (["--squash-constant", "-1"], "--squash-constant must be a positive number"),
    (["--squash-constant", "inf"], "--squash-constant must be a positive number"),
    (["--seed", "-1"], "--seed must be in [0, 9223372036854775808)"),
    (["--seed", str(2**70)], "--seed must be in [0, 9223372036854775808)"),
    (["--threads", "0"], "--threads must be at least 1"),
    (["--device", "tpu"], "unknown device 'tpu'"),
    (["--device", "meta"], "unsupported device 'meta'"),
])
def test_bad_train_flags(capsys, tmp_path, flags, message):
    assert_one_line_error(capsys, [*TRAIN, "--out", str(tmp_path / "m.ckpt"), *flags], message)
    assert not (tmp_path / "m.ckpt").exists()


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the error on a machine without CUDA")
def test_cuda_requested_without_a_gpu(capsys, tmp_path):
    assert_one_line_error(capsys, [*TRAIN, "--out", str(tmp_path / "m.ckpt"), "--device", "cuda"], "no usable CUDA GPU")


def test_malformed_data_directories(capsys, tmp_path, idx_dataset):
    flat = torch.zeros(10, 0, 28, dtype=torch.uint8).numpy()  # images 0 pixels high: once blamed on --max-shift
    directory = idx_dataset(flat, torch.arange(10).numpy(), flat, torch.arange(10).numpy(), name="flat")
    assert_one_line_error(capsys, [*TRAIN, "--data", str(directory), "--val-fraction", "0"],
                          "declares images of 0x28 with 1 channel")
    (tmp_path / "empty").mkdir()
    assert_one_line_error(capsys, [*TRAIN, "--data", str(tmp_path / "empty")], "has no train-images-idx3-ubyte[.gz]")
    images = torch.zeros(10, 28, 28, dtype=torch.uint8).numpy()
    directory = idx_dataset(images, torch.arange(10).numpy(), images, torch.arange(10).numpy())
    (directory / "t10k-images-idx3-ubyte").write_bytes(b"PK\x03\x04 a zip file, not IDX")
    assert_one_line_error(capsys, [*TRAIN, "--data", str(directory)],
                          "not an unsigned-byte IDX file (bad magic number)")


def test_unwritable_out(capsys, tmp_path):
    assert_one_line_error(capsys, [*TRAIN, "--out", str(tmp_path)], "is a directory")
    # a folder still to be made: without the check, a checkpoint file named `new` appeared
    assert_one_line_error(capsys, [*TRAIN, "--out", f"{tmp_path}/new/"],
                          f"--out {tmp_path}/new/ names a folder; give a file name such as {tmp_path}/new/model.ckpt")
    assert not (tmp_path / "new").exists()
    (tmp_path / "file").write_text("")
    assert_one_line_error(capsys, [*TRAIN, "--out", str(tmp_path / "file" / "m.ckpt")], "cannot create the folder")
    # a folder that exists but takes no files: os.access says yes to root there, a real write says no
    assert_one_line_error(capsys, [*TRAIN, "--out", "/proc/m.ckpt"], "cannot write to /proc")


def test_a_stray_world_size_without_torchrun(capsys, tmp_path, monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.delenv("MASTER_ADDR", raising=False)
    monkeypatch.delenv("MASTER_PORT", raising=False)
    assert_one_line_error(capsys, [*TRAIN, "--out", str(tmp_path / "m.ckpt")],
                          "WORLD_SIZE=2 asks for a process group but MASTER_ADDR and MASTER_PORT are not set")


def test_bad_resume(capsys, tmp_path, random_tiny_checkpoint, copy_of):
    out = tmp_path / "m.ckpt"
    assert_one_line_error(capsys, [*TRAIN, "--out", str(out), "--resume"],
                          f"checkpoint {tmp_path}/m.last.ckpt does not exist")
    assert_one_line_error(capsys, [*TRAIN, "--out", str(out), "--resume", str(random_tiny_checkpoint)],
                          "holds no optimizer state")
    assert_one_line_error(capsys, [*TRAIN, "--preset", "paper", "--out", str(out),
                                   "--resume", str(random_tiny_checkpoint)],
                          "--resume continues the checkpoint's model; these flags change it: conv1_channels=256")
    damaged = copy_of(random_tiny_checkpoint)
    damaged.write_bytes(damaged.read_bytes()[:1000])
    assert_one_line_error(capsys, [*TRAIN, "--out", str(out), "--resume", str(damaged)], "is damaged")


def test_a_checkpoint_with_a_field_of_the_wrong_kind(capsys, tmp_path, trained_tiny_checkpoint):
    payload = torch.load(trained_tiny_checkpoint.with_name("model.last.ckpt"), weights_only=True)
    damaged = tmp_path / "damaged.ckpt"
    torch.save({**payload, "metrics": [1, 2]}, damaged)
    message = f"checkpoint {damaged} is damaged: its metrics is not a dict: [1, 2]"
    assert_one_line_error(capsys, ["eval", str(damaged)], message)
    resume = [*TRAIN, "--epochs", "3", "--out", str(tmp_path / "m.ckpt"), "--resume", str(damaged)]
    assert_one_line_error(capsys, resume, message)
    torch.save({**payload, "optimizer_state": {}}, damaged)  # a dict, but not an optimizer's
    assert_one_line_error(capsys, resume, f"checkpoint {damaged} is damaged: its optimizer state does not load "
                                          "(KeyError: 'param_groups')")


def test_resume_refuses_data_of_other_classes(capsys, trained_tiny_checkpoint, copy_of, idx_dataset):
    last = copy_of(trained_tiny_checkpoint.with_name("model.last.ckpt"))  # 10 digits, 2 epochs
    # no --preset: the model is the checkpoint's whatever the data
    resume = ["train", "--epochs", "3", "--no-progress", "--out", str(last.with_name("m.ckpt")), "--resume", str(last)]
    images, labels = torch.zeros(20, 28, 28, dtype=torch.uint8).numpy(), (torch.arange(20) % 10).numpy()
    clothes = idx_dataset(images, labels, images, labels, name="fashion-mnist")  # the folder name names the classes
    assert_one_line_error(capsys, [*resume, "--data", str(clothes)],
                          f"checkpoint {last} was trained on classes 0, 1, 2, 3, 4, 5, 6, 7, 8, 9 and needs data of "
                          "all of them; data 'fashion-mnist' has T-shirt/top, Trouser, Pullover")
    # fewer classes than the model's would write a checkpoint whose class names do not match its outputs
    some_digits = idx_dataset(images, labels % 5, images, labels % 5, name="digits-0-4")
    assert_one_line_error(capsys, [*resume, "--data", str(some_digits)], "data 'digits-0-4' has 0, 1, 2, 3, 4 (a")
    # the same classes in a folder of another name (moved, copied) continue, and the checkpoint says where
    digits = idx_dataset(images, labels, images, labels, name="digits-elsewhere")
    assert main([*resume, "--data", str(digits)]) == 0
    resumed = load_checkpoint(last.with_name("m.last.ckpt"))
    assert (resumed.epoch, resumed.dataset, resumed.metrics["data"]) == (3, "digits-elsewhere", str(digits))


def test_resume_of_a_finished_run(capsys, trained_tiny_checkpoint, tmp_path):
    finished = [*TRAIN, "--epochs", "2", "--out", str(tmp_path / "m.ckpt"), "--resume", str(trained_tiny_checkpoint)]
    assert_one_line_error(capsys, finished, "has already trained 2 epochs; pass --epochs above that")


def test_bad_eval_inputs(capsys, tmp_path, random_tiny_checkpoint, copy_of, random_colour_dataset):
    assert_one_line_error(capsys, ["eval", str(tmp_path / "absent.ckpt")], "does not exist")
    damaged = copy_of(random_tiny_checkpoint)
    damaged.write_bytes(b"\x00" * 64)
    assert_one_line_error(capsys, ["eval", str(damaged)], "is damaged or not a capsnet checkpoint")
    assert_one_line_error(capsys, ["eval", str(random_tiny_checkpoint), "--data", str(random_colour_dataset)],
                          "takes 1x28x28 images; data 'colour-32' has 3x32x32")
    assert_one_line_error(capsys, ["eval", str(random_tiny_checkpoint), "--batch-size", "0"],
                          "--batch-size must be at least 1")


def test_the_installed_command_reports_errors_without_a_traceback(tmp_path):
    result = subprocess.run([sys.executable, "-m", "capsnet", *TRAIN, "--data", str(tmp_path / "absent")],
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 2
    assert result.stderr == f"capsnet train: error: data directory {tmp_path / 'absent'} does not exist\n"
    result = subprocess.run([sys.executable, "-m", "capsnet", *TRAIN, "--epochs", "three"],
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 2 and "Traceback" not in result.stderr
    assert "argument --epochs: invalid int value: 'three'" in result.stderr.splitlines()[-1]


def test_eval_refuses_data_of_other_classes(capsys, random_tiny_checkpoint, idx_dataset):
    images, labels = torch.zeros(20, 28, 28, dtype=torch.uint8).numpy(), (torch.arange(20) % 10).numpy()
    clothes = idx_dataset(images, labels, images, labels, name="fashion-mnist")  # the folder name names the classes
    assert_one_line_error(capsys, ["eval", str(random_tiny_checkpoint), "--data", str(clothes)],
                          "was trained on classes 0, 1, 2, 3, 4, 5, 6, 7, 8, 9; data 'fashion-mnist' has T-shirt/top")
    some_digits = idx_dataset(images, labels % 5, images, labels % 5, name="digits-0-4")  # a subset is fine
    assert main(["eval", str(random_tiny_checkpoint), "--data", str(some_digits)]) == 0


def test_commands_that_read_a_checkpoint_default_to_its_training_data(capsys, random_tiny_checkpoint, idx_dataset):
    from capsnet.training.checkpoint import save_checkpoint
    from capsnet.training.data import FASHION_MNIST_NAMES

    images, labels = torch.zeros(20, 28, 28, dtype=torch.uint8).numpy(), (torch.arange(20) % 10).numpy()
    clothes = idx_dataset(images, labels, images, labels, name="fashion-mnist")
    checkpoint = load_checkpoint(random_tiny_checkpoint)
    checkpoint.class_names, checkpoint.dataset = list(FASHION_MNIST_NAMES), "fashion-mnist"
    checkpoint.metrics = {"data": str(clothes)}
    path = clothes.parent / "clothes.ckpt"
    save_checkpoint(checkpoint, path)
    # no --data: the clothes it was trained on, not the embedded digits
    assert main(["eval", str(path), "--json"]) == 0
    assert '"data": "fashion-mnist"' in capsys.readouterr().out
    assert main(["robustness", str(path), "--pairs", "4", "--json"]) == 0
    assert '"data": "fashion-mnist"' in capsys.readouterr().out
    shutil.rmtree(clothes)
    for command in ("eval", "visualize", "robustness"):
        extra = ["--out", str(path.parent / "pictures")] if command == "visualize" else []
        assert_one_line_error(capsys, [command, str(path), *extra],
                              f"was trained on fashion-mnist ({clothes} is not here); pass --data")


@pytest.mark.parametrize("flags, message", [
    (["--arch", "gap-cnn", "--routing", "su"], "--routing sets capsule routing; a gap-cnn model has no capsules"),
    (["--preset", "gap-cnn-tiny", "--routing-iterations", "2"], "--routing-iterations sets capsule routing"),
    (["--arch", "shared-capsnet", "--preset", "paper"],
     "--preset paper is a capsnet preset; --arch shared-capsnet takes shared or shared-article or shared-tiny"),
    (["--arch", "gap-cnn", "--preset", "shared-tiny"],
     "--preset shared-tiny is a shared-capsnet preset; --arch gap-cnn takes gap-cnn or gap-cnn-article or "
     "gap-cnn-tiny"),
    (["--arch", "cnn-baseline", "--preset", "shared"],
     "--arch cnn-baseline takes paper or paper-half or paper-pose or paper-quarter or tiny or em or em-tiny"),
    (["--preset", "shared-tiny", "--reconstruction-weight", "0.1"],
     "config: a shared-capsnet model has no decoder; reconstruction_weight must be 0"),
])
def test_any_size_model_flags(capsys, tmp_path, flags, message):
    assert_one_line_error(capsys, ["train", *flags, "--epochs", "1", "--out", str(tmp_path / "m.ckpt"),
                                   "--no-progress"], message)
    assert not (tmp_path / "m.ckpt").exists()


def test_images_below_the_smallest_size_an_any_size_model_takes(capsys, tmp_path, idx_dataset):
    images = np.zeros((20, 13, 30), np.uint8)
    data = idx_dataset(images, np.arange(20) % 10, images, np.arange(20) % 10, name="too-short")
    assert_one_line_error(capsys, ["train", "--data", str(data), "--preset", "shared-tiny", "--val-fraction", "0",
                                   "--out", str(tmp_path / "m.ckpt")],
                          "config: a shared-capsnet model takes 1-channel images of 14x14 to 256x256 (height x "
                          "width, any in between); got 1x13x30")


@pytest.mark.parametrize("flags, message", [
    (["--pairs", "side-by-side"], "takes 1x28x28 images; side-by-side pairs are 1x28x56 (models of --arch "
                                  "shared-capsnet or gap-cnn take any size)"),
    (["--seed", "3"], "--seed sets the pairs; add --pairs side-by-side|stacked|overlap"),
    (["--pair-count", "10"], "--pair-count sets the pairs; add --pairs"),
    (["--pairs", "side-by-side", "--pair-count", "0"], "--pair-count must be from 1 to 1,000,000, got 0"),
    (["--pairs", "side-by-side", "--pair-count", "1000001"], "--pair-count must be from 1 to 1,000,000"),
    (["--pairs", "side-by-side", "--seed", "-1"], "--seed must be in [0, "),
])
def test_bad_eval_pairs(capsys, random_tiny_checkpoint, flags, message):
    assert_one_line_error(capsys, ["eval", str(random_tiny_checkpoint), *flags], message)
