"""The decoder alone as an ONNX graph (model.json's `decoder`, capsnet/model_description/decoder.py): poses (B, J, D)
and a class index (B,) in, the reconstruction (B, C*H*W) out, checked against PyTorch's decoder before it is
published, as the classifier's graph is.

The poses it is checked on are those a client sends: the reference images' own poses with their predicted class,
the same poses drawn as every other class, and each pose dimension moved by -0.25..+0.25 (the paper's figure 4),
kept within the unit length a squashed capsule has."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import onnx

from capsnet.errors import CapsNetError
from capsnet.export.logs import quiet
from capsnet.export.onnx_export import BATCH_DIM, check_graph, graph_opset
from capsnet.export.parity import onnxruntime_session
from capsnet.model_description.precision_gate import FP32_TOLERANCE, max_abs_diff
from capsnet.model_description.decoder import (
    CLASS_INPUT, DECODER_FILE, LENGTH_SLACK, POSES_INPUT, RECONSTRUCTION_OUTPUT, DecoderDescription,
)
from capsnet.model_description.pose import PoseFigures
from capsnet.training.pose import pose_length_limit

PERTURBATION_STEPS = np.linspace(-0.25, 0.25, 11, dtype=np.float32)  # the paper's figure 4


def export_decoder(model, directory: Path, opset: int) -> onnx.ModelProto:
    """`model.decoder` as DECODER_FILE in `directory`, its batch axis dynamic."""
    import torch

    config = model.config
    example = (torch.rand(2, config.num_classes, config.digit_caps_dim),  # (2, J, D); batch 2: 1 would specialise
               torch.tensor([0, 1], dtype=torch.int64))  # (2,)
    batch = torch.export.Dim(BATCH_DIM, min=1)
    with quiet("torch.export", "torch._dynamo", "torch.onnx", "onnxscript", "onnx_ir"):
        program = torch.export.export(model.decoder.eval(), example,
                                      dynamic_shapes={"poses": {0: batch}, "target": {0: batch}})
        path = directory / DECODER_FILE
        torch.onnx.export(program, (), str(path), input_names=[POSES_INPUT, CLASS_INPUT],
                          output_names=[RECONSTRUCTION_OUTPUT], opset_version=opset, dynamo=True,
                          external_data=False, verbose=False)
    exported = onnx.load(str(path))
    if graph_opset(exported) != opset:
        raise CapsNetError(f"asked for ONNX opset {opset} but the PyTorch exporter wrote opset "
                           f"{graph_opset(exported)} for the decoder")
    for value in [*exported.graph.input, *exported.graph.output]:  # the exporter names the batch axis by a symbol
        value.type.tensor_type.shape.dim[0].dim_param = BATCH_DIM
    onnx.save(exported, str(path))
    check_graph(exported)
    return exported


def parity_poses(poses: np.ndarray, classes: np.ndarray, limit: float | None) -> tuple[np.ndarray, np.ndarray]:
    """Poses (N, J, D) and class indices (N,) a client would send, from `poses` and their predicted `classes`: each
    as predicted, the first as every class (its own capsule's pose in that class's place), and the first's each
    dimension moved by PERTURBATION_STEPS, within `limit` (the pose's length, where bounded)."""
    _, classes_count, pose_dim = poses.shape
    first, own = poses[0], int(classes[0])
    as_other = np.zeros((classes_count, classes_count, pose_dim), dtype=np.float32)  # (J, J, D)
    as_other[np.arange(classes_count), np.arange(classes_count)] = first[own]
    moved = np.repeat(first[None], pose_dim * len(PERTURBATION_STEPS), axis=0)  # (D*11, J, D)
    for dim in range(pose_dim):
        rows = moved[dim * len(PERTURBATION_STEPS):(dim + 1) * len(PERTURBATION_STEPS)]
        rows[:, own, dim] += PERTURBATION_STEPS
        if limit is not None:
            lengths = np.linalg.norm(rows[:, own], axis=1, keepdims=True)  # (11, 1)
            rows[:, own] *= np.minimum(1, (limit - LENGTH_SLACK) / lengths)
    all_poses = np.concatenate([poses, as_other, moved])
    all_classes = np.concatenate([classes, np.arange(classes_count), np.full(len(moved), own)]).astype(np.int64)
    return all_poses, all_classes


def check_decoder(model, directory: Path, reference_poses: np.ndarray, reference_probabilities: np.ndarray,
                  reference_reconstruction: np.ndarray, pose: PoseFigures | None) -> DecoderDescription:
    """decoder.onnx on ONNX Runtime against PyTorch's decoder on parity_poses, and against the full graph's
    reconstruction of the reference images (the same decoder, masked by the predicted class); CapsNetError beyond
    FP32_TOLERANCE. `pose`: the pose figures measured on the model, recorded with it."""
    import torch

    config = model.config
    limit = pose_length_limit(config)
    predicted = reference_probabilities.argmax(axis=1)  # (N,)
    poses, classes = parity_poses(reference_poses, predicted, limit)
    session = onnxruntime_session(str(directory / DECODER_FILE))
    (drawn,) = session.run([RECONSTRUCTION_OUTPUT], {POSES_INPUT: poses, CLASS_INPUT: classes})
    with torch.inference_mode():
        expected = model.decoder(torch.from_numpy(poses), torch.from_numpy(classes)).numpy()
    against_pytorch = max_abs_diff(expected, drawn)
    against_graph = max_abs_diff(reference_reconstruction, drawn[:len(reference_poses)])
    parity: dict[str, Any] = {"reference": "pytorch", "tolerance": FP32_TOLERANCE, "rows": len(poses),
                              "max_abs_diff": against_pytorch, "vs_full_graph_max_abs_diff": against_graph}
    if not (against_pytorch <= FP32_TOLERANCE and against_graph <= FP32_TOLERANCE):  # `not`: NaN fails too
        raise CapsNetError(f"the decoder's ONNX graph disagrees beyond {FP32_TOLERANCE:g}: max |diff| "
                           f"{against_pytorch:.2e} against PyTorch's decoder on {len(poses)} poses, "
                           f"{against_graph:.2e} against the full graph's reconstruction")
    return DecoderDescription(DECODER_FILE, config.num_classes, config.digit_caps_dim, config.input_size, limit,
                              parity, pose)
