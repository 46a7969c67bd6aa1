"""Batch invariance and determinism of a served model, measured through a running `capsnet serve`.

For N held-out digits (every class): each sent alone, one request of all N, and N single-image requests
sent at once from N threads so the dynamic batcher groups them with each other; then all of it again.
Prints the largest |difference| of probabilities and poses between the ways, and whether the repeat
gave the same bits.

Usage: python scripts/experiments/served_invariance.py HOST:PORT [--data embedded] [--images 32]
(the server's --max-batch-size must be at least --images).
"""

from __future__ import annotations

import argparse
import json
from concurrent.futures import ThreadPoolExecutor

import numpy as np

from capsnet.client.api import CapsNetClient
from capsnet.training.data import load_dataset, to_float


def served(client: CapsNetClient, images: np.ndarray) -> dict[str, np.ndarray]:
    alone = [client.classify([image])[0] for image in images]
    together = client.classify(list(images))
    with ThreadPoolExecutor(len(images)) as pool:
        concurrent = list(pool.map(lambda image: client.classify([image])[0], images))
    stack = lambda predictions, field: np.stack([getattr(p, field) for p in predictions])  # noqa: E731
    return {f"{way} {field}": stack(predictions, field)
            for way, predictions in (("alone", alone), ("one request", together), ("concurrent", concurrent))
            for field in ("probabilities", "poses")}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("server")
    parser.add_argument("--data", default="embedded")
    parser.add_argument("--images", type=int, default=32)
    args = parser.parse_args()
    test = load_dataset(args.data).test
    picked = np.linspace(0, len(test) - 1, args.images).astype(int)  # spread over the class-sorted split
    images = to_float(test.images[picked]).numpy()  # (N, C, H, W)
    with CapsNetClient(args.server) as client:
        first, second = served(client, images), served(client, images)
    report = {}
    for field in ("probabilities", "poses"):
        alone = first[f"alone {field}"]
        for way in ("one request", "concurrent"):
            report[f"max |{field} alone - {way}|"] = float(np.abs(alone - first[f"{way} {field}"]).max())
    report["repeat identical bits"] = all(np.array_equal(first[key], second[key]) for key in first)
    report["images"] = len(images)
    print(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
