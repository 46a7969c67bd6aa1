"""`capsnet bench --quick` end to end on the tiny model, as a user runs it (a child process)."""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile

import pytest

from capsnet.bench.engines import engine_names, served_here
from capsnet.bench.results import cells
from capsnet.serving.engine.backend_registry import BACKEND_KINDS
from capsnet.serving.engine.backends.torch_backend import bf16_unavailable_reason

CPU_ENGINES = ("torch:fp32", "public", "onnxruntime:fp32", "onnxruntime:int8")


@pytest.fixture(scope="module")
def quick_run(random_tiny_checkpoint, tmp_path_factory):
    out = tmp_path_factory.mktemp("bench") / "results"
    command = [sys.executable, "-m", "capsnet", "bench", str(random_tiny_checkpoint), "--quick", "--out", str(out)]
    finished = subprocess.run(command, capture_output=True, text=True, timeout=300)
    assert finished.returncode == 0, finished.stderr[-3000:]
    return out, json.loads((out / "results.json").read_text()), finished.stdout


def test_bench_quick_times_every_cpu_engine_at_every_batch_size(quick_run):
    _, results, _ = quick_run
    inprocess = results["inprocess"]
    timed = set(cells(inprocess["measurements"]))
    assert {(name, batch) for name in CPU_ENGINES for batch in (1, 8)} <= timed
    assert ("onnxruntime:fp32", 16) not in timed  # the gRPC rows time their own references
    for row in inprocess["measurements"]:
        figures = row["figures"]
        assert row["io"] == "numpy" and figures["calls"] >= 1 and figures["p50_ms"] <= figures["p99_ms"]
        assert figures["images_per_s"] == pytest.approx(row["batch"] / figures["p50_ms"] * 1e3)
        assert figures["share_of_ceiling"] == pytest.approx(figures["images_per_s"]
                                                            / results["ceiling"]["images_per_s"])


def test_bench_quick_takes_every_engine_the_registry_serves_on_the_cpu(quick_run):
    """Every row of the backend registry at each precision it serves on the CPU is timed or skipped with its reason,
    read from the registry: a row added there is benchmarked without a bench edit."""
    _, results, _ = quick_run
    inprocess = results["inprocess"]
    cpu_engines = {f"{kind.name}:{precision}" for kind in BACKEND_KINDS.values() for precision in kind.cpu_precisions}
    assert set(served_here(gpu=False)) == cpu_engines and cpu_engines <= set(engine_names())
    if results["machine"]["gpu"] is None:
        assert set(inprocess["engines"]) | set(inprocess["skipped"]) == cpu_engines | {"public"}
        assert not set(inprocess["engines"]) & set(inprocess["skipped"])
        assert all(reason for reason in inprocess["skipped"].values())
        # the fused kernels run on the CPU only in Triton's interpreter, which the workers never use
        assert "runs on a CUDA GPU" in inprocess["skipped"]["fused:fp32"]
    if bf16_unavailable_reason():  # skipped where it would be emulated
        assert "torch:bf16" in inprocess["skipped"]


def test_bench_quick_reports_accuracy_and_memory_per_backend(quick_run):
    _, results, _ = quick_run
    engines = results["inprocess"]["engines"]
    assert set(CPU_ENGINES) <= set(engines)
    for info in engines.values():
        assert 0.0 <= info["accuracy"] <= 1.0
        assert 0 < info["rss_start_mib"] < info["rss_loaded_mib"] <= info["peak_rss_mib"]
    # Same weights and math: the public baseline classifies exactly like our model.
    assert engines["public"]["accuracy"] == engines["torch:fp32"]["accuracy"]
    # Each engine in its own process: ONNX Runtime's workers do not carry torch.
    assert engines["onnxruntime:fp32"]["peak_rss_mib"] < engines["torch:fp32"]["rss_loaded_mib"]


