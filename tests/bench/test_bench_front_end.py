"""The front-end benchmark's reference servers (scripts/bench_front_end.py): the bare floor answers zeros of the
model's shapes, floor+engine the engine's own outputs; both count what they served as the benchmark reads it. The
engine's in-process figures come from the project's harness (capsnet/bench/engines.py)."""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

import numpy as np
import pytest

from capsnet.bench.engines import build_engine

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
            expected = build_engine(engine, random_tiny_export, threads=0, max_batch=64).run(images)
            for name, array in answers.items():
                np.testing.assert_allclose(array, expected[name], rtol=1e-5, atol=1e-6)
            assert served.counts() == (1, 3, 1)  # one request, its 3 images, one run
    finally:
        served.stop()


def test_the_engine_in_process_is_timed_at_every_batch_size_a_server_forms(random_tiny_export):
    engine = bench_front_end.engine_in_process(random_tiny_export, 0.01, "onnxruntime:fp32", None)
    assert list(engine["cpu_ms_per_image"]) == list(engine["images_per_s"]) == list(bench_front_end.BATCH_SIZES)
    assert all(value > 0 for value in engine["images_per_s"].values())
    assert engine["p50_ms"] > 0 and all(value > 0 for value in engine["cpu_ms_per_image"].values())
    assert bench_front_end.backend_cpu_ms(engine, 13.0) == engine["cpu_ms_per_image"][16]
    cores = len(os.sched_getaffinity(0))  # the tiny model's runs are short: the loop keeps its core
    assert engine["threads"] == max(1, cores - 1)
    with pytest.raises(SystemExit, match=r"--engine torch:fp16: .*runs on a GPU"):
        bench_front_end.engine_in_process(random_tiny_export, 0.01, "torch:fp16", None)


def test_ratios_divide_each_cell_by_both_floors():
    def cells(*values):
        return {"cells": {str(level): {"server_cpu_ms_per_request": value} for level, value in zip((1, 16), values)}}

    report = {"concurrency": [1, 16], "servers": {"floor": cells(0.5, 0.4), "floor+engine": cells(0.8, 0.6),
                                                  "capsnet-1": cells(1.2, 0.9)}}
    lines = bench_front_end.ratios(report)
    assert f"| capsnet-1 | {1.2 / 0.5:.2f}× / {1.2 / 0.8:.2f}× | {0.9 / 0.4:.2f}× / {0.9 / 0.6:.2f}× |" in lines
    assert f"| floor+engine | {0.8 / 0.5:.2f}× / 1.00× | {0.6 / 0.4:.2f}× / 1.00× |" in lines
    assert not any(line.startswith("| floor |") for line in lines)


def test_the_engine_alone_is_driven_over_its_link_and_its_cpu_time_counted_per_request(random_tiny_export):
    command = [sys.executable, "-m", "capsnet", "serve", "--model", str(random_tiny_export), "--backend", "onnxruntime",
               "--precision", "fp32", "--workers", "2", "--no-allow-client-shm", "--grpc-port", "0", "--http-port", "0",
               "--metrics-port", "0"]
    served = bench_front_end.Served("capsnet-2", command)
    engine = {"cpu_ms_per_image": {1: 0.02, 4: 0.01, 16: 0.005, 64: 0.004}}
    try:
        image, _ = bench_front_end.model_io(random_tiny_export)
        samples = bench_front_end.engine_alone(served, argparse.Namespace(concurrency=[1, 8], seconds=0.5,
                                                                          max_batch_size=64), random_tiny_export, image)
        answered, _, _ = served.counts()
    finally:
        served.stop()
    assert answered == 0  # the engine's requests came over its link, not through a front end
    assert all(sample["answered"] < sample["images"] for sample in samples.values())  # the warm-up's too
    lone, eight = (bench_front_end.engine_alone_cell([samples[level]], engine) for level in (1, 8))
    assert lone["mean_batch"] == 1.0  # one request in flight: each run is one image
    assert 1.0 <= eight["mean_batch"] <= 8.0
    for cell in (lone, eight):
        assert cell["requests_per_s"] > 0 and cell["cpu_ms_per_request"] > 0
        backend = bench_front_end.backend_cpu_ms(engine, cell["mean_batch"])
        assert cell["less_the_backend_ms"] == pytest.approx(cell["cpu_ms_per_request"] - backend)
        assert cell["requests_per_s_one_engine_takes"] == pytest.approx(1e3 / cell["cpu_ms_per_request"])
    alone = {"front_ends_of": "capsnet-2", "cells": {1: lone, 8: eight}}
    report = {"concurrency": [1, 8], "device": "", "cores": 2, "servers": {}, "engine_alone": alone}
    rows = bench_front_end.engine_alone_rows(report)
    assert rows[-2].startswith(f"| 1 | {lone['requests_per_s']:,.0f} | 1.0 | {lone['cpu_ms_per_request']:.3f} |")
    assert rows[-1].startswith(f"| 8 | {eight['requests_per_s']:,.0f} | {eight['mean_batch']:.1f} |")


