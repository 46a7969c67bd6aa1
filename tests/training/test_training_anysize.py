"""Models that take any image size (`--arch shared-capsnet`, `gap-cnn`): the article's sizes, the valid input sizes
(exact at their edges), per-sample results at several sizes, a graph traced with free H and W, and training on
data of another size."""

from __future__ import annotations

import json
import os

import numpy as np
import pytest
import torch

from capsnet.errors import CapsNetError
from capsnet.models.any_size import GapCnn, SharedCapsNet
from capsnet.models.checkpoint import create_model, load_checkpoint
from capsnet.models.config import ANY_SIZE_ARCHITECTURES, PRESETS, CapsNetConfig, InputSizes, preset
from capsnet.training.data import load_embedded, to_float
from capsnet.models.capsnet import count_parameters

SIZES = [(14, 14), (28, 28), (28, 56), (56, 28), (40, 100), (31, 17)]


def test_presets_are_the_articles_models():
    capsules, cnn = preset("shared"), preset("gap-cnn")
    # 3×3 convolutions 1→64→64, pool, 64→128→128: 258,624 weights (+ 384 biases in the article's), a shared
    # 128 × 10·16 transformation; dense 128 then 10
    assert count_parameters(SharedCapsNet(capsules)) == 258_624 + 128 * 160 == 279_104
    assert count_parameters(GapCnn(cnn)) == 258_624 + 128 * 128 + 128 + 128 * 10 + 10 == 276_426
    assert count_parameters(SharedCapsNet(preset("shared-article"))) == 279_104 + 384
    assert count_parameters(GapCnn(preset("gap-cnn-article"))) == 276_426 + 384
    for name in ("shared", "gap-cnn", "shared-article", "gap-cnn-article"):
        config = preset(name)
        assert config.backbone_stages == ((64, 64), (128, 128)) and config.backbone_kernel == 3
        assert config.backbone_bias == name.endswith("-article")
        margin_loss = (config.m_plus, config.m_minus, config.lambda_absent)
        assert margin_loss == (0.9, 0.1, 0.25) and config.reconstruction_weight == 0
        if config.arch == "shared-capsnet":
            assert (config.routing, config.routing_iterations, config.squash_constant) == ("su", 3, 0.5)
            assert (config.num_classes, config.digit_caps_dim) == (10, 16)
    # 28 → 26 → 24 → pool 12 → 10 → 8: 64 input capsules of 128 values for a digit, 8 × 22 for a pair side by side
    assert capsules.backbone_grid(28, 28) == (8, 8) and capsules.backbone_grid(28, 56) == (8, 22)
    with torch.no_grad():
        coupling = SharedCapsNet(capsules).eval()(torch.rand(1, 1, 28, 56)).coupling
    assert coupling.shape == (1, 8 * 22, 10)


@pytest.mark.parametrize("name", ["shared-tiny", "shared-article"])
def test_without_biases_blank_canvas_casts_no_votes(name):
    """Without biases a blank region has zero features: once the ink is a receptive field (14 pixels) away from
    the added blank, at an offset the pool keeps aligned (even), a larger canvas gives the same lengths exactly."""
    torch.manual_seed(0)
    model = SharedCapsNet(preset(name)).eval()
    for layer in model.backbone.modules():
        if isinstance(layer, torch.nn.Conv2d) and layer.bias is not None:
            torch.nn.init.uniform_(layer.bias, 0.0, 0.1)  # biases start at 0: as training leaves them instead
    digit = to_float(load_embedded().test.images[:4])  # (4, 1, 28, 28)
    framed = torch.nn.functional.pad(digit, (16, 16, 16, 16))  # (4, 1, 60, 60): a 16-pixel blank frame
    larger = torch.nn.functional.pad(digit, (16, 60, 16, 30))  # (4, 1, 74, 104): the same, more blank right, below
    with torch.no_grad():
        alone, framed, larger = (model(images).probabilities for images in (digit, framed, larger))
    if preset(name).backbone_bias:
        assert (framed - larger).abs().max() > 1e-4  # the article's biases: every blank position votes
    else:
        torch.testing.assert_close(larger, framed, rtol=0, atol=1e-6)
        assert (alone - framed).abs().max() > 0  # a frame within reach of the ink does change the positions


def smallest_size_by_trial(config: CapsNetConfig) -> int:
    """The least square size whose backbone output has one position, found by running the bare backbone."""
    backbone = create_model(config).backbone
    for size in range(1, 200):
        try:
            features = backbone(torch.zeros(1, config.in_channels, size, size))
        except RuntimeError:  # a convolution's kernel larger than its input
            continue
        if features.shape[-1] >= 1:
            return size
    raise AssertionError("no size up to 200 worked")


