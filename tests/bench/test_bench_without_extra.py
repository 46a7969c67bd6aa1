"""`capsnet bench` where the bench extra is not installed, as in the serving image: it measures throughput and
latency, says in one line which extra to install, and its report holds no analysis; the measuring core and the
server never import the analysis."""

from __future__ import annotations

import json
import subprocess
import sys

from capsnet.bench.analysis import INSTALL

# matplotlib, the extra's dependency, made unimportable in the child, as where the extra is not installed
WITHOUT_EXTRA = "import sys; sys.modules['matplotlib'] = None; "


def test_bench_without_the_extra_measures_and_names_the_extra(tiny_export, tmp_path):
    out = tmp_path / "out"
    run = subprocess.run(
        [sys.executable, "-c", WITHOUT_EXTRA + "from capsnet.cli import main; sys.exit(main(sys.argv[1:]))", "bench",
         str(tiny_export), "--out", str(out), "--quick", "--no-grpc", "--backends", "onnxruntime:fp32,public",
         "--batch-sizes", "1", "--seconds", "0.05", "--rounds", "1", "--accuracy-images", "10"],
        capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    said = [line for line in run.stderr.splitlines() if line.startswith("capsnet bench: ")]
    assert said == ["capsnet bench: measuring throughput and latency only: the CPU's ceiling, ONNX Runtime's profile, "
                    f"the public reference, the targets and the plots need the bench extra: {INSTALL}"]
    results = json.loads((out / "results.json").read_text())
    assert not {"flops", "peak", "ceiling", "profiles"} & set(results) and results["targets"] == []
    assert results["not_analysed"].endswith(INSTALL)
    inprocess = results["inprocess"]
    assert set(inprocess["engines"]) == {"onnxruntime:fp32"} and "public" in inprocess["skipped"]
    assert [row["batch"] for row in inprocess["measurements"]] == [1]
    assert "share_of_ceiling" not in inprocess["measurements"][0]["figures"]
    assert sorted(path.name for path in out.iterdir()) == ["README.md", "results.json"]  # no plots
    readme = (out / "README.md").read_text()
    assert "## In-process throughput and latency" in readme and "| onnxruntime:fp32 | 1 |" in readme
    assert "## The CPU's limit" not in readme and "## Targets" not in readme and "of ceiling" not in readme
    assert f"Not analysed in this run: {results['not_analysed']}." in readme


def test_the_measuring_core_and_the_server_leave_the_analysis_out():
    imports = ("capsnet.cli", "capsnet.bench.cli", "capsnet.bench.run", "capsnet.bench.report_files",
               "capsnet.bench.grpc_load", "capsnet.bench.inprocess", "capsnet.bench.worker", "capsnet.bench.engines",
               "capsnet.serving.transports.server", "capsnet.bench.loadgen")
    check = (WITHOUT_EXTRA + "import importlib; [importlib.import_module(m) for m in sys.argv[1:]]; "
             "from capsnet.cli import build_parser; build_parser(); "
             "print(sorted(m for m in sys.modules if m.startswith('capsnet.bench.analysis')))")
    run = subprocess.run([sys.executable, "-c", check, *imports], capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr[-3000:]
    assert run.stdout.strip() == "[]"
