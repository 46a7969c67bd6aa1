"""Training-step time of the dynamic-routing `paper` CapsNet against the `em` model, measured in one run.

Alternates the two models' steps (forward, loss, backward, Adam) on the same random 64-image batches, so
both see the same machine load, and prints the median seconds per step and their ratio.

Usage: python scripts/experiments/step_time.py [--steps 5] [--batch-size 64] [--amp] [--threads 1]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import time

import torch

from capsnet.training.checkpoint import create_model
from capsnet.training.config import preset
from capsnet.training.loss import capsnet_loss


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--amp", action="store_true", help="bf16 autocast, as capsnet train --amp on CPU")
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    models = {}
    for name in ("paper", "em"):
        config = preset(name)
        model = create_model(config)
        models[name] = (config, model, torch.optim.Adam(model.parameters(), lr=1e-3))
    seconds: dict[str, list[float]] = {name: [] for name in models}
    for step in range(args.steps + 1):  # the first step of each model warms up and is not counted
        images = torch.rand(args.batch_size, 1, 28, 28)  # (B, 1, 28, 28)
        labels = torch.randint(0, 10, (args.batch_size,))  # (B,)
        for name, (config, model, optimizer) in models.items():
            started = time.perf_counter()
            autocast = torch.autocast("cpu", dtype=torch.bfloat16) if args.amp else contextlib.nullcontext()
            with autocast:
                output = model(images, labels)
            loss = capsnet_loss(output, images, labels, config, epoch=0).total
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            if step:
                seconds[name].append(time.perf_counter() - started)
    medians = {name: statistics.median(values) for name, values in seconds.items()}
    print(json.dumps({"batch_size": args.batch_size, "amp": args.amp, "threads": args.threads, "steps": args.steps,
                      "seconds_per_step": medians, "em_over_paper": medians["em"] / medians["paper"]}, indent=1))


if __name__ == "__main__":
    main()
