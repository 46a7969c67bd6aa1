"""`capsnet eval`, `capsnet visualize` and `capsnet robustness` given mistakes and edge cases: one line on stderr and
exit 2, or the figure the user asked for, never a traceback, an endless run or a picture of something else."""

from __future__ import annotations

import json
import logging
import tempfile
from pathlib import Path

import numpy as np
import pytest

from capsnet.cli import main
from capsnet.training import visualize
from capsnet.models.checkpoint import load_checkpoint
from capsnet.training.checkpoint import save_checkpoint
from capsnet.models.config import preset
from capsnet.training.data import load_embedded

PICTURES = ["confusion.png", "pose-perturbation-0.png", "pose-perturbation-1.png", "pose-perturbation-2.png",
            "reconstructions.png", "routing.png", "training-curves.png"]


def assert_one_line_error(capsys, argv, message):
    code = main(argv)
    captured = capsys.readouterr()
    assert code == 2, captured.err
    lines = captured.err.splitlines()
    assert len(lines) == 1, captured.err
    assert lines[0].startswith(f"capsnet {argv[0]}: error: ") and message in lines[0], lines[0]


def test_visualize_refuses_an_empty_out(capsys, random_tiny_checkpoint, tmp_path, monkeypatch):
    # `--out "$UNSET"` drew every picture into the working directory
    monkeypatch.chdir(tmp_path)
    assert_one_line_error(capsys, ["visualize", str(random_tiny_checkpoint), "--out", "", "--images", "20"],
                          "--out needs a folder for the pictures, got an empty path")
    assert list(tmp_path.iterdir()) == []


def test_visualize_refuses_more_examples_than_a_figure_can_lay_out(capsys, random_tiny_checkpoint, tmp_path):
    # 200 ran past 5 minutes in matplotlib's layout; 600 columns exceed its image size limit
    assert_one_line_error(capsys, ["visualize", str(random_tiny_checkpoint), "--out", str(tmp_path / "p"),
                                   "--examples", "33"],
                          "--examples must be at most 32, got 33")


def test_visualize_reports_a_picture_it_cannot_write(capsys, random_tiny_checkpoint, tmp_path):
    (tmp_path / "confusion.png").mkdir()  # in the way of the first picture
    assert_one_line_error(capsys, ["visualize", str(random_tiny_checkpoint), "--out", str(tmp_path),
                                   "--images", "20"],
                          f"cannot write {tmp_path / 'confusion.png'}: Is a directory")


def _unwritable_directory() -> str | None:
    """/sys refuses new files even to root; None where it does not (or is absent)."""
    try:
        with tempfile.TemporaryFile(dir="/sys"):
            return None
    except OSError:
        return "/sys" if Path("/sys").is_dir() else None


@pytest.mark.skipif(_unwritable_directory() is None, reason="no directory here refuses new files")
def test_visualize_checks_out_is_writable_before_scoring(capsys, random_tiny_checkpoint, monkeypatch):
    monkeypatch.setattr("capsnet.training.evaluate.evaluate", lambda *args, **kwargs: pytest.fail("scored"))
    assert_one_line_error(capsys, ["visualize", str(random_tiny_checkpoint), "--out", _unwritable_directory()],
                          "cannot write to --out /sys: ")


def test_visualize_removes_an_earlier_runs_pictures_this_checkpoint_does_not_get(capsys, caplog, random_checkpoint,
                                                                                  tmp_path):
    out = tmp_path / "pictures"
    out.mkdir()
    for name in PICTURES:  # a CapsNet's pictures from an earlier run
        (out / name).write_bytes(b"an earlier checkpoint's picture")
    (out / "notes.txt").write_text("not ours")
    cnn = random_checkpoint(preset("tiny", arch="cnn-baseline", reconstruction_weight=0.0), "cnn.ckpt")
    with caplog.at_level(logging.INFO, logger="capsnet.training.visualize"):
        assert main(["visualize", str(cnn), "--out", str(out), "--images", "20"]) == 0
    # the pictures a CapsNet gets are not silently missing
    assert f"{cnn} is a cnn-baseline: it has no capsules, so no reconstructions" in caplog.text
    # a CNN gets the confusion matrix only (no history, no capsules): nothing of the CapsNet may pass for its own
    assert sorted(p.name for p in out.iterdir()) == ["confusion.png", "notes.txt"]
    assert (out / "confusion.png").read_bytes().startswith(b"\x89PNG")
    assert f"removed {out / 'routing.png'}" in capsys.readouterr().out


