"""`capsnet visualize` on a briefly trained tiny model: the files, and the figures' contents computed."""

from __future__ import annotations

import pytest
import torch
from PIL import Image

from capsnet.errors import CapsNetError
from capsnet.training import visualize
from capsnet.models.checkpoint import load_checkpoint
from capsnet.training.data import load_embedded, to_float

PICTURES = ["confusion.png", "pose-perturbation-0.png", "pose-perturbation-1.png", "pose-perturbation-2.png",
            "reconstructions.png", "routing.png", "training-curves.png"]


@pytest.fixture(scope="module")
def model(trained_tiny_checkpoint):
    return load_checkpoint(trained_tiny_checkpoint).build_model()


@pytest.fixture(scope="module")
def images():
    return to_float(load_embedded().test.images[::100])  # (10, 1, 28, 28): one of each class


def test_writes_every_picture_as_a_png(trained_tiny_checkpoint, tmp_path, run_command, capsys):
    code = run_command(visualize, "visualize", str(trained_tiny_checkpoint), "--out", str(tmp_path / "pictures"),
                       "--images", "300")
    assert code == 0
    out = tmp_path / "pictures"
    assert sorted(p.name for p in out.iterdir()) == PICTURES
    assert sorted(capsys.readouterr().out.splitlines()) == sorted(f"wrote {out / name}" for name in PICTURES)
    for name in PICTURES:
        with Image.open(out / name) as image:
            assert image.format == "PNG"
            width, height = image.size
            assert 300 <= width <= 2000 and 250 <= height <= 2000, (name, image.size)
            assert (out / name).stat().st_size < 400_000
    with Image.open(out / "pose-perturbation-0.png") as image:
        # room for the 16 × 11 panels of 28 × 28 pixels at least at their own size
        assert image.size[0] >= 11 * 28 and image.size[1] >= 16 * 28


def test_training_curves_show_each_split_and_the_epoch_validation_chose(trained_tiny_checkpoint):
    record = load_checkpoint(trained_tiny_checkpoint).history[0]
    # validation added to a real record, with the test accuracy peaking elsewhere: the mark follows validation
    history = [{**record, "epoch": epoch + 1, "validation_loss": 1 - accuracy, "validation_accuracy": accuracy,
                "test_accuracy": 1 - accuracy} for epoch, accuracy in enumerate([0.5, 0.9, 0.7])]
    accuracy_axes = visualize.training_curves(history).axes[1]
    lines = {line.get_label(): line for line in accuracy_axes.get_lines()}
    assert set(lines) == {"train", "validation", "test", "best on validation (epoch 2)"}
    assert list(lines["validation"].get_ydata()) == pytest.approx([50, 90, 70])
    assert list(lines["best on validation (epoch 2)"].get_xdata()) == [2, 2]
    without_validation = [{key: value for key, value in record.items() if not key.startswith("validation")}
                          for record in history]
    labels = [line.get_label() for line in visualize.training_curves(without_validation).axes[1].get_lines()]
    assert labels == ["train", "test"]


def test_pose_perturbation_moves_one_dimension_of_the_predicted_capsule(model, images):
    with torch.no_grad():
        grid = visualize.pose_perturbations(model, images[:1])
        output = model(images[:1])
        assert grid.shape == (16, 11, 1, 28, 28)
        deltas = visualize.perturbation_deltas()
        assert torch.allclose(deltas, torch.linspace(-0.25, 0.25, 11))
        # offset 0: the model's own reconstruction
        for dim in range(16):
            torch.testing.assert_close(grid[dim, 5].reshape(1, -1), output.reconstruction)
        # one panel against the decoder on a pose changed by hand
        target = output.probabilities.argmax(dim=1)  # (1,)
        poses = output.poses.clone()  # (1, J, D)
        poses[0, target[0], 7] += deltas[2]
        torch.testing.assert_close(grid[7, 2].reshape(1, -1), model.decoder(poses, target))
    assert all((grid[d, 0] - grid[d, -1]).abs().max() > 1e-4 for d in range(16))


def test_coupling_maps_are_the_coupling_on_the_primary_grid(model, images):
    config = model.config
    grid_h, grid_w = config.primary_grid
    with torch.no_grad():
        coupling = model(images).coupling  # (10, I, J)
    maps = visualize.coupling_maps(coupling, config)
    assert maps.shape == (10, 10, grid_h, grid_w)
    # capsule i = (channel, y, x) in PrimaryCaps order
    image, klass, y, x = 3, 4, 1, 2
    members = [channel * grid_h * grid_w + y * grid_w + x for channel in range(config.primary_caps_channels)]
    assert maps[image, klass, y, x].item() == pytest.approx(coupling[image, members, klass].mean().item(), rel=1e-5)
    torch.testing.assert_close(maps.sum(dim=1), torch.ones(10, grid_h, grid_w))  # sabour: softmax over classes


def test_em_model_gets_every_picture_and_maps_on_the_class_layers_input_grid(trained_em_tiny_checkpoint, images,
                                                                           tmp_path, run_command):
    code = run_command(visualize, "visualize", str(trained_em_tiny_checkpoint), "--out", str(tmp_path), "--images",
                       "200")
    assert code == 0 and sorted(p.name for p in tmp_path.iterdir()) == PICTURES
    model = load_checkpoint(trained_em_tiny_checkpoint).build_model()
    config = model.config
    grid_h, grid_w = config.em_grids[-1]
    types = config.conv_caps_types[-1]
    with torch.no_grad():
        coupling = model(images).coupling  # (10, H*W*N, J): ConvCaps2 capsules ordered (y, x, type)
    maps = visualize.coupling_maps(coupling, config)
    assert maps.shape == (10, 10, grid_h, grid_w)
    image, klass, y, x = 2, 7, 3, 1
    members = [(y * grid_w + x) * types + kind for kind in range(types)]
    assert maps[image, klass, y, x].item() == pytest.approx(coupling[image, members, klass].mean().item(), rel=1e-5)
    torch.testing.assert_close(maps.sum(dim=1), torch.ones(10, grid_h, grid_w))  # R: a distribution over classes


def test_bad_counts_are_refused(trained_tiny_checkpoint, tmp_path, run_command):
    with pytest.raises(CapsNetError, match="--examples must be at least 1"):
        run_command(visualize, "visualize", str(trained_tiny_checkpoint), "--out", str(tmp_path), "--examples", "0")


def test_without_the_visualize_extra_one_line_names_it(random_tiny_checkpoint, tmp_path):
    """matplotlib comes with the visualize extra (the serving image leaves it out): without it, one line says so."""
    import subprocess
    import sys

    without = "import sys; sys.modules['matplotlib'] = None; from capsnet.cli import main; sys.exit(main(sys.argv[1:]))"
    run = subprocess.run([sys.executable, "-c", without, "visualize", str(random_tiny_checkpoint), "--out",
                          str(tmp_path / "pictures")], capture_output=True, text=True, timeout=120)
    assert (run.returncode, run.stderr) == (2, "capsnet visualize: error: the pictures are drawn with matplotlib: "
                                               f"{visualize.INSTALL}\n")
    assert not (tmp_path / "pictures").exists()
