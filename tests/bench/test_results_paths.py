"""Results name no machine: every committed result under docs/ is free of home and machine paths, and the writers'
path rewriting (capsnet.bench.results.portable) keeps them so."""

from __future__ import annotations

import re
import tempfile
from pathlib import Path

import pytest

from capsnet.bench.results import portable, portable_command

DOCS = Path(__file__).resolve().parents[2] / "docs"
# a home folder or this kind of machine's working folder, in any file under docs/; a Windows drive path too
HOME_OR_MACHINE = re.compile(r"(?<![\w.:/~$-])(/(root|home|Users|work)/|[A-Za-z]:\\\\?[A-Za-z])")
# temporary folders as well, in the results (JSON) and the reports written beside them: a how-to under docs/ may
# tell a reader to write to /tmp, but a result that names one names the machine it ran on
TEMPORARY = re.compile(r"(?<![\w.:/~$-])/(tmp|var/folders|private/var)/")


def results_and_reports() -> list[Path]:
    results = [path for path in DOCS.rglob("*") if path.suffix in (".json", ".jsonl")]
    return results + [path.with_suffix(".md") for path in results if path.with_suffix(".md").is_file()]


def text_files() -> list[Path]:
    return [path for path in DOCS.rglob("*") if path.suffix in (".json", ".jsonl", ".md", ".txt", ".csv")]


def offending_lines(path: Path, pattern: re.Pattern) -> list[str]:
    return [f"{path.relative_to(DOCS.parent)}:{number}: {line.strip()[:160]}"
            for number, line in enumerate(path.read_text(errors="replace").splitlines(), 1) if pattern.search(line)]


def test_no_file_under_docs_names_a_home_or_machine_folder():
    assert len(text_files()) > 20
    found = [line for path in text_files() for line in offending_lines(path, HOME_OR_MACHINE)]
    assert not found, "\n".join(found)


def test_no_result_under_docs_names_a_temporary_folder():
    assert len(results_and_reports()) > 20
    found = [line for path in results_and_reports() for line in offending_lines(path, TEMPORARY)]
    assert not found, "\n".join(found)


@pytest.mark.parametrize("line", ['"tree": "/work/main"', "--model-dir /tmp/tmpn2sobbw4/model",
                                  '"checkpoint": "/home/ana/m.ckpt"', "C:\\Users\\ana\\m.ckpt", "/Users/ana/x"])
def test_the_scan_finds_what_it_is_for(line):
    assert HOME_OR_MACHINE.search(line) or TEMPORARY.search(line)


@pytest.mark.parametrize("line", ["images/s", "http://127.0.0.1:8000/metrics", "1 / 2", "$TMPDIR/model",
                                  "/opt/perf-analyzer/bin/perf_analyzer", "docs/benchmarks/work/x", "/usr/share/x"])
def test_the_scan_passes_what_names_no_machine(line):
    assert not HOME_OR_MACHINE.search(line) and not TEMPORARY.search(line)


def test_portable_writes_paths_relative_to_the_root_the_temporary_folder_and_home():
    root = Path("/work/checkout")
    temporary, home = Path(tempfile.gettempdir()), Path.home()
    assert portable("/work/checkout", root) == "."
    assert portable("/work/checkout/docs/benchmarks/x", root) == "docs/benchmarks/x"
    assert portable(f"--model-dir {temporary}/ab12/model --out x", root) == "--model-dir $TMPDIR/ab12/model --out x"
    assert portable(str(home / "models" / "m.ckpt"), root) == "~/models/m.ckpt"
    assert portable("127.0.0.1:18101=/work/served/model.onnx", root) == "127.0.0.1:18101=../served/model.onnx"
    for kept in ("/opt/perf-analyzer/bin/perf_analyzer", "http://127.0.0.1:9/metrics", "images/s", "relative/path"):
        assert portable(kept, root) == kept


def test_a_command_is_written_from_the_root_with_python_by_name():
    root = Path("/work/checkout")
    argv = ["/work/checkout/.venv/bin/python", "/work/checkout/scripts/serving_ab.py", "--baseline",
            f"{tempfile.gettempdir()}/base line", "--out", "docs/benchmarks/serving-ab"]
    assert portable_command(argv, root) == ("python scripts/serving_ab.py --baseline $TMPDIR/'base line' "
                                            "--out docs/benchmarks/serving-ab")
    assert not HOME_OR_MACHINE.search(portable_command(argv, root))
