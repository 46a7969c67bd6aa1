"""`capsnet bench` from start to end: artifacts, in-process engines, gRPC, the analysis where installed, report."""

from __future__ import annotations

import json
import logging
import tempfile
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path

import numpy as np

from capsnet.bench.engines import split
from capsnet.bench.grpc_load import run_grpc_load
from capsnet.bench.inprocess import EnginePlan, Schedule, run_inprocess
from capsnet.bench.machine import cpu_shares, cpu_times, load_average, machine_facts
from capsnet.bench.report_files import write_report
from capsnet.bench.results import PUBLIC, portable
from capsnet.errors import CapsNetError

log = logging.getLogger(__name__)

TENSORRT_OPT_BATCH = 32  # the batch size TensorRT engines are tuned for (at most the largest one measured)


@dataclass(frozen=True)
class BenchOptions:
    model: Path  # a checkpoint (exported here first) or an export directory
    out: Path
    backends: tuple[str, ...]  # the engines timed in process (capsnet.bench.engines)
    batch_sizes: tuple[int, ...]
    concurrency: tuple[int, ...]
    threads: int
    seconds: float  # timed seconds per in-process (engine, batch size)
    rounds: int
    grpc_seconds: float  # timed seconds per gRPC (API, batching, concurrency)
    peak_seconds: float
    accuracy_images: int
    profile_runs: int
    grpc: bool
    quick: bool
    data: str
    command: str


class Analysis:
    """What the analysis (capsnet.bench.analysis, the bench extra) adds to a run, at the points the run calls it.
    This one adds nothing: `missing` says why, in the report, and the engine it would bring is skipped."""

    def __init__(self, missing: str | None):
        self.missing = missing

    def unavailable(self, engine: str) -> str | None:
        """Why `engine` cannot run without the analysis: the public reference is part of it."""
        return "part of the analysis, not installed here (below)" if engine == PUBLIC and self.missing else None

    def start(self, artifacts, config) -> None:
        """Before the in-process rounds, with the export's artifacts and the model's config."""

    def after_round(self) -> None:
        """After each interleaved in-process round, while the engines' workers wait."""

    def after_inprocess(self, inprocess: dict, images: np.ndarray, artifacts) -> dict:
        """The analysis' parts of the results, from the in-process results (whose rows it may annotate)."""
        return {"not_analysed": self.missing}

    def targets(self, results: dict) -> list[dict]:
        return []

    def sections(self, results: dict) -> dict[str, list[str]]:
        """Markdown lines for the report, by where they go (report_files.SECTIONS)."""
        return {}

    def plots(self, results: dict, out_dir: Path) -> list[Path]:
        return []


def _check_dynamic_routing(model: Path, checkpoint: Path) -> None:
    """The targets compare with the public dynamic-routing CapsNet and its convolution peak: EM and CNN
    models have neither, so they are refused before anything is exported or timed."""
    from capsnet.models.checkpoint import load_checkpoint

    arch = load_checkpoint(checkpoint).config.arch
    if arch != "capsnet":
        raise CapsNetError(f"capsnet bench measures dynamic-routing CapsNets; {model} holds a model of --arch {arch}")


