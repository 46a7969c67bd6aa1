"""The first stage of an export: the FP32 ONNX graph, checked against PyTorch, and the reference images with its
answers. Every later stage (the decoder, the reduced-precision graphs, the AOTInductor packages, the TensorRT
engine) measures against what this one records."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import onnx

from capsnet.errors import CapsNetError
from capsnet.export.config import ExportConfig
from capsnet.export.metadata import output_shapes
from capsnet.export.onnx_export import export_onnx, export_program, graph_opset, op_counts
from capsnet.export.parity import (PARITY_BATCH_SIZES, Batch, Outputs, compare, onnxruntime_outputs,
                                   onnxruntime_probabilities, onnxruntime_session, parity_batches, spread, tiled,
                                   torch_outputs)
from capsnet.model_description.files import ONNX_NAME, REFERENCE_NAME
from capsnet.model_description.precision_gate import FP32_TOLERANCE
from capsnet.models.checkpoint import Checkpoint
from capsnet.training.data import Dataset

if TYPE_CHECKING:
    from onnxruntime import InferenceSession
    from torch.export import ExportedProgram

log = logging.getLogger(__name__)

REFERENCE_IMAGES = 128  # the self-check's images; the precision gate's figures are measured on them
# (H, W) a model of any size is checked at besides its own: one and two digits side by side, four, a wide image
# whose backbone grid is neither square nor any multiple of the training size, and an odd height and width, which
# the backbone's pools floor; those it takes
PARITY_SIZES = ((28, 28), (28, 56), (56, 56), (40, 100), (29, 45))
SIZE_PARITY_IMAGES = 7


@dataclass(frozen=True)
class ExportJob:
    """What every stage of one export reads: where it writes, what was asked, the model and its data."""

    staging: Path  # the folder the artifacts are written into before they are published
    config: ExportConfig
    checkpoint: Checkpoint  # the staged copy
    dataset: Dataset

    @property
    def names(self) -> tuple[str, ...]:
        """The outputs, in order; a CNN baseline's only output is its probabilities: no poses, as it has no
        capsules."""
        return tuple(output_shapes(self.checkpoint.config, self.config.reconstruction))


@dataclass(frozen=True)
class Fp32Graph:
    """The FP32 graph: its file, its session, and the exported program it and the AOTInductor packages come from."""

    program: ExportedProgram
    model: onnx.ModelProto
    path: Path
    session: InferenceSession  # ONNX Runtime's


@dataclass(frozen=True)
class ParityAnswers:
    """The parity batches, and PyTorch's and the FP32 graph's answers on them."""

    batches: list[Batch]
    pytorch: list[Outputs]
    onnxruntime: list[Outputs]


@dataclass(frozen=True)
class Reference:
    """The images `capsnet serve` checks its backend with, and the FP32 graph's answers on them."""

    images: np.ndarray  # (128, C, H, W) float32
    outputs: dict[str, np.ndarray]  # FP32 ONNX Runtime outputs on them
    description: dict[str, Any]  # model.json's reference_set


@dataclass(frozen=True)
class Fp32Stage:
    """The FP32 graph written into the staging folder and checked: what every later stage measures against."""

    job: ExportJob
    graph: Fp32Graph
    answers: ParityAnswers
    test_probabilities: np.ndarray  # the graph's probabilities on the test split
    reference: Reference
    parity: dict[str, Any]  # model.json's parity of the FP32 graph against PyTorch


def write_fp32(job: ExportJob) -> Fp32Stage:
    """The FP32 ONNX graph, checked against PyTorch (FP32_TOLERANCE), and the reference images with its answers."""
    config, dataset, names = job.config, job.dataset, job.names
    model = job.checkpoint.build_model()
    path = job.staging / ONNX_NAME
    # one exported program: the ONNX file and the AOTInductor packages are both made from it
    program = export_program(model, names, config.max_batch if config.aoti else None)
    exported = export_onnx(program, path, config.opset, names)
    counts = op_counts(exported)
    log.info("ONNX opset %d, %d nodes: %s", graph_opset(exported), sum(counts.values()),
             ", ".join(f"{op} {n}" for op, n in counts.most_common()))
    batches = parity_batches(dataset.test.images)
    session = onnxruntime_session(str(path))
    outputs = onnxruntime_outputs(session, batches, names)
    pytorch_outputs = torch_outputs(model, batches, names)
    onnx_parity = compare(pytorch_outputs, outputs)
    log.info("ONNX Runtime vs PyTorch: %s", onnx_parity.describe())
    if not onnx_parity.passes(FP32_TOLERANCE):
        raise CapsNetError(f"ONNX Runtime disagrees with PyTorch beyond {FP32_TOLERANCE:g}: {onnx_parity.describe()}")
    parity: dict[str, Any] = {
        "reference": "pytorch",
        "batch_sizes": list(PARITY_BATCH_SIZES),
        "tolerance": FP32_TOLERANCE,
        "onnxruntime": onnx_parity.to_dict(),
    }
    if not job.checkpoint.config.input_sizes.fixed:
        parity["sizes"] = _size_parity(model, session, dataset, names)
    return Fp32Stage(job, Fp32Graph(program, exported, path, session),
                     ParityAnswers(batches, pytorch_outputs, outputs),
                     onnxruntime_probabilities(session, dataset.test.images),
                     _write_reference(job.staging / REFERENCE_NAME, session, dataset, names), parity)


def _size_parity(model, session, dataset: Dataset, names: tuple[str, ...]) -> dict[str, Any]:
    """The graph of a model of any size against PyTorch at each of PARITY_SIZES it takes, on images of real digits
    (parity.tiled), and each image alone against the batch it came in: a graph whose shapes were mis-traced answers
    one size right and another wrong, or an image differently beside others."""
    results = {}
    sizes = model.config.input_sizes
    for height, width in PARITY_SIZES:
        if (sizes.channels, height, width) not in sizes:
            continue
        batch = tiled(dataset.test.images, SIZE_PARITY_IMAGES, height, width)  # (7, C, H, W)
        (batched,) = onnxruntime_outputs(session, [batch], names)
        size_parity = compare(torch_outputs(model, [batch], names), [batched])
        alone = onnxruntime_outputs(session, [batch[index:index + 1] for index in range(len(batch))], names)
        invariance = compare([{name: batched[name][index:index + 1] for name in names} for index in range(len(batch))],
                             alone)
        size = f"{height}x{width}"
        log.info("ONNX Runtime at %s: vs PyTorch %s; alone vs in a batch %s", size, size_parity.describe(),
                 invariance.describe())
        for what, result in (("disagrees with PyTorch", size_parity), ("answers an image alone differently from in "
                                                                       "a batch", invariance)):
            if not result.passes(FP32_TOLERANCE):
                raise CapsNetError(f"at {size}, ONNX Runtime {what} beyond {FP32_TOLERANCE:g}: {result.describe()}")
        results[size] = {"pytorch": size_parity.to_dict(), "batch_invariance": invariance.to_dict()}
    return results


def _write_reference(path: Path, fp32_session, dataset: Dataset, names: tuple[str, ...]) -> Reference:
    """The images `capsnet serve` checks its backend with before it reports SERVING, and their FP32 outputs."""
    images = spread(dataset.test.images, REFERENCE_IMAGES)  # (128, C, H, W)
    (outputs,) = onnxruntime_outputs(fp32_session, [images], names)
    # numpy's stub lets **outputs fill allow_pickle; output names are the model's, never that
    np.savez_compressed(path, images=images, **outputs)  # type: ignore[arg-type]
    return Reference(images, outputs, {"images": len(images), "dataset": dataset.name, "split": "test"})