@pytest.mark.parametrize("stages, kernel, pool, smallest", [
    (((64, 64), (128, 128)), 3, 2, 14),  # the article's: (1 + 4) · 2 + 4
    (((4,), (4,), (4, 4)), 5, 3, ((1 + 8) * 3 + 4) * 3 + 4),  # three stages, a larger kernel and pool: 97
    (((4, 4, 4),), 3, 2, 7),  # one stage: no pool
])
def test_smallest_valid_size_is_exact(stages, kernel, pool, smallest):
    config = preset("shared-tiny", backbone_stages=stages, backbone_kernel=kernel, backbone_pool=pool, height=120,
                    width=120)
    sizes = config.input_sizes
    assert (sizes.min_height, sizes.min_width) == (smallest, smallest) == (smallest_size_by_trial(config),) * 2


@pytest.mark.parametrize("name", ["shared-tiny", "gap-cnn-tiny"])
def test_every_size_from_the_smallest_up_works_and_one_below_is_refused(name):
    config = preset(name)
    sizes = config.input_sizes
    assert sizes == InputSizes(channels=1, min_height=14, min_width=14, max_height=256, max_width=256)
    model = create_model(config).eval()
    with torch.no_grad():
        for height in range(14, 34):  # no stride or divisibility constraint: odd sizes too
            for width in (14, 15, 29):
                output = model(torch.rand(1, 1, height, width))
                assert output.probabilities.shape == (1, 10) and torch.isfinite(output.probabilities).all()
                if name == "shared-tiny":
                    grid_h, grid_w = config.backbone_grid(height, width)
                    assert output.coupling.shape == (1, grid_h * grid_w, 10)
        assert model(torch.rand(1, 1, 256, 256)).probabilities.shape == (1, 10)
        message = "takes 1-channel images of 14x14 to 256x256 (height x width, any in between); got 1x13x28"
        with pytest.raises(CapsNetError, match=message.replace("(", r"\(").replace(")", r"\)")):
            model(torch.rand(1, 1, 13, 28))
        for shape in ((1, 28, 13), (1, 257, 28), (1, 28, 257), (3, 28, 28)):
            with pytest.raises(CapsNetError, match=f"got {'x'.join(map(str, shape))}"):
                model(torch.rand(1, *shape))


def test_fixed_size_models_take_their_own_size_only():
    for name in ("paper", "tiny", "em"):
        sizes = preset(name).input_sizes
        assert sizes == InputSizes(1, 28, 28, 28, 28) and sizes.fixed and sizes.describe() == "1x28x28"
        assert (1, 28, 28) in sizes and (1, 28, 29) not in sizes
    colour = preset("tiny", in_channels=3, height=32, width=32).input_sizes
    assert colour.describe() == "3x32x32" and (3, 32, 32) in colour and (1, 32, 32) not in colour
    assert sorted(name for name, config in PRESETS.items() if config.arch in ANY_SIZE_ARCHITECTURES) == [
        "gap-cnn", "gap-cnn-article", "gap-cnn-tiny", "shared", "shared-article", "shared-tiny"]


@pytest.mark.parametrize("changes, message", [
    ({"height": 13}, "config: a shared-capsnet model takes 1-channel images of 14x14 to 256x256"),
    ({"max_width": 13}, "the largest input 256x13 is below the smallest the backbone takes, 14x14"),
    ({"reconstruction_weight": 0.1}, "a shared-capsnet model has no decoder"),
    ({"backbone_stages": ((8,), ())}, "backbone_stages must be stages of positive channel counts"),
    ({"backbone_pool": 0}, "backbone_pool must be a positive integer"),
])
def test_bad_any_size_configs(changes, message):
    with pytest.raises(CapsNetError, match=message.replace("(", r"\(")):
        preset("shared-tiny", **changes)


@pytest.mark.parametrize("fixture, name", [("trained_shared_tiny_checkpoint", "shared-tiny"),
                                           ("trained_gap_cnn_tiny_checkpoint", "gap-cnn-tiny")])
