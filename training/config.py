"""Every size of the model in one dataclass, with the paper's architecture as a preset."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from capsnet.errors import CapsNetError

ROUTING_VARIANTS = ("sabour", "leaky", "su")
ARCHITECTURES = ("capsnet", "cnn-baseline")  # cnn-baseline: training/cnn_baseline.py


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
    # margin loss
    m_plus: float = 0.9
    m_minus: float = 0.1
    lambda_absent: float = 0.5

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
        if self.squash_constant <= 0:
            raise CapsNetError(f"config: squash_constant must be > 0, got {self.squash_constant}")
        for name in ("input_mean", "input_std"):
            if len(getattr(self, name)) not in (1, self.in_channels):
                raise CapsNetError(f"config: {name} needs 1 or {self.in_channels} values")
        if any(s <= 0 for s in self.input_std):
            raise CapsNetError("config: input_std values must be > 0")
        if self.primary_grid[0] < 1 or self.primary_grid[1] < 1:
            raise CapsNetError(
                f"config: a {self.in_channels}x{self.height}x{self.width} input is too small for "
                f"{self.conv1_kernel}x{self.conv1_kernel} then {self.primary_caps_kernel}x{self.primary_caps_kernel} convolutions"
            )

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

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, values: dict) -> "CapsNetConfig":
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(values) - known)
        if unknown:
            raise CapsNetError(f"config: unknown fields {', '.join(unknown)}")
        tuple_fields = {"input_mean", "input_std", "decoder_hidden"}
        return cls(**{k: tuple(v) if k in tuple_fields else v for k, v in values.items()})

    def replace(self, **changes) -> "CapsNetConfig":
        return dataclasses.replace(self, **changes)


PRESETS: dict[str, CapsNetConfig] = {
    # Sabour et al. 2017: 8.2M parameters with the decoder.
    "paper": CapsNetConfig(),
    # Same structure, small enough that tests train in seconds.
    "tiny": CapsNetConfig(
        conv1_channels=16,
        primary_caps_channels=4,
        primary_caps_dim=4,
        primary_caps_stride=3,
        decoder_hidden=(64, 128),
    ),
}


def preset(name: str, **overrides) -> CapsNetConfig:
    """The named preset, with `overrides` (e.g. in_channels/height/width from the data) applied."""
    try:
        base = PRESETS[name]
    except KeyError:
        raise CapsNetError(f"unknown preset {name!r}; choose one of {', '.join(PRESETS)}") from None
    return base.replace(**overrides) if overrides else base
