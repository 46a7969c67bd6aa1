"""INT8 accuracy of an export as another x86 CPU kind computes it, under QEMU's user-mode emulation of that CPU.

    python scripts/experiments/int8_emulated_cpu.py DIR [--cpu EPYC-Rome] [--images 1000] [--out results.jsonl]

ONNX Runtime chooses its integer kernels by the CPU's feature bits. Without VNNI (an AVX2-only AMD EPYC, say) an
int8 convolution multiplies through VPMADDUBSW, whose 16-bit sums of two products saturate; VNNI and AMX sum in 32
bits. `qemu-x86_64 -cpu MODEL` (Debian's qemu-user, 7.2 or later, which emulates AVX2) shows ONNX Runtime that
CPU's feature bits from any x86-64 host, so the AVX2 kernels run here and their answers can be compared with this
host's. Emulation costs about 0.2 s an image of the `paper` preset on one core, so it runs on the first --images
test images.

The script
1. finds which int8 sums the emulated CPU has: one QDQ convolution whose exact sum 16-bit pairs cannot hold comes
   out wrong with 8-bit weights on the AVX2 path (`emulated_int8_sums`), and right with the 7-bit weights export
   writes on every path;
2. quantises DIR's model.onnx as `capsnet export --int8` does (200 training images, export's calibration);
3. runs the INT8 model natively and emulated on the test images, and prints one JSON line: FP32's and each INT8's
   accuracy, the images whose class differs between the two INT8 runs, and the largest probability difference.

Run with --worker, under qemu, it only runs an ONNX model on a .npy file (numpy and ONNX Runtime, no torch).
"""

from __future__ import annotations

import argparse
import json
import platform
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

CALIBRATION_IMAGES = 200  # export's default --calibration-images
PROBE_CHANNELS = 64
PROBE_ACTIVATION = 127  # int8 activations reach the kernel as 255 once shifted to uint8
PROBE_OUTPUT_SCALE = 16384.0  # the largest exact sum, 127 · 127 · 64, stays within int8 at this scale


def first_output(model: Path, values: np.ndarray, batch: int = 50) -> np.ndarray:
    """The first output of `model` on `values`, on one thread, in batches: the same calls natively and emulated."""
    import onnxruntime as ort

    options = ort.SessionOptions()
    options.intra_op_num_threads = options.inter_op_num_threads = 1
    session = ort.InferenceSession(str(model), options, providers=["CPUExecutionProvider"])
    name = session.get_inputs()[0].name
    return np.concatenate([session.run(None, {name: values[start:start + batch]})[0]
                           for start in range(0, len(values), batch)])


def saturation_probe(path: Path, weight: int) -> float:
    """Write a QDQ convolution of PROBE_CHANNELS int8 activations of PROBE_ACTIVATION by int8 weights `weight` to
    `path`, and return what it should answer: the exact sum requantised at PROBE_OUTPUT_SCALE. 32-bit sums always
    reach it; 16-bit pairs only with 7-bit weights."""
    import onnx
    from onnx import TensorProto, helper, numpy_helper

    def scalar(name, value, dtype):
        return numpy_helper.from_array(np.array(value, dtype), name)

    nodes = [
        helper.make_node("QuantizeLinear", ["x", "one", "zero"], ["xq"]),
        helper.make_node("DequantizeLinear", ["xq", "one", "zero"], ["xd"]),
        helper.make_node("DequantizeLinear", ["w", "one", "zero"], ["wd"]),
        helper.make_node("Conv", ["xd", "wd"], ["y"]),
        # quantising the output too is what makes ONNX Runtime fuse the four into one integer convolution
        helper.make_node("QuantizeLinear", ["y", "output_scale", "zero"], ["yq"]),
        helper.make_node("DequantizeLinear", ["yq", "output_scale", "zero"], ["answer"]),
    ]
    weights = numpy_helper.from_array(np.full((1, PROBE_CHANNELS, 1, 1), weight, np.int8), "w")
    graph = helper.make_graph(
        nodes, "saturation_probe",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, PROBE_CHANNELS, 1, 1])],
        [helper.make_tensor_value_info("answer", TensorProto.FLOAT, [1, 1, 1, 1])],
        [scalar("one", 1.0, np.float32), scalar("zero", 0, np.int8),
         scalar("output_scale", PROBE_OUTPUT_SCALE, np.float32), weights])
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), str(path))
    return float(round(PROBE_ACTIVATION * weight * PROBE_CHANNELS / PROBE_OUTPUT_SCALE) * PROBE_OUTPUT_SCALE)


