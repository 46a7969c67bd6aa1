"""`capsnet eval --pose`: fidelity and per-dimension sensitivity of a trained model's decoder on held-out digits,
checked against a plain image-by-image computation of the same definitions."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
import torch

from capsnet.cli import main
from capsnet.errors import CapsNetError
from capsnet.model_description.pose import PoseFigures
from capsnet.models.checkpoint import load_checkpoint
from capsnet.models.config import preset
from capsnet.training.data import load_dataset
from capsnet.training.pose import measure_pose

IMAGES = 12


def reference_figures(model, dataset, count: int) -> tuple[float, float, np.ndarray]:
    """Reconstruction MSE, template MSE and grey levels per dimension, one image and one dimension at a time."""
    train = dataset.train.images.reshape(len(dataset.train), -1).astype(np.float64) / 255
    templates = np.stack([train[dataset.train.labels == k].mean(axis=0) for k in range(10)])  # (10, 784)
    rec, tem, levels = [], [], np.zeros(16)
    model.eval()
    with torch.inference_mode():
        for index in range(count):
            image = torch.from_numpy(dataset.test.images[index:index + 1]).float() / 255  # (1, 1, 28, 28)
            label = int(dataset.test.labels[index])
            output = model(image, torch.tensor([label]))
            target = image.flatten().double().numpy()
            rec.append(np.mean((output.reconstruction[0].double().numpy() - target) ** 2))
            tem.append(np.mean((templates[label] - target) ** 2))
            own = output.poses[0, label].double().numpy()
            for dim in range(16):
                drawings = []
                for step in (-0.25, 0.25):
                    moved = own.copy()
                    room = math.sqrt(max(0.0, (1 - 1e-5) ** 2 - (np.sum(own ** 2) - own[dim] ** 2)))
                    moved[dim] = np.clip(own[dim] + step, -room, room)
                    poses = output.poses.clone()
                    poses[0, label] = torch.from_numpy(moved).float()
                    drawings.append(model.decoder(poses, torch.tensor([label]))[0].double().numpy())
                levels[dim] += np.mean(np.abs(drawings[1] - drawings[0])) * 255 / count
    return float(np.mean(rec)), float(np.mean(tem)), levels


def test_eval_pose_prints_and_writes_the_figures_a_plain_computation_gives(trained_tiny_checkpoint, tmp_path,
                                                                          capsys):
    out = tmp_path / "pose.json"
    code = main(["eval", str(trained_tiny_checkpoint), "--pose", "--pose-images", str(IMAGES), "--pose-out", str(out),
                 "--json"])
    assert code == 0
    printed = json.loads(capsys.readouterr().out)["pose"]
    written = json.loads(out.read_text())
    assert printed == written
    model = load_checkpoint(trained_tiny_checkpoint).build_model()
    reconstruction, template, levels = reference_figures(model, load_dataset("embedded"), IMAGES)
    assert written["images"] == IMAGES and written["split"] == "test" and written["dataset"] == "embedded-mnist-5k"
    assert written["reconstruction_mse"] == pytest.approx(reconstruction, rel=1e-4)
    assert written["template_mse"] == pytest.approx(template, rel=1e-6)
    assert written["fidelity"] == pytest.approx(reconstruction / template, rel=1e-4)
    assert written["sensitivity"] == pytest.approx(levels.tolist(), rel=1e-3, abs=1e-3)
    assert written["visible_dimensions"] == int(np.sum(np.asarray(written["sensitivity"]) >= 8.0))
    assert written["step"] == 0.25 and written["visible_grey_levels"] == 8.0


def test_the_text_report_names_the_figures(trained_tiny_checkpoint, capsys):
    assert main(["eval", str(trained_tiny_checkpoint), "--pose", "--pose-images", "5"]) == 0
    report = capsys.readouterr().out
    assert "pose on 5 test images of embedded-mnist-5k: fidelity" in report and "dimensions reach 8" in report


def test_a_decoder_that_ignores_the_pose_moves_nothing_and_draws_no_better_than_its_bias(trained_tiny_checkpoint):
    model = load_checkpoint(trained_tiny_checkpoint).build_model()
    with torch.no_grad():
        model.decoder.net[0].weight.zero_()  # the first layer no longer reads the capsule
    figures = measure_pose(model, load_dataset("embedded"), images=IMAGES)
    assert figures.sensitivity == (0.0,) * 16 and figures.visible_dimensions == 0
    assert figures.fidelity > 0


def test_the_figures_round_trip_through_model_json_and_damage_is_refused():
    figures = PoseFigures(images=3, split="test", dataset="d", reconstruction_mse=0.02, template_mse=0.05,
                          sensitivity=(9.0,) * 8 + (1.0,) * 8)
    fail = CapsNetError
    again = PoseFigures.from_json(json.loads(json.dumps(figures.to_json())), fail, 16)
    assert again == figures and again.fidelity == pytest.approx(0.4) and again.visible_dimensions == 8
    with pytest.raises(CapsNetError, match="and 8 sensitivities"):
        PoseFigures.from_json(figures.to_json(), fail, 8)
    with pytest.raises(CapsNetError, match="finite figures"):
        PoseFigures.from_json({**figures.to_json(), "template_mse": float("nan")}, fail, 16)
    with pytest.raises(CapsNetError, match="lacks"):
        PoseFigures.from_json({"images": 3}, fail, 16)


def test_a_model_without_a_decoder_or_images_is_refused_in_one_line(random_checkpoint, trained_tiny_checkpoint,
                                                                    tmp_path, capsys):
    cnn = random_checkpoint(preset("gap-cnn-tiny"))
    assert main(["eval", str(cnn), "--pose", "--data", "embedded"]) != 0
    assert "has no decoder" in capsys.readouterr().err
    assert main(["eval", str(trained_tiny_checkpoint), "--pose", "--pose-images", "0"]) != 0
    assert "--pose-images must be at least 1" in capsys.readouterr().err
    assert main(["eval", str(trained_tiny_checkpoint), "--pose", "--pose-images", "2",
                 "--pose-out", str(tmp_path / "missing" / "pose.json")]) != 0
    assert "cannot write --pose-out" in capsys.readouterr().err


def test_the_decoder_learns_at_its_own_scale_of_the_rate_and_every_parameter_is_in_one_group():
    from capsnet.models.checkpoint import create_model
    from capsnet.training.optimizer import parameter_groups

    model = create_model(preset("tiny", decoder_lr_scale=5.0))
    groups = parameter_groups(model, 1e-3)
    decoder = {id(p) for p in model.decoder.parameters()}
    assert [group["lr"] for group in groups] == [1e-3, pytest.approx(5e-3)]
    assert {id(p) for p in groups[1]["params"]} == decoder
    assert sorted(id(p) for group in groups for p in group["params"]) == sorted(id(p) for p in model.parameters())
    optimizer = torch.optim.Adam(groups, lr=1e-3)
    assert [group["lr"] for group in optimizer.param_groups] == [1e-3, pytest.approx(5e-3)]
    assert len(parameter_groups(create_model(preset("tiny")), 1e-3)) == 1  # the paper's: one rate for all
    assert len(parameter_groups(create_model(preset("gap-cnn-tiny", decoder_lr_scale=5.0)), 1e-3)) == 1
    with pytest.raises(CapsNetError, match="decoder_lr_scale must be > 0"):
        preset("tiny", decoder_lr_scale=0.0)