def test_each_image_alone_equals_the_same_image_in_a_batch_at_every_size(fixture, name, request):
    checkpoint = load_checkpoint(request.getfixturevalue(fixture))
    model = checkpoint.build_model()
    assert checkpoint.config == PRESETS[name]  # the nested backbone_stages come back as tuples
    assert checkpoint.metrics["test_accuracy"] > 0.3  # trained: its answers depend on the image
    digits = to_float(load_embedded().test.images[::100])  # (10, 1, 28, 28): one of each class
    with torch.no_grad():
        for height, width in SIZES:
            # digits scaled onto each canvas, so the batch holds different, real content
            images = torch.nn.functional.interpolate(digits[:5], size=(height, width), mode="bilinear")  # (5, 1, H, W)
            batched = model(images)
            for index in (0, 3):
                alone = model(images[index : index + 1])
                for name, value in alone._asdict().items():
                    torch.testing.assert_close(value[0], getattr(batched, name)[index], rtol=0, atol=1e-5,
                                               msg=f"{name} at {height}x{width}")


@pytest.mark.parametrize("fixture", ["trained_shared_tiny_checkpoint", "trained_gap_cnn_tiny_checkpoint"])
def test_an_onnx_graph_traced_with_free_height_and_width_answers_every_size(fixture, request, tmp_path):
    """The dynamo ONNX exporter keeps H and W symbolic over the config's valid range: no size is baked in, no
    control flow, and the size check leaves nothing behind that refuses a valid size."""
    import onnx
    import onnxruntime

    model = load_checkpoint(request.getfixturevalue(fixture)).build_model()
    sizes = model.config.input_sizes
    dims = {0: torch.export.Dim("batch"), 2: torch.export.Dim("height", min=sizes.min_height, max=sizes.max_height),
            3: torch.export.Dim("width", min=sizes.min_width, max=sizes.max_width)}

    class Lengths(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.model = model

        def forward(self, images):
            return self.model(images).probabilities

    path = tmp_path / "model.onnx"
    torch.onnx.export(Lengths().eval(), (torch.rand(2, 1, 28, 28),), str(path), input_names=["images"],
                      dynamic_shapes={"images": dims}, dynamo=True, external_data=False, verbose=False)
    graph = onnx.load(str(path)).graph
    assert not {"Loop", "If", "Scan"} & {node.op_type for node in graph.node}
    assert [dim.dim_param or dim.dim_value for dim in graph.input[0].type.tensor_type.shape.dim][1] == 1
    session = onnxruntime.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    with torch.no_grad():
        for height, width in [*SIZES, (sizes.max_height, sizes.max_width)]:
            images = torch.rand(3, 1, height, width)
            answered = session.run(None, {"images": images.numpy()})[0]  # (3, J)
            np.testing.assert_allclose(answered, model(images).probabilities.numpy(), rtol=1e-4, atol=1e-5,
                                       err_msg=f"{height}x{width}")


def test_trains_on_images_of_another_size_and_scores_any_it_takes(idx_dataset, tmp_path, trained_shared_tiny_checkpoint,
                                                                 capsys):
    from capsnet.cli import main

    rng = np.random.default_rng(0)
    images = rng.integers(0, 256, size=(60, 20, 24), dtype=np.uint8)
    labels = np.arange(60) % 10
    data = idx_dataset(images[:40], labels[:40], images[40:], labels[40:], name="digits-20x24")
    out = tmp_path / "small.ckpt"
    assert main(["train", "--data", str(data), "--preset", "shared-tiny", "--epochs", "1", "--val-fraction", "0",
                 "--out", str(out), "--no-progress"]) == 0
    config = load_checkpoint(out).config
    assert (config.height, config.width, config.input_sizes.min_height) == (20, 24, 14)
    # the model trained on 28x28 digits scores 20x24 images: a size it takes, not its own
    capsys.readouterr()
    assert main(["eval", str(trained_shared_tiny_checkpoint), "--data", str(data), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["images"] == 20


def test_full_mnist_folder_loads_with_its_validation_split():
    from pathlib import Path

    from capsnet.training.data import load_dataset

    folder = Path(os.environ.get("CAPSNET_MNIST_DIR", ""))
    if not os.environ.get("CAPSNET_MNIST_DIR") or not folder.is_dir():
        pytest.skip("CAPSNET_MNIST_DIR does not name a folder of the full MNIST IDX files")
    dataset = load_dataset(str(folder), 0.1)
    assert dataset.image_shape == (1, 28, 28) and len(dataset.class_names) == 10
    assert (len(dataset.train), len(dataset.validation), len(dataset.test)) == (54_001, 5_999, 10_000)
    assert np.bincount(dataset.validation.labels).min() >= 0.1 * np.bincount(dataset.train.labels).min()