def emulated(cpu: str, model: Path, values: np.ndarray, scratch: Path) -> np.ndarray:
    """first_output() in a worker process under `qemu-x86_64 -cpu cpu`, through .npy files in `scratch`."""
    inputs, outputs = scratch / "inputs.npy", scratch / "outputs.npy"
    np.save(inputs, values)
    command = ["qemu-x86_64", "-cpu", cpu, sys.executable, __file__, "--worker", str(model), str(inputs), str(outputs)]
    subprocess.run(command, check=True, stderr=subprocess.DEVNULL)  # qemu warns of each CPU feature TCG lacks
    return np.load(outputs)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("export", type=Path, help="a `capsnet export` directory")
    parser.add_argument("--cpu", default="EPYC-Rome",
                        help="a model `qemu-x86_64 -cpu help` lists (default: an AVX2-only EPYC)")
    parser.add_argument("--images", type=int, default=1000, help="test images to run emulated (default 1000)")
    parser.add_argument("--data", default=None, help="the data (default: the checkpoint's)")
    parser.add_argument("--out", type=Path, default=None, help="append the JSON line here too")
    args = parser.parse_args()
    if platform.machine() != "x86_64" or shutil.which("qemu-x86_64") is None:
        print("int8_emulated_cpu: needs an x86-64 host with qemu-x86_64 (apt-get install qemu-user)", file=sys.stderr)
        return 2

    from capsnet.export.quantize import Calibration, quantize_int8
    from capsnet.runtime.cpu import CpuKind
    from capsnet.models.checkpoint import load_checkpoint
    from capsnet.training.data import to_float
    from capsnet.training.evaluate import load_checkpoint_data

    started = time.perf_counter()
    checkpoint_path = args.export / "model.ckpt"
    dataset = load_checkpoint_data(load_checkpoint(checkpoint_path), checkpoint_path, args.data, every_class=True)
    images = to_float(dataset.test.images[:args.images]).numpy()  # (N, C, H, W), as export's parity feeds it
    labels = dataset.test.labels[:args.images]
    with tempfile.TemporaryDirectory() as scratch_name:
        scratch = Path(scratch_name)
        probe = {}
        activations = np.full((1, PROBE_CHANNELS, 1, 1), PROBE_ACTIVATION, np.float32)
        for bits, weight in ((8, 127), (7, 63)):
            model = scratch / f"probe-{bits}.onnx"
            probe[f"{bits}_bit_weights"] = {
                "expected": saturation_probe(model, weight),
                "native": float(first_output(model, activations).item()),
                "emulated": float(emulated(args.cpu, model, activations, scratch).item())}
        int8 = scratch / "model.int8.onnx"
        quantize_int8(args.export / "model.onnx", int8, dataset.train.images[:CALIBRATION_IMAGES], Calibration())
        fp32_classes = first_output(args.export / "model.onnx", images).argmax(axis=1)
        int8_native = first_output(int8, images)
        int8_emulated = emulated(args.cpu, int8, images, scratch)
    native_classes, emulated_classes = int8_native.argmax(axis=1), int8_emulated.argmax(axis=1)

    def accuracy(classes: np.ndarray) -> float:
        return float((classes == labels).mean())

    record = {
        "model": str(args.export), "dataset": dataset.name, "test_images": len(labels),
        "calibration": Calibration().describe(), "calibration_images": CALIBRATION_IMAGES,
        "emulated_cpu": args.cpu, "host_cpu": CpuKind.this_host().describe(),
        "saturation_probe": probe,
        "emulated_int8_sums": ("32-bit" if probe["8_bit_weights"]["emulated"] == probe["8_bit_weights"]["expected"]
                               else "16-bit pairs, saturating"),
        "fp32_accuracy": accuracy(fp32_classes),
        "int8_native_accuracy": accuracy(native_classes),
        "int8_emulated_accuracy": accuracy(emulated_classes),
        "change_points_emulated": round(100 * (accuracy(emulated_classes) - accuracy(fp32_classes)), 2),
        "classes_differing_native_emulated": int((native_classes != emulated_classes).sum()),
        "max_abs_probability_difference": float(np.abs(int8_native - int8_emulated).max()),
        "seconds": round(time.perf_counter() - started, 1),
    }
    line = json.dumps(record)
    print(line)
    if args.out:
        with args.out.open("a") as stream:
            stream.write(line + "\n")
    return 0


if __name__ == "__main__":
    if sys.argv[1:2] == ["--worker"]:
        np.save(sys.argv[4], first_output(Path(sys.argv[2]), np.load(sys.argv[3])))
        sys.exit(0)
    sys.exit(main())