def run_bench(options: BenchOptions, analysis: Analysis) -> dict:
    facts, cpu_before = machine_facts(), cpu_times()
    with tempfile.TemporaryDirectory(prefix="capsnet-bench-") as tmp:
        model_dir, model_dirs, skipped = _prepare_models(options, Path(tmp))
        for name in list(model_dirs):
            if reason := analysis.unavailable(name):
                skipped[name] = reason
                del model_dirs[name]
        from capsnet.models.checkpoint import load_checkpoint
        from capsnet.serving.engine.artifacts import load_artifacts
        from capsnet.training.data import load_dataset

        artifacts = load_artifacts(model_dir)
        int8_export = json.loads((model_dir / "model.json").read_text()).get("int8")
        config = load_checkpoint(artifacts.checkpoint).config
        dataset = load_dataset(options.data)
        if tuple(dataset.image_shape) != artifacts.input_shape:
            raise CapsNetError(f"--data {options.data} has {dataset.image_shape} images; the model takes "
                               f"{artifacts.input_shape}")
        images = dataset.test.images.astype(np.float32) / 255.0  # (N, C, H, W) in [0, 1]

        analysis.start(artifacts, config)
        plans = {name: EnginePlan(str(model_dirs[name]), tuple(sorted(set(options.batch_sizes))))
                 for name in options.backends if name in model_dirs}
        log.info("in-process: %s at batch sizes %s", ", ".join(plans), ", ".join(map(str, options.batch_sizes)))
        inprocess = run_inprocess(plans, options.threads, images, dataset.test.labels,
                                  Schedule(options.seconds, options.rounds), options.accuracy_images or len(images),
                                  after_round=analysis.after_round)
        # the reasons name the temporary export: written as $TMPDIR/..., as every path in a result
        inprocess["skipped"] = {name: portable(reason, Path.cwd())
                                for name, reason in {**skipped, **inprocess["skipped"]}.items()}
        analysed = analysis.after_inprocess(inprocess, images, artifacts)

        grpc_results = None
        if options.grpc:
            grpc_results = run_grpc_load(str(model_dir), images, options.concurrency, options.threads,
                                         options.grpc_seconds)

    facts["load_after"] = load_average()
    facts["cpu_during_run"] = cpu_shares(cpu_before, cpu_times())
    results = {
        "command": options.command,
        "created": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "quick": options.quick,
        "machine": facts,
        "model": {"source": portable(str(options.model), Path.cwd()), "data": dataset.name,
                  "config": config.to_dict(), "int8_export": int8_export},
        "inprocess": inprocess,
        "grpc": grpc_results,
        **analysed,
    }
    results["targets"] = analysis.targets(results)
    for path in write_report(results, options.out, analysis.sections(results), analysis.plots):
        log.info("wrote %s", path)
    return results


def _prepare_models(options: BenchOptions, tmp: Path) -> tuple[Path, dict[str, Path], dict[str, str]]:
    """(the export directory, engine -> export directory it loads, engine -> why it is skipped).

    A checkpoint is exported first (ONNX FP32 + INT8, and one TensorRT engine per precision where a GPU
    allows); an export directory is used as it is."""
    from capsnet.serving.engine.artifacts import load_artifacts

    wanted_trt = [name for name in options.backends if split(name)[0] == "tensorrt"]
    model_dirs, skipped = {}, {}
    if options.model.is_dir():
        artifacts = load_artifacts(options.model)
        _check_dynamic_routing(options.model, artifacts.checkpoint)
        plan_precision = artifacts.tensorrt_info["precision"] if artifacts.tensorrt_info else None
        for name in options.backends:
            if name in wanted_trt and split(name)[1] != plan_precision:
                skipped[name] = (f"{options.model} has no {split(name)[1]} TensorRT plan (bench a "
                                 "checkpoint to build one)")
            else:
                model_dirs[name] = options.model
        return options.model, model_dirs, skipped
    if not options.model.is_file():
        raise CapsNetError(f"{options.model} does not exist: give a checkpoint or an export directory")
    _check_dynamic_routing(options.model, options.model)
    from capsnet.export.exporter import export_model
    from capsnet.runtime.tensorrt_runner import unavailable_reason

    max_batch = max(options.batch_sizes + options.concurrency)
    log.info("exporting %s (ONNX FP32 + INT8)", options.model)
    # The bench reports INT8 accuracy itself, so the exporter's refusal threshold is lifted.
    export_model(options.model, tmp / "model", int8=True, data=options.data, max_accuracy_drop=100.0)
    for name in options.backends:
        if name not in wanted_trt:
            model_dirs[name] = tmp / "model"
    no_trt = unavailable_reason() if wanted_trt else None
    for name in wanted_trt:
        if no_trt:
            skipped[name] = no_trt
            continue
        precision = split(name)[1]
        log.info("building a TensorRT %s engine", precision)
        export_model(options.model, tmp / name, tensorrt=True, tensorrt_precision=precision, data=options.data,
                     max_accuracy_drop=100.0, opt_batch=min(TENSORRT_OPT_BATCH, max_batch), max_batch=max_batch)
        model_dirs[name] = tmp / name
    return tmp / "model", model_dirs, skipped

