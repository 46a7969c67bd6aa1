"""The performance targets of issue #6, checked against a run's measurements (never by a timed test)."""

from __future__ import annotations

FP32, INT8, PUBLIC = "onnxruntime-fp32", "onnxruntime-int8", "pytorch-public"
MIN_BATCH = 8  # throughput targets apply at batch >= 8
CEILING_SHARE = 0.85
PUBLIC_SPEEDUP = 2.5
INT8_SPEEDUP = 1.8
INT8_MAX_ACCURACY_LOSS_POINTS = 0.3
GRPC_CONCURRENCY, GRPC_SHARE = 16, 0.85
GRPC_P50_EXTRA_MS = 1.0
SERVER_RSS_MIB = 1024


def evaluate(results: dict) -> list[dict]:
    """[{target, measured, met}] for each target whose measurements this run has."""
    rows = {(row["backend"], row["batch_size"]): row for row in results["inprocess"]["results"]}
    batches = sorted({batch for name, batch in rows if name == FP32 and batch >= MIN_BATCH})
    checks = []

    def per_batch(target: str, numerator: str, denominator, threshold: float, fmt) -> None:
        """numerator's images/s over denominator(batch) at every batch >= MIN_BATCH, all >= threshold."""
        values = {}
        for batch in batches:
            if (numerator, batch) in rows:
                base = denominator(batch)
                if base:
                    values[batch] = rows[numerator, batch]["images_per_s"] / base
        if values:
            measured = ", ".join(f"batch {b}: {fmt(v)}" for b, v in values.items())
            checks.append({"target": target, "measured": measured, "met": min(values.values()) >= threshold,
                           "values": {str(b): v for b, v in values.items()}})

    ceiling = results["ceiling"]["images_per_s"]
    per_batch(f"ONNX Runtime FP32 at batch ≥ {MIN_BATCH}: ≥ {CEILING_SHARE:.0%} of the fp32 ceiling", FP32,
              lambda batch: ceiling, CEILING_SHARE, _percent)
    per_batch(f"ONNX Runtime FP32 at batch ≥ {MIN_BATCH}: ≥ {PUBLIC_SPEEDUP}× the public-style PyTorch CapsNet", FP32,
              lambda batch: rows.get((PUBLIC, batch), {}).get("images_per_s"), PUBLIC_SPEEDUP, _times)
    per_batch(f"INT8 at batch ≥ {MIN_BATCH}: ≥ {INT8_SPEEDUP}× FP32 throughput", INT8,
              lambda batch: rows[FP32, batch]["images_per_s"], INT8_SPEEDUP, _times)

    backends = results["inprocess"]["backends"]
    if FP32 in backends and INT8 in backends:
        loss = (backends[FP32]["accuracy"] - backends[INT8]["accuracy"]) * 100
        checks.append({"target": f"INT8 accuracy loss ≤ {INT8_MAX_ACCURACY_LOSS_POINTS} points",
                       "measured": f"{loss:+.2f} points ({results['inprocess']['accuracy_images']} images)",
                       "met": loss <= INT8_MAX_ACCURACY_LOSS_POINTS, "values": {"loss_points": loss}})

    grpc_results = results.get("grpc")
    if grpc_results:
        checks += _grpc_checks(grpc_results)
    return checks


def _percent(value: float) -> str:
    return f"{value * 100:.1f}%"


def _times(value: float) -> str:
    return f"{value:.2f}×"


def _grpc_checks(grpc_results: dict) -> list[dict]:
    checks = []
    reference = {row["batch_size"]: row for row in grpc_results["inprocess_reference"]}
    batched = [row for row in grpc_results["results"] if row["dynamic_batching"]]
    at_16 = {row["api"]: row["ratio_to_inprocess"] for row in batched if row["concurrency"] == GRPC_CONCURRENCY}
    if at_16:
        checks.append({
            "target": f"gRPC at concurrency {GRPC_CONCURRENCY} with dynamic batching: ≥ {GRPC_SHARE:.0%} of in-process "
                      f"at batch {GRPC_CONCURRENCY}",
            "measured": ", ".join(f"{api}: {_percent(ratio)}" for api, ratio in at_16.items()),
            "met": min(at_16.values()) >= GRPC_SHARE, "values": at_16,
        })
    if 1 in reference:
        extra = {row["api"]: row["p50_ms"] - reference[1]["p50_ms"] for row in batched if row["concurrency"] == 1}
        if extra:
            checks.append({
                "target": f"gRPC at concurrency 1: p50 within {GRPC_P50_EXTRA_MS:g} ms of in-process",
                "measured": ", ".join(f"{api}: {ms:+.2f} ms" for api, ms in extra.items()),
                "met": max(extra.values()) <= GRPC_P50_EXTRA_MS, "values": extra,
            })
    peak = grpc_results["server_memory"]["peak_rss_mib"]
    checks.append({"target": f"server RSS under load ≤ {SERVER_RSS_MIB / 1024:g} GiB", "measured": f"{peak:.0f} MiB",
                   "met": peak <= SERVER_RSS_MIB, "values": {"peak_rss_mib": peak}})
    return checks