def test_bench_quick_measures_the_cpu_limit_from_the_graph(quick_run):
    _, results, _ = quick_run
    assert results["flops"]["flops_per_image"] == sum(node["flops"] for node in results["flops"]["nodes"]) > 0
    conv = results["peak"]["conv"]
    assert conv["gflops"] == max(conv["gflops_torch"], conv["gflops_onnxruntime"]) > 0
    assert results["ceiling"]["images_per_s"] == pytest.approx(
        conv["gflops"] * 1e9 / results["flops"]["flops_per_image"])
    int8 = results["profiles"]["onnxruntime:int8"]
    assert "QLinearConv" in {op["op_type"] for op in int8["op_types"]}  # the Q/DQ convolutions run as int8 kernels
    assert 0 < int8["conv_share"] <= 1 and int8["conv_gops_in_model"] > 0


def test_bench_quick_serves_both_apis_with_and_without_batching(quick_run):
    _, results, _ = quick_run
    grpc_results = results["grpc"]
    combos = {(row["api"], row["dynamic_batching"], row["concurrency"]) for row in grpc_results["results"]}
    assert combos == {(api, batching, c)
                      for api in ("capsnet", "kserve") for batching in (True, False) for c in (1, 16)}
    for row in grpc_results["results"]:
        assert row["errors"] == 0 and row["requests"] > 0
        # the in-process reference is timed around each row, at batch size = concurrency
        reference = row["inprocess"]
        assert reference["batch_size"] == row["concurrency"] and reference["calls"] >= 2
        assert row["ratio_to_inprocess"] == pytest.approx(row["images_per_s"] / reference["images_per_s"])
        assert 0 < row["server_compute_busy"] <= 1 and row["server_cpu_per_s"] > 0
        assert 0 < row["server_mean_ms"]
        if row["dynamic_batching"]:
            assert 1 <= row["server_mean_batch"] <= row["concurrency"]
        else:
            assert row["server_mean_batch"] == 1  # off: every request is its own backend run
    memory = grpc_results["server_memory"]
    assert 0 < memory["idle_rss_mib"] <= memory["peak_rss_mib"]


def test_bench_quick_writes_the_report(quick_run):
    out, results, stdout = quick_run
    readme = (out / "README.md").read_text()
    assert results["command"] in readme and results["command"].startswith("capsnet bench ")
    # the checkpoint, --out and the temporary export named in the skip reasons are written as $TMPDIR/...
    for text in ((out / "results.json").read_text(), readme):
        assert f"{tempfile.gettempdir()}/" not in text and "$TMPDIR/" in text
    for heading in ("## Machine", "## The CPU's limit", "## In-process throughput and latency",
                    "## Engines side by side", "## End-to-end gRPC", "## Targets"):
        assert heading in readme
    flags = readme.split("CPU flags: ")[1].split(".\n")[0].split()
    assert flags == results["machine"]["cpu_flags"] and set(results["machine"]["isa"]) <= set(flags)
    assert readme.count("| onnxruntime:int8 | 8 |") == 1
    # side by side: ONNX Runtime's row at batch 8, its INT8 against the fastest FP32 engine there
    figures = cells(results["inprocess"]["measurements"])
    best_fp32 = max(figures[name, 8]["images_per_s"] for name in ("onnxruntime:fp32", "torch:fp32"))
    int8 = figures["onnxruntime:int8", 8]["images_per_s"]
    assert f"{int8:,.0f} ({int8 / best_fp32:.2f}×)" in readme.split("## Engines side by side")[1]
    checks = 8 if bf16_unavailable_reason() else 10  # bf16's speed and accuracy where it ran
    checks += "openvino:int8" in results["inprocess"]["engines"]  # its accuracy, where the openvino extra is installed
    assert len(results["targets"]) == checks and all(isinstance(t["met"], bool) for t in results["targets"])
    # Fractions of a second of timing: no verdict on the console or in the report, only the figures.
    assert stdout.count("[not judged: --quick]") == checks and "[met]" not in stdout and "[MISSED]" not in stdout
    assert readme.count("| not judged: --quick |") == checks and "**no**" not in readme
    for plot in ("inprocess.png", "grpc.png"):
        assert (out / plot).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
        assert f"]({plot})" in readme
