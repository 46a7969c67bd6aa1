"""The front-end benchmark's reference servers (scripts/bench_front_end.py): the bare floor answers zeros of the
model's shapes, floor+engine the engine's own outputs; both count what they served as the benchmark reads it."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest

SCRIPTS = Path(__file__).resolve().parents[2] / "scripts"
sys.path.insert(0, str(SCRIPTS))

import bench_front_end  # noqa: E402  (a script, importable from scripts/)


def _infer(target: str, images: np.ndarray) -> dict[str, np.ndarray]:
    import grpc

    from capsnet.kserve import grpc_service_pb2 as pb
    from capsnet.kserve import grpc_service_pb2_grpc as pb_grpc

    request = pb.ModelInferRequest(model_name=bench_front_end.MODEL)
    request.inputs.add(name="images", datatype="FP32", shape=images.shape)
    request.raw_input_contents.append(images.tobytes())
    with grpc.insecure_channel(target) as channel:
        response = pb_grpc.GRPCInferenceServiceStub(channel).ModelInfer(request, timeout=60)
    return {output.name: np.frombuffer(raw, np.float32).reshape(output.shape)
            for output, raw in zip(response.outputs, response.raw_output_contents)}


@pytest.mark.parametrize("engine", [None, "onnxruntime:fp32"], ids=["floor", "floor+engine"])
def test_the_floor_answers_every_output_and_counts_its_runs(random_tiny_export, engine):
    port = bench_front_end.free_port()
    command = [sys.executable, str(SCRIPTS / "bench_front_end.py"), "--floor", str(port), "--model-dir",
               str(random_tiny_export), *(["--floor-engine", engine] if engine else [])]
    served = bench_front_end.Served("floor", command, port)
    try:
        image, shapes = bench_front_end.model_io(random_tiny_export)
        images = np.random.default_rng(0).random((3, *image), dtype=np.float32)
        answers = _infer(served.target, images)
        assert {name: list(array.shape) for name, array in answers.items()} == {
            name: [3, *shape] for name, shape in shapes.items()}
        if engine is None:
            assert all(not array.any() for array in answers.values())
            assert served.counts() == (1, 0, 0)
        else:
            expected = bench_front_end.create_engine(random_tiny_export, engine, None).run(images)
            for name, array in answers.items():
                np.testing.assert_allclose(array, expected[name], rtol=1e-5, atol=1e-6)
            assert served.counts() == (1, 3, 1)  # one request, its 3 images, one run
    finally:
        served.stop()


def test_ratios_divide_each_cell_by_both_floors():
    def cells(*values):
        return {"cells": {str(level): {"server_cpu_ms_per_request": value} for level, value in zip((1, 16), values)}}

    report = {"concurrency": [1, 16], "servers": {"floor": cells(0.5, 0.4), "floor+engine": cells(0.8, 0.6),
                                                  "capsnet-1": cells(1.2, 0.9)}}
    lines = bench_front_end.ratios(report)
    assert f"| capsnet-1 | {1.2 / 0.5:.2f}× / {1.2 / 0.8:.2f}× | {0.9 / 0.4:.2f}× / {0.9 / 0.6:.2f}× |" in lines
    assert f"| floor+engine | {0.8 / 0.5:.2f}× / 1.00× | {0.6 / 0.4:.2f}× / 1.00× |" in lines
    assert not any(line.startswith("| floor |") for line in lines)
