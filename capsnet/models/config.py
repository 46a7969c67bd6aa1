"""Every size of the model in one dataclass, with the paper's architecture as a preset."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from capsnet.errors import CapsNetError
from capsnet.model_description.input_sizes import InputSizes

ROUTING_VARIANTS = ("sabour", "leaky", "su")
# em: capsnet/models/em.py; cnn-baseline: capsnet/models/cnn_baseline.py; shared-capsnet and gap-cnn:
# capsnet/models/any_size.py
ARCHITECTURES = ("capsnet", "em", "cnn-baseline", "shared-capsnet", "gap-cnn")
# Those with capsule poses, a decoder and a fixed capsule grid to export, serve and draw; the CNN baselines have
# no capsules, and shared-capsnet no decoder nor a fixed number of capsules.
CAPSULE_ARCHITECTURES = ("capsnet", "em")
# The CNN baselines: one sigmoid per class, and no poses, routing or decoder (their forward's are empty or zero)
CNN_ARCHITECTURES = ("cnn-baseline", "gap-cnn")
# Those whose input is any height and width within `input_sizes`: fully convolutional up to a layer whose weights
# do not depend on the number of positions.
ANY_SIZE_ARCHITECTURES = ("shared-capsnet", "gap-cnn")
EM_POSE_SIZE = 16  # EM capsules carry 4×4 pose matrices


@dataclass(frozen=True)
class CapsNetConfig:
    arch: str = "capsnet"  # checkpoints written before this field existed load as capsnet
    # input
    in_channels: int = 1
    height: int = 28
    width: int = 28
    num_classes: int = 10
    # per-channel normalisation applied inside the model, so exported graphs take [0, 1] images
    input_mean: tuple[float, ...] = (0.0,)
    input_std: tuple[float, ...] = (1.0,)
    # Conv1
    conv1_channels: int = 256
    conv1_kernel: int = 9
    # PrimaryCaps
    primary_caps_channels: int = 32
    primary_caps_dim: int = 8
    primary_caps_kernel: int = 9
    primary_caps_stride: int = 2
    # DigitCaps
    digit_caps_dim: int = 16
    routing_iterations: int = 3
    routing: str = "sabour"  # sabour: b += û·v (paper); leaky: extra zero logit; su: b = û·v
    squash_constant: float = 1.0  # 1 in the paper; 0.5 is a common variant
    detach_agreement: bool = False  # stop the gradient through the agreement update
    # reconstruction decoder
    decoder_hidden: tuple[int, ...] = (512, 1024)
    reconstruction_weight: float = 0.0005
    decoder_lr_scale: float = 1.0  # the decoder's learning rate over the rest's (training/optimizer.py)
    # margin loss
    m_plus: float = 0.9
    m_minus: float = 0.1
    lambda_absent: float = 0.5
    # EM routing (arch "em"): Conv1 is conv1_channels × conv1_kernel² with stride 2 and "same" padding, the
    # primary capsules have primary_caps_channels types, routing_iterations EM iterations per capsule layer.
    conv_caps_types: tuple[int, ...] = (16, 16)  # ConvCaps1 (3×3, stride 2) and ConvCaps2 (3×3, stride 1)
    em_inverse_temperature: float = 0.01  # the limit of λ's schedule over the EM iterations
    em_conv2_channels: int = 0  # > 0: a second ReLU convolution (3×3, "same") between Conv1 and PrimaryCaps
    em_conv3_channels: int = 0  # > 0: a third after it (3×3, "same"; batch-normalised with em_batch_norm)
    em_batch_norm: bool = False  # batch-normalise Conv1 (before its ReLU) and the primary poses
    # spread loss (arch "em"): the margin starts at spread_margin_start, grows by spread_margin_step per epoch
    spread_margin_start: float = 0.2
    spread_margin_step: float = 0.1
    spread_margin_end: float = 0.9
    # Any-size models (arch shared-capsnet, gap-cnn): stages of backbone_kernel² ReLU convolutions without padding,
    # the channels of each listed, with a backbone_pool² average pool between stages; height and width are then the
    # training images' size, and max_height × max_width the largest image taken (its activations' memory grows with
    # H·W, and serving sizes its message limits from it).
    backbone_stages: tuple[tuple[int, ...], ...] = ((64, 64), (128, 128))
    backbone_kernel: int = 3
    backbone_pool: int = 2
    # False: convolutions without biases, so a blank (zero) region has zero features and casts no votes, however
    # much of it the canvas has; True: as Keras builds them (the article's model)
    backbone_bias: bool = True
    max_height: int = 256
    max_width: int = 256
    gap_hidden: int = 128  # gap-cnn: the dense ReLU layer between the pooled features and the class sigmoids

    def __post_init__(self) -> None:
        positive = (
            "in_channels height width num_classes conv1_channels conv1_kernel primary_caps_channels "
            "primary_caps_dim primary_caps_kernel primary_caps_stride digit_caps_dim routing_iterations"
        ).split()
        for name in positive:
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise CapsNetError(f"config: {name} must be a positive integer, got {value!r}")
        if self.arch not in ARCHITECTURES:
            raise CapsNetError(f"config: arch must be one of {', '.join(ARCHITECTURES)}, got {self.arch!r}")
        if self.routing not in ROUTING_VARIANTS:
            raise CapsNetError(f"config: routing must be one of {', '.join(ROUTING_VARIANTS)}, got {self.routing!r}")
        if not self.decoder_lr_scale > 0:
            raise CapsNetError(f"config: decoder_lr_scale must be > 0, got {self.decoder_lr_scale}")
        if self.squash_constant <= 0:
            raise CapsNetError(f"config: squash_constant must be > 0, got {self.squash_constant}")
        for name in ("input_mean", "input_std"):
            if len(getattr(self, name)) not in (1, self.in_channels):
                raise CapsNetError(f"config: {name} needs 1 or {self.in_channels} values")
        if any(s <= 0 for s in self.input_std):
            raise CapsNetError("config: input_std values must be > 0")
        if self.arch == "em":
            self._check_em()
        elif self.arch in ANY_SIZE_ARCHITECTURES:
            self._check_any_size()
        elif self.primary_grid[0] < 1 or self.primary_grid[1] < 1:
            raise CapsNetError(
                f"config: a {self.in_channels}x{self.height}x{self.width} input is too small for "
                f"{self.conv1_kernel}x{self.conv1_kernel} then {self.primary_caps_kernel}x{self.primary_caps_kernel} "
                "convolutions"
            )

    def _check_em(self) -> None:
        if len(self.conv_caps_types) != 2 or any(not isinstance(n, int) or n < 1 for n in self.conv_caps_types):
            raise CapsNetError(f"config: conv_caps_types must be two positive integers, got {self.conv_caps_types!r}")
        if self.primary_caps_dim != EM_POSE_SIZE or self.digit_caps_dim != EM_POSE_SIZE:
            raise CapsNetError("config: EM capsules have 4x4 poses: primary_caps_dim and digit_caps_dim must be 16")
        for name in ("em_conv2_channels", "em_conv3_channels"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 0:
                raise CapsNetError(f"config: {name} must be an integer >= 0, got {value!r}")
        if self.em_conv3_channels and not self.em_conv2_channels:
            raise CapsNetError("config: em_conv3_channels needs em_conv2_channels > 0 "
                               "(the third convolution follows the second)")
        if not isinstance(self.em_batch_norm, bool):
            raise CapsNetError(f"config: em_batch_norm must be true or false, got {self.em_batch_norm!r}")
        if not self.em_inverse_temperature > 0:
            raise CapsNetError(f"config: em_inverse_temperature must be > 0, got {self.em_inverse_temperature}")
        if not 0 <= self.spread_margin_start <= self.spread_margin_end or self.spread_margin_step < 0:
            raise CapsNetError("config: the spread margin needs 0 <= start <= end and step >= 0")
        grid = self.em_grids[-1]
        if grid[0] < 1 or grid[1] < 1:
            raise CapsNetError(
                f"config: a {self.in_channels}x{self.height}x{self.width} input is too small for the EM model's "
                "convolutional capsule layers"
            )

    def _check_any_size(self) -> None:
        stages = self.backbone_stages
        if (not stages or any(not isinstance(stage, tuple) or not stage for stage in stages)
                or any(not isinstance(n, int) or n < 1 for stage in stages for n in stage)):
            raise CapsNetError(f"config: backbone_stages must be stages of positive channel counts, got {stages!r}")
        for name in ("backbone_kernel", "backbone_pool", "max_height", "max_width", "gap_hidden"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise CapsNetError(f"config: {name} must be a positive integer, got {value!r}")
        if not isinstance(self.backbone_bias, bool):
            raise CapsNetError(f"config: backbone_bias must be true or false, got {self.backbone_bias!r}")
        if self.reconstruction_weight != 0:
            raise CapsNetError(f"config: a {self.arch} model has no decoder; reconstruction_weight must be 0")
        sizes = self.input_sizes
        if sizes.min_height > sizes.max_height or sizes.min_width > sizes.max_width:
            raise CapsNetError(f"config: the largest input {sizes.max_height}x{sizes.max_width} is below the "
                               f"smallest the backbone takes, {sizes.min_height}x{sizes.min_width}")
        sizes.check(self.in_channels, self.height, self.width, what=f"config: a {self.arch} model")

    @property
    def input_sizes(self) -> InputSizes:
        """The image sizes the model takes, which export records and serving enforces. Any-size models: from the
        smallest image whose backbone output is one position to max_height × max_width; the others: their size."""
        if self.arch not in ANY_SIZE_ARCHITECTURES:
            return InputSizes(self.in_channels, self.height, self.width, self.height, self.width)
        smallest = 1  # one position out of the last stage
        for index, stage in reversed(list(enumerate(self.backbone_stages))):
            smallest += len(stage) * (self.backbone_kernel - 1)  # each unpadded convolution takes kernel − 1
            if index:
                smallest *= self.backbone_pool  # the pool floors: pool · n is the least size giving n
        return InputSizes(self.in_channels, smallest, smallest, self.max_height, self.max_width)

    def backbone_grid(self, height: int, width: int) -> tuple[int, int]:
        """Positions out of an any-size model's backbone for an H×W image (8×8 for 28×28 with the `shared` preset,
        8×22 for 28×56): its input capsules are their product."""

        def out(size: int) -> int:
            for index, stage in enumerate(self.backbone_stages):
                if index:
                    size //= self.backbone_pool
                size -= len(stage) * (self.backbone_kernel - 1)
            return size

        return out(height), out(width)

    @property
    def em_grids(self) -> tuple[tuple[int, int], ...]:
        """Spatial sizes after Conv1/PrimaryCaps, ConvCaps1 and ConvCaps2 of the EM model (14, 6, 4 for 28×28)."""

        def sizes(size: int) -> tuple[int, int, int]:
            primary = (size + 2 * (self.conv1_kernel // 2) - self.conv1_kernel) // 2 + 1  # stride 2, "same"
            first = (primary - 3) // 2 + 1
            return primary, first, first - 2

        rows, cols = sizes(self.height), sizes(self.width)
        return tuple(zip(rows, cols))

    def spread_margin(self, epoch: int | None) -> float:
        """The spread loss margin in (0-based) `epoch`; None: the final margin."""
        if epoch is None:
            return self.spread_margin_end
        return min(self.spread_margin_end, self.spread_margin_start + self.spread_margin_step * epoch)

    @property
    def primary_grid(self) -> tuple[int, int]:
        """Spatial size of the PrimaryCaps output (6×6 for 28×28 input)."""

        def out(size: int) -> int:
            after_conv1 = size - self.conv1_kernel + 1
            return (after_conv1 - self.primary_caps_kernel) // self.primary_caps_stride + 1

        return out(self.height), out(self.width)

    @property
    def num_primary_caps(self) -> int:
        """Number of input capsules to routing (1152 for the paper)."""
        grid_h, grid_w = self.primary_grid
        return self.primary_caps_channels * grid_h * grid_w

    @property
    def input_size(self) -> int:
        return self.in_channels * self.height * self.width

    @property
    def has_capsules(self) -> bool:
        """Class capsules with poses and routing, which export and serving then describe; not the CNN baselines."""
        return self.arch not in CNN_ARCHITECTURES

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, values: dict) -> "CapsNetConfig":
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(values) - known)
        if unknown:
            raise CapsNetError(f"config: unknown fields {', '.join(unknown)}")
        tuple_fields = {"input_mean", "input_std", "decoder_hidden", "conv_caps_types"}
        values = {k: tuple(v) if k in tuple_fields else v for k, v in values.items()}
        if isinstance(values.get("backbone_stages"), (list, tuple)):  # a checkpoint stores lists of lists
            values["backbone_stages"] = tuple(tuple(s) if isinstance(s, list) else s for s in values["backbone_stages"])
        return cls(**values)

    def replace(self, **changes) -> "CapsNetConfig":
        return dataclasses.replace(self, **changes)


PRESETS: dict[str, CapsNetConfig] = {
    # Sabour et al. 2017: 8.2M parameters with the decoder.
    "paper": CapsNetConfig(),
    # The paper's layers at half and a quarter of its Conv1 and PrimaryCaps channels: PrimaryCaps' convolution,
    # 95% of the paper's arithmetic, costs 4× and 16× less, so a CPU trains more epochs in the same time.
    "paper-half": CapsNetConfig(conv1_channels=128, primary_caps_channels=16),
    # The paper's model with a decoder that learns within a short CPU run: 10× the reconstruction weight and 5× the
    # decoder's learning rate (docs/experiments, "Poses that show").
    "paper-pose": CapsNetConfig(reconstruction_weight=0.005, decoder_lr_scale=5.0),
    "paper-quarter": CapsNetConfig(conv1_channels=64, primary_caps_channels=8),
    # Same structure, small enough that tests train in seconds.
    "tiny": CapsNetConfig(
        conv1_channels=16,
        primary_caps_channels=4,
        primary_caps_dim=4,
        primary_caps_stride=3,
        decoder_hidden=(64, 128),
    ),
    # Matrix capsules with EM routing, smaller than the paper's small model (A=64, B=8, C=D=16, 3 iterations):
    # A=32, B=8, C=D=8 and 2 iterations train faster per image than `paper` on a CPU and learned faster
    # (docs/experiments; 2 iterations also did best in public MNIST runs). The capsule layers are close to
    # linear in the primary poses, so two more ReLU convolutions give the features their nonlinearity, and
    # batch normalisation keeps the poses' scale (and with it σ and the cost) from following the front end.
    "em": CapsNetConfig(
        arch="em",
        conv1_channels=32,
        conv1_kernel=5,
        em_conv2_channels=128,
        em_conv3_channels=128,
        em_batch_norm=True,
        primary_caps_channels=8,
        primary_caps_dim=EM_POSE_SIZE,
        conv_caps_types=(8, 8),
        routing_iterations=2,
    ),
    "em-tiny": CapsNetConfig(
        arch="em",
        conv1_channels=16,
        conv1_kernel=5,
        em_conv2_channels=16,
        em_conv3_channels=16,
        em_batch_norm=True,
        primary_caps_channels=4,
        primary_caps_dim=EM_POSE_SIZE,
        conv_caps_types=(4, 4),
        routing_iterations=2,
        decoder_hidden=(64, 128),
    ),
    # Su Jianlin's any-size capsule model (kexue.fm, 2018; bojone/Capsule): 3×3 convolutions of 64 and 64 channels,
    # a 2×2 average pool, 128 and 128, each position's 128 features an input capsule, one capsule layer of 10×16
    # with its transformation shared across positions, routed 3 times with b = û·v recomputed each time (`su`)
    # and the squash |s|²/(0.5+|s|²); margin loss with λ = 0.25 and no decoder. Its convolutions have no biases:
    # with them (`shared-article`, 279,488 parameters) the blank background casts votes that add up with the
    # canvas, and a digit with a blank square beside it was read as another class (docs/experiments/pairs.md).
    # 279,104 parameters for 1 channel.
    "shared": CapsNetConfig(
        arch="shared-capsnet",
        backbone_bias=False,
        routing="su",
        squash_constant=0.5,
        reconstruction_weight=0.0,
        lambda_absent=0.25,
    ),
    # The same backbone with global average pooling, a dense ReLU layer of 128 and 10 sigmoids: the article's CNN
    # baseline, trained with the same margin loss. 276,426 parameters for 1 channel (276,810 with biases).
    "gap-cnn": CapsNetConfig(arch="gap-cnn", backbone_bias=False, reconstruction_weight=0.0, lambda_absent=0.25),
    # The article's two models as it built them, the backbone's convolutions with biases.
    "shared-article": CapsNetConfig(
        arch="shared-capsnet",
        routing="su",
        squash_constant=0.5,
        reconstruction_weight=0.0,
        lambda_absent=0.25,
    ),
    "gap-cnn-article": CapsNetConfig(arch="gap-cnn", reconstruction_weight=0.0, lambda_absent=0.25),
    # The same structures with 8, 8 and 16, 16 channels, small enough that tests train them in seconds.
    "shared-tiny": CapsNetConfig(
        arch="shared-capsnet",
        backbone_stages=((8, 8), (16, 16)),
        backbone_bias=False,
        routing="su",
        squash_constant=0.5,
        reconstruction_weight=0.0,
        lambda_absent=0.25,
    ),
    "gap-cnn-tiny": CapsNetConfig(
        arch="gap-cnn",
        backbone_stages=((8, 8), (16, 16)),
        backbone_bias=False,
        gap_hidden=16,
        reconstruction_weight=0.0,
        lambda_absent=0.25,
    ),
}


def preset(name: str, **overrides) -> CapsNetConfig:
    """The named preset, with `overrides` (e.g. in_channels/height/width from the data) applied."""
    try:
        base = PRESETS[name]
    except KeyError:
        raise CapsNetError(f"unknown preset {name!r}; choose one of {', '.join(PRESETS)}") from None
    return base.replace(**overrides) if overrides else base
