"""Fixtures shared by every area's tests: checkpoints of the `tiny` preset, IDX data sets and the GPU skip.

Each area keeps its own tests (and any local conftest.py) in tests/<area>/.
"""

from __future__ import annotations

import gzip
import os
import shutil
import struct
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
import torch
from filelock import FileLock

from capsnet.models.checkpoint import Checkpoint, create_model, load_checkpoint
from capsnet.models.config import preset
from capsnet.runtime.cpu import CPU_FLAGS_ENV, CpuKind
from capsnet.training.checkpoint import save_checkpoint
from capsnet.training.data import DIGIT_NAMES
from cpu_kinds import CPU_KINDS

# Without a CUDA GPU the fused routing kernels run in Triton's CPU interpreter, which Triton chooses when a kernel is
# defined: set before any test imports capsnet.runtime.fused_routing
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


def _gpu_skip_reason() -> str | None:
    if not torch.cuda.is_available():
        return "no CUDA GPU on this machine"
    return None


@pytest.fixture(autouse=True)
def torch_threads_restored():
    """torch's thread count as each test found it: a backend sets it for the whole process, and a model trained by a
    later session fixture would otherwise depend on which tests ran before (its float sums' order does)."""
    threads = torch.get_num_threads()
    yield
    torch.set_num_threads(threads)


def pytest_collection_modifyitems(config, items):
    for item in items:
        if "cpu_kind" in getattr(item, "fixturenames", ()):
            item.add_marker(pytest.mark.cpu_kind)  # `pytest -m cpu_kind`: every CPU-kind decision, every kind
    reason = _gpu_skip_reason()
    if reason is None:
        return
    for item in items:
        # the marker itself: `"gpu" in item.keywords` also matched every test of a checkout in a folder named gpu
        if item.get_closest_marker("gpu") is not None:
            item.add_marker(pytest.mark.skip(reason=reason))


@pytest.fixture(params=list(CPU_KINDS))
def cpu_kind(request, monkeypatch) -> CpuKind:
    """Each CPU kind in turn, as every CPU-kind decision of the product reads it (torch's and oneDNN's caps
    cleared, so only the kind decides)."""
    monkeypatch.setenv(CPU_FLAGS_ENV, CPU_KINDS[request.param])
    for cap in ("ATEN_CPU_CAPABILITY", "ONEDNN_MAX_CPU_ISA", "DNNL_MAX_CPU_ISA"):
        monkeypatch.delenv(cap, raising=False)
    return CpuKind.this_host()


def save_random_checkpoint(config, path: Path) -> Path:
    """An untrained model of `config` (weights seeded with 0) saved as a checkpoint of the 10 digits at `path`."""
    torch.manual_seed(0)
    save_checkpoint(Checkpoint(config=config, state_dict=create_model(config).state_dict(),
                               class_names=list(DIGIT_NAMES), dataset="embedded-mnist-5k"), path)
    return path


@pytest.fixture(scope="session")
def random_tiny_checkpoint(tmp_path_factory) -> Path:
    """An untrained `tiny` checkpoint (seeded): for shape, format and error-path tests."""
    return save_random_checkpoint(preset("tiny"), tmp_path_factory.mktemp("random-tiny") / "model.ckpt")


@pytest.fixture(scope="session")
def random_tiny_export(random_tiny_checkpoint, tmp_path_factory) -> Path:
    """The untrained `tiny` checkpoint exported with its reconstruction output: the model the serving and KServe
    servers load, exported once for both (tests read it; those that damage a model work on a copy)."""
    from capsnet.export.exporter import export_model

    return built_once(tmp_path_factory, "random-tiny-export", lambda folder: export_model(
        random_tiny_checkpoint, folder / "model", reconstruction=True)) / "model"


@pytest.fixture(scope="session")
def paper_int8_export(tmp_path_factory) -> Path:
    """An untrained `paper` model exported with INT8, its gate opened wide: engines compared at the paper's size
    (its near-uniform answers are for comparing engines, not for accuracy)."""
    from capsnet.export.exporter import export_model

    def export(folder: Path) -> None:
        checkpoint = save_random_checkpoint(preset("paper"), folder / "model.ckpt")
        export_model(checkpoint, folder / "model", int8=True, max_accuracy_drop=100.0)

    return built_once(tmp_path_factory, "paper-int8-export", export) / "model"


@pytest.fixture()
def random_checkpoint(tmp_path):
    """random_checkpoint(config, name) -> an untrained checkpoint of `config` in this test's tmp dir."""
    return lambda config, name="model.ckpt": save_random_checkpoint(config, tmp_path / name)