def test_visualize_scores_images_of_every_class_of_a_sorted_test_split(random_tiny_checkpoint, tmp_path,
                                                                       monkeypatch):
    assert list(load_embedded().test.labels[:300]) == [0] * 100 + [1] * 100 + [2] * 100  # sorted by class
    scored = []
    monkeypatch.setattr(visualize, "draw_confusion",
                        lambda evaluation, path: scored.append(evaluation) or path)
    monkeypatch.setattr(visualize, "draw_reconstructions", lambda *args: args[-1])
    monkeypatch.setattr(visualize, "draw_perturbations", lambda *args: args[-1])
    monkeypatch.setattr(visualize, "draw_routing", lambda *args: args[-1])
    visualize.visualize(visualize.VisualizeOptions(random_tiny_checkpoint, None, tmp_path, 300, 8, 256, "cpu"))
    per_class = scored[0].confusion.sum(axis=1)  # (J,): the first 300 were 0s, 1s and 2s only
    assert scored[0].count == 300 and (per_class > 10).all(), per_class


@pytest.fixture()
def checkpoint_with_validation(random_tiny_checkpoint, tmp_path) -> Path:
    """The random tiny model as if trained with --val-fraction 0.1 on the embedded digits."""
    checkpoint = load_checkpoint(random_tiny_checkpoint)
    checkpoint.metrics = {"data": "embedded", "validation_fraction": 0.1}
    path = tmp_path / "val.ckpt"
    save_checkpoint(checkpoint, path)
    return path


def test_visualize_names_every_picture_it_can_write():
    assert sorted(visualize.picture_names()) == sorted([*PICTURES, "pairs.png"])  # pairs.png: any-size models


def test_a_small_test_set_is_scored_whatever_share_the_checkpoint_held_out(capsys, checkpoint_with_validation,
                                                                          idx_dataset, tmp_path):
    # two training images a class: 10% of them rounds to none, which only the validation split needs
    rng = np.random.default_rng(0)
    images = rng.integers(0, 256, (30, 28, 28), dtype=np.uint8)
    labels = np.arange(30) % 10
    small = str(idx_dataset(images[:20], labels[:20], images, labels, name="small-digits"))
    assert main(["eval", str(checkpoint_with_validation), "--data", small, "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert (report["split"], report["images"], report["validation_fraction"]) == ("test", 30, 0.1)
    assert main(["robustness", str(checkpoint_with_validation), "--data", small, "--pairs", "8", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["test_images"] == 30
    assert main(["visualize", str(checkpoint_with_validation), "--data", small, "--out", str(tmp_path / "p")]) == 0
    capsys.readouterr()
    assert_one_line_error(capsys, ["eval", str(checkpoint_with_validation), "--data", small, "--split", "validation"],
                          "a validation fraction of 0.1 leaves 20 training and 0 validation images")


def test_eval_of_the_checkpoints_own_validation_split_is_unchanged(capsys, checkpoint_with_validation):
    assert main(["eval", str(checkpoint_with_validation), "--split", "validation", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert (report["split"], report["images"], report["validation_fraction"]) == ("validation", 400, 0.1)


def test_robustness_refuses_more_pairs_than_memory_can_hold(capsys, random_tiny_checkpoint):
    # 10**12 pairs asked numpy for 7 TiB and ended in a MemoryError traceback
    assert_one_line_error(capsys, ["robustness", str(random_tiny_checkpoint), "--pairs", str(10**12)],
                          "--pairs must be at most 1,000,000, got 1,000,000,000,000")
