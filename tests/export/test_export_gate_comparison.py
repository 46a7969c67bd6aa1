"""The precision gate's one comparison of a variant's outputs with FP32's on the reference images, as export
measures a gate entry with it and a server (or export's package check) holds a variant to that entry."""

from __future__ import annotations

import math

import numpy as np
import pytest

from capsnet.export.precision import measure_gate
from capsnet.model_description.precision_gate import (
    GATE_DIFF_FACTOR, GATE_DIFF_SLACK, Comparison, abs_diffs, compare_outputs, max_abs_diff)

REFERENCE = {"probabilities": np.array([[0.9, 0.1], [0.2, 0.8], [0.6, 0.4], [0.3, 0.7]], np.float32),
             "poses": np.zeros((4, 3), np.float32)}
LABELS = np.array([0, 1, 0, 1])


def _gate(candidate: dict[str, np.ndarray]):
    return measure_gate("fp16", "a test variant", REFERENCE, candidate, LABELS, REFERENCE["probabilities"],
                        candidate["probabilities"], 1.0, "this CPU")


def test_export_and_the_server_read_one_comparison():
    candidate = {"probabilities": REFERENCE["probabilities"] + np.float32(0.01),
                 "poses": np.full((4, 3), 0.002, np.float32)}
    candidate["probabilities"][2] = [0.4, 0.6]  # one image of four changes class
    gate = _gate(candidate)
    assert gate.argmax_agreement == 0.75 and gate.reference_images == 4
    assert math.isclose(gate.max_abs_diff, 0.2, rel_tol=1e-6) and gate.bounded_diff == gate.max_abs_diff
    assert gate.most_diff == GATE_DIFF_FACTOR * gate.max_abs_diff + GATE_DIFF_SLACK
    compared = compare_outputs(REFERENCE, candidate, ("probabilities",))
    assert gate.reproduced_by(compared)  # what export measured, measured again
    candidate["probabilities"][3] = [0.8, 0.2]
    assert not gate.reproduced_by(compare_outputs(REFERENCE, candidate, ("probabilities",)))


def test_a_nan_is_refused_by_both_halves():
    candidate = {"probabilities": REFERENCE["probabilities"].copy(), "poses": REFERENCE["poses"].copy()}
    accepted = _gate(candidate)
    candidate["poses"][1, 2] = np.nan
    refused = _gate(candidate)
    assert math.isinf(refused.bounded_diff) and refused.max_abs_diff == 0 and not refused.accepted
    compared = compare_outputs(REFERENCE, candidate, ("probabilities", "poses"))
    assert math.isinf(compared.max_abs_diff["poses"]) and not compared.passes(1.0, 0.0)  # NaN after a finite value
    candidate["probabilities"][0, 0] = np.nan
    assert not accepted.reproduced_by(compare_outputs(REFERENCE, candidate, ("probabilities",)))


@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
@pytest.mark.parametrize("side", ["reference", "candidate"])
def test_one_nan_rule_an_item_with_a_nan_or_an_infinity_differs_by_infinity(bad, side):
    """Parity, self-check, gate and the decoder's check take every difference from abs_diffs: an item holding a NaN
    or an infinity on either side differs by infinity (which every max keeps and no tolerance passes); the others
    by their own largest |difference|."""
    reference = np.array([[0.0, 1.0], [0.5, 0.5], [1.0, 0.0]], np.float32)
    candidate = reference + np.array([[0.0, 0.25], [0.0, 0.0], [-0.5, 0.0]], np.float32)
    (reference if side == "reference" else candidate)[1, 0] = bad
    assert abs_diffs(reference, candidate).tolist() == [0.25, math.inf, 0.5]
    assert max_abs_diff(reference, candidate) == math.inf
    assert max_abs_diff(reference[[0, 2]], candidate[[0, 2]]) == 0.5
    assert max_abs_diff(reference[:0], candidate[:0]) == 0.0


def test_comparisons_of_batches_join_into_one():
    first = compare_outputs(REFERENCE, REFERENCE, ("probabilities",))
    moved = {"probabilities": REFERENCE["probabilities"][::-1].copy()}
    second = compare_outputs(REFERENCE, moved, ("probabilities",))  # every class changes
    joined = Comparison.joined([first, second])
    assert joined.images == 8 and joined.argmax_agreement == 0.5
    assert math.isclose(joined.max_abs_diff["probabilities"], 0.6, rel_tol=1e-6)
    assert joined.passes(0.6 + 1e-6, 0.5) and not joined.passes(0.5, 0.5) and not joined.passes(1.0)
