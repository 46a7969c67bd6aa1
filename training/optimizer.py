"""The optimizer's parameter groups: the decoder learns at `config.decoder_lr_scale` times the rate of the rest.

The decoder is a plain MLP from a pose to an image; at the paper's rate it takes far more steps than a short run has
to draw more than its class's template (docs/experiments, "Poses that show"), while the capsules' own rate is what
their accuracy was measured at."""

from __future__ import annotations

import torch

from capsnet.models.checkpoint import Model


def parameter_groups(model: Model, lr: float) -> list[dict]:
    """Adam's groups: the decoder's parameters at lr × the config's decoder_lr_scale, the others at lr."""
    decoder = getattr(model, "decoder", None)
    scale = model.config.decoder_lr_scale
    if not isinstance(decoder, torch.nn.Module) or scale == 1.0:
        return [{"params": list(model.parameters()), "lr": lr}]
    own = {id(parameter) for parameter in decoder.parameters()}
    return [{"params": [p for p in model.parameters() if id(p) not in own], "lr": lr},
            {"params": list(decoder.parameters()), "lr": lr * scale}]
