"""The performance targets, checked against a run's measurements (never by a timed test).

Each check says what was measured, whether it is met, and where it is not, by how much (`short_by`) and
what bounds it (`bound`), from the same run's profile and server metrics.
"""

from __future__ import annotations

from capsnet.bench.analysis.ortprofile import CONV_OP_TYPES
from capsnet.bench.engines import fastest, ordered, split
from capsnet.bench.results import PUBLIC, cells
from capsnet.runtime.cpu import CpuKind

MIN_BATCH = 8  # throughput targets apply at batch >= 8
CEILING_SHARE = 0.90
PUBLIC_SPEEDUP = 3.0
# int8 dot products: VNNI/AMX hosts multiply-add u8×s8 in one instruction; AVX2 needs three, with an int16 step
INT8_SPEEDUP = {"vnni": 3.0, "avx2": 2.0}
MAX_ACCURACY_LOSS_POINTS = 0.3  # a reduced precision against the same backend's fp32
# what bounds a reduced precision's accuracy, named where its loss is too large
ROUNDING = {"int8": "the int8 convolutions' rounding and saturation", "bf16": "bf16's 8-bit mantissa in the "
            "convolutions", "fp16": "fp16's 11-bit mantissa and its range"}
GRPC_CONCURRENCY, GRPC_SHARE = 16, 0.90
GRPC_P50_EXTRA_MS = 1.0
SERVER_CPU_CORES = 1.2  # CPU seconds per second of the server at concurrency 1
SERVER_RSS_MIB = 1024


def evaluate(results: dict) -> list[dict]:
    """[{target, measured, met, values, short_by, bound}] for each target whose measurements this run has.

    Each precision is judged by its fastest engine at each batch size (capsnet.bench.engines.fastest): the INT8
    verdict is the fastest INT8 engine against the fastest FP32 engine, whichever backends they are."""
    figures = cells(results["inprocess"]["measurements"])
    batches = sorted({batch for name, batch in figures if ":" in name and batch >= MIN_BATCH})
    profiles = results.get("profiles") or {}
    checks = []

    def best(precision: str) -> dict[int, str]:
        """batch -> the fastest engine at `precision` there."""
        return {batch: name for batch in batches if (name := fastest(figures, precision, batch))}

    def per_batch(target: str, numerator: dict[int, str], denominator, threshold: float, fmt, bound: str) -> None:
        """The engines' images/s (batch -> engine) over denominator(batch) at every batch >= MIN_BATCH, all >=
        threshold."""
        values = {}
        for batch, name in numerator.items():
            base = denominator(batch)
            if base:
                values[batch] = figures[name, batch]["images_per_s"] / base
        if values:
            engines = ", ".join(dict.fromkeys(numerator[batch] for batch in values))
            measured = ", ".join(f"batch {b}: {fmt(v)}" for b, v in values.items()) + f" ({engines})"
            worst = min(values.values())
            shortfall = f"{threshold / worst:.2f}× faster needed at the worst batch" if worst < threshold else ""
            checks.append(_check(target, measured, worst >= threshold, {str(b): v for b, v in values.items()},
                                 shortfall, bound))

    def images_per_s(engines: dict[int, str]):
        return lambda batch: figures[engines[batch], batch]["images_per_s"] if batch in engines else None

    fp32, int8 = best("fp32"), best("int8")
    ceiling = results["ceiling"]["images_per_s"]
    per_batch(f"the fastest FP32 engine at batch ≥ {MIN_BATCH}: ≥ {CEILING_SHARE:.0%} of the fp32 ceiling", fp32,
              lambda batch: ceiling, CEILING_SHARE, _percent, _non_conv(_profile_of(profiles, fp32)))
    public = {batch: figures[PUBLIC, batch]["images_per_s"] for batch in batches if (PUBLIC, batch) in figures}
    per_batch(f"the fastest FP32 engine at batch ≥ {MIN_BATCH}: ≥ {PUBLIC_SPEEDUP:g}× the public PyTorch CapsNet "
              "(XifengGuo/CapsNet-Pytorch formulation)", fp32, public.get, PUBLIC_SPEEDUP, _times,
              f"at 100% of the ceiling an FP32 engine would be {ceiling / max(public.values()):.2f}× the baseline at "
              "the baseline's fastest batch" if public else "")
    isa = frozenset(results.get("machine", {}).get("isa", ()))
    kind = "vnni" if CpuKind("", isa).vnni else "avx2"
    int8_speedup = INT8_SPEEDUP[kind]
    per_batch(f"INT8 at batch ≥ {MIN_BATCH}: ≥ {int8_speedup:g}× FP32 throughput, the fastest INT8 engine against "
              f"the fastest FP32 engine ({'a VNNI/AMX' if kind == 'vnni' else 'an AVX2, no-VNNI'} host)", int8,
              images_per_s(fp32), int8_speedup, _times, _non_conv(_profile_of(profiles, int8)))

    # bf16 pays where its convolutions beat fp32's in the same framework (oneDNN's AMX/AVX512_BF16 kernels)
    for backend in dict.fromkeys(split(name)[0] for name, _ in figures if name.endswith(":bf16")):
        same = {batch: f"{backend}:fp32" for batch in batches if (f"{backend}:fp32", batch) in figures}
        per_batch(f"{backend} at bf16, batch ≥ {MIN_BATCH}: faster than {backend} at fp32 (a native-bf16 host)",
                  {batch: f"{backend}:bf16" for batch in batches if (f"{backend}:bf16", batch) in figures},
                  images_per_s(same), 1.0, _times,
                  "oneDNN's bf16 convolution kernels on this CPU against its fp32 ones")

    engines = results["inprocess"]["engines"]
    for name in ordered(engines):
        backend, precision = split(name)
        full = f"{backend}:fp32"
        if precision in ("", "fp32") or full not in engines:
            continue
        loss = (engines[full]["accuracy"] - engines[name]["accuracy"]) * 100
        met = loss <= MAX_ACCURACY_LOSS_POINTS
        checks.append(_check(f"{name} accuracy loss against {full} ≤ {MAX_ACCURACY_LOSS_POINTS} points",
                             f"{loss:+.2f} points ({results['inprocess']['accuracy_images']} images)", met,
                             {"loss_points": loss}, f"{loss - MAX_ACCURACY_LOSS_POINTS:.2f} points",
                             ROUNDING.get(precision, "")))

    grpc_results = results.get("grpc")
    if grpc_results:
        checks += _grpc_checks(grpc_results)
    return checks


