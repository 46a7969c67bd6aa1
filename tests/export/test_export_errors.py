"""User mistakes: one line on stderr, exit code 2, no traceback and nothing half-written."""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest

from capsnet.cli import main


def _export_error(argv, capsys) -> str:
    code = main(["export", *argv])
    stderr = capsys.readouterr().err
    assert code == 2 and "Traceback" not in stderr
    (line,) = stderr.strip().splitlines()
    assert line.startswith("capsnet export: error: ")
    return line


def test_export_missing_checkpoint(tmp_path, capsys):
    line = _export_error([str(tmp_path / "missing.ckpt"), "--out", str(tmp_path / "out")], capsys)
    assert "does not exist" in line
    assert list(tmp_path.iterdir()) == []


def test_export_damaged_checkpoint(tmp_path, capsys):
    damaged = tmp_path / "damaged.ckpt"
    damaged.write_bytes(b"\x80\x02 not a checkpoint" * 10)
    assert "damaged" in _export_error([str(damaged), "--out", str(tmp_path / "out")], capsys)
    assert [path.name for path in tmp_path.iterdir()] == ["damaged.ckpt"]


def test_export_output_directory_is_a_file(random_tiny_checkpoint, tmp_path, capsys):
    target = tmp_path / "model"
    target.write_text("precious")
    assert "is not a directory" in _export_error([str(random_tiny_checkpoint), "--out", str(target)], capsys)
    assert target.read_text() == "precious"


def test_export_refuses_a_foreign_non_empty_directory(random_tiny_checkpoint, tmp_path, capsys):
    (tmp_path / "notes.txt").write_text("mine")
    assert "holds no previous export" in _export_error([str(random_tiny_checkpoint), "--out", str(tmp_path)], capsys)
    assert [path.name for path in tmp_path.iterdir()] == ["notes.txt"]


@pytest.mark.parametrize("opset", ["16", "25"])
def test_export_unsupported_opset(random_tiny_checkpoint, tmp_path, capsys, opset):
    line = _export_error([str(random_tiny_checkpoint), "--out", str(tmp_path / "out"), "--opset", opset], capsys)
    assert f"unsupported opset {opset}" in line
    assert list(tmp_path.iterdir()) == []


def test_export_unwritable_path(random_tiny_checkpoint, tmp_path, capsys):
    blocker = tmp_path / "file"
    blocker.write_text("")
    line = _export_error([str(random_tiny_checkpoint), "--out", str(blocker / "sub" / "out")], capsys)
    assert "cannot write to" in line
    assert [path.name for path in tmp_path.iterdir()] == ["file"]


def test_export_error_from_the_command_line(tmp_path):
    result = subprocess.run([sys.executable, "-m", "capsnet", "export", str(tmp_path / "missing.ckpt"),
                             "--out", str(tmp_path / "out")], capture_output=True, text=True, timeout=120)
    assert result.returncode == 2
    expected = f"capsnet export: error: checkpoint {tmp_path / 'missing.ckpt'} does not exist"
    assert result.stderr.strip().splitlines() == [expected]


def test_export_refuses_a_checkpoint_without_capsules(tmp_path, capsys, random_checkpoint):
    from capsnet.training.config import preset

    baseline = random_checkpoint(preset("tiny", arch="cnn-baseline"), "baseline.ckpt")
    line = _export_error([str(baseline), "--out", str(tmp_path / "out")], capsys)
    assert "cnn-baseline checkpoint" in line and "export takes capsule networks (capsnet or em)" in line
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("out, triton", [
    ("exp", "exp"),  # was: the export replaced exp, then lost the Triton staging directory inside the old one
    ("exp", "exp/triton"),
    ("repo/exp", "repo"),  # Triton would also take exp for a model
    ("exp", "other/../exp"),
])
def test_export_refuses_overlapping_out_and_triton(random_tiny_checkpoint, tmp_path, capsys, out, triton):
    previous = tmp_path / out / "model.json"  # a previous export, which must survive the refusal
    previous.parent.mkdir(parents=True)
    previous.write_text("{}")
    argv = [str(random_tiny_checkpoint), "--out", str(tmp_path / out), "--triton", str(tmp_path / triton)]
    line = _export_error(argv, capsys)
    assert "overlap; give them separate directories" in line
    assert set(tmp_path.rglob("*")) == {previous, *(path for path in previous.parents if tmp_path in path.parents)}


@pytest.mark.parametrize("drop", ["nan", "inf", "-1"])
def test_export_int8_max_drop_must_be_finite_and_not_negative(tmp_path, capsys, drop):
    # nan passed every comparison: the accuracy gate was off and model.json recorded NaN
    line = _export_error([str(tmp_path / "any.ckpt"), "--out", str(tmp_path / "out"), "--int8-max-drop", drop], capsys)
    assert f"--int8-max-drop must be finite and >= 0 accuracy points, got {float(drop)}" in line
    assert list(tmp_path.iterdir()) == []


def test_export_needs_data_of_every_class_the_model_has(random_tiny_checkpoint, idx_dataset, tmp_path, capsys):
    # eval takes a subset of the model's classes; export calibrates INT8 on them and gates on each one
    images, labels = np.zeros((20, 28, 28), dtype=np.uint8), np.arange(20) % 5
    some_digits = idx_dataset(images, labels, images, labels, name="digits-0-4")
    line = _export_error([str(random_tiny_checkpoint), "--out", str(tmp_path / "out"), "--data", str(some_digits)],
                         capsys)
    assert line.endswith("was trained on classes 0, 1, 2, 3, 4, 5, 6, 7, 8, 9 and needs data of all of them; data "
                         "'digits-0-4' has 0, 1, 2, 3, 4 (a classes.txt in the data folder names its classes)")
    assert not (tmp_path / "out").exists()