def test_a_cell_is_its_median_round_every_round_s_rate_beside_it():
    def sample(rate, p50, done, cpu_s, runs):
        parts = dict.fromkeys(bench_front_end.CPU_PARTS, 0.0)
        parts.update({"total": cpu_s, "main thread": cpu_s / 2})
        return {"load": {"requests_per_s": rate, "p50_ms": p50, "p99_ms": 2 * p50}, "done": done, "images": done,
                "runs": runs, "cpu_s": parts}

    engine = {"cpu_ms_per_image": {1: 0.2, 4: 0.1, 16: 0.05, 64: 0.04}}
    rounds = [sample(1000.0, 1.0, 3000, 3.0, 1000), sample(1400.0, 0.8, 4200, 3.6, 1400),
              sample(1300.0, 0.9, 3900, 4.2, 325)]
    cell = bench_front_end.server_cell("capsnet-1", rounds, engine)
    assert cell["requests_per_s"] == 1300.0 and cell["requests_per_s_by_round"] == [1000.0, 1400.0, 1300.0]
    assert cell["p50_ms"] == 0.9 and cell["p99_ms"] == 1.8  # the median round's own
    assert cell["server_cpu_ms_per_request"] == pytest.approx(4.2e3 / 3900)
    assert cell["cpu_ms_per_request_by_thread"]["main thread"] == pytest.approx(2.1e3 / 3900)
    assert cell["mean_batch"] == 12.0
    assert cell["request_path_cpu_ms"] == pytest.approx(4.2e3 / 3900 - 0.05)  # batch 12: measured at 16
    assert bench_front_end._rate(cell) == "1,300 (1,000 / 1,400 / 1,300)"
    # of two rounds, the slower; a round whose load failed is left out, and only a cell with none gives its error
    assert bench_front_end.server_cell("capsnet-1", rounds[:2], engine)["requests_per_s"] == 1000.0
    failed = {"load": {"error": "perf_analyzer: no response"}, "done": 0, "images": 0, "runs": 0, "cpu_s": {}}
    assert bench_front_end.server_cell("capsnet-1", [rounds[1], failed], engine)["requests_per_s_by_round"] == [1400]
    assert bench_front_end.server_cell("capsnet-1", [failed], engine) == {"error": "perf_analyzer: no response"}
    driven = [{"answered": 900, "seconds": 1.0, "images": 2000, "runs": 100, "cpu_s": 0.3},
              {"answered": 500, "seconds": 1.0, "images": 1000, "runs": 100, "cpu_s": 0.2},
              {"answered": 1000, "seconds": 1.0, "images": 2000, "runs": 50, "cpu_s": 0.2}]
    alone = bench_front_end.engine_alone_cell(driven, engine)
    assert alone["requests_per_s"] == 900.0 and alone["mean_batch"] == 20.0
    assert alone["cpu_ms_per_request"] == pytest.approx(0.15)
    assert alone["less_the_backend_ms"] == pytest.approx(0.15 - 0.05)


