"""Two digits of different classes from the embedded test split, side by side in one 28×56 PNG: a request for a
model of any size (`--preset shared` or `gap-cnn`), whose answer should name both as present.

    python scripts/pair_png.py models/pair.png            # then: capsnet predict models/pair.png
    python scripts/pair_png.py models/pair-3.png --seed 3  # another pair
"""

from __future__ import annotations

import argparse
from pathlib import Path

from PIL import Image

from capsnet.training.data import load_embedded
from capsnet.training.transforms import digit_pairs


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", type=Path, help="the PNG to write")
    parser.add_argument("--seed", type=int, default=0, help="which pair (default 0)")
    args = parser.parse_args()
    pair = digit_pairs(load_embedded().test, 1, args.seed, "side-by-side")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    Image.fromarray(pair.images[0, 0]).save(args.out)  # (1, 1, 28, 56) -> a 28x56 grey image
    first, second = pair.labels[0]
    print(f"{args.out}: digits {first} and {second} side by side")


if __name__ == "__main__":
    main()
