"""The image sizes a model takes (model.json's `input.sizes`)."""

from __future__ import annotations

from dataclasses import dataclass

from capsnet.errors import CapsNetError


@dataclass(frozen=True)
class InputSizes:
    """The images a model takes: `channels` channels, a height from min_height to max_height and a width from
    min_width to max_width, each a multiple of `multiple_of` (1 for the models here: their pooling floors an odd
    size, so every whole number in between is valid). A fixed-size model has min = max. model.json records it
    as `input.sizes`; export traces the graph over it and serving refuses any other size naming it."""

    channels: int
    min_height: int
    min_width: int
    max_height: int
    max_width: int
    multiple_of: int = 1

    @classmethod
    def fixed_at(cls, shape: tuple[int, int, int]) -> "InputSizes":
        channels, height, width = shape
        return cls(channels, height, width, height, width)

    @property
    def fixed(self) -> bool:
        return (self.min_height, self.min_width) == (self.max_height, self.max_width)

    @property
    def largest(self) -> tuple[int, int, int]:
        """(C, H, W) of the largest image taken: what message and memory limits are sized for."""
        return self.channels, self.max_height, self.max_width

    def dims(self, shape: tuple[int, int, int]) -> list[int]:
        """`shape` (C, H, W) with -1 for a height or width left free, as Triton's config and KServe's metadata
        give a dimension of any size."""
        channels, height, width = shape
        return [channels, height if self.min_height == self.max_height else -1,
                width if self.min_width == self.max_width else -1]

    def __contains__(self, shape: tuple[int, ...]) -> bool:
        """(C, H, W) in sizes."""
        channels, height, width = shape
        try:
            self.check(channels, height, width)
        except CapsNetError:
            return False
        return True

    def describe(self) -> str:
        """'1x28x28', or '1-channel images of 14x14 to 256x256 (height x width, any in between)'."""
        if self.fixed:
            return f"{self.channels}x{self.min_height}x{self.min_width}"
        step = "any in between" if self.multiple_of == 1 else f"multiples of {self.multiple_of}"
        return (f"{self.channels}-channel images of {self.min_height}x{self.min_width} to {self.max_height}x"
                f"{self.max_width} (height x width, {step})")

    def check(self, channels: int, height: int, width: int, what: str = "the model") -> None:
        """A one-line CapsNetError naming the valid sizes, for an image `what` cannot take. Comparisons only, so a
        traced forward pass with symbolic H and W turns them into guards its dimension ranges already decide."""
        # the step is tested only where there is one, so that a traced pass meets no modulo of H and W
        if not (channels == self.channels and self.min_height <= height <= self.max_height
                and self.min_width <= width <= self.max_width) or (
                self.multiple_of != 1 and (height % self.multiple_of or width % self.multiple_of)):
            raise CapsNetError(f"{what} takes {self.describe()}; got {channels}x{height}x{width}")

    def to_dict(self) -> dict[str, int]:
        return {name: getattr(self, name) for name in INPUT_SIZE_KEYS}


INPUT_SIZE_KEYS = ("channels", "min_height", "min_width", "max_height", "max_width", "multiple_of")