def test_targets_and_the_engine_rows_read_each_server_s_cells():
    def cell(rate, cpu, batch=1.0, engine_ms=None):
        found = {"requests_per_s": rate, "server_cpu_ms_per_request": cpu, "mean_batch": batch}
        if engine_ms is not None:
            found["engine_process"] = {"cpu_ms_per_request": engine_ms, "less_the_backend_ms": engine_ms / 4,
                                       "requests_per_s_one_engine_takes": 1e3 / engine_ms}
        return found

    report = {"concurrency": [1, 16, 64], "device": "", "cores": 2, "servers": {
        "floor+engine": {"cells": {"1": cell(1000, 0.5), "16": cell(1400, 0.45), "64": cell(1500, 0.44)}},
        "capsnet-1": {"cells": {"1": cell(900, 0.6), "16": cell(2800, 0.4, 3.5), "64": cell(2900, 0.4, 4.0)}},
        "capsnet-2": {"cells": {"64": cell(2500, 0.45, 15.0, engine_ms=0.1)}},
        "kserve": {"cells": {"1": cell(850, 0.7), "16": cell(1200, 0.8), "64": cell(1300, 0.8)}}}}
    lines = bench_front_end.targets(report)
    assert "| mean batch ≥ 3 at c16 | capsnet-1 | 3.5 | yes |" in lines
    assert "| mean batch ≥ 6 at c64 | capsnet-1 | 4.0 | **no** |" in lines
    assert (f"| requests/s at c64 ≥ floor+engine's | capsnet-1 | 2,900 against 1,500 ({2900 / 1500:.2f}×) "
            "| yes |") in lines
    assert "| CPU per request at c1 ≤ 1.3× floor+engine's | capsnet-1 | 0.600 against 0.500 ms (1.20×) | yes |" in lines
    assert (f"| requests/s at c16 ≥ 1.3× KServe's | capsnet-1 | 2,800 against 1,200 ({2800 / 1200:.2f}×) "
            "| yes |") in lines
    assert ("| engine process CPU per request at c64 ≤ 0.05 ms | capsnet-2 | 0.100 ms (0.025 not the backend's run) "
            "| **no** |") in lines
    assert "| capsnet-2 | 64 | 0.100 | 0.025 | 10,000 |" in bench_front_end.engine_process(report)
    report["engine_alone"] = {"front_ends_of": "capsnet-2", "cells": {"64": {
        "requests_per_s": 9000.0, "mean_batch": 40.0, "cpu_ms_per_request": 0.045, "less_the_backend_ms": 0.02,
        "requests_per_s_one_engine_takes": 1e3 / 0.045}}}
    assert ("| engine process CPU per request at c64 ≤ 0.05 ms | the engine alone | 0.045 ms (0.020 not the backend's "
            "run) | yes |") in bench_front_end.targets(report)
    assert bench_front_end.engine_process(report)[-1] == "| 64 | 9,000 | 40.0 | 0.045 | 0.020 | 22,222 |"
    assert not any("engine in process" in line for line in lines)  # the tiny model's request path dominates


def test_the_paper_model_is_held_to_the_engine_s_own_images_per_second_at_the_batch_it_formed():
    """On a model whose compute dominates, one-image requests at c64 against the engine in process at the measured
    batch size nearest the server's mean batch."""
    engine = {"cpu_ms_per_image": {1: 2.0, 4: 1.5, 16: 1.2, 64: 1.1}, "images_per_s": {1: 400.0, 4: 520.0, 16: 600.0,
                                                                                       64: 640.0}}
    served = {"capsnet-1": {"cells": {"64": {"requests_per_s": 560.0, "mean_batch": 14.2}}}}
    report = {"concurrency": [64], "device": "", "cores": 2, "preset": "paper", "engine": engine, "servers": served}
    assert ("| requests/s at c64 ≥ 0.95× the engine in process at the mean batch (14.2; measured at 16) | capsnet-1 | "
            f"560 against 600 ({560 / 600:.2f}×) | **no** |") in bench_front_end.targets(report)
    served["capsnet-1"]["cells"]["64"]["requests_per_s"] = 575.0
    assert any(line.endswith(f"({575 / 600:.2f}×) | yes |") for line in bench_front_end.targets(report))
