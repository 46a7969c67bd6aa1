"""The decoder served as a model of its own (model.json's `decoder`, docs/serving.md): `<model>-decoder` beside every
model exported with its reconstruction, over KServe v2 (gRPC and REST), so a client draws what any pose looks like
as any class, as the paper's figure 4 does offline.

It takes the one request path (serving/protocol/kserve.py -> InferenceService.infer -> the batcher -> a backend). The
batcher batches one float32 array per request, so a request's two inputs become one row per item: its J*D pose values,
then its class index (exact in float32 for the few classes a model has). InferenceService.infer checks the rows before
they are queued (check_rows): finite poses, no capsule longer than a squashed one can be, a class of the model's.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from capsnet.errors import CapsNetError, first_line
from capsnet.model_description.backend_table import DECODER_BACKEND, DECODER_PRECISION
from capsnet.model_description.decoder import (CLASS_INPUT, DECODER_PART, LENGTH_SLACK, POSES_INPUT,
                                               RECONSTRUCTION_OUTPUT, DecoderDescription)
from capsnet.model_description.precision_gate import FP32_TOLERANCE, abs_diffs
from capsnet.runtime.cpu import CpuKind
from capsnet.serving.config import ServerConfig
from capsnet.serving.engine.artifacts import ModelArtifacts, load_artifacts
from capsnet.serving.engine.backends.base import Backend
from capsnet.serving.engine.self_check import SelfCheck, non_finite, read_reference
from capsnet.serving.errors import InvalidInput

GRID_STEPS = 11  # a perturbation grid's steps per pose dimension: -0.25 to +0.25 by 0.05, the paper's figure 4
CHOICE = (f"the decoder runs on {DECODER_BACKEND} at {DECODER_PRECISION} on the CPU, as the backend table says "
          "(a few small matrix products)")


def decoder_spec_fields(artifacts: ModelArtifacts, max_batch_size: int) -> dict:
    """The fields that make a model's description its decoder's, as served. Its batch limit is --max-batch-size or a
    whole perturbation grid (every pose dimension at GRID_STEPS steps), whichever is larger, so that a client draws
    the paper's figure 4 in one call: an item is a few small matrix products."""
    decoder = _described(artifacts)
    return {"input_name": POSES_INPUT, "output_shapes": {RECONSTRUCTION_OUTPUT: (decoder.output_size,)},
            "part": DECODER_PART, "max_batch_size": max(max_batch_size, decoder.pose_dim * GRID_STEPS)}


def _described(artifacts: ModelArtifacts) -> DecoderDescription:
    if artifacts.decoder is None:
        raise CapsNetError(f"{artifacts.directory} has no decoder: export it with `capsnet export --reconstruction`")
    return artifacts.decoder


def check_takes_images(spec) -> None:
    """Our CapsNet API classifies images: a decoder is refused there, naming where it is served."""
    if spec.part == DECODER_PART:
        raise InvalidInput(f"model_name: {spec.name!r} is a decoder (poses and a class index in, no images): call it "
                           f"over KServe v2 (ModelInfer, or POST /v2/models/{spec.name}/infer)")


def rows(poses: np.ndarray, classes: np.ndarray) -> np.ndarray:
    """The batcher's rows (N, J*D + 1) float32 of poses (N, J, D) and class indices (N,), not yet checked."""
    packed = np.empty((len(poses), poses[0].size + 1), dtype=np.float32)  # (N, J*D + 1)
    packed[:, :-1] = poses.reshape(len(poses), -1)  # (N, J*D)
    packed[:, -1] = np.clip(classes, -1, 2**24)  # out of range stays out of range, exactly
    return packed


def check_rows(packed: np.ndarray, decoder: DecoderDescription) -> None:
    """Finite poses, none longer than a squashed capsule, and classes of the model; InvalidInput naming the input
    and the item otherwise."""
    poses = packed[:, :-1].reshape(len(packed), *decoder.pose_shape)  # (N, J, D)
    finite = np.isfinite(poses).reshape(len(packed), -1).all(axis=1)  # (N,)
    if not finite.all():
        raise InvalidInput(f"{POSES_INPUT}: item {int(np.argmin(finite))} contains NaN or Inf; expected the poses of "
                           "a capsule layer")
    if decoder.max_pose_length is not None:
        lengths = np.linalg.norm(poses, axis=2)  # (N, J)
        if (too_long := lengths > decoder.max_pose_length + LENGTH_SLACK).any():
            item, capsule = map(int, np.argwhere(too_long)[0])
            raise InvalidInput(f"{POSES_INPUT}: item {item} capsule {capsule} has length "
                               f"{lengths[item, capsule]:.4f}; expected at most {decoder.max_pose_length:g} (poses "
                               "are squashed: scale a longer one back to length 1)")
    classes = packed[:, -1]  # (N,)
    if (outside := (classes < 0) | (classes >= decoder.classes)).any():
        item = int(np.argmax(outside))
        raise InvalidInput(f"{CLASS_INPUT}: item {item} is class {int(classes[item])}; expected 0 to "
                           f"{decoder.classes - 1} (the model's {decoder.classes} classes)")


