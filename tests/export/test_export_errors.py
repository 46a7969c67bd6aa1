"""User mistakes: one line on stderr, exit code 2, no traceback and nothing half-written."""

from __future__ import annotations

import os
import subprocess
import sys
from dataclasses import replace

import numpy as np
import pytest
import torch

from capsnet.cli import main
from capsnet.export import exporter
from capsnet.export.parity import onnxruntime_session
from capsnet.model_description.files import file_sha256
from capsnet.models.checkpoint import load_checkpoint
from capsnet.training.checkpoint import save_checkpoint


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


def test_export_refuses_a_reconstruction_of_a_model_without_a_decoder(tmp_path, capsys, random_checkpoint):
    from capsnet.models.config import preset

    baseline = random_checkpoint(preset("tiny", arch="cnn-baseline", reconstruction_weight=0.0), "baseline.ckpt")
    line = _export_error([str(baseline), "--out", str(tmp_path / "out"), "--reconstruction"], capsys)
    assert "a cnn-baseline model has no decoder, so no reconstruction" in line
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
def test_export_max_accuracy_drop_must_be_finite_and_not_negative(tmp_path, capsys, drop):
    # nan passed every comparison: the accuracy gate was off and model.json recorded NaN
    line = _export_error([str(tmp_path / "any.ckpt"), "--out", str(tmp_path / "out"), "--max-accuracy-drop", drop],
                         capsys)
    assert f"--max-accuracy-drop must be finite and >= 0 accuracy points, got {float(drop)}" in line
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


@pytest.mark.parametrize("int8_flags", [["--int8"], ["--tensorrt", "--tensorrt-precision", "int8"]])
def test_export_int8_needs_an_opset_onnxruntime_can_load_quantised(tmp_path, capsys, int8_flags):
    # at opset 21 the INT8 model was written, then ONNX Runtime's optimiser failed to load it: a traceback
    line = _export_error([str(tmp_path / "any.ckpt"), "--out", str(tmp_path / "out"), "--opset", "21", *int8_flags],
                         capsys)
    assert line.endswith("INT8 needs --opset 20 or lower: ONNX Runtime cannot load the quantised graph at opset 21")
    assert list(tmp_path.iterdir()) == []


def test_export_max_batch_must_fit_tritons_int32(tmp_path, capsys):
    # config.pbtxt said max_batch_size: 3000000000, which Triton's parser refuses as out of range
    line = _export_error([str(tmp_path / "any.ckpt"), "--out", str(tmp_path / "out"), "--max-batch", "3000000000"],
                         capsys)
    assert line.endswith("--max-batch must be at most 2147483647 (Triton's max_batch_size is a 32-bit integer), "
                         "got 3000000000")
    assert list(tmp_path.iterdir()) == []


