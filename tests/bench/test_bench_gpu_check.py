"""The GPU check's steps on the CPU, small: each writes its part, and the report says what ran, what did not, and
what the targets compare (scripts/gpu_check.sh --cpu-dry-run walks the whole script; this runs in CI)."""

from __future__ import annotations

import json

import pytest

from capsnet.bench.analysis import gpu_check, gpu_engines


def test_the_steps_write_parts_and_the_report_tables_them(tiny_export, tmp_path):
    work, out = tmp_path / "work", tmp_path / "out"
    common = ["--work", str(work), "--cpu-dry-run", "--threads", "1"]
    for step in (["facts"], ["peak"], ["flops", "--model", str(tiny_export)],
                 ["inprocess", "--model", str(tiny_export), "--specs", "torch:fp32", "public:fp32", "torch:fp16",
                  "--batches", "1", "4", "--seconds", "0.03", "--rounds", "1"]):
        assert gpu_check.main([*step, *common]) == 0
    (work / "steps.jsonl").write_text(json.dumps({"step": "serve", "status": "timed out", "seconds": 150,
                                                  "limit": 150}) + "\n")
    assert gpu_check.main(["report", "--work", str(work), "--out", str(out)]) == 0
    summary = json.loads((out / "gpu_check.json").read_text())
    assert summary["facts"]["dry_run"] and summary["peak"]["matmul_fp32_tflops"] > 0
    assert summary["flops"]["flops_per_image"] > 0 and summary["flops"]["bytes_in_per_image"] == 4 * 28 * 28
    inprocess = summary["inprocess"]
    # fp16 needs a GPU: refused in its own line, the others timed
    assert "torch:fp16" in inprocess["failed"] and "add --gpu N" in inprocess["failed"]["torch:fp16"]
    assert {(row["backend"], row["batch_size"]) for row in inprocess["results"]} == {
        ("torch:fp32", 1), ("torch:fp32", 4), ("public:fp32", 1), ("public:fp32", 4)}
    assert inprocess["backends"]["torch:fp32"]["self_check"]["passed"]
    analysis = summary["analysis"]["batch_4"]
    assert analysis["best"] == "torch:fp32" and analysis["speedup_vs_public"] > 0
    assert 0 < analysis["share_of_matmul_peak"]
    markdown = (out / "gpu_check.md").read_text()
    assert markdown.startswith("# GPU check — CPU DRY RUN")
    assert "| serve | timed out | 150 | 150 |" in markdown and "| torch:fp32 |" in markdown
    assert "torch:fp16: did not load: CapsNetError: --precision fp16 on the torch backend runs on a GPU" in markdown


def test_the_profile_splits_the_fused_kernels_time_from_the_convolutions():
    """Kernel names as an H200 profile shows them (torch 2.11, cuDNN 9.19): µs over 5 calls -> ms a call."""
    kernels = [("_routing_pass", 1500.0), ("_routing_reduce", 100.0),
               ("void cutlass__5x_cudnn::Kernel<cutlass_tensorop_bf16_s16816fprop_optimized_bf16_128x128_64x3", 1720.0),
               ("sm80_xmma_fprop_implicit_gemm_indexed_bf16bf16_bf16f32_f32_nhwckrsc_nchw", 130.0),
               ("void cudnn::engines_precompiled::nhwcToNchwKernel<__nv_bfloat16, __nv_bfloat16, float>", 260.0),
               ("Memcpy DtoD (Device -> Device)", 25.0), ("triton_poi_fused__to_copy_3", 40.0)]
    split = gpu_engines.device_time_split(kernels, ("_routing_pass", "_routing_reduce"), calls=5)
    assert split == pytest.approx({"fused_routing_ms": 0.32, "convolutions_ms": 0.422, "copies_ms": 0.005,
                                   "other_ms": 0.008})
    assert gpu_engines.device_time_split(kernels, (), calls=5)["fused_routing_ms"] == 0.0
    cell = {"engine": "fused:fp16", "batch_size": 256, "device_resident": {"p50_ms": 2.0},
            "numpy": {"p50_ms": 2.4, "images_per_s": 106_667}}
    markdown = gpu_engines.markdown({"results": [cell], "device_time_split": {"fused:fp16": {"256": split}}})
    assert "| fused:fp16 | 256 | 0.320 ms | 0.422 ms | 0.005 ms | 0.008 ms |" in markdown
