"""What EM routing does inside a trained `--arch em` checkpoint, layer by layer: the figures behind the known
implementation pitfalls (docs/experiments, "EM routing against the documented pitfalls").

For N test images, every capsule layer's routing is recorded as the model runs, and the last M-step is
recomputed from its votes, input activations and last assignments R (as em_route computes it):
- parents apart: how far the parents' means μ_j lie from each other, in units of their own σ, at the first
  M-step (R uniform) and at the last. A constant R collapses every parent onto one cluster only where the
  votes are the same for every parent; near 0 here would be that collapse.
- R: the largest assignment of each input (1/J is uniform) and how far routing moved R from uniform.
- σ² at the floor: the share of (parent, entry) variances within 10× the 1e-6 guard, the sign of a parent
  with one child (Gritzman 2019's first pitfall).
- activations: mean, standard deviation, smallest and largest, and the share above 0.99 or below 0.01 (a λ
  too large saturates the logistic and stops learning).

Usage: python scripts/experiments/em_routing_stats.py CKPT --data DIR [--images 200]
"""

from __future__ import annotations

import argparse
import json

import numpy as np
import torch

from capsnet.models import em as em_model
from capsnet.models.checkpoint import load_checkpoint
from capsnet.training.data import load_dataset, to_float


def moments(votes: torch.Tensor, weights: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The weighted mean and variance per parent, as the M-step forms them: votes (..., J, I, H), weights
    (..., J, I) -> μ, σ² (..., J, H)."""
    coefficients = weights / weights.sum(dim=-1, keepdim=True).clamp_min(em_model.EPSILON)  # (..., J, I)
    mean = torch.einsum("...ji,...jih->...jh", coefficients, votes)  # (..., J, H)
    variance = torch.einsum("...ji,...jih->...jh", coefficients, (votes - mean.unsqueeze(-2)).square())
    return mean, variance + em_model.EPSILON


def parents_apart(mean: torch.Tensor, variance: torch.Tensor) -> float:
    """Mean over groups of the standard deviation of μ_j across the parents j, over the mean σ: (..., J, H)."""
    return float((mean.std(dim=-2) / variance.sqrt().mean(dim=-2)).mean())


def layer_figures(votes: torch.Tensor, activations: torch.Tensor, routed: em_model.EMResult) -> dict:
    parents = votes.shape[-3]
    inputs = activations.unsqueeze(-2)  # (..., 1, I)
    first_mean, first_variance = moments(votes, torch.full_like(votes[..., 0], 1.0 / parents) * inputs)
    assignments = routed.assignments.transpose(-1, -2)  # (..., J, I): the R the last M-step used
    last_mean, last_variance = moments(votes, assignments * inputs)
    largest = routed.assignments.max(dim=-1).values  # (..., I)
    out = routed.activations
    return {
        "parents": parents, "inputs per group": votes.shape[-2],
        "parents apart, first M-step (σ units)": round(parents_apart(first_mean, first_variance), 3),
        "parents apart, last M-step (σ units)": round(parents_apart(last_mean, last_variance), 3),
        "R largest, mean (uniform = 1/J)": round(float(largest.mean()), 4),
        "R mean |R - 1/J|": round(float((routed.assignments - 1.0 / parents).abs().mean()), 5),
        "σ² within 10x the guard, share": float((last_variance < 10 * em_model.EPSILON).float().mean()),
        "activation mean": round(float(out.mean()), 4), "activation std": round(float(out.std()), 4),
        "activation min": round(float(out.min()), 4), "activation max": round(float(out.max()), 4),
        "activations > 0.99 or < 0.01, share": float(((out > 0.99) | (out < 0.01)).float().mean()),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("checkpoint")
    parser.add_argument("--data", required=True)
    parser.add_argument("--images", type=int, default=200)
    args = parser.parse_args()
    checkpoint = load_checkpoint(args.checkpoint)
    if checkpoint.config.arch != "em":
        raise SystemExit(f"em_routing_stats.py: {args.checkpoint} is not an EM model (arch {checkpoint.config.arch})")
    model = checkpoint.build_model()
    test = load_dataset(args.data).test
    picked = np.random.default_rng(0).choice(len(test), size=min(args.images, len(test)), replace=False)
    recorded = []
    original = em_model.em_route

    def recording(votes, activations, *rest, **options):
        routed = original(votes, activations, *rest, **options)
        recorded.append((votes.detach(), activations.detach(), routed))
        return routed

    em_model.em_route = recording
    with torch.no_grad():
        probabilities = model(to_float(test.images[picked])).probabilities  # (N, 10)
    em_model.em_route = original
    names = ("ConvCaps1", "ConvCaps2", "ClassCaps")
    report = {"checkpoint": args.checkpoint, "images": len(picked),
              "accuracy on them": float((probabilities.argmax(dim=1).numpy() == test.labels[picked]).mean()),
              "λ per iteration": em_model.inverse_temperatures(checkpoint.config.routing_iterations,
                                                               checkpoint.config.em_inverse_temperature),
              "layers": {name: layer_figures(*entry) for name, entry in zip(names, recorded)}}
    print(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
