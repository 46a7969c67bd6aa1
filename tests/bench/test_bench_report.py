"""The report files of `capsnet bench`: written whole or not at all, so an earlier report is never left half
replaced."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from capsnet.bench import report_files
from capsnet.bench.analysis import plots, sections
from capsnet.errors import CapsNetError

COMMITTED = Path(__file__).resolve().parents[2] / "docs" / "benchmarks" / "results.json"


@pytest.fixture
def earlier_report(tmp_path) -> Path:
    out = tmp_path / "out"
    out.mkdir()
    for name in ("results.json", "README.md", "inprocess.png", "grpc.png"):
        (out / name).write_text(f"earlier {name}\n")
    return out


def contents(folder: Path) -> dict[str, str]:
    return {path.name: path.read_text() for path in folder.iterdir()}


@pytest.mark.parametrize("failure", [KeyboardInterrupt(), OSError(28, "No space left on device")])
def test_bench_report_interrupted_while_plotting_leaves_the_earlier_report_whole(earlier_report, failure):
    """Ctrl-C (or a full disk) while the plots were drawn left a new results.json beside the earlier README.md."""
    before = contents(earlier_report)

    def plot(results, out_dir):
        raise failure

    results = json.loads(COMMITTED.read_text())
    with pytest.raises(CapsNetError if isinstance(failure, OSError) else KeyboardInterrupt):
        report_files.write_report(results, earlier_report, sections.sections(results), plot)
    assert contents(earlier_report) == before  # no file replaced, no partial folder left


def test_bench_report_replaces_every_file_and_leaves_nothing_else(earlier_report):
    results = json.loads(COMMITTED.read_text())
    written = report_files.write_report(results, earlier_report, sections.sections(results), plots.plots)
    assert [path.name for path in written] == ["results.json", "README.md", "inprocess.png", "grpc.png"]
    assert sorted(path.name for path in earlier_report.iterdir()) == sorted(path.name for path in written)
    assert json.loads((earlier_report / "results.json").read_text()) == results
    assert (earlier_report / "README.md").read_text() == report_files.markdown(
        results, ["inprocess.png", "grpc.png"], False, sections.sections(results))
    for plot in ("inprocess.png", "grpc.png"):
        assert (earlier_report / plot).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
