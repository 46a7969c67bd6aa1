"""`capsnet train` and `capsnet eval` end to end on the embedded digits with the tiny preset."""

from __future__ import annotations

import json

import pytest
import torch

from capsnet.cli import main
from capsnet.training.checkpoint import load_checkpoint

# Measured with the conftest command (tiny, 2 epochs, batch 64, seed 0): 73.5% held-out accuracy; chance is 10%.
TINY_TWO_EPOCH_ACCURACY_FLOOR = 0.60
TRAIN_ARGS = ["train", "--data", "embedded", "--preset", "tiny", "--batch-size", "64", "--seed", "0", "--no-progress"]


def test_tiny_model_beats_chance_by_a_wide_margin(trained_tiny_checkpoint, capsys):
    assert main(["eval", str(trained_tiny_checkpoint), "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["images"] == 1000 and report["split"] == "test"
    assert report["accuracy"] >= TINY_TWO_EPOCH_ACCURACY_FLOOR
    # eval recomputes what training recorded for the same weights
    metrics = load_checkpoint(trained_tiny_checkpoint).metrics
    assert report["accuracy"] == metrics["test_accuracy"]
    assert report["loss"] == pytest.approx(metrics["test_loss"], rel=1e-5)
    assert report["per_class_accuracy"] == pytest.approx(metrics["per_class_accuracy"])
    confusion = torch.tensor(report["confusion_matrix"])
    assert confusion.shape == (10, 10) and confusion.sum() == 1000 and confusion.trace() == report["correct"]
    assert confusion.sum(dim=1).tolist() == [100] * 10  # rows are true classes


def test_eval_text_report(trained_tiny_checkpoint, capsys):
    assert main(["eval", str(trained_tiny_checkpoint), "--split", "train", "--batch-size", "500"]) == 0
    text = capsys.readouterr().out
    assert "train split" in text and "/4000)" in text
    assert "confusion matrix (rows: true class, columns: predicted class):" in text
    assert sum(line.rstrip().endswith("/400)") for line in text.splitlines()) == 10  # one line per class


def test_last_checkpoint_holds_the_whole_history(trained_tiny_checkpoint):
    last = load_checkpoint(trained_tiny_checkpoint.with_name("model.last.ckpt"))
    assert last.epoch == 2 and [record["epoch"] for record in last.history] == [1, 2]
    lrs = [record["lr"] for record in last.history]
    assert lrs == pytest.approx([1e-3, 1e-3 * 0.9])  # ExponentialLR, default --lr-decay 0.9
    best = max(last.history, key=lambda record: record["test_accuracy"])
    assert load_checkpoint(trained_tiny_checkpoint).epoch == best["epoch"]
    for record in last.history:
        assert record["train_images_per_second"] > 0 and 0 <= record["train_accuracy"] <= 1


def test_resume_continues_the_same_run(trained_tiny_checkpoint, tmp_path, capsys):
    out = tmp_path / "model.ckpt"
    assert main([*TRAIN_ARGS, "--epochs", "1", "--out", str(out)]) == 0
    assert main([*TRAIN_ARGS, "--epochs", "2", "--out", str(out), "--resume"]) == 0
    assert "epoch 1/2" not in capsys.readouterr().out
    resumed = load_checkpoint(out.with_name("model.last.ckpt"))
    straight = load_checkpoint(trained_tiny_checkpoint.with_name("model.last.ckpt"))
    assert resumed.epoch == 2 and len(resumed.history) == 2
    # seeds derive from --seed and the epoch, and the optimizer state travels: the same weights as one run
    for name, value in straight.state_dict.items():
        assert torch.equal(resumed.state_dict[name], value), name
    assert resumed.metrics["test_accuracy"] == straight.metrics["test_accuracy"]


@pytest.mark.gpu
def test_cuda_mixed_precision_training(tmp_path):
    out = tmp_path / "cuda.ckpt"
    assert main([*TRAIN_ARGS, "--epochs", "2", "--device", "cuda", "--amp", "--out", str(out)]) == 0
    metrics = load_checkpoint(out).metrics
    assert metrics["device"] == "cuda" and metrics["amp"] is True
    # fp16 with gradient scaling learns like the CPU runs (73-74%); not measured on a GPU yet, hence the wider margin
    assert metrics["test_accuracy"] >= 0.5
