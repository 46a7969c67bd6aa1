"""Targets are judged from the numbers of a run: each check met or missed as its definition says."""

from __future__ import annotations

from capsnet.bench.targets import evaluate


def _row(backend, batch, images_per_s, p50_ms=1.0):
    return {"backend": backend, "batch_size": batch, "images_per_s": images_per_s, "p50_ms": p50_ms}


def _results(fp32_at_32=360.0, int8_at_32=700.0, int8_accuracy=0.978, grpc=None):
    return {
        "ceiling": {"images_per_s": 400.0},
        "inprocess": {
            "accuracy_images": 1000,
            "backends": {"onnxruntime-fp32": {"accuracy": 0.98}, "onnxruntime-int8": {"accuracy": int8_accuracy}},
            "results": [
                _row("onnxruntime-fp32", 1, 100.0), _row("onnxruntime-fp32", 8, 350.0),
                _row("onnxruntime-fp32", 32, fp32_at_32),
                _row("onnxruntime-int8", 8, 700.0), _row("onnxruntime-int8", 32, int8_at_32),
                _row("pytorch-public", 8, 130.0), _row("pytorch-public", 32, 140.0),
            ],
        },
        "grpc": grpc,
    }


def test_bench_targets_all_met():
    checks = evaluate(_results())
    assert len(checks) == 4
    assert all(check["met"] for check in checks), checks


def test_bench_targets_each_miss_is_reported_with_its_batch():
    checks = evaluate(_results(fp32_at_32=300.0, int8_at_32=500.0, int8_accuracy=0.975))
    ceiling, public, int8_speed, int8_accuracy = checks
    assert not ceiling["met"] and "batch 8: 87.5%, batch 32: 75.0%" in ceiling["measured"]  # 350, 300 of 400
    assert not public["met"] and "batch 8: 2.69×, batch 32: 2.14×" in public["measured"]  # 350/130, 300/140
    assert not int8_speed["met"] and "batch 32: 1.67×" in int8_speed["measured"]
    assert not int8_accuracy["met"] and "+0.50 points" in int8_accuracy["measured"]


def test_bench_targets_grpc_and_memory():
    grpc = {
        "inprocess_reference": [{"batch_size": 1, "p50_ms": 2.0}, {"batch_size": 16, "p50_ms": 40.0}],
        "results": [
            {"api": "capsnet", "dynamic_batching": True, "concurrency": 1, "p50_ms": 2.5, "ratio_to_inprocess": 0.8},
            {"api": "kserve", "dynamic_batching": True, "concurrency": 1, "p50_ms": 3.5, "ratio_to_inprocess": 0.7},
            {"api": "capsnet", "dynamic_batching": True, "concurrency": 16, "p50_ms": 45.0, "ratio_to_inprocess": 0.9},
            {"api": "kserve", "dynamic_batching": True, "concurrency": 16, "p50_ms": 46.0, "ratio_to_inprocess": 0.86},
            {"api": "capsnet", "dynamic_batching": False, "concurrency": 16, "p50_ms": 90.0, "ratio_to_inprocess": 0.2},
        ],
        "server_memory": {"idle_rss_mib": 300.0, "peak_rss_mib": 1100.0},
    }
    checks = evaluate(_results(grpc=grpc))[4:]
    share, latency, memory = checks
    assert share["met"] and "capsnet: 90.0%" in share["measured"] and "kserve: 86.0%" in share["measured"]
    assert not latency["met"] and "kserve: +1.50 ms" in latency["measured"]
    assert not memory["met"] and "1100 MiB" in memory["measured"]
