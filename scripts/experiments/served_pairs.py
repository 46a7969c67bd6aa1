"""The pairs test through a running server, beside `capsnet eval --pairs` in process: do they agree?

The seeded pairs of different test digits that `capsnet eval CKPT --data DIR --pairs LAYOUT --pair-count N --seed S`
scores are written as real PNG files (28x56 for side by side), read back, and sent to `capsnet serve` over KServe
v2 gRPC (tritonclient, UINT8 tensors of the decoded PNGs) and, as the PNG bytes themselves, over our CapsNet API
(which decodes them at their own size). Each answer's top-2 set accuracy and the same with both lengths > 0.5 are
computed as eval computes them (robustness.overlap_scores), and eval itself is run in process on the same pairs.
Prints one JSON object: the three sets of figures, the largest |difference| of the served lengths from eval's, and
whether the figures agree.

    capsnet export CKPT --out DIR
    capsnet serve --model DIR --precision fp32 &
    python scripts/experiments/served_pairs.py CKPT --data MNIST_DIR --server 127.0.0.1:8001 --count 1000
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import tempfile
import time
from pathlib import Path

import numpy as np
import tritonclient.grpc as grpcclient
from PIL import Image

from capsnet.bench.results import portable
from capsnet.cli import main as capsnet
from capsnet.client.api import CapsNetClient
from capsnet.models.checkpoint import load_checkpoint
from capsnet.training.data import load_dataset
from capsnet.training.pairs import PairSpec, build_pairs
from capsnet.training.robustness import overlap_scores

MODEL = "capsnet"
REPO = Path(__file__).resolve().parents[2]  # the result's paths are written relative to it


def write_pngs(images: np.ndarray, folder: Path) -> list[Path]:
    paths = []
    for index, image in enumerate(images):  # (N, 1, H, W) uint8
        path = folder / f"pair-{index:05d}.png"
        Image.fromarray(image[0]).save(path)
        paths.append(path)
    return paths


def kserve_lengths(server: str, paths: list[Path], batch: int) -> np.ndarray:
    client = grpcclient.InferenceServerClient(url=server)
    runs = []
    for start in range(0, len(paths), batch):
        images = np.stack([np.asarray(Image.open(path))[None] for path in paths[start:start + batch]])  # (b, 1, H, W)
        tensor = grpcclient.InferInput("images", list(images.shape), "UINT8")
        tensor.set_data_from_numpy(images)
        runs.append(client.infer(MODEL, [tensor]).as_numpy("probabilities"))
    client.close()
    return np.concatenate(runs)


def capsnet_api_lengths(server: str, paths: list[Path], batch: int) -> tuple[np.ndarray, int]:
    """The lengths our API answers for the PNG bytes, and how many it said it resized (0 for a model of any size)."""
    lengths, resized = [], 0
    with CapsNetClient(server, timeout=600) as client:
        for start in range(0, len(paths), batch):
            for prediction in client.classify([path.read_bytes() for path in paths[start:start + batch]], poses=False):
                lengths.append(prediction.probabilities)
                resized += prediction.resized_from is not None
    return np.stack(lengths), resized


def in_process(checkpoint: str, data: str, layout: str, count: int, seed: int) -> dict:
    """`capsnet eval --pairs ... --json`, run as the command runs."""
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        code = capsnet(["eval", checkpoint, "--data", data, "--pairs", layout, "--pair-count", str(count),
                        "--seed", str(seed), "--json"])
    if code != 0:
        raise SystemExit(f"capsnet eval failed ({code})")
    return json.loads(out.getvalue())["pairs"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("checkpoint")
    parser.add_argument("--data", required=True, help="the IDX folder the checkpoint was trained on")
    parser.add_argument("--server", default="127.0.0.1:8001", help="capsnet serve's gRPC address (KServe and ours)")
    parser.add_argument("--layout", default="side-by-side", choices=["side-by-side", "stacked"])
    parser.add_argument("--count", type=int, default=1000)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--batch", type=int, default=32, help="images per request (at most the server's max)")
    args = parser.parse_args()

    checkpoint = load_checkpoint(args.checkpoint)
    split = load_dataset(args.data).test
    spec = PairSpec(args.layout, args.count, args.seed)
    pairs = build_pairs(checkpoint.config, split, spec, args.checkpoint)
    with tempfile.TemporaryDirectory() as folder:
        paths = write_pngs(pairs.images, Path(folder))
        started = time.perf_counter()
        served = {"kserve_grpc_uint8": kserve_lengths(args.server, paths, args.batch)}
        kserve_seconds = time.perf_counter() - started
        served["capsnet_api_png"], resized = capsnet_api_lengths(args.server, paths, args.batch)
    eval_figures = in_process(args.checkpoint, args.data, args.layout, args.count, args.seed)
    # eval's own lengths on the same pairs, for the differences (eval reports only its figures)
    import torch

    from capsnet.training.evaluate import Scoring
    from capsnet.training.pairs import score_pairs

    reference, _ = score_pairs(checkpoint.build_model().eval(), pairs, spec, Scoring(256, torch.device("cpu")))
    figures = {name: overlap_scores(lengths, pairs.labels) for name, lengths in served.items()}
    result = {
        "checkpoint": portable(args.checkpoint, REPO), "layout": args.layout, "pairs": args.count, "seed": args.seed,
        "image_shape": list(pairs.images.shape[1:]),
        "capsnet_eval": {key: eval_figures[key] for key in ("top2_accuracy", "top2_both_present_accuracy")},
        **figures,
        "max_abs_diff_from_eval": {name: float(np.abs(lengths - reference).max()) for name, lengths in served.items()},
        "resized_by_capsnet_api": resized,
        "kserve_seconds": round(kserve_seconds, 2),
    }
    result["agree"] = all(figures[name] == result["capsnet_eval"] for name in figures)
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
