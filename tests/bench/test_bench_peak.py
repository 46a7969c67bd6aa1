"""The ceiling's peak: the median of the per-round measurements, the faster conv implementation counting."""

from __future__ import annotations

from capsnet.bench.analysis.peak import median_peak


def _run(matmul, torch_conv, ort_conv):
    return {"threads": 2, "matmul": {"shape": [4, 4, 4], "gflops": matmul},
            "conv": {"input_shape": [1], "weight_shape": [1], "stride": 2, "gflops_torch": torch_conv,
                     "gflops_onnxruntime": ort_conv, "gflops": max(torch_conv, ort_conv)}}


def test_bench_peak_is_the_median_round_not_the_calmest():
    runs = [_run(200, 150, 170), _run(100, 60, 80), _run(190, 140, 90), _run(210, 100, 175), _run(50, 40, 45)]
    peak = median_peak(runs)
    assert peak["matmul"]["gflops"] == 190
    assert peak["conv"]["gflops_torch"] == 100 and peak["conv"]["gflops_onnxruntime"] == 90
    assert peak["conv"]["gflops"] == 100  # the faster implementation's median, not the best round's 175
    assert peak["runs"] == runs and peak["conv"]["stride"] == 2
