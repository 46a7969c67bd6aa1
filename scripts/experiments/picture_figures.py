"""The figures quoted beside `capsnet visualize`'s pictures in docs/experiments/README.md, measured on the first
test image of each class: the routing weights (coupling coefficients c_ij, or EM's assignments R_ij) of single
capsules and of the grid maps routing.png draws, the share the predicted class receives, and how far each pose
dimension moves the reconstruction between the -0.25 and +0.25 panels of pose-perturbation-<k>.png.

Usage: python scripts/experiments/picture_figures.py CHECKPOINT [--data embedded]
Prints one JSON object.
"""

from __future__ import annotations

import argparse
import json

import numpy as np
import torch

from capsnet.models.checkpoint import load_checkpoint
from capsnet.training.data import load_dataset, to_float
from capsnet.training.visualize import coupling_maps, pose_perturbations


def value_range(values: torch.Tensor) -> list[float]:
    return [round(float(values.min()), 3), round(float(values.max()), 3)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("checkpoint")
    parser.add_argument("--data", default="embedded")
    args = parser.parse_args()
    checkpoint = load_checkpoint(args.checkpoint)
    model = checkpoint.build_model().eval()
    test = load_dataset(args.data).test
    firsts = [int(np.flatnonzero(test.labels == label)[0]) for label in range(len(checkpoint.class_names))]
    with torch.no_grad():
        images = to_float(test.images[firsts])  # (J, C, H, W): the first image of each class
        output = model(images)
        predicted = output.probabilities.argmax(dim=1)  # (J,)
        coupling = output.coupling  # (J, I, J)
        maps = coupling_maps(coupling, model.config)  # (J, J, grid_h, grid_w)
        to_predicted = coupling[torch.arange(len(firsts)), :, predicted].mean(dim=1)  # (J,): mean over the I capsules
        # the largest pixel change per pose dimension between the -0.25 and +0.25 panels, classes 0-2
        changes = [(grid[:, -1] - grid[:, 0]).abs().flatten(1).amax(dim=1)  # (D,)
                   for grid in (pose_perturbations(model, images[k : k + 1]) for k in range(3))]
    print(json.dumps({
        "checkpoint": args.checkpoint,
        "labels": test.labels[firsts].tolist(), "predicted": predicted.tolist(),
        "single_capsule_weight_range": value_range(coupling),
        "grid_map_range": value_range(maps),
        "grid_map_max_per_image_range": value_range(maps.flatten(1).amax(dim=1)),
        "mean_weight_to_predicted_class_range": value_range(to_predicted),
        "uniform_weight": round(1 / coupling.shape[-1], 3),
        "perturbation_max_pixel_change_range": value_range(torch.cat(changes)),
        "reconstruction_peak_range": value_range(output.reconstruction[:3].amax(dim=1)),  # classes 0-2
    }))


if __name__ == "__main__":
    main()
