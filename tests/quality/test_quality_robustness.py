"""`capsnet robustness`: the overlap scoring by hand, and the command against `capsnet eval`'s figure."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from capsnet.training import robustness
from capsnet.models.checkpoint import load_checkpoint
from capsnet.training.data import load_embedded, to_float
from capsnet.training.evaluate import Scoring, evaluate
from capsnet.training.transforms import affine_split, overlay_pairs


def test_overlap_scores_top2_with_and_without_both_present():
    probabilities = np.array([
        [0.9, 0.8, 0.1],  # top-2 {0, 1}, both > 0.5
        [0.9, 0.3, 0.2],  # top-2 {0, 1}, class 1 only 0.3
        [0.6, 0.1, 0.7],  # top-2 {2, 0}, both > 0.5
        [0.9, 0.1, 0.8],  # top-2 {0, 2}: wrong pair
    ])
    labels = np.array([[0, 1], [1, 0], [2, 0], [0, 1]])
    scores = robustness.overlap_scores(probabilities, labels)
    assert scores == {"top2_accuracy": 0.75, "top2_both_present_accuracy": 0.5}


def test_report_matches_eval_and_a_direct_computation(trained_tiny_checkpoint, run_command, capsys):
    code = run_command(robustness, "robustness", str(trained_tiny_checkpoint), "--pairs", "200", "--seed", "7",
                       "--json")
    assert code == 0
    report = json.loads(capsys.readouterr().out)
    model = load_checkpoint(trained_tiny_checkpoint).build_model()
    test = load_embedded().test
    names = tuple(str(d) for d in range(10))
    cpu = torch.device("cpu")
    assert report["clean_accuracy"] == evaluate(model, test, names, Scoring(256, cpu)).accuracy
    assert report["affine_accuracy"] == evaluate(model, affine_split(test, 7)[0], names, Scoring(256, cpu)).accuracy
    overlay = overlay_pairs(test, 200, 7)
    with torch.no_grad():
        probabilities = model(to_float(overlay.images)).probabilities.numpy()  # (200, J)
    assert report["pairs"] == 200 and report["split"] == "test" and report["test_images"] == len(test)
    assert report["overlap_top2_accuracy"] == pytest.approx(
        robustness.overlap_scores(probabilities, overlay.labels)["top2_accuracy"])
    assert 0 <= report["overlap_top2_both_present_accuracy"] <= report["overlap_top2_accuracy"] <= 1
