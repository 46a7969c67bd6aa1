"""The fused routing kernels against `capsnet.models.capsnet`'s own routing, in Triton's interpreter on the CPU
(on a GPU where there is one): every routing variant and squash constant, batches across several sample blocks,
capsule slices of every size, both memory layouts of the primary convolution's output, and the whole forward pass.
fp32 is held to 1e-4; fp16 and bf16 to the emulation that export's precision gate measures them by."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from capsnet.runtime.reduced_precision import convolutions_in, routing_inputs_in
from capsnet.model_description.precision_gate import GATE_DIFF_FACTOR, GATE_DIFF_SLACK
from capsnet.runtime.fused_support import fused_unsupported_reason, gpu_engine
from capsnet.models.config import preset
from capsnet.models.capsnet import CapsNet, squash

pytest.importorskip("triton", reason="triton is not installed (pip install triton, in the dev extra)")
from capsnet.runtime.fused_routing import DTYPES, FusedCapsNet, FusedDigitCaps, launch_plan

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
# the tiny preset's shape with 5 capsule channels: 80 primary capsules of 4 dimensions, 10 classes of 16
SMALL = dataclasses.replace(preset("tiny"), primary_caps_channels=5)


def small_model(seed: int = 0, **changes) -> CapsNet:
    torch.manual_seed(seed)
    model = CapsNet(dataclasses.replace(SMALL, **changes)).to(DEVICE).eval()
    with torch.no_grad():  # primary capsules and votes long enough that routing moves far from uniform coupling
        model.primary_caps.conv.weight.mul_(20.0)
        model.digit_caps.weight.normal_(0.0, 0.4)
    return model


def primary_output(model: CapsNet, batch: int, seed: int = 1) -> torch.Tensor:
    images = torch.rand((batch, 1, 28, 28), generator=torch.Generator().manual_seed(seed)).to(DEVICE)
    with torch.inference_mode():
        return model.primary_caps.conv(torch.relu(model.conv1(images)))  # (B, C·P, H, W)


def unfused(model: CapsNet, primary: torch.Tensor):
    """The model's own DigitCaps on the same primary output: poses (B, J, D) and their lengths (B, J)."""
    with torch.inference_mode():
        poses = model.digit_caps(squashed_primary(model, primary)).poses  # (B, J, D)
    return poses, torch.linalg.vector_norm(poses, dim=-1)


def assert_routes_as_the_model(fused: FusedDigitCaps, model: CapsNet, primary: torch.Tensor) -> torch.Tensor:
    """The fused poses and lengths within 1e-4 of the model's own routing; the model's lengths (B, J)."""
    poses, lengths = fused(primary)
    expected_poses, expected_lengths = unfused(model, primary)
    assert (poses - expected_poses).abs().max().item() <= 1e-4
    assert (lengths - expected_lengths).abs().max().item() <= 1e-4
    return expected_lengths


def squashed_primary(model: CapsNet, primary: torch.Tensor) -> torch.Tensor:
    """PrimaryCaps.forward after its convolution: the capsules (B, I, P), squashed."""
    batch, _, height, width = primary.shape
    cfg = model.config
    x = primary.view(batch, cfg.primary_caps_channels, cfg.primary_caps_dim, height, width)  # (B, C, P, H, W)
    u = x.permute(0, 1, 3, 4, 2).reshape(batch, -1, cfg.primary_caps_dim)  # (B, I, P)
    return squash(u, cfg.squash_constant)


@pytest.mark.parametrize(("routing", "constant", "iterations"), [
    ("sabour", 1.0, 3), ("sabour", 0.5, 1), ("leaky", 1.0, 3), ("su", 0.5, 3), ("su", 1.0, 2)])
def test_fp32_routing_matches_the_model_for_every_variant(routing, constant, iterations):
    model = small_model(routing=routing, squash_constant=constant, routing_iterations=iterations)
    primary = primary_output(model, 21)
    fused = FusedDigitCaps(model.config, model.digit_caps.weight, torch.float32, programs_wanted=6)
    assert fused.shift_free  # these weights bound the logits: the softmax without its shift is what is checked
    expected_lengths = assert_routes_as_the_model(fused, model, primary)
    assert expected_lengths.max() > 0.3  # far from zero: the comparison means something


@pytest.mark.parametrize("routing", ["sabour", "leaky"])
def test_votes_long_enough_to_leave_exp2s_range_route_with_the_shifted_softmax(routing):
    """Weights that bound no logit within exp2's headroom take the softmax shifted by its maximum, alike."""
    model = small_model(seed=8, routing=routing)
    with torch.no_grad():
        model.digit_caps.weight.mul_(8.0)
    primary = primary_output(model, 13)
    fused = FusedDigitCaps(model.config, model.digit_caps.weight, torch.float32, programs_wanted=6)
    assert not fused.shift_free
    assert_routes_as_the_model(fused, model, primary)


