"""Pairs of digits in one image: the pair sets, `capsnet eval --pairs` against a computation of its own, and
visualize's pairs.png, on briefly trained any-size models."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from capsnet.cli import main
from capsnet.training import visualize
from capsnet.models.checkpoint import load_checkpoint
from capsnet.training.data import Split, load_embedded, to_float
from capsnet.training.evaluate import Scoring, evaluate
from capsnet.training.pairs import PairScores
from capsnet.training.transforms import digit_pairs, overlay_pairs


@pytest.fixture(scope="module")
def digits() -> Split:
    return load_embedded().test


@pytest.mark.parametrize("layout, axis", [("side-by-side", 3), ("stacked", 2)])
def test_pairs_are_two_different_digits_as_they_are_side_by_side_or_stacked(digits, layout, axis):
    pairs = digit_pairs(digits, 300, seed=1, layout=layout)
    expected_shape = (300, 1, 28, 56) if layout == "side-by-side" else (300, 1, 56, 28)
    assert pairs.images.shape == expected_shape and pairs.images.dtype == np.uint8
    assert (pairs.labels[:, 0] != pairs.labels[:, 1]).all() and len(np.unique(pairs.labels)) == 10
    np.testing.assert_array_equal(pairs.labels, digits.labels[pairs.sources])
    first, second = np.split(pairs.images, 2, axis=axis)
    np.testing.assert_array_equal(first, digits.images[pairs.sources[:, 0]])
    np.testing.assert_array_equal(second, digits.images[pairs.sources[:, 1]])
    np.testing.assert_array_equal(digit_pairs(digits, 300, 1, layout).images, pairs.images)  # seeded
    assert not np.array_equal(digit_pairs(digits, 300, 2, layout).sources, pairs.sources)


def test_overlap_layout_is_the_robustness_overlay(digits):
    np.testing.assert_array_equal(digit_pairs(digits, 50, 4, "overlap").images, overlay_pairs(digits, 50, 4).images)


def top2_by_hand(lengths: np.ndarray, labels: np.ndarray) -> tuple[float, float]:
    """The top-2 set accuracy and the same with both lengths > 0.5, one pair at a time."""
    found = present = 0
    for row, pair in zip(lengths.tolist(), labels.tolist()):
        ranked = sorted(range(len(row)), key=lambda k: -row[k])
        if set(ranked[:2]) == set(pair):
            found += 1
            present += all(row[k] > 0.5 for k in pair)
    return found / len(labels), present / len(labels)


@pytest.mark.parametrize("fixture", ["trained_shared_tiny_checkpoint", "trained_gap_cnn_tiny_checkpoint"])
def test_eval_pairs_figures_are_those_computed_pair_by_pair(fixture, request, capsys, digits):
    checkpoint = request.getfixturevalue(fixture)
    capsys.readouterr()  # what training the fixture printed
    assert main(["eval", str(checkpoint), "--pairs", "side-by-side", "--pair-count", "300", "--seed", "3",
                 "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    model = load_checkpoint(checkpoint).build_model()
    scoring = Scoring(256, torch.device("cpu"))
    assert report["accuracy"] == evaluate(model, digits, tuple(map(str, range(10))), scoring).accuracy
    pairs = digit_pairs(digits, 300, 3, "side-by-side")
    with torch.no_grad():  # one image at a time: nothing shared with the command's batches
        lengths = np.concatenate([model(to_float(image[None])).probabilities.numpy() for image in pairs.images])
    top2, both = top2_by_hand(lengths, pairs.labels)
    assert 0 < both <= top2 < 1  # a model that finds some pairs and misses others, so the figures can be wrong
    assert report["pairs"] == {"layout": "side-by-side", "count": 300, "seed": 3, "image_shape": [1, 28, 56],
                               "top2_accuracy": pytest.approx(top2), "top2_both_present_accuracy": pytest.approx(both),
                               "present_threshold": 0.5}
    assert main(["eval", str(checkpoint), "--pairs", "side-by-side", "--pair-count", "300", "--seed", "3"]) == 0
    text = capsys.readouterr().out.splitlines()
    assert text[-3:] == ["pairs (side-by-side, 300 images of 28x56, seed 3):",
                         f"  top-2 set accuracy                {100 * top2:6.2f}%",
                         f"  ... with both lengths > 0.5      {100 * both:6.2f}%"]


def test_a_fixed_size_model_scores_overlaid_pairs(trained_tiny_checkpoint, capsys):
    assert main(["eval", str(trained_tiny_checkpoint), "--pairs", "overlap", "--pair-count", "50", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["pairs"]["image_shape"] == [1, 28, 28]


@pytest.mark.parametrize("fixture", ["trained_shared_tiny_checkpoint", "trained_gap_cnn_tiny_checkpoint"])
def test_visualize_draws_pairs_with_their_lengths(fixture, request, tmp_path, run_command):
    out = tmp_path / "pictures"
    assert run_command(visualize, "visualize", str(request.getfixturevalue(fixture)), "--out", str(out),
                       "--images", "100") == 0
    assert sorted(p.name for p in out.iterdir()) == ["confusion.png", "pairs.png", "training-curves.png"]
    with Image.open(out / "pairs.png") as image:
        assert image.format == "PNG" and image.size[1] >= visualize.PAIRS_SHOWN * 100


def test_pairs_figure_shows_each_length_the_classes_and_who_is_present(digits):
    from matplotlib.colors import to_rgba

    pairs = digit_pairs(digits, 2, 0, "side-by-side")
    lengths = np.full((2, 10), 0.1)
    lengths[0, pairs.labels[0]] = (0.9, 0.7)  # found, both present
    wrong = next(k for k in range(10) if k not in pairs.labels[1])
    lengths[1, [pairs.labels[1][0], wrong]] = (0.8, 0.6)  # one of the pair and another class
    scores = PairScores("side-by-side", 2, 0, (1, 28, 56), 0.5, 0.5)
    figure = visualize.pairs_figure(pairs, lengths, scores, tuple(map(str, range(10))), "shared-capsnet")
    for row, verdict in enumerate(["top 2 right, both present", "top 2 wrong"]):
        axes = figure.axes[2 * row + 1]  # each row: the image, then the bars
        bars = axes.patches
        assert [bar.get_height() for bar in bars] == pytest.approx(lengths[row].tolist())
        orange = [k for k, bar in enumerate(bars) if bar.get_facecolor() == to_rgba("tab:orange")]
        assert orange == sorted(pairs.labels[row].tolist())
        outlined = [k for k, bar in enumerate(bars) if bar.get_linewidth() > 0]
        assert outlined == np.flatnonzero(lengths[row] > 0.5).tolist()
        assert [text.get_text() for text in axes.texts] == ["present"] * len(outlined)
        assert axes.get_title(loc="right") == verdict


def test_pair_png_script_writes_two_test_digits_of_different_classes_side_by_side(digits, tmp_path):
    script = Path(__file__).resolve().parents[2] / "scripts" / "pair_png.py"
    out = tmp_path / "models" / "pair.png"
    run = subprocess.run([sys.executable, str(script), str(out), "--seed", "3"], capture_output=True, text=True,
                         timeout=120)
    assert run.returncode == 0, run.stderr
    pixels = np.asarray(Image.open(out))  # (28, 56)
    left, right = pixels[:, :28], pixels[:, 28:]
    sources = [np.flatnonzero((digits.images[:, 0] == half).all(axis=(1, 2))) for half in (left, right)]
    assert all(len(found) for found in sources)
    first, second = (int(digits.labels[found[0]]) for found in sources)
    assert first != second and run.stdout.strip() == f"{out}: digits {first} and {second} side by side"
