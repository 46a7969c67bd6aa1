"""A plain CNN baseline of the `paper` CapsNet's size, trained the same way (`capsnet train --arch cnn-baseline`).

Two 5×5 convolutions with 2×2 max pooling, a wide hidden layer with dropout (as in Sabour et al.'s
baseline), one output per class: 8,248,842 parameters for 1×28×28 digits against the CapsNet's 8,215,568,
at about a quarter of its compute. It has one size: a preset only sets its input shape and loss constants.

Its sigmoid outputs stand in for capsule lengths, so the margin loss, `train`, `eval` and the robustness
tests take it unchanged. It has no poses, routing or decoder: those outputs are empty or zero, and
`capsnet train` sets its reconstruction weight to 0.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from capsnet.models.config import CapsNetConfig
from capsnet.models.capsnet import CapsNetOutput, InputNormalisation

CONV_CHANNELS = (64, 128)
HIDDEN = 1280  # sized so the parameter count matches the paper CapsNet's


class CnnBaseline(nn.Module):
    def __init__(self, config: CapsNetConfig):
        super().__init__()
        self.config = config
        self.input_normalisation = InputNormalisation(config)
        first, second = CONV_CHANNELS
        self.features = nn.Sequential(
            nn.Conv2d(config.in_channels, first, kernel_size=5, padding=2), nn.ReLU(inplace=True), nn.MaxPool2d(2),
            nn.Conv2d(first, second, kernel_size=5, padding=2), nn.ReLU(inplace=True), nn.MaxPool2d(2),
        )
        flat = second * (config.height // 4) * (config.width // 4)
        self.classifier = nn.Sequential(
            nn.Linear(flat, HIDDEN), nn.ReLU(inplace=True), nn.Dropout(0.5), nn.Linear(HIDDEN, config.num_classes),
        )

    def forward(self, images: Tensor, target: Tensor | None = None) -> CapsNetOutput:
        """images (B, C, H, W) in [0, 1]; `target` is accepted for the CapsNet's signature and unused."""
        cfg = self.config
        batch = images.shape[0]
        features = self.features(self.input_normalisation(images))  # (B, 128, H/4, W/4)
        logits = self.classifier(features.flatten(1))  # (B, 128*H/4*W/4) -> (B, J)
        return CapsNetOutput(
            probabilities=torch.sigmoid(logits),  # (B, J) in [0, 1], like capsule lengths
            poses=logits.new_zeros(batch, cfg.num_classes, 0),  # (B, J, 0): no poses
            reconstruction=logits.new_zeros(batch, cfg.input_size),  # (B, C*H*W): no decoder
            coupling=logits.new_zeros(batch, 0, cfg.num_classes),  # (B, 0, J): no routing
        )