@pytest.mark.parametrize(("batch", "programs"), [(1, 1), (1, 200), (16, 3), (40, 7), (33, 80)])
def test_every_cut_of_the_batch_and_the_capsules_gives_the_same_routing(batch, programs):
    """Blocks of samples with a ragged last one, slices from one capsule to all of them: only sums' order moves."""
    model = small_model(seed=2)
    primary = primary_output(model, batch, seed=batch)
    plan = launch_plan(batch, SMALL.num_primary_caps, programs)
    assert plan.slices * plan.per_slice >= SMALL.num_primary_caps > (plan.slices - 1) * plan.per_slice
    poses, _ = FusedDigitCaps(model.config, model.digit_caps.weight, torch.float32, programs)(primary)
    assert (poses - unfused(model, primary)[0]).abs().max().item() <= 1e-4


def test_a_forward_pass_leaves_its_scratch_zeroed_for_the_next():
    """The sums each iteration adds into and the blocks' counters are zero again after a pass (each block's last
    program zeroes them), so a second pass on other images routes as a first one."""
    model = small_model(seed=7, routing="leaky")
    fused = FusedDigitCaps(model.config, model.digit_caps.weight, torch.float32, programs_wanted=5)
    fused(primary_output(model, 7, seed=8))
    sums, _, done, _ = fused.scratch[(7, DEVICE)]
    assert not sums.any() and not done.any()
    primary = primary_output(model, 7, seed=9)
    assert (fused(primary)[0] - unfused(model, primary)[0]).abs().max().item() <= 1e-4


def test_channels_last_and_contiguous_primary_outputs_route_alike():
    model = small_model(seed=3)
    primary = primary_output(model, 5)
    fused = FusedDigitCaps(model.config, model.digit_caps.weight, torch.float32, programs_wanted=4)
    nchw, _ = fused(primary.contiguous())
    nhwc, _ = fused(primary.contiguous(memory_format=torch.channels_last))
    assert torch.equal(nchw, nhwc)


def test_each_image_is_routed_on_its_own():
    """A sample's result does not depend on the others in its block (padding rows included)."""
    model = small_model(seed=4)
    primary = primary_output(model, 18)
    fused = FusedDigitCaps(model.config, model.digit_caps.weight, torch.float32, programs_wanted=5)
    together, _ = fused(primary)
    alone, _ = fused(primary[17:18])
    assert (together[17:18] - alone).abs().max().item() <= 1e-6


@pytest.mark.parametrize("precision", ["fp16", "bf16"])
@pytest.mark.parametrize("batch", [1, 130])  # one sample; three blocks of samples, the last ragged
def test_reduced_precision_routing_is_its_inputs_rounded_with_fp32_sums(precision, batch):
    """On the same primary output, the fp16/bf16 kernels compute the model's routing of inputs rounded to that
    precision, up to the order of the fp32 sums."""
    dtype = DTYPES[precision]
    model = small_model(seed=5)
    primary = primary_output(model, batch).to(dtype)
    poses, _ = FusedDigitCaps(model.config, model.digit_caps.weight, dtype, programs_wanted=4)(primary)
    routing_inputs_in(model, precision)
    expected, _ = unfused(model, primary.float())
    assert (poses - expected).abs().max().item() <= 1e-5 + 1e-3 * expected.abs().max().item()


@pytest.mark.parametrize("precision", ["fp16", "bf16"])
def test_reduced_precision_passes_the_gate_that_export_measures_by_emulation(precision):
    """The whole engine in fp16/bf16 against FP32 stays within the bound the server's self-check puts on it:
    GATE_DIFF_FACTOR × what export's emulation of the same rounding measured, + GATE_DIFF_SLACK."""
    model = small_model(seed=5)
    images = torch.rand((12, 1, 28, 28), generator=torch.Generator().manual_seed(5)).to(DEVICE)
    emulated = small_model(seed=5)
    convolutions_in(emulated, precision, emulate=True)
    routing_inputs_in(emulated, precision)
    engine = FusedCapsNet(small_model(seed=5), DTYPES[precision], reconstruction=False, programs_wanted=4)
    with torch.inference_mode():
        fp32 = model(images).probabilities
        measured = (emulated(images).probabilities - fp32).abs().max().item()
        served = (engine(images).probabilities - fp32).abs().max().item()
    assert 0 < measured and served <= GATE_DIFF_FACTOR * measured + GATE_DIFF_SLACK, (served, measured)


def test_the_whole_forward_pass_matches_the_model_in_fp32():
    model = small_model(seed=6)
    images = torch.rand((9, 1, 28, 28), generator=torch.Generator().manual_seed(6)).to(DEVICE)
    with torch.inference_mode():
        expected = model(images)
        got = FusedCapsNet(small_model(seed=6), torch.float32, reconstruction=True, programs_wanted=4)(images)
    for name in ("probabilities", "poses", "reconstruction"):
        assert (getattr(got, name) - getattr(expected, name)).abs().max().item() <= 1e-4, name


def test_models_outside_the_kernels_say_why():
    assert fused_unsupported_reason(SMALL) is None and gpu_engine(SMALL) == "fused"
    assert gpu_engine(preset("paper")) == "fused"
    assert gpu_engine(preset("em-tiny")).startswith("unfused: arch em ")
    assert gpu_engine(preset("shared-tiny")).startswith("unfused: arch shared-capsnet ")
    assert "pose vectors of 12 dimensions" in gpu_engine(dataclasses.replace(SMALL, digit_caps_dim=12))
    with pytest.raises(ValueError, match="cannot run this model: arch em"):
        FusedDigitCaps(preset("em-tiny"), torch.zeros(1), torch.float32, 4)