def _profile_of(profiles: dict, engines: dict[int, str]) -> dict | None:
    """The profile of the fastest engine at the largest batch size, where one was taken (ONNX Runtime's)."""
    return profiles.get(engines[max(engines)]) if engines else None


def _check(target: str, measured: str, met: bool, values: dict, short_by: str, bound: str) -> dict:
    return {"target": target, "measured": measured, "met": met, "values": values,
            "short_by": "" if met else short_by, "bound": "" if met else bound}


def _non_conv(profile: dict | None) -> str:
    """What the profile says bounds a backend: the convolutions' speed and the share of time outside them."""
    if not profile:
        return ""
    conv = sum(op["share"] for op in profile["op_types"] if op["op_type"] in CONV_OP_TYPES)
    others = ", ".join(f"{op['op_type']} {op['share'] * 100:.1f}%" for op in profile["op_types"]
                       if op["op_type"] not in CONV_OP_TYPES)
    return (f"convolutions {conv * 100:.1f}% of ONNX Runtime's time at batch {profile['batch_size']}, the rest "
            f"{(1 - conv) * 100:.1f}% ({others})")


def _percent(value: float) -> str:
    return f"{value * 100:.1f}%"


def _times(value: float) -> str:
    return f"{value:.2f}×"


def _grpc_checks(grpc_results: dict) -> list[dict]:
    checks = []
    batched = [row for row in grpc_results["results"] if row["dynamic_batching"]]
    at_16 = {row["api"]: row for row in batched if row["concurrency"] == GRPC_CONCURRENCY}
    if at_16:
        ratios = {api: row["ratio_to_inprocess"] for api, row in at_16.items()}
        worst = min(ratios.values())
        checks.append(_check(
            f"gRPC at concurrency {GRPC_CONCURRENCY} with dynamic batching: ≥ {GRPC_SHARE:.0%} of in-process "
            f"at batch {GRPC_CONCURRENCY} (timed around the row)",
            ", ".join(f"{api}: {_percent(ratio)}" for api, ratio in ratios.items()), worst >= GRPC_SHARE, ratios,
            f"{(GRPC_SHARE - worst) * 100:.1f} points",
            "the backend's compute per image inside the server against in-process: "
            + ", ".join(f"{row['server_compute_busy'] / row['images_per_s'] * 1e3:.2f} against "
                        f"{1e3 / row['inprocess']['images_per_s']:.2f} ms ({api})" for api, row in at_16.items())
            + ", its threads sharing the cores with the server's and the load generator's Python (CPU/s server / "
              "client: "
            + ", ".join(f"{row['server_cpu_per_s']:.2f} / {row['client_cpu_per_s']:.2f}" for row in at_16.values())
            + "); batches of " + ", ".join(f"{row['server_mean_batch']:.1f} ({api})" for api, row in at_16.items())
            + f" images on average instead of {GRPC_CONCURRENCY}"))
    at_1 = {row["api"]: row for row in batched if row["concurrency"] == 1}
    if at_1:
        extra = {api: row["p50_ms"] - row["inprocess"]["p50_ms"] for api, row in at_1.items()}
        worst = max(extra.values())
        checks.append(_check(
            f"gRPC at concurrency 1: p50 within {GRPC_P50_EXTRA_MS:g} ms of in-process (timed around the row)",
            ", ".join(f"{api}: {ms:+.2f} ms" for api, ms in extra.items()), worst <= GRPC_P50_EXTRA_MS, extra,
            f"{worst - GRPC_P50_EXTRA_MS:.2f} ms",
            "; ".join(f"{api}: in-process p50 {row['inprocess']['p50_ms']:.2f} ms, mean time inside the server "
                      f"{row['server_mean_ms']:.2f} ms (+{row['server_mean_ms'] - row['inprocess']['p50_ms']:.2f} ms: "
                      f"the server's request path and its backend sharing the cores with it), the remaining "
                      f"{row['p50_ms'] - row['server_mean_ms']:.2f} ms the Python gRPC client and loopback transport"
                      for api, row in at_1.items())))
    if at_1:
        cpu = {api: row["server_cpu_per_s"] for api, row in at_1.items()}
        worst = max(cpu.values())
        checks.append(_check(
            f"server CPU at concurrency 1 ≤ {SERVER_CPU_CORES:g} cores",
            ", ".join(f"{api}: {cores:.2f}" for api, cores in cpu.items()), worst <= SERVER_CPU_CORES, cpu,
            f"{worst - SERVER_CPU_CORES:.2f} cores",
            "the backend computing on its intra-op threads "
            + ", ".join(f"{row['server_compute_busy'] * 100:.0f}% ({api})" for api, row in at_1.items())
            + " of the time, plus the Python request path"))
    peak = grpc_results["server_memory"]["peak_rss_mib"]
    checks.append(_check(f"server RSS under load ≤ {SERVER_RSS_MIB / 1024:g} GiB", f"{peak:.0f} MiB",
                         peak <= SERVER_RSS_MIB, {"peak_rss_mib": peak}, f"{peak - SERVER_RSS_MIB:.0f} MiB",
                         "the model, ONNX Runtime's arenas and gRPC buffers"))
    return checks