class DecoderBackend(Backend):
    """decoder.onnx on ONNX Runtime's CPU provider, run on the batcher's rows."""

    name = DECODER_BACKEND
    precision = DECODER_PRECISION
    output_names = (RECONSTRUCTION_OUTPUT,)

    def __init__(self, artifacts: ModelArtifacts, threads: int):
        import onnxruntime as ort  # here: importing the request path loads no runtime

        decoder = _described(artifacts)
        path = artifacts.resolve(artifacts.directory, decoder.file, "decoder.file")
        options = ort.SessionOptions()
        options.intra_op_num_threads = threads
        options.inter_op_num_threads = 1
        options.add_session_config_entry("session.intra_op.allow_spinning", "0")  # as the classifier's: idle cores
        try:
            self.session = ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])
        except Exception as err:  # onnxruntime's own exception types
            raise CapsNetError(f"{path} is damaged or cannot be loaded: {first_line(err)}") from None
        names = [node.name for node in self.session.get_inputs()]
        if names != [POSES_INPUT, CLASS_INPUT]:
            raise CapsNetError(f"{path} takes inputs {names}, model.json says {[POSES_INPUT, CLASS_INPUT]}; "
                               "re-export it")
        self.decoder = decoder
        self.description = f"{path.name} on CPUExecutionProvider, {threads} threads"

    @classmethod
    def create(cls, artifacts: ModelArtifacts, precision: str, config: ServerConfig) -> DecoderBackend:
        return cls(artifacts, config.intra_op_threads)

    def run(self, images: np.ndarray) -> dict[str, np.ndarray]:
        """`images`: the batcher's rows (N, J*D + 1)."""
        poses = images[:, :-1].reshape(len(images), *self.decoder.pose_shape)  # (N, J, D)
        classes = images[:, -1].astype(np.int64)  # (N,)
        (drawn,) = self.session.run([RECONSTRUCTION_OUTPUT], {POSES_INPUT: poses, CLASS_INPUT: classes})
        return {RECONSTRUCTION_OUTPUT: drawn}

    def warmup(self, batch_sizes, input_shape) -> None:
        classes, pose_dim = self.decoder.pose_shape
        for batch_size in batch_sizes:
            self.run(np.zeros((batch_size, classes * pose_dim + 1), dtype=np.float32))


def load_decoder(folder: Path, config: ServerConfig) -> tuple[ModelArtifacts, DecoderBackend, SelfCheck]:
    """An export folder's decoder, self-checked: the reference images' poses with their predicted classes must draw
    the reconstruction the whole graph drew for them at export, within FP32's tolerance (blocking)."""
    artifacts = load_artifacts(folder)
    backend = DecoderBackend.create(artifacts, DECODER_PRECISION, config)
    reference = read_reference(artifacts.reference, artifacts)
    if "poses" not in reference or RECONSTRUCTION_OUTPUT not in reference:
        raise CapsNetError(f"{artifacts.reference} has no poses and reconstruction to check the decoder with; "
                           "re-export it")
    poses, expected = reference["poses"], reference[RECONSTRUCTION_OUTPUT]
    classes = reference["probabilities"].argmax(axis=1)  # (N,) the class the reconstruction was masked by
    packed = rows(poses, classes)  # (N, J*D + 1)
    drawn = np.concatenate([backend.run(packed[start:start + config.max_batch_size])[RECONSTRUCTION_OUTPUT]
                            for start in range(0, len(packed), config.max_batch_size)])
    differences = abs_diffs(expected, drawn)  # (N,)
    check = SelfCheck(
        precision=DECODER_PRECISION, images=len(poses),
        max_abs_diff={RECONSTRUCTION_OUTPUT: float(differences.max())},
        # a decoder has no class to agree on: the share of reference rows drawn within the tolerance
        argmax_agreement=float((differences <= FP32_TOLERANCE).mean()),
        cpu=CpuKind.this_host().describe(), tolerance=FP32_TOLERANCE, min_agreement=1.0,
        non_finite=non_finite({RECONSTRUCTION_OUTPUT: drawn}))
    if not check.passed:
        raise CapsNetError(f"decoder self-check failed: {check.describe()}")
    return artifacts, backend, check
