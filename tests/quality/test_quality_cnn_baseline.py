"""The CNN baseline (`--arch cnn-baseline`): its size against the paper CapsNet's, a training step, and
that train/eval/checkpoints/visualize take it like a CapsNet."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from PIL import Image

from capsnet.cli import main
from capsnet.training import visualize
from capsnet.models.checkpoint import load_checkpoint
from capsnet.training.checkpoint import save_checkpoint
from capsnet.models.cnn_baseline import CnnBaseline
from capsnet.models.config import preset
from capsnet.training.data import Dataset, Split, load_embedded, to_float, with_validation
from capsnet.training.loss import capsnet_loss
from capsnet.models.capsnet import CapsNet, count_parameters

CONFIG = preset("paper", arch="cnn-baseline", reconstruction_weight=0.0)


def small_embedded(spec: str = "embedded", validation_fraction: float = 0.0) -> Dataset:
    """256 training and 63 test digits of every class: a CNN epoch in a second (load_dataset's signature)."""
    full = load_embedded()
    return with_validation(Dataset(full.name, Split(full.train.images[:256], full.train.labels[:256]),
                                   Split(full.test.images[::16], full.test.labels[::16]), full.class_names),
                           validation_fraction)


@pytest.fixture(scope="module")
def cnn_checkpoint(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("cnn") / "cnn.ckpt"
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr("capsnet.training.train.load_dataset", small_embedded)
        code = main(["train", "--arch", "cnn-baseline", "--epochs", "1", "--batch-size", "64",
                     "--out", str(path), "--no-progress"])
    assert code == 0
    return path


def test_parameter_count_is_within_30_percent_of_the_paper_capsnet():
    capsnet = count_parameters(CapsNet(preset("paper")))
    baseline = count_parameters(CnnBaseline(CONFIG))
    assert abs(baseline - capsnet) <= 0.3 * capsnet, (baseline, capsnet)


def test_outputs_have_the_capsnet_fields():
    output = CnnBaseline(CONFIG).eval()(torch.rand(3, 1, 28, 28))
    assert output.probabilities.shape == (3, 10)
    assert ((output.probabilities > 0) & (output.probabilities < 1)).all()
    assert output.poses.shape == (3, 10, 0) and output.coupling.shape == (3, 0, 10)
    assert output.reconstruction.shape == (3, 784) and not output.reconstruction.any()


def test_one_step_of_the_margin_loss_lowers_it():
    torch.manual_seed(0)
    train = load_embedded().train
    images, labels = to_float(train.images[:64]), torch.as_tensor(train.labels[:64])  # (64, 1, 28, 28), (64,)
    model = CnnBaseline(CONFIG)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)

    def loss() -> float:
        with torch.no_grad():
            return capsnet_loss(model.eval()(images), images, labels, CONFIG).total.item()

    before = loss()
    model.train()
    step = capsnet_loss(model(images, labels), images, labels, CONFIG)
    assert step.total.item() == pytest.approx(step.margin.mean().item())  # margin loss only
    optimizer.zero_grad()
    step.total.backward()
    optimizer.step()
    assert loss() < before


def test_train_records_the_architecture_and_eval_takes_it(cnn_checkpoint, monkeypatch, capsys):
    checkpoint = load_checkpoint(cnn_checkpoint)
    assert checkpoint.config.arch == "cnn-baseline" and checkpoint.config.reconstruction_weight == 0.0
    assert isinstance(checkpoint.build_model(), CnnBaseline)
    assert checkpoint.metrics["parameters"] == count_parameters(CnnBaseline(CONFIG))
    monkeypatch.setattr("capsnet.training.evaluate.load_dataset", small_embedded)
    capsys.readouterr()
    assert main(["eval", str(cnn_checkpoint)]) == 0
    correct = round(checkpoint.metrics["test_accuracy"] * 63)
    assert f"({correct}/63)" in capsys.readouterr().out


def test_resume_refuses_another_architecture(cnn_checkpoint, monkeypatch, capsys):
    monkeypatch.setattr("capsnet.training.train.load_dataset", small_embedded)
    last = cnn_checkpoint.with_name("cnn.last.ckpt")
    code = main(["train", "--arch", "capsnet", "--epochs", "2", "--out", str(cnn_checkpoint), "--resume", str(last)])
    assert code == 2 and "arch='capsnet' (checkpoint: 'cnn-baseline')" in capsys.readouterr().err


def test_a_checkpoint_without_the_field_loads_as_capsnet(random_tiny_checkpoint, tmp_path):
    payload = torch.load(random_tiny_checkpoint, weights_only=True)
    del payload["config"]["arch"]
    old = tmp_path / "old.ckpt"
    torch.save(payload, old)
    checkpoint = load_checkpoint(old)
    assert checkpoint.config.arch == "capsnet" and isinstance(checkpoint.build_model(), CapsNet)
    save_checkpoint(checkpoint, tmp_path / "again.ckpt")
    assert load_checkpoint(tmp_path / "again.ckpt").config.arch == "capsnet"


def test_visualize_draws_what_a_cnn_has(cnn_checkpoint, tmp_path, run_command):
    assert run_command(visualize, "visualize", str(cnn_checkpoint), "--out", str(tmp_path), "--images", "64") == 0
    assert sorted(p.name for p in tmp_path.iterdir()) == ["confusion.png", "training-curves.png"]
    for path in tmp_path.iterdir():
        with Image.open(path) as image:
            assert image.format == "PNG"
