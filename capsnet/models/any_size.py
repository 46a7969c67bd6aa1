"""Models that take any image size (Su Jianlin 2018, bojone/Capsule): a fully convolutional backbone, then

- `shared-capsnet`: every output position's feature vector is an input capsule, and one capsule layer maps it
  with a transformation shared across positions (W_j per class, not W_ij per input capsule), so the number of
  input capsules follows the image and routing sums over however many there are;
- `gap-cnn`: the CNN baseline of the same backbone, global average pooling, a dense ReLU layer and one
  sigmoid per class, trained with the same margin loss.

A class's score is its capsule's length (or sigmoid) on its own, not a softmax share, so two digits in one image
can both score high. The valid sizes are `config.input_sizes`: the forward pass refuses others in one line.
With `backbone_bias` off (the `shared` and `gap-cnn` presets) a blank region has zero features and casts no votes:
only positions that see ink vote, so blank canvas added a receptive field (14 pixels) away from the ink changes
nothing; with the article's biases every blank position votes, and the votes add up with the canvas.

Export-friendly with free H and W: every reshape takes its sizes from the config (classes, capsule size) or
from flatten/unflatten, never a Python int read off a tensor's spatial shape; routing is the same fixed number
of tensor ops as CapsNet's (`capsnet.route`); each image is computed on its own, so its output does not depend on
its batch.
torch.onnx.export(dynamo=True) traces it with symbolic H and W into one graph without Loop/If that answers every
valid size (tested down to the smallest). A bare torch.export keeps a guard that the number of input capsules is
not 1 (a reshape decides between a view and a copy on it), which the ONNX exporter's size-oblivious tracing does
not emit.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from capsnet.models.config import CapsNetConfig
from capsnet.models.capsnet import CapsNetOutput, InputNormalisation, RoutingResult, capsule_lengths, route


class Backbone(nn.Module):
    """Stages of unpadded ReLU convolutions with an average pool between stages: (B, C, H, W) -> (B, F, H', W')."""

    def __init__(self, config: CapsNetConfig):
        super().__init__()
        layers: list[nn.Module] = []
        channels = config.in_channels
        for index, stage in enumerate(config.backbone_stages):
            if index:
                # floors an odd size (drops the last row or column), so every size from the minimum up is valid
                layers.append(nn.AvgPool2d(config.backbone_pool))
            for width in stage:
                layers += [nn.Conv2d(channels, width, config.backbone_kernel, bias=config.backbone_bias),
                           nn.ReLU(inplace=True)]
                channels = width
        self.net = nn.Sequential(*layers)
        self.out_channels = channels

    def forward(self, images: Tensor) -> Tensor:
        return self.net(images)  # (B, 128, H', W')


def glorot_initialise(module: nn.Module) -> None:
    """Keras's defaults (Glorot-uniform weights, zero biases), which the article's models trained from."""
    for layer in module.modules():
        if isinstance(layer, (nn.Conv2d, nn.Linear)):
            nn.init.xavier_uniform_(layer.weight)
            if layer.bias is not None:
                nn.init.zeros_(layer.bias)


class SharedCapsules(nn.Module):
    """û_j|i = W_j · u_i with one P→J·D matrix for every input capsule i, then routing by agreement over them."""

    def __init__(self, config: CapsNetConfig, in_dim: int):
        super().__init__()
        self.config = config
        # Glorot-uniform over (P, J*D), as Keras initialises the article's shared capsule kernel
        weight = torch.empty(in_dim, config.num_classes * config.digit_caps_dim)  # (P, J*D)
        self.weight = nn.Parameter(nn.init.xavier_uniform_(weight))

    def forward(self, u: Tensor) -> RoutingResult:
        """u (B, I, P): the input capsules, any number of them."""
        cfg = self.config
        votes = (cfg.num_classes, cfg.digit_caps_dim)
        u_hat = torch.matmul(u, self.weight).unflatten(-1, votes)  # (B, I, P) @ (P, J*D) -> (B, I, J, D)
        u_hat = u_hat.transpose(1, 2)  # (B, J, I, D): class-major, as `route` takes it
        # Σ_i û_j|i = (Σ_i u_i) W_j: the uniform first iteration needs one small product, not a pass over û
        total = torch.matmul(u.sum(dim=1), self.weight).unflatten(-1, votes)  # (B, P) @ (P, J*D) -> (B, J, D)
        return route(u_hat, uniform_sum=total, iterations=cfg.routing_iterations, variant=cfg.routing,
                     squash_constant=cfg.squash_constant, detach_agreement=cfg.detach_agreement)


class AnySizeModel(nn.Module):
    """What both heads share: the config's input normalisation and size check, then the backbone."""

    def __init__(self, config: CapsNetConfig):
        super().__init__()
        self.config = config
        self.input_sizes = config.input_sizes
        self.input_normalisation = InputNormalisation(config)
        self.backbone = Backbone(config)

    def features(self, images: Tensor) -> Tensor:
        """images (B, C, H, W) in [0, 1] -> backbone features (B, F, H', W'); a size the config does not take is
        a one-line error here rather than a convolution's shape error deep inside."""
        _, channels, height, width = images.shape
        self.input_sizes.check(channels, height, width, what=f"this {self.config.arch} model")
        return self.backbone(self.input_normalisation(images))  # (B, F, H', W')