def test_export_out_of_space_is_one_line(random_tiny_checkpoint, tmp_path):
    # A file size limit stands in for a full disk (writes fail with EFBIG once SIGXFSZ is ignored); was a traceback.
    script = ("import resource, signal, sys; signal.signal(signal.SIGXFSZ, signal.SIG_IGN); "
              "resource.setrlimit(resource.RLIMIT_FSIZE, (100_000, resource.RLIM_INFINITY)); "
              "from capsnet.cli import main; sys.exit(main(sys.argv[1:]))")
    out = tmp_path / "out"
    result = subprocess.run([sys.executable, "-c", script, "--log-level", "ERROR", "export",
                             str(random_tiny_checkpoint), "--out", str(out)],
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 2
    assert result.stderr.strip().splitlines() == [
        f"capsnet export: error: cannot write the export to {out}: File too large"]
    assert list(tmp_path.iterdir()) == []  # the staging directory is gone too


def test_export_replaces_a_symlinked_out_without_leftovers(random_tiny_checkpoint, tmp_path):
    previous = tmp_path / "v1"
    previous.mkdir()
    (previous / "model.json").write_text("{}")
    link = tmp_path / "current"
    link.symlink_to(previous)
    assert main(["export", str(random_tiny_checkpoint), "--out", str(link)]) == 0
    # the link's stand-in (.current.<random>.previous) was left beside it: rmtree does not remove a symlink
    assert sorted(path.name for path in tmp_path.iterdir()) == ["current", "v1"]
    assert not link.is_symlink() and (link / "model.onnx").is_file()
    assert [path.name for path in previous.iterdir()] == ["model.json"]  # what the link pointed to is kept


def _replace_checkpoint_while_exporting(monkeypatch, live, replacement):
    """Training writes `replacement` over `live` (atomically, as `capsnet train` saves) once export has loaded it."""
    load_data = exporter.load_checkpoint_data

    def load_data_then_replace(*args, **kwargs):
        dataset = load_data(*args, **kwargs)
        os.replace(replacement, live)
        return dataset

    monkeypatch.setattr(exporter, "load_checkpoint_data", load_data_then_replace)


def test_export_holds_one_model_when_training_replaces_the_checkpoint(random_tiny_checkpoint, copy_of, tmp_path,
                                                                     monkeypatch):
    # model.ckpt was copied at the end, so it held the new epoch while model.onnx held the old one
    live = copy_of(random_tiny_checkpoint)
    checkpoint = load_checkpoint(live)
    next_epoch = replace(checkpoint, state_dict={name: value * 1.5 for name, value in checkpoint.state_dict.items()})
    save_checkpoint(next_epoch, tmp_path / "next.ckpt")
    _replace_checkpoint_while_exporting(monkeypatch, live, tmp_path / "next.ckpt")
    out = tmp_path / "out"
    assert main(["export", str(live), "--out", str(out)]) == 0
    assert file_sha256(out / "model.ckpt") == file_sha256(live)
    with np.load(out / "reference.npz") as reference:
        images = reference["images"][:8]  # (8, 1, 28, 28)
    (onnx_probabilities,) = onnxruntime_session(str(out / "model.onnx")).run(["probabilities"], {"images": images})
    with torch.inference_mode():
        torch_probabilities = load_checkpoint(out / "model.ckpt").build_model()(torch.from_numpy(images)).probabilities
    np.testing.assert_allclose(onnx_probabilities, torch_probabilities.numpy(), rtol=0, atol=1e-4)


def test_export_refuses_a_checkpoint_replaced_by_another_configuration(random_tiny_checkpoint, random_checkpoint,
                                                                      copy_of, tmp_path, monkeypatch, capsys):
    from capsnet.models.config import preset

    live = copy_of(random_tiny_checkpoint)
    other = random_checkpoint(preset("tiny", routing_iterations=2), "other.ckpt")
    _replace_checkpoint_while_exporting(monkeypatch, live, other)
    line = _export_error([str(live), "--out", str(tmp_path / "out")], capsys)
    assert line.endswith(f"{live} changed while it was being exported; export it again")
    assert sorted(path.name for path in tmp_path.iterdir()) == ["model.ckpt"]


@pytest.mark.parametrize("flag", ["--out", "--triton"])
def test_export_refuses_an_empty_path(random_tiny_checkpoint, tmp_path, capsys, monkeypatch, flag):
    # `--triton "$UNSET"` exported without a repository and exited 0; `--out ""` meant the working directory
    monkeypatch.chdir(tmp_path)
    paths = {"--out": str(tmp_path / "out"), "--triton": str(tmp_path / "triton"), flag: ""}
    line = _export_error([str(random_tiny_checkpoint), *(item for pair in paths.items() for item in pair)], capsys)
    assert line.endswith(f"{flag} needs a directory, got an empty path")
    assert list(tmp_path.iterdir()) == []


def test_export_stages_the_triton_model_outside_its_repository(random_tiny_checkpoint, tmp_path, monkeypatch):
    # Triton loads every directory of its repository as a model: the staging directory sat in it while the export
    # ran, and stayed there after a kill (a model Triton cannot load: its config names another model)
    repo = tmp_path / "models" / "triton"
    seen = []
    write_model_directory = exporter.write_model_directory

    def write_and_look(model_dir, *args, **kwargs):
        write_model_directory(model_dir, *args, **kwargs)
        seen.append(sorted(path.name for path in repo.iterdir()))

    monkeypatch.setattr(exporter, "write_model_directory", write_and_look)
    for _ in range(2):  # a new repository, then replacing the previous export in it
        assert main(["export", str(random_tiny_checkpoint), "--out", str(tmp_path / "models" / "capsnet"),
                     "--triton", str(repo)]) == 0
    assert seen == [[], ["capsnet"]]
    assert sorted(path.name for path in repo.iterdir()) == ["capsnet"]
    assert sorted(path.name for path in (tmp_path / "models").iterdir()) == ["capsnet", "triton"]


@pytest.mark.parametrize("flags, message", [
    (["--calibration-images", "50"], "--calibration-images does nothing without --int8"),
    (["--aoti-precision", "bf16", "--aoti"], "--aoti-precision does nothing without --aoti cuda"),
    (["--gpu", "1", "--int8"], "--gpu does nothing without --tensorrt or --aoti cuda"),
    (["--tensorrt-precision", "int8", "--int8"], "--tensorrt-precision does nothing without --tensorrt"),
    (["--timing-cache", "cache", "--triton", "repo"], "--timing-cache does nothing without --tensorrt"),
    (["--max-batch", "64"], "--max-batch does nothing without --tensorrt or --triton or --aoti"),
    (["--max-queue-delay-us", "500", "--int8"], "--max-queue-delay-us does nothing without --triton"),
])
def test_export_refuses_an_option_for_an_artifact_it_does_not_write(tmp_path, capsys, monkeypatch, flags, message):
    # they were ignored: `--tensorrt-precision int8` without --tensorrt exported FP32 alone and exited 0
    monkeypatch.chdir(tmp_path)
    line = _export_error([str(tmp_path / "any.ckpt"), "--out", "out", *flags], capsys)
    assert line.endswith(message)
    assert list(tmp_path.iterdir()) == []


def test_export_refuses_an_engine_triton_could_not_send_one_image(tmp_path, capsys):
    # the plan's profile started at 4 images, and Triton's dynamic batcher sends a lone request as a batch of 1
    line = _export_error([str(tmp_path / "any.ckpt"), "--out", str(tmp_path / "out"), "--tensorrt", "--min-batch", "4",
                          "--triton", str(tmp_path / "repo")], capsys)
    assert line.endswith("--triton serves the engine batches from 1 image: --min-batch must be 1, got 4")
    assert list(tmp_path.iterdir()) == []
