"""The GPU check's steps on the CPU, small: each writes its part, and the report (scripts/gpu_check_report.py) says
what ran, what did not, and what the targets compare (scripts/gpu_check.sh --cpu-dry-run walks the whole script;
this runs in CI)."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest

from capsnet.bench import gpu_check, harness

REPORT = Path(__file__).resolve().parents[2] / "scripts" / "gpu_check_report.py"


def test_the_steps_write_parts_and_the_report_tables_them(tiny_export, tmp_path):
    work, out = tmp_path / "work", tmp_path / "out"
    common = ["--work", str(work), "--cpu-dry-run", "--threads", "1"]
    for step in (["facts"], ["peak"], ["flops", "--model", str(tiny_export)],
                 ["engines", "--model", str(tiny_export), "--references", "public", "--kinds", "torch",
                  "--precisions", "fp32", "fp16", "--batches", "1", "4", "--no-profile"]):
        assert gpu_check.main([*step, *common]) == 0
    (work / "steps.jsonl").write_text(json.dumps({"step": "serve", "status": "timed out", "seconds": 150,
                                                  "limit": 150}) + "\n")
    done = subprocess.run([sys.executable, str(REPORT), "--work", str(work), "--out", str(out)], capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    summary = json.loads((out / "gpu_check.json").read_text())
    assert summary["facts"]["dry_run"] and summary["peak"]["matmul_fp32_tflops"] > 0
    assert summary["flops"]["flops_per_image"] > 0 and summary["flops"]["bytes_in_per_image"] == 4 * 28 * 28
    engines = summary["engines"]
    # the registry's torch row at the precisions asked for; fp16 needs a GPU: refused in its own line
    assert set(engines["engines"]) == {"public", "torch:fp32"}
    assert "add --gpu N" in engines["failed"]["torch:fp16"]
    # numpy in and out, and device-resident (the CPU here), each a measurement of its own
    assert sorted((row["engine"], row["batch"], row["io"]) for row in engines["measurements"]) == sorted(
        (engine, batch, io) for engine in ("torch:fp32", "public") for batch in (1, 4)
        for io in ("numpy", "device_resident"))
    assert all(row["figures"]["calls"] == 3 and row["figures"]["p50_ms"] > 0 for row in engines["measurements"])
    assert engines["engines"]["torch:fp32"]["self_check"]["passed"]
    analysis = summary["analysis"]["batch_4"]
    assert analysis["best"] == "torch:fp32" and analysis["speedup_vs_public"] > 0
    assert 0 < analysis["share_of_matmul_peak"]
    ratio = summary["engine_ratios"]["numpy_batch_1"]["vs_public"]
    [target] = summary["targets"]  # at batch 1 against the public formulation: the only one measured here
    assert target["values"]["ratio"] == ratio and target["met"] == (ratio >= 10.0)
    markdown = (out / "gpu_check.md").read_text()
    assert markdown.startswith("# GPU check — CPU DRY RUN")
    assert "| serve | timed out | 150 | 150 |" in markdown and "| torch:fp32 |" in markdown
    assert "torch:fp16: did not run: --precision fp16 on the torch backend runs on a GPU" in markdown
    assert f"[{'met' if target['met'] else 'MISSED'}] {target['target']}" in markdown


def test_the_harness_takes_each_registry_row_at_the_precisions_it_serves():
    assert harness.served_engines(["onnxruntime", "fused"], ["int8", "bf16"]) == ["onnxruntime:int8", "fused:bf16"]
    assert harness.served_engines(["aoti"], ["fp32", "fp16", "bf16", "int8"]) == ["aoti:fp32", "aoti:fp16",
                                                                                   "aoti:bf16"]


def test_the_profile_splits_the_fused_kernels_time_from_the_convolutions():
    """Kernel names as an H200 profile shows them (torch 2.11, cuDNN 9.19; the routing is one kernel, launched
    once an iteration): µs over 5 calls -> ms a call."""
    kernels = [("_routing_pass", 1600.0),
               ("void cutlass__5x_cudnn::Kernel<cutlass_tensorop_bf16_s16816fprop_optimized_bf16_128x128_64x3", 1720.0),
               ("sm80_xmma_fprop_implicit_gemm_indexed_bf16bf16_bf16f32_f32_nhwckrsc_nchw", 130.0),
               ("void cudnn::engines_precompiled::nhwcToNchwKernel<__nv_bfloat16, __nv_bfloat16, float>", 260.0),
               ("Memcpy DtoD (Device -> Device)", 25.0), ("triton_poi_fused__to_copy_3", 40.0)]
    split = harness.device_time_split(kernels, ("_routing_pass",), calls=5)
    assert split == pytest.approx({"fused_routing_ms": 0.32, "convolutions_ms": 0.422, "copies_ms": 0.005,
                                   "other_ms": 0.008})
    assert harness.device_time_split(kernels, (), calls=5)["fused_routing_ms"] == 0.0
    cells = [{"engine": "fused:fp16", "batch": 256, "io": "device_resident", "figures": {"p50_ms": 2.0}},
             {"engine": "fused:fp16", "batch": 256, "io": "numpy", "figures": {"p50_ms": 2.4, "images_per_s": 106_667}}]
    spec = importlib.util.spec_from_file_location("gpu_check_report", REPORT)
    assert spec is not None and spec.loader is not None
    report = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(report)
    markdown = report.engines_markdown({"measurements": cells, "device_time_split": {"fused:fp16": {"256": split}}})
    assert "| fused:fp16 | 2.000 / 2.400 (106,667/s) |" in markdown
    assert "| fused:fp16 | 256 | 0.320 ms | 0.422 ms | 0.005 ms | 0.008 ms |" in markdown