class SharedCapsNet(AnySizeModel):
    """The backbone's positions as input capsules, one shared-weight capsule layer; no decoder (its output would
    have the image's size, which is not fixed)."""

    def __init__(self, config: CapsNetConfig):
        super().__init__(config)
        self.capsules = SharedCapsules(config, self.backbone.out_channels)
        glorot_initialise(self)

    def forward(self, images: Tensor, target: Tensor | None = None) -> CapsNetOutput:
        """images (B, C, H, W) in [0, 1]; `target` is accepted for the CapsNet's signature and unused (no decoder).
        The input capsules are the backbone's ReLU features as they are, not squashed, as in the article."""
        u = self.features(images).flatten(2).transpose(1, 2)  # (B, F, H'*W') -> (B, H'*W', F): rows of positions
        poses, coupling = self.capsules(u)  # (B, J, D), (B, H'*W', J)
        return CapsNetOutput(
            probabilities=capsule_lengths(poses),  # (B, J)
            poses=poses,
            reconstruction=torch.zeros_like(images).flatten(1),  # (B, C*H*W): no decoder
            coupling=coupling,
        )


class GapCnn(AnySizeModel):
    """The backbone, global average pooling, a dense ReLU layer, one sigmoid per class."""

    def __init__(self, config: CapsNetConfig):
        super().__init__(config)
        self.head = nn.Sequential(nn.Linear(self.backbone.out_channels, config.gap_hidden), nn.ReLU(inplace=True),
                                  nn.Linear(config.gap_hidden, config.num_classes))
        glorot_initialise(self)

    def forward(self, images: Tensor, target: Tensor | None = None) -> CapsNetOutput:
        """images (B, C, H, W) in [0, 1]; `target` is accepted for the CapsNet's signature and unused."""
        pooled = self.features(images).mean(dim=(2, 3))  # (B, F, H', W') -> (B, F)
        logits = self.head(pooled)  # (B, J)
        num_classes = self.config.num_classes
        return CapsNetOutput(
            probabilities=torch.sigmoid(logits),  # (B, J) in [0, 1], like capsule lengths
            poses=logits.new_zeros(logits.shape[0], num_classes, 0),  # (B, J, 0): no poses
            reconstruction=torch.zeros_like(images).flatten(1),  # (B, C*H*W): no decoder
            coupling=logits.new_zeros(logits.shape[0], 0, num_classes),  # (B, 0, J): no routing
        )
