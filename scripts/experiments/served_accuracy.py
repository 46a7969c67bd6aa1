"""Accuracy of a served model on a whole test split through KServe v2 (tritonclient), beside the same images in process.

Every test image goes through `tritonclient.grpc` to each running `capsnet serve` named, in requests of the
server's max_batch_size; the same images are scored in process by the checkpoint in PyTorch (what `capsnet eval`
scores) and, where a server's ONNX file is named, by that file in ONNX Runtime with the same batches. Prints one
JSON object: each accuracy, the largest |difference| of the served probabilities from ONNX Runtime's, and every
image whose served class differs from an in-process one, with its label, both classes and both answers'
probabilities of the two (a near tie that the other arithmetic tips the other way shows as two close values).

    capsnet serve --model DIR --precision fp32 --grpc-port 8001 &
    capsnet serve --model DIR --precision int8 --grpc-port 8011 --http-port 8010 --metrics-port 8012 &
    python scripts/experiments/served_accuracy.py 127.0.0.1:8001=DIR/model.onnx 127.0.0.1:8011=DIR/model.int8.onnx \
        --data IDX_DIR --checkpoint CKPT
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import numpy as np
import torch
import tritonclient.grpc as grpcclient

from capsnet.bench.results import portable
from capsnet.export.parity import onnxruntime_session
from capsnet.models.checkpoint import load_checkpoint
from capsnet.training.data import load_dataset, to_float

MODEL = "capsnet"
REPO = Path(__file__).resolve().parents[2]  # the report's paths are written relative to it


def batches(images: np.ndarray, size: int):
    for start in range(0, len(images), size):
        yield to_float(images[start : start + size]).numpy()  # (b, C, H, W) in [0, 1]


def served_probabilities(server: str, images: np.ndarray) -> tuple[np.ndarray, int]:
    client = grpcclient.InferenceServerClient(url=server)
    if not client.is_model_ready(MODEL):
        raise SystemExit(f"served_accuracy.py: {server} has no ready model {MODEL!r}")
    batch = int(client.get_model_config(MODEL).config.max_batch_size)
    answers = []
    for pixels in batches(images, batch):
        request = grpcclient.InferInput("images", list(pixels.shape), "FP32")
        request.set_data_from_numpy(pixels)
        result = client.infer(MODEL, [request], outputs=[grpcclient.InferRequestedOutput("probabilities")])
        answers.append(result.as_numpy("probabilities"))  # (b, J)
    client.close()
    return np.concatenate(answers), batch


@torch.no_grad()
def checkpoint_probabilities(path: str, images: np.ndarray, batch: int) -> np.ndarray:
    model = load_checkpoint(path).build_model()
    return np.concatenate([model(torch.from_numpy(pixels)).probabilities.numpy() for pixels in batches(images, batch)])


def onnx_probabilities(path: str, images: np.ndarray, batch: int) -> np.ndarray:
    session = onnxruntime_session(path)
    return np.concatenate([session.run(["probabilities"], {"images": pixels})[0] for pixels in batches(images, batch)])


def differing(served: np.ndarray, reference: np.ndarray, labels: np.ndarray) -> list[dict]:
    rows = []
    for index in np.flatnonzero(served.argmax(axis=1) != reference.argmax(axis=1)):
        mine, theirs = int(served[index].argmax()), int(reference[index].argmax())
        rows.append({"image": int(index), "label": int(labels[index]), "served": mine, "in_process": theirs,
                     "served_probabilities": [round(float(served[index, k]), 6) for k in (mine, theirs)],
                     "in_process_probabilities": [round(float(reference[index, k]), 6) for k in (mine, theirs)]})
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("servers", nargs="+", metavar="HOST:PORT[=ONNX]",
                        help="a server's gRPC port, with the ONNX file it serves (model.onnx or model.int8.onnx) "
                             "to compare with ONNX Runtime in process")
    parser.add_argument("--data", required=True, help="'embedded' or a folder of MNIST-format IDX files")
    parser.add_argument("--checkpoint", required=True, help="the checkpoint the served exports came from")
    args = parser.parse_args()
    test = load_dataset(args.data).test
    served = {}
    for server in args.servers:
        address, _, onnx = server.partition("=")
        started = time.monotonic()
        served[server] = (*served_probabilities(address, test.images), time.monotonic() - started, onnx)
    batch = min(entry[1] for entry in served.values())
    checkpoint = checkpoint_probabilities(args.checkpoint, test.images, batch)
    report = {"test_images": len(test), "checkpoint": portable(args.checkpoint, REPO),
              "checkpoint_accuracy": float((checkpoint.argmax(axis=1) == test.labels).mean()), "servers": {}}
    for server, (probabilities, request_images, seconds, onnx) in served.items():
        entry = {"request_images": request_images, "served_seconds": round(seconds, 1),
                 "served_accuracy": float((probabilities.argmax(axis=1) == test.labels).mean()),
                 "differing_from_checkpoint": differing(probabilities, checkpoint, test.labels)}
        if onnx:
            in_process = onnx_probabilities(onnx, test.images, request_images)
            entry.update({"onnx": portable(onnx, REPO),
                          "onnx_accuracy": float((in_process.argmax(axis=1) == test.labels).mean()),
                          "max |served - onnx| probabilities": float(np.abs(probabilities - in_process).max()),
                          "differing_from_onnx": differing(probabilities, in_process, test.labels)})
        report["servers"][portable(server, REPO)] = entry
    print(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
