"""Numerics on inputs real clients send: the export gates must not pass a NaN, and an EM model's outputs must be
finite, in range and independent of the rest of the batch on blank, saturated, noisy and one-pixel images."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from capsnet.export.parity import compare
from capsnet.models.checkpoint import load_checkpoint
from capsnet.training.data import to_float


def outputs(probabilities, poses) -> dict[str, np.ndarray]:
    return {"probabilities": np.asarray(probabilities, np.float32), "poses": np.asarray(poses, np.float32)}


GOOD = outputs([[0.1, 0.9]], [[[0.5, 0.5], [0.25, 0.25]]])  # (1, 2), (1, 2, 2)


@pytest.mark.parametrize("bad", [
    outputs([[0.1, 0.9]], [[[0.5, np.nan], [0.25, 0.25]]]),  # a NaN pose; the class is unaffected
    outputs([[0.1, np.nan]], [[[0.5, 0.5], [0.25, 0.25]]]),  # NaN where the argmax is: argmax still agrees
    outputs([[0.1, 0.9]], [[[0.5, np.inf], [0.25, 0.25]]]),
])
@pytest.mark.parametrize("position", [0, 1, 2])
def test_parity_gate_refuses_a_nan_or_inf_in_any_batch_and_output(bad, position):
    reference = [GOOD, GOOD, GOOD]  # batches as the exporter compares them (1, 7, 64)
    candidate = [bad if index == position else GOOD for index in range(3)]
    parity = compare(reference, candidate)
    assert not parity.passes(1.0, 0.0)  # however loose the gate
    assert np.isinf(max(parity.max_abs_diff.values()))


def test_parity_gate_refuses_a_nan_in_the_reference():
    bad = outputs([[0.1, 0.9]], [[[np.nan, 0.5], [0.25, 0.25]]])
    assert not compare([GOOD, bad], [GOOD, bad]).passes(1.0, 0.0)


def test_parity_gate_passes_finite_outputs_within_tolerance():
    near = outputs([[0.1, 0.9 + 1e-5]], [[[0.5, 0.5 - 1e-5], [0.25, 0.25]]])
    parity = compare([GOOD, GOOD], [GOOD, near])
    assert parity.passes(1e-4) and not parity.passes(1e-6)


def edge_images(shape: tuple[int, ...]) -> dict[str, np.ndarray]:
    """What clients send besides digits: (1, C, H, W) float32 in [0, 1]."""
    pixel = np.zeros((1, *shape), np.float32)
    pixel[0, :, shape[1] // 2, shape[2] // 2] = 1.0
    return {
        "black": np.zeros((1, *shape), np.float32),
        "white": np.ones((1, *shape), np.float32),
        "grey": np.full((1, *shape), 0.5, np.float32),
        "noise": np.random.default_rng(0).random((1, *shape), dtype=np.float32),
        "one bright pixel": pixel,
    }


def test_em_model_is_finite_and_batch_independent_on_edge_images(trained_em_tiny_checkpoint, embedded):
    model = load_checkpoint(trained_em_tiny_checkpoint).build_model().eval()
    digits = to_float(embedded.test.images[:: len(embedded.test.images) // 64][:64])  # (64, C, H, W)
    for name, image in edge_images(tuple(digits.shape[1:])).items():
        batch = digits.clone()
        batch[37] = torch.from_numpy(image[0])  # among 63 digits
        with torch.inference_mode():
            alone, among = model(torch.from_numpy(image)), model(batch)
        for output in ("probabilities", "poses", "reconstruction"):
            single, batched = getattr(alone, output), getattr(among, output)[37:38]
            assert torch.isfinite(single).all() and torch.isfinite(batched).all(), (name, output)
            torch.testing.assert_close(batched, single, rtol=0, atol=1e-5, msg=f"{name}: {output}")
        assert ((alone.probabilities >= 0) & (alone.probabilities <= 1)).all(), name
