"""The analysis' sections of a benchmark's README (the CPU's limit, ONNX Runtime's profile, the public reference, the
targets); capsnet.bench.report_files places them among the measurements' tables."""

from __future__ import annotations

from capsnet.bench.analysis.ortprofile import CONV_OP_TYPES
from capsnet.bench.report_files import QUICK_VERDICT, table


def sections(results: dict) -> dict[str, list[str]]:
    """Markdown lines by where they go (capsnet.bench.report_files.SECTIONS)."""
    found = {
        "engines": [
            "",
            "`public` is not our model: it is `capsnet/bench/analysis/public_reference.py`, a "
            "re-implementation of how the most-used public PyTorch CapsNet (XifengGuo/CapsNet-Pytorch) computes a "
            "forward pass, run eagerly: PrimaryCaps as one convolution; W as a (J, I, D, P) parameter, (10, 1152, 16, "
            "8) in the paper model; û by a broadcast `torch.matmul` of W with u[:, None, :, :, None]; logits (B, 10, "
            "1152) with a softmax over the classes in every iteration; sums over û as elementwise products then sums; "
            "the masked decoder. It is loaded with our weights (capsules grouped as ours, its one deviation), so it "
            "computes the same outputs.",
        ],
        "limit": _limit_section(results),
        "targets": ["## Targets", "", table(["target", "measured", "met", "short by", "what bounds it"], [
            [t["target"], t["measured"], QUICK_VERDICT, "", ""] if results["quick"] else
            [t["target"], t["measured"], "yes" if t["met"] else "**no**", t.get("short_by", ""), t.get("bound", "")]
            for t in results["targets"]
        ])],
    }
    if results.get("profiles"):
        found["profile"] = _profile_section(results["profiles"], results["ceiling"]["gflops"])
    return found


def _limit_section(results: dict) -> list[str]:
    flops, peak, ceiling = results["flops"], results["peak"], results["ceiling"]
    largest = max(flops["nodes"], key=lambda node: node["flops"])
    conv = peak["conv"]
    return [
        "## The CPU's limit",
        "",
        f"- FLOPs per image, counted from the exported graph (Conv/MatMul/Gemm/Einsum shapes, 2 per multiply-add): "
        f"**{flops['flops_per_image'] / 1e6:.1f} MFLOP**; the largest node, `{largest['name']}` "
        f"({largest['op_type']}), is {largest['share'] * 100:.1f}% of it.",
        f"- fp32 peak on {peak['threads']} threads (the median of {len(peak.get('runs', [peak]))} measurements, "
        f"one after each interleaved round of the in-process backends, so under the load they ran under; the "
        f"PrimaryCaps-shaped conv ranged {_range(peak, 'gflops')} GFLOP/s over them): "
        f"{peak['matmul']['gflops']:.0f} GFLOP/s on a {'×'.join(map(str, peak['matmul']['shape']))} matmul; "
        f"{conv['gflops_torch']:.0f} (PyTorch) and "
        f"{conv['gflops_onnxruntime']:.0f} (ONNX Runtime) GFLOP/s on a PrimaryCaps-shaped conv "
        f"({'×'.join(map(str, conv['input_shape']))} input, {'×'.join(map(str, conv['weight_shape']))} weights, "
        f"stride {conv['stride']}).",
        f"- Ceiling: {conv['gflops']:.0f} GFLOP/s ÷ {flops['flops_per_image'] / 1e6:.1f} MFLOP = "
        f"**{ceiling['images_per_s']:.0f} images/s**.",
    ]


def _range(peak: dict, key: str) -> str:
    values = [run["conv"][key] for run in peak.get("runs", [peak])]
    return f"{min(values):.0f}–{max(values):.0f}"


def _profile_section(profiles: dict, peak_gflops: float) -> list[str]:
    lines = ["## Where ONNX Runtime spends its time", "",
             "From ONNX Runtime's profiler (node time by operator type, after graph optimisation), then the "
             "convolutions' speed inside the model: their FLOPs over their share of the measured time per image at "
             "that batch size.", ""]
    for name, profile in profiles.items():
        top = ", ".join(f"{op['op_type']} {op['share'] * 100:.1f}%" for op in profile["op_types"][:6])
        kernels = "; ".join(f"{op['op_type']}: {', '.join(op['kernels'])}" for op in profile["op_types"]
                            if op["op_type"] in CONV_OP_TYPES)
        lines.append(f"- `{name}` at batch {profile['batch_size']} ({profile['runs']} profiled runs): {top}. "
                     f"Convolutions: {profile['conv_share'] * 100:.1f}% of the time, at "
                     f"{profile['conv_gops_in_model']:.0f} GOP/s "
                     f"({profile['conv_gops_in_model'] / peak_gflops * 100:.0f}% of the fp32 conv peak); "
                     f"kernels {kernels}.")
    return lines
