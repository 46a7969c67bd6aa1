"""Model structure: the paper's size, per-sample routing (batch invariance), and non-MNIST input shapes."""

from __future__ import annotations

import numpy as np
import torch

from capsnet.cli import main
from capsnet.models.checkpoint import load_checkpoint
from capsnet.models.config import preset
from capsnet.training.data import load_embedded, to_float
from capsnet.models.capsnet import CapsNet, count_parameters


def test_paper_preset_has_the_papers_size():
    config = preset("paper")
    assert config.primary_grid == (6, 6) and config.num_primary_caps == 1152
    model = CapsNet(config)
    # Conv1 20,992 + PrimaryCaps 5,308,672 + W_ij 1,474,560 + decoder 1,411,344
    assert count_parameters(model) == 8_215_568
    assert model.digit_caps.weight.shape == (1152, 8, 10 * 16)


def test_an_image_alone_equals_the_same_image_in_a_mixed_batch(trained_tiny_checkpoint):
    model = load_checkpoint(trained_tiny_checkpoint).build_model()
    test = load_embedded().test
    # 64 images of every class, interleaved, so no batch is homogeneous
    order = np.argsort(np.arange(len(test)) % 100, kind="stable")[:64]
    images = to_float(test.images[order])  # (64, 1, 28, 28)
    assert len(set(test.labels[order].tolist())) == 10
    with torch.no_grad():
        batched = model(images)
        assert batched.probabilities.max() > 0.5, "the model must be decisive for this test to mean something"
        for index in (0, 1, 31, 63):
            alone = model(images[index : index + 1])
            for name, value in alone._asdict().items():
                torch.testing.assert_close(value[0], getattr(batched, name)[index], rtol=0, atol=1e-5, msg=name)


def test_colour_32x32_input_and_model_flags(random_colour_dataset, tmp_path):
    out = tmp_path / "colour.ckpt"
    code = main(["train", "--data", str(random_colour_dataset), "--preset", "tiny", "--epochs", "1",
                 "--batch-size", "32", "--normalize", "--routing", "su", "--routing-iterations", "2",
                 "--squash-constant", "0.5", "--detach-agreement", "--out", str(out), "--no-progress"])
    assert code == 0
    checkpoint = load_checkpoint(out)
    config = checkpoint.config
    assert (config.in_channels, config.height, config.width) == (3, 32, 32)
    routing = (config.routing, config.routing_iterations, config.squash_constant, config.detach_agreement)
    assert routing == ("su", 2, 0.5, True)
    assert len(config.input_mean) == 3 and all(0.4 < m < 0.6 for m in config.input_mean)  # uniform noise
    torch.manual_seed(0)  # the weights `capsnet train --seed 0` starts from
    initial = CapsNet(config).state_dict()
    assert any(not torch.equal(initial[name], value) for name, value in checkpoint.state_dict.items()), "no step taken"
    with torch.no_grad():
        output = checkpoint.build_model()(torch.rand(2, 3, 32, 32))
    assert output.probabilities.shape == (2, 10)
    assert output.poses.shape == (2, 10, 16)
    assert output.reconstruction.shape == (2, 3 * 32 * 32)
    assert output.coupling.shape == (2, config.num_primary_caps, 10)
    assert torch.isfinite(output.reconstruction).all()
