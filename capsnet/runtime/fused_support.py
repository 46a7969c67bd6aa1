"""Which models the fused routing kernels (fused_routing.py) run, without importing triton: export names the
engine in model.json and measures its precision gate on machines where triton is not installed.
"""

from __future__ import annotations

from capsnet.models.config import CapsNetConfig

# tl.dot takes operands of at least 16 along every dimension: the 8 components of a primary capsule are padded
# with zeros to 16, and so are the samples of a block
MIN_DOT = 16
MAX_OUTPUTS = 1024  # J·D after padding each to a power of two: one program holds (BB, J·D) fp32 sums in registers


def fused_unsupported_reason(config: CapsNetConfig) -> str | None:
    """None where the fused kernels run this model's routing; else why its routing stays unfused."""
    if config.arch != "capsnet":
        return f"arch {config.arch} has no dynamic routing over a fixed grid of primary capsules"
    outputs = next_power_of_2(config.num_classes) * next_power_of_2(config.digit_caps_dim)
    if outputs > MAX_OUTPUTS:
        return (f"{config.num_classes} classes × {config.digit_caps_dim} dimensions pad to {outputs} sums per sample, "
                f"more than the {MAX_OUTPUTS} a program holds")
    if config.digit_caps_dim != next_power_of_2(config.digit_caps_dim):
        return f"pose vectors of {config.digit_caps_dim} dimensions (the kernels take a power of two)"
    if config.primary_caps_dim > MIN_DOT:
        return f"primary capsules of {config.primary_caps_dim} dimensions (at most {MIN_DOT})"
    return None


def next_power_of_2(n: int) -> int:
    return 1 << (n - 1).bit_length()


def gpu_engine(config: CapsNetConfig) -> str:
    """model.json's routing.gpu_engine: "fused", or "unfused: <why>" (the torch backend's graph serves it)."""
    reason = fused_unsupported_reason(config)
    return "fused" if reason is None else f"unfused: {reason}"
