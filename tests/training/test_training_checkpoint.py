"""Checkpoints: bit-identical round trip, the metadata training records, clear errors for bad files."""

from __future__ import annotations

import pytest
import torch

from capsnet.errors import CapsNetError
from capsnet.training.checkpoint import FORMAT_VERSION, load_checkpoint, save_checkpoint
from capsnet.training.data import load_embedded, to_float


def test_round_trip_is_bit_identical(trained_tiny_checkpoint, tmp_path):
    original = load_checkpoint(trained_tiny_checkpoint)
    copy_path = tmp_path / "copy.ckpt"
    save_checkpoint(original, copy_path)
    copy = load_checkpoint(copy_path)
    assert copy.config == original.config and copy.class_names == original.class_names
    assert copy.metrics == original.metrics and copy.history == original.history
    assert all(torch.equal(copy.state_dict[name], value) for name, value in original.state_dict.items())
    images = to_float(load_embedded().test.images[::50])  # (20, 1, 28, 28)
    with torch.no_grad():
        expected, actual = original.build_model()(images), copy.build_model()(images)
    for name, value in expected._asdict().items():
        assert torch.equal(value, getattr(actual, name)), name


def test_training_records_what_export_and_serving_need(trained_tiny_checkpoint):
    checkpoint = load_checkpoint(trained_tiny_checkpoint)
    assert checkpoint.class_names == [str(d) for d in range(10)]
    assert checkpoint.config.routing == "sabour" and checkpoint.config.routing_iterations == 3
    assert checkpoint.config.input_mean == (0.0,) and checkpoint.config.input_std == (1.0,)
    assert checkpoint.dataset == "embedded-mnist-5k"
    assert checkpoint.optimizer_state is not None and checkpoint.scheduler_state is not None
    metrics = checkpoint.metrics
    for key in ("test_accuracy", "test_loss", "train_loss", "train_accuracy", "train_images_per_second", "lr",
                "validation_fraction"):
        assert isinstance(metrics[key], float), key
    assert metrics["epoch"] == checkpoint.epoch
    assert metrics["parameters"] == sum(t.numel() for t in checkpoint.state_dict.values())
    assert set(metrics["test_per_class_accuracy"]) == set(checkpoint.class_names)
    # the fixture trains on every training digit (--val-fraction 0): no validation figures
    assert (metrics["train_images"], metrics["validation_images"], metrics["test_images"]) == (4000, 0, 1000)
    assert "validation_accuracy" not in metrics and "validation_per_class_accuracy" not in metrics
    assert [record["epoch"] for record in checkpoint.history] == list(range(1, checkpoint.epoch + 1))


def rewrite_payload(path, **changes):
    payload = torch.load(path, weights_only=True)
    payload.update(changes)
    torch.save(payload, path)


@pytest.mark.parametrize("damage, message", [
    (lambda p: p.write_bytes(p.read_bytes()[: len(p.read_bytes()) // 2]), "damaged or not a capsnet checkpoint"),
    (lambda p: p.write_bytes(b""), "damaged or not a capsnet checkpoint"),
    (lambda p: p.write_bytes(b"not a checkpoint at all\n" * 100), "damaged or not a capsnet checkpoint"),
    (lambda p: torch.save({"weights": torch.zeros(3)}, p), "is not a capsnet checkpoint"),
    (lambda p: rewrite_payload(p, format_version=FORMAT_VERSION + 1), f"format version {FORMAT_VERSION + 1}"),
    (lambda p: rewrite_payload(p, state_dict={}), "is damaged: Error"),
    (lambda p: rewrite_payload(p, class_names=["a", "b"]), "2 class names for 10 classes"),
])
def test_damaged_checkpoint_is_a_clear_error(random_tiny_checkpoint, copy_of, damage, message):
    path = copy_of(random_tiny_checkpoint)
    damage(path)
    with pytest.raises(CapsNetError, match=message):
        load_checkpoint(path)


def test_missing_checkpoint_is_a_clear_error(tmp_path):
    with pytest.raises(CapsNetError, match="does not exist"):
        load_checkpoint(tmp_path / "absent.ckpt")
    with pytest.raises(CapsNetError, match="is not a file"):
        load_checkpoint(tmp_path)
