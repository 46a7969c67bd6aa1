"""The analysis' part of a `capsnet bench` run: the CPU's fp32 ceiling, ONNX Runtime's profile, the targets, the report
sections and the plots, at the points capsnet.bench.run.run_bench calls them."""

from __future__ import annotations

import logging
from pathlib import Path

import numpy as np

from capsnet.bench.analysis import plots, sections
from capsnet.bench.analysis.flops import FlopCount, count_flops
from capsnet.bench.analysis.ortprofile import conv_rate, profile_onnx
from capsnet.bench.analysis.peak import measure_peak, median_peak
from capsnet.bench.analysis.targets import evaluate
from capsnet.bench.inprocess import tile
from capsnet.bench.results import cells
from capsnet.bench.run import Analysis, BenchOptions
from capsnet.models.config import CapsNetConfig

log = logging.getLogger(__name__)

PEAK_BATCH = 32  # images in the PrimaryCaps-shaped conv of the peak microbenchmark
PROFILE_BATCH = 32  # ONNX Runtime is profiled at the largest batch size up to this


class BenchAnalysis(Analysis):
    def __init__(self, options: BenchOptions):
        super().__init__(missing=None)
        self.options = options
        self.peaks: list[dict] = []
        self.config: CapsNetConfig | None = None  # both from start()
        self.flops: FlopCount | None = None

    def start(self, artifacts, config) -> None:
        self.config, self.flops = config, count_flops(artifacts.onnx["fp32"])
        log.info("%.1f MFLOP per image; the fp32 peak after each in-process round", self.flops.total / 1e6)

    def after_round(self) -> None:
        """The fp32 peak once per interleaved round, so it meets the same load as the engines' cells."""
        assert self.config is not None, "start() first"
        self.peaks.append(measure_peak(self.config, batch=PEAK_BATCH, threads=self.options.threads,
                                       min_seconds=self.options.peak_seconds))

    def after_inprocess(self, inprocess: dict, images: np.ndarray, artifacts) -> dict:
        """The ceiling (each row's share of it goes into the row) and ONNX Runtime's profile of each precision."""
        assert self.flops is not None, "start() first"
        peak = median_peak(self.peaks)
        ceiling = peak["conv"]["gflops"] * 1e9 / self.flops.total
        for row in inprocess["measurements"]:
            row["figures"]["share_of_ceiling"] = row["figures"]["images_per_s"] / ceiling
        batch_sizes = self.options.batch_sizes
        profile_images = tile(images, max((b for b in batch_sizes if b <= PROFILE_BATCH), default=min(batch_sizes)))
        figures = cells(inprocess["measurements"])
        conv_flops = sum(node.flops for node in self.flops.nodes if node.op_type == "Conv")
        profiles = {}
        for precision, path in artifacts.onnx.items():
            name = f"onnxruntime:{precision}"
            if (name, len(profile_images)) in figures:
                profile = profile_onnx(path, profile_images, self.options.threads, self.options.profile_runs)
                images_per_s = figures[name, len(profile_images)]["images_per_s"]
                profiles[name] = {**profile, **conv_rate(profile, conv_flops, images_per_s)}
        return {"flops": self.flops.to_dict(), "peak": peak,
                "ceiling": {"images_per_s": ceiling, "gflops": peak["conv"]["gflops"]}, "profiles": profiles}

    def targets(self, results: dict) -> list[dict]:
        return evaluate(results)

    def sections(self, results: dict) -> dict[str, list[str]]:
        return sections.sections(results)

    def plots(self, results: dict, out_dir: Path) -> list[Path]:
        return plots.plots(results, out_dir)