def built_once(tmp_path_factory, name: str, build: Callable[[Path], object]) -> Path:
    """A folder that build(folder) filled, once for the whole run. pytest-xdist's workers (scripts/test.sh runs two)
    share it: the first to need it builds it while the other waits, so a model is trained or exported once, not once
    a worker. Tests only read what is in it."""
    if "PYTEST_XDIST_WORKER" not in os.environ:  # one process: a folder of its own
        folder = tmp_path_factory.mktemp(name)
        build(folder)
        return folder
    run = tmp_path_factory.getbasetemp().parent  # this run's folder, above each worker's own
    folder, built = run / name, run / f"{name}.built"
    with FileLock(str(run / f"{name}.lock")):
        if not built.exists():
            shutil.rmtree(folder, ignore_errors=True)  # what a build that failed left behind
            folder.mkdir()
            build(folder)
            built.touch()
    return folder


@pytest.fixture(scope="session")
def trained_tiny_checkpoint(tmp_path_factory) -> Path:
    """A `tiny` model trained briefly on the embedded MNIST digits, through the real CLI.

    Decisive predictions (unlike random weights), so parity tests can demand identical argmax.
    """
    from capsnet.cli import main

    def train(folder: Path) -> None:
        # every training digit, no validation split: the model the export and serving figures were measured on
        code = main(["train", "--data", "embedded", "--preset", "tiny", "--epochs", "2", "--batch-size", "64",
                     "--seed", "0", "--val-fraction", "0", "--out", str(folder / "model.ckpt"), "--no-progress"])
        assert code == 0
        load_checkpoint(folder / "model.ckpt")

    return built_once(tmp_path_factory, "trained-tiny", train) / "model.ckpt"


@pytest.fixture(scope="session")
def trained_em_tiny_checkpoint(tmp_path_factory) -> Path:
    """An `em-tiny` model (matrix capsules, EM routing) trained for one epoch on the embedded digits, via the CLI."""
    from capsnet.cli import main

    def train(folder: Path) -> None:
        code = main(["train", "--arch", "em", "--data", "embedded", "--preset", "em-tiny", "--epochs", "1",
                     "--batch-size", "64", "--seed", "0", "--out", str(folder / "model.ckpt"), "--no-progress"])
        assert code == 0 and (folder / "model.ckpt").is_file()

    return built_once(tmp_path_factory, "trained-em-tiny", train) / "model.ckpt"


@pytest.fixture(scope="session")
def int8_tiny_export(trained_tiny_checkpoint, tmp_path_factory) -> Path:
    """The trained `tiny` model exported with INT8, its gate opened wide: how many points INT8 loses depends on the
    host's int8 kernels, and the tests that use it are the server's and the benchmark's, not the gate's. An INT8
    export calibrates and measures both precisions on every test digit: it is made once for them all."""
    from capsnet.export.exporter import export_model

    return built_once(tmp_path_factory, "int8-tiny-export", lambda folder: export_model(
        trained_tiny_checkpoint, folder / "model", int8=True, max_accuracy_drop=100.0)) / "model"


@pytest.fixture(scope="session")
def em_tiny_export(trained_em_tiny_checkpoint, tmp_path_factory) -> Path:
    """The trained `em-tiny` model through `capsnet export --reconstruction`: one export (its parity check runs EM's
    iterations in PyTorch and ONNX Runtime), shared by the export and serving tests, which only read it."""
    from capsnet.cli import main

    def export(folder: Path) -> None:
        out = folder / "model"
        assert main(["export", str(trained_em_tiny_checkpoint), "--out", str(out), "--reconstruction"]) == 0

    return built_once(tmp_path_factory, "em-tiny-export", export) / "model"


@pytest.fixture(scope="session")
def full_tiny_export(trained_tiny_checkpoint, tmp_path_factory) -> Path:
    """`capsnet export` of the trained tiny model with every CPU option: reconstruction, INT8, FP16 and a Triton
    repository (root/model and root/triton; the root is returned). Shared by the export tests, which check these
    artifacts, and the fused backend's, which serve them; all only read it.

    The INT8 gate is opened wide: how many points the tiny model's INT8 loses depends on the host's int8 kernels
    (test_export_int8 checks the gate itself).
    """
    from capsnet.cli import main

    def export(root: Path) -> None:
        code = main(["export", str(trained_tiny_checkpoint), "--out", str(root / "model"), "--reconstruction",
                     "--int8", "--fp16", "--max-accuracy-drop", "100", "--triton", str(root / "triton")])
        assert code == 0

    return built_once(tmp_path_factory, "full-tiny-export", export)


def train_any_size_tiny(path: Path, preset_name: str) -> Path:
    """`preset_name` (shared-tiny or gap-cnn-tiny) trained for 2 epochs on the embedded digits through the real CLI,
    at a higher rate than the default so that so small a model becomes decisive (shared-tiny: 85% test accuracy)."""
    from capsnet.cli import main

    code = main(["train", "--data", "embedded", "--preset", preset_name, "--epochs", "2", "--batch-size", "32",
                 "--lr", "0.003", "--seed", "0", "--val-fraction", "0", "--out", str(path), "--no-progress"])
    assert code == 0 and path.is_file()
    return path