# The GPU check's (capsnet/bench/gpu_check.py). In one process, numpy in and out: the fastest served engine against
# the public formulation at batches 1 and 256, and against torch.compile of the model at 256. Served: gRPC and REST
# throughput at 32 images a request against in-process at batch 32, and one image's p50 at concurrency 1.
GPU_PUBLIC_SPEEDUP = 10.0
GPU_COMPILE_SPEEDUP = 2.0
GPU_SERVED_SHARE = 0.5
GPU_SERVED_P50_MS = 2.0


def evaluate_gpu(engine_ratios: dict, served: dict) -> list[dict]:
    """[{target, measured, met, ...}] from the harness's ratios (capsnet.bench.harness.ratios) and the served
    figures ({"served_<api>_share_of_inprocess_batch32": share, "served_<api>_one_image_p50_ms": ms})."""
    checks = []
    for key, entry in engine_ratios.items():
        way, batch = key.split("_batch_")
        if way != "numpy":
            continue
        for reference, threshold, what in (("public", GPU_PUBLIC_SPEEDUP, "the public PyTorch CapsNet"),
                                           ("compile", GPU_COMPILE_SPEEDUP, "the model under torch.compile")):
            value = entry.get(f"vs_{reference}")
            if value is None or (reference == "compile" and batch != "256"):
                continue
            checks.append(_check(f"fastest served engine at batch {batch}, numpy in and out: ≥ {threshold:g}× {what}",
                                 f"{entry['best']}: {_times(value)}", value >= threshold, {"ratio": value},
                                 f"{threshold / value:.2f}× faster needed", ""))
    for key, value in served.items():
        if value is None:
            continue
        api = key.split("_")[1]
        if key.endswith("share_of_inprocess_batch32"):
            checks.append(_check(f"{api} at 32 images a request: ≥ {GPU_SERVED_SHARE:.0%} of in-process at batch 32",
                                 _percent(value), value >= GPU_SERVED_SHARE, {"share": value},
                                 f"{(GPU_SERVED_SHARE - value) * 100:.1f} points", ""))
        elif key.endswith("one_image_p50_ms"):
            checks.append(_check(f"{api}, one image at concurrency 1: p50 ≤ {GPU_SERVED_P50_MS:g} ms",
                                 f"{value:.2f} ms", value <= GPU_SERVED_P50_MS, {"p50_ms": value},
                                 f"{value - GPU_SERVED_P50_MS:.2f} ms", ""))
    return checks
