"""Does an exported graph compute what the model computes? Outputs compared on real images.

Every backend is run the same way: a list of batches in, a list of {output name: array} out, so
PyTorch, ONNX Runtime and TensorRT results compare with one function.
"""

from __future__ import annotations

import itertools

import numpy as np

from capsnet.export.onnx_export import INPUT_NAME
from capsnet.model_description.precision_gate import Comparison, compare_outputs
from capsnet.training.data import to_float

PARITY_BATCH_SIZES = (1, 7, 64)

Batch = np.ndarray  # (N, C, H, W) float32 in [0, 1]
Outputs = dict[str, np.ndarray]


def spread(images_uint8: np.ndarray, count: int) -> Batch:
    """`count` images spread evenly over the split (splits may be sorted by class), as [0, 1] floats."""
    return to_float(images_uint8[np.arange(count) * len(images_uint8) // count]).numpy()  # (count, C, H, W)


def parity_batches(images_uint8: np.ndarray, batch_sizes=PARITY_BATCH_SIZES) -> list[Batch]:
    """Different images for each batch size, spread evenly over the split."""
    picked = spread(images_uint8, sum(batch_sizes))  # (total, C, H, W)
    bounds = np.cumsum((0, *batch_sizes))
    return [picked[start:stop] for start, stop in itertools.pairwise(bounds)]


def tiled(images_uint8: np.ndarray, count: int, height: int, width: int) -> Batch:
    """`count` images of height × width, each a grid of the split's images side by side and one above the other,
    cut to size (a 28×56 image holds two digits, 56×56 four, 40×100 three and parts of four more), as [0, 1] floats:
    real strokes at every position of a size a model of any size takes."""
    channels, tile_height, tile_width = images_uint8.shape[1:]
    rows, columns = -(-height // tile_height), -(-width // tile_width)
    tiles = spread(images_uint8, count * rows * columns)  # (count*rows*columns, C, h, w)
    grid = tiles.reshape(count, rows, columns, channels, tile_height, tile_width)
    grid = grid.transpose(0, 3, 1, 4, 2, 5).reshape(count, channels, rows * tile_height, columns * tile_width)
    return np.ascontiguousarray(grid[:, :, :height, :width])  # (count, C, H, W)


def torch_outputs(model, batches: list[Batch], names: tuple[str, ...]) -> list[Outputs]:
    import torch

    results = []
    with torch.inference_mode():
        for batch in batches:
            outputs = model(torch.from_numpy(batch))
            results.append({name: getattr(outputs, name).numpy() for name in names})
    return results


def onnxruntime_session(model_path_or_bytes):
    import onnxruntime as ort

    return ort.InferenceSession(model_path_or_bytes, providers=["CPUExecutionProvider"])


def onnxruntime_outputs(session, batches: list[Batch], names: tuple[str, ...]) -> list[Outputs]:
    results = []
    for batch in batches:
        values = session.run(list(names), {INPUT_NAME: batch})
        results.append({name: value.astype(np.float32) for name, value in zip(names, values)})
    return results


def onnxruntime_probabilities(session, images_uint8: np.ndarray, batch: int = 250) -> np.ndarray:
    """The probabilities (N, J) of an ONNX Runtime session over a whole split of uint8 images, in batches."""
    runs = []
    for start in range(0, len(images_uint8), batch):
        images = to_float(images_uint8[start:start + batch]).numpy()  # (B, C, H, W)
        (probabilities,) = session.run(["probabilities"], {INPUT_NAME: images})
        runs.append(probabilities.astype(np.float32))
    return np.concatenate(runs)


def compare(reference: list[Outputs], candidate: list[Outputs]) -> Comparison:
    """Batch by batch (a model of any size answers each image size in outputs of its own shape), then over them all."""
    names = tuple(reference[0])
    return Comparison.joined([compare_outputs(ref, cand, names) for ref, cand in zip(reference, candidate)])