@pytest.fixture(scope="session")
def trained_shared_tiny_checkpoint(tmp_path_factory) -> Path:
    """A `shared-tiny` model: any image size, capsules whose transformation is shared across positions."""
    return built_once(tmp_path_factory, "trained-shared-tiny",
                      lambda folder: train_any_size_tiny(folder / "model.ckpt", "shared-tiny")) / "model.ckpt"


@pytest.fixture(scope="session")
def trained_gap_cnn_tiny_checkpoint(tmp_path_factory) -> Path:
    """A `gap-cnn-tiny` model: the same backbone with global average pooling and sigmoids."""
    return built_once(tmp_path_factory, "trained-gap-cnn-tiny",
                      lambda folder: train_any_size_tiny(folder / "model.ckpt", "gap-cnn-tiny")) / "model.ckpt"


def export_any_size_tiny(checkpoint: Path, root: Path, *options: str) -> Path:
    """`capsnet export --int8 --triton` of an any-size tiny model into root/model, the Triton repository beside it in
    root/triton. The INT8 gate is opened wide, as in the fixed-size export fixture: how many points so small a model
    loses depends on the host's kernels."""
    from capsnet.cli import main

    code = main(["export", str(checkpoint), "--out", str(root / "model"), "--int8", "--max-accuracy-drop", "100",
                 "--triton", str(root / "triton"), *options])
    assert code == 0
    return root / "model"


@pytest.fixture(scope="session")
def shared_tiny_export(trained_shared_tiny_checkpoint, tmp_path_factory) -> Path:
    """The `shared-tiny` model exported: ONNX graphs with a free height and width, shared by the export and serving
    tests."""
    return built_once(tmp_path_factory, "shared-tiny-export",
                      lambda folder: export_any_size_tiny(trained_shared_tiny_checkpoint, folder)) / "model"


@pytest.fixture(scope="session")
def gap_cnn_tiny_export(trained_gap_cnn_tiny_checkpoint, tmp_path_factory) -> Path:
    """The `gap-cnn-tiny` model exported with its FP16 graph too: a CNN baseline of any size, whose only output is
    its probabilities."""
    return built_once(tmp_path_factory, "gap-cnn-tiny-export",
                      lambda folder: export_any_size_tiny(trained_gap_cnn_tiny_checkpoint, folder, "--fp16")) / "model"


@pytest.fixture()
def copy_of(tmp_path):
    """Copy a file into this test's tmp dir (tests may damage it)."""

    def _copy(path: Path) -> Path:
        target = tmp_path / Path(path).name
        shutil.copy(path, target)
        return target

    return _copy


def write_idx(path: Path, array: np.ndarray) -> None:
    """An unsigned-byte IDX file (the MNIST format): magic 0x0000 08 <ndim>, big-endian sizes, data."""
    header = bytes([0, 0, 0x08, array.ndim]) + struct.pack(f">{array.ndim}I", *array.shape)
    payload = header + array.astype(np.uint8).tobytes()
    path.write_bytes(gzip.compress(payload) if path.suffix == ".gz" else payload)


@pytest.fixture()
def idx_dataset(tmp_path):
    """make(images (N, H, W[, C]) uint8, labels, test_images, test_labels, gz=False) -> a folder of IDX files."""

    def make(train_images, train_labels, test_images, test_labels, gz: bool = False, name: str = "idx-data") -> Path:
        directory = tmp_path / name
        directory.mkdir()
        suffix = ".gz" if gz else ""
        write_idx(directory / f"train-images-idx3-ubyte{suffix}", train_images)
        write_idx(directory / f"train-labels-idx1-ubyte{suffix}", train_labels)
        write_idx(directory / f"t10k-images-idx3-ubyte{suffix}", test_images)
        write_idx(directory / f"t10k-labels-idx1-ubyte{suffix}", test_labels)
        return directory

    return make


AOTI_MAX_BATCH = 16


@pytest.fixture(scope="session")
def aoti_model_dir(random_tiny_checkpoint, tmp_path_factory) -> Path:
    """The tiny model exported with its reconstruction and an AOTInductor CPU package for batches up to 16: the one
    AOTInductor compile of the suite (about a minute on 2 cores), shared by the export and serving tests."""
    from capsnet.cli import main

    def export(folder: Path) -> None:
        code = main(["export", str(random_tiny_checkpoint), "--out", str(folder / "model"), "--reconstruction",
                     "--aoti", "--max-batch", str(AOTI_MAX_BATCH)])
        assert code == 0

    return built_once(tmp_path_factory, "aoti", export) / "model"
