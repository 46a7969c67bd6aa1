"""The precision gate's one comparison of a variant's outputs with FP32's on the reference images, as export
measures a gate entry with it and a server (or export's package check) holds a variant to that entry."""

from __future__ import annotations

import math

import numpy as np

from capsnet.export.precision import measure_gate
from capsnet.model_description.precision_gate import GATE_DIFF_FACTOR, GATE_DIFF_SLACK, compare_outputs

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
    assert math.isnan(compared.max_abs_diff["poses"]) and not compared.within(1.0, 0.0)  # NaN after a finite value
    candidate["probabilities"][0, 0] = np.nan
    assert not accepted.reproduced_by(compare_outputs(REFERENCE, candidate, ("probabilities",)))
