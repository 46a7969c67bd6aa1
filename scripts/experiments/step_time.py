"""Training-step time of the dynamic-routing `paper` CapsNet against the `em` model, measured in one run.

Alternates the two models' steps (forward, loss, backward, Adam) on the same random 64-image batches, so
both see the same machine load, and prints the median seconds per step and their ratio. Like `capsnet train`
it asks torch for transparent huge pages (THP_MEM_ALLOC_ENABLE=0 in the environment measures without them).

Usage: python scripts/experiments/step_time.py [--steps 5] [--batch-size 64] [--amp] [--threads 1]
       [--em FIELD=JSON ...] [--only paper|em] [--presets NAME ...]
(--em changes a field of the `em` preset for the measurement, e.g. --em 'conv_caps_types=[16, 16]'; --only times
one model alone in the process: alternating with `paper` made the `em` preset's steps slower, docs/experiments;
--presets alternates other presets, e.g. `--presets paper paper-half paper-quarter`, and prints each one's speed-up
over the first)
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import time

import torch

from capsnet.errors import CapsNetError
from capsnet.models.checkpoint import create_model
from capsnet.models.config import CapsNetConfig, preset
from capsnet.training.loss import capsnet_loss
from capsnet.training.train import use_transparent_huge_pages


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--amp", action="store_true", help="bf16 autocast, as capsnet train --amp on CPU")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--em", action="append", default=[], metavar="FIELD=JSON",
                        help="a field of the em preset and its value as JSON (repeatable)")
    parser.add_argument("--only", choices=("paper", "em"), help="time this model alone (default: both, alternating)")
    parser.add_argument("--presets", nargs="+", metavar="NAME", help="alternate these presets instead")
    args = parser.parse_args()
    em_changes = {}
    for change in args.em:
        field, _, value = change.partition("=")
        try:
            em_changes[field] = json.loads(value)
        except json.JSONDecodeError:
            parser.error(f"--em {change}: the value after '=' must be JSON")
    use_transparent_huge_pages()  # as capsnet train does; THP_MEM_ALLOC_ENABLE=0 in the environment turns it off
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    models = {}
    for name in args.presets or ([args.only] if args.only else ("paper", "em")):
        config = preset(name)
        if name == "em" and em_changes:
            try:
                config = CapsNetConfig.from_dict({**config.to_dict(), **em_changes})
            except CapsNetError as error:
                parser.error(str(error))
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
    print(json.dumps({"thp_mem_alloc_enable": os.environ["THP_MEM_ALLOC_ENABLE"], "em_changes": em_changes,
                      "batch_size": args.batch_size, "amp": args.amp, "threads": args.threads, "steps": args.steps,
                      "seconds_per_step": medians,
                      **({"speed_up_over_first": {name: medians[args.presets[0]] / value
                                                  for name, value in medians.items()}} if args.presets
                         else {} if args.only else {"em_over_paper": medians["em"] / medians["paper"]})}, indent=1))


if __name__ == "__main__":
    main()
