"""`capsnet serve` on export directories that are damaged, tampered with or odd, as users make them: each is one
line on stderr and exit 2 before anything is served, never a traceback, a hang, or SERVING then failing requests.

Every case here failed on the code before it (a traceback, or a server that started and then failed GetModelInfo).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from capsnet.runtime import tensorrt_runner
from capsnet.cli import main
from capsnet.model_description.files import file_sha256
from capsnet.models.checkpoint import Checkpoint, create_model
from capsnet.training.checkpoint import save_checkpoint
from capsnet.models.config import preset
from fake_tensorrt import FakeCudaRuntime, fake_tensorrt
from serving_helpers import READY_LINE


def _copy(model_dir: Path, tmp_path: Path) -> Path:
    copy = tmp_path / "model"
    shutil.copytree(model_dir, copy)
    return copy


def _edit(directory: Path, change) -> None:
    """Apply change(model.json's dict) and write it back, as a hand edit would."""
    sidecar = json.loads((directory / "model.json").read_text())
    change(sidecar)
    (directory / "model.json").write_text(json.dumps(sidecar))


def _replace(directory: Path, name: str, data: bytes) -> None:
    """Put other bytes in `name` and record their digest, as a tampering user (or an exporter bug) would."""
    (directory / name).write_bytes(data)
    _edit(directory, lambda sidecar: sidecar["sha256"].__setitem__(name, file_sha256(directory / name)))


def _refused(directory: Path, *flags: str, prefix: tuple[str, ...] = ()) -> str:
    """`capsnet serve` as a real process until it exits or says it is ready; the one error line it printed.

    A server that starts is a failure (it is stopped at once), as are a traceback and any exit but 2."""
    stderr_path = directory.parent / "stderr.txt"
    with open(stderr_path, "w") as stderr:  # a file: a chatty process cannot block on a full pipe
        process = subprocess.Popen([*prefix, sys.executable, "-m", "capsnet", "serve", "--model", str(directory),
                                    "--grpc-port", "0", "--http-port", "0", "--metrics-port", "0",
                                    "--max-batch-size", "8", "--threads", "1", *flags],
                                   stdout=subprocess.PIPE, stderr=stderr, text=True)
        try:
            for line in process.stdout:  # its one stdout line is the ready line
                if READY_LINE.search(line):
                    pytest.fail(f"capsnet serve started on a bad model directory: {line.strip()}")
            process.wait(60)
        finally:
            if process.poll() is None:
                process.kill()
                process.wait(10)
    text = stderr_path.read_text()
    errors = [line for line in text.splitlines() if line.startswith("capsnet serve: error: ")]
    assert process.returncode == 2 and "Traceback" not in text and len(errors) == 1, text[-3000:]
    return errors[0]


def _random_checkpoint(path: Path, **overrides) -> Path:
    torch.manual_seed(1)
    config = preset("tiny", **overrides)
    save_checkpoint(Checkpoint(config=config, state_dict=create_model(config).state_dict(),
                               class_names=[str(i) for i in range(config.num_classes)], dataset="embedded-mnist-5k"),
                    path)
    return path


@pytest.fixture(scope="module")
def other_models(tmp_path_factory) -> dict[str, Path]:
    """Checkpoints and ONNX files (with reconstruction, as model_dir) of two other models: 5 classes, 32x32 images."""
    from capsnet.export.onnx_export import export_onnx, export_program
    from capsnet.models.checkpoint import load_checkpoint

    out = tmp_path_factory.mktemp("other-models")
    files = {}
    for name, overrides in {"5-classes": {"num_classes": 5}, "32x32": {"height": 32, "width": 32}}.items():
        checkpoint = _random_checkpoint(out / f"{name}.ckpt", **overrides)
        names = ("probabilities", "poses", "reconstruction")
        export_onnx(export_program(load_checkpoint(checkpoint).build_model().eval(), names), out / f"{name}.onnx", 18,
                    names)
        files[f"{name}.ckpt"], files[f"{name}.onnx"] = checkpoint, out / f"{name}.onnx"
    return files


@pytest.mark.parametrize("text, message", [
    ('{"format": "capsnet-model", "opset": ' + "9" * 5000 + "}", "Exceeds the limit (4300 digits)"),  # a ValueError
    ("[" * 100_000 + "]" * 100_000, "maximum recursion depth exceeded"),
])
def test_model_json_that_json_cannot_read_is_one_line(model_dir, tmp_path, text, message):
    copy = _copy(model_dir, tmp_path)
    (copy / "model.json").write_text(text)
    error = _refused(copy)
    assert "model.json is damaged: not valid JSON (" in error and message in error


@pytest.mark.parametrize("change, flags, message", [
    # informational keys that are not objects
    (lambda s: s.__setitem__("training_metrics", [0.97]), (), "'training_metrics' has the wrong type (list)"),
    (lambda s: s.__setitem__("parity", "passed"), (), "'parity' has the wrong type (str)"),
    # routing of the wrong type served, then failed every GetModelInfo (it becomes a proto)
    (lambda s: s["routing"].__setitem__("iterations", "3"), (), "routing.'iterations' has the wrong type (str)"),
    (lambda s: s["routing"].__setitem__("iterations", 2**40), (),
     "routing.iterations must be a positive 32-bit integer"),
    (lambda s: s["routing"].__setitem__("variant", 3), (), "routing.'variant' has the wrong type (int)"),
    (lambda s: s["routing"].__setitem__("squash_constant", "1"), (),
     "routing.'squash_constant' has the wrong type (str)"),
    # the variants export refused: file names to reasons, never a file the export lists as written
    (lambda s: s.__setitem__("refused", ["model.int8.onnx"]), (), "'refused' has the wrong type (list)"),
    (lambda s: s.__setitem__("refused", {"model.int8.onnx": -2.09}), (), "refused must map file names to reasons"),
    (lambda s: s.__setitem__("refused", {"model.onnx": "FP32 refused"}), (),
     "refused names model.onnx, which sha256 lists as written"),
    # an output no backend returns (the torch backend looked it up on the model's output)
    (lambda s: s["outputs"].append({"name": "logits", "datatype": "FP32", "shape": [10]}), ("--backend", "torch"),
     "outputs[3].name 'logits' is not one of probabilities, poses, reconstruction"),
])
def test_model_json_values_of_the_wrong_kind_are_refused_before_serving(model_dir, tmp_path, change, flags, message):
    copy = _copy(model_dir, tmp_path)
    _edit(copy, change)
    assert message in _refused(copy, *flags)


@pytest.mark.parametrize("name", ["model.onnx.link", "model\0.onnx"])  # a symlink loop; a NUL (JSON's \u0000)
def test_artifact_names_that_cannot_be_opened_are_one_line(model_dir, tmp_path, name):
    copy = _copy(model_dir, tmp_path)
    if name == "model.onnx.link":
        os.symlink(name, copy / name)
    _edit(copy, lambda s: (s["artifacts"].__setitem__("onnx", name), s["sha256"].__setitem__(name, "0" * 64)))
    assert "model.json is damaged: artifacts.onnx" in (error := _refused(copy)) and "cannot be opened inside" in error


def _unreadable(path: Path) -> tuple[str, ...]:
    """chmod 000 `path`; the command prefix under which that stops this process's user from reading it (root reads
    anything unless it gives up CAP_DAC_OVERRIDE and CAP_DAC_READ_SEARCH, as setpriv does)."""
    path.chmod(0)
    if os.geteuid() != 0:
        return ()
    if shutil.which("setpriv") is None:
        pytest.skip("running as root without setpriv: cannot make a file unreadable")
    return ("setpriv", "--bounding-set=-dac_override,-dac_read_search")


@pytest.mark.parametrize("name", ["model.json", "model.onnx", "reference.npz", "."])
def test_an_unreadable_model_file_or_directory_is_one_line(model_dir, tmp_path, name):
    copy = _copy(model_dir, tmp_path)
    try:
        prefix = _unreadable(copy / name)
        error = _refused(copy, prefix=prefix)
    finally:
        copy.chmod(0o755)
    assert "Permission denied" in error and "cannot read" in error


@pytest.mark.parametrize("damage, flags, message", [
    # another model's ONNX, its digest rewritten to match
    (lambda d, other: _replace(d, "model.onnx", other["5-classes.onnx"].read_bytes()), ("--precision", "fp32"),
     "model.onnx gives probabilities of shape ['batch', 5], model.json says [N, 10]; re-export it"),
    (lambda d, other: _replace(d, "model.onnx", other["32x32.onnx"].read_bytes()), ("--precision", "fp32"),
     "model.onnx takes tensor(float) ['batch', 1, 32, 32], model.json says float32 [N, 1, 28, 28]"),
    # model.json edited so that it no longer describes the graph
    (lambda d, other: _edit(d, lambda s: s["input"].__setitem__("name", "pixels")), (),
     "model.onnx takes inputs ['images'], model.json says ['pixels']"),
    # the description of another model, 32x32 and without the reconstruction (so without a decoder)
    (lambda d, other: _edit(d, lambda s: (s["input"].__setitem__("shape", [1, 32, 32]), s["outputs"].pop(),
                                          s.pop("decoder", None),
                                          s["input"]["sizes"].update(min_height=32, max_height=32, min_width=32,
                                                                     max_width=32))), (),
     "model.onnx takes tensor(float) ['batch', 1, 28, 28], model.json says float32 [N, 1, 32, 32]"),
    # the torch backend on another model's checkpoint
    (lambda d, other: _replace(d, "model.ckpt", other["5-classes.ckpt"].read_bytes()), ("--backend", "torch"),
     "self-check: the torch backend (model.ckpt on CPU, 1 threads) gives probabilities of shape [5] per image, "
     "model.json says [10]"),
])
def test_files_of_another_model_are_refused_at_startup(model_dir, other_models, tmp_path, damage, flags, message):
    copy = _copy(model_dir, tmp_path)
    damage(copy, other_models)
    assert message in _refused(copy, *flags)


def _npz(**arrays) -> bytes:
    import io

    buffer = io.BytesIO()
    np.savez(buffer, **arrays)
    return buffer.getvalue()


@pytest.mark.parametrize("make, message", [
    (lambda ref: b"", "not a self-check set (EOFError"),
    (lambda ref: b"not an archive", "not a self-check set (ValueError"),
    (lambda ref: _npz(probabilities=ref["probabilities"], poses=ref["poses"]),
     "no 'images' or no 'probabilities' array"),
    (lambda ref: _npz(**{**ref, "poses": ref["poses"][:50]}),
     "'poses' is float32 [50, 10, 16], expected float32 [128, 10, 16]"),
    (lambda ref: _npz(**{**ref, "images": ref["images"][:, :, :20]}),
     "'images' are [1, 20, 28], model.json says [1, 28, 28]"),
])
def test_a_damaged_self_check_set_is_one_line(model_dir, tmp_path, make, message):
    copy = _copy(model_dir, tmp_path)
    with np.load(copy / "reference.npz") as archive:
        reference = {name: archive[name] for name in archive.files}
    _replace(copy, "reference.npz", make(reference))
    error = _refused(copy, "--precision", "fp32")
    assert "reference.npz is damaged" in error and message in error, error


def test_a_plan_description_of_the_wrong_kind_is_one_line(model_dir, tmp_path, monkeypatch, capsys):
    """model.plan.json with a batch size that is not a number (TensorRT and the GPU are FAKES,
    tests/fake_tensorrt.py)."""
    copy = _copy(model_dir, tmp_path)
    (copy / "model.plan").write_bytes(b"engine")
    (copy / "model.plan.json").write_text(json.dumps({
        "tensorrt_version": "10.0.0-fake", "gpu_name": "Fake GPU 0", "compute_capability": "9.0", "precision": "fp32",
        "min_batch": 1, "opt_batch": 8, "max_batch": "many"}))
    _edit(copy, lambda s: (s["artifacts"].__setitem__("tensorrt", "model.plan"),
                           s["sha256"].update({name: file_sha256(copy / name)
                                               for name in ("model.plan", "model.plan.json")})))
    runtime = FakeCudaRuntime(device_count=1)
    monkeypatch.setitem(sys.modules, "tensorrt", fake_tensorrt(runtime))
    monkeypatch.setattr(tensorrt_runner, "cudart", lambda: runtime)
    code = main(["serve", "--model", str(copy), "--backend", "tensorrt", "--grpc-port", "0", "--http-port", "0",
                 "--metrics-port", "0"])
    errors = [line for line in capsys.readouterr().err.splitlines() if line.startswith("capsnet serve: error: ")]
    assert code == 2 and len(errors) == 1 and "model.plan.json is damaged: expected" in errors[0], errors
