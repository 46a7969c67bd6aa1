"""ruff over the product code, its tests and scripts, mypy over the product code and import-linter's contracts over
its imports, with the rules and settings of pyproject.toml: as tests, so that scripts/test.sh (and CI) fails with
their findings, and `pytest tests/test_static_checks.py` runs them alone."""
from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
# pyproject.toml's [tool.setuptools.package-dir]: these folders are the subpackages capsnet.<folder>
SUBPACKAGE_FOLDERS = ("serving", "training", "export")
PRODUCT_FOLDERS = ("capsnet", *SUBPACKAGE_FOLDERS)
# the tests and scripts too: a bug in a test hides the bug it was written to catch
LINTED_FOLDERS = (*PRODUCT_FOLDERS, "tests", "scripts")


def _run(args: list[str], cwd: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(args, cwd=cwd, capture_output=True, text=True, timeout=300)


def test_ruff_finds_nothing():
    result = _run([sys.executable, "-m", "ruff", "check", "--no-cache", "--output-format", "concise",
                   *LINTED_FOLDERS], REPO)
    if result.returncode != 0:
        pytest.fail(f"ruff check (pyproject.toml [tool.ruff]):\n{result.stdout}{result.stderr}", pytrace=False)


def _import_name_tree(root: Path) -> Path:
    """A tree of links under root/capsnet that holds every module under its import name: mypy and import-linter find
    a module by its folder, and serving/ is imported as capsnet.serving."""
    package = root / "capsnet"
    package.mkdir()
    for entry in (REPO / "capsnet").iterdir():
        if entry.name != "__pycache__":
            (package / entry.name).symlink_to(entry)
    for folder in SUBPACKAGE_FOLDERS:
        (package / folder).symlink_to(REPO / folder)
    return package


@pytest.mark.slow
def test_mypy_finds_nothing(tmp_path):
    # each file checked under the name the rest of the code imports it by
    _import_name_tree(tmp_path)
    # mypy's own incremental cache, kept between runs (a fresh checkout starts without one): only the modules whose
    # files changed, and those depending on them, are checked again; torch's and numpy's types are read once
    result = _run([sys.executable, "-m", "mypy", "--config-file", str(REPO / "pyproject.toml"),
                   "--cache-dir", str(REPO / ".mypy_cache"), "capsnet"], tmp_path)
    # back to the paths in the repository: capsnet/serving/x.py is serving/x.py
    findings = re.sub(rf"^capsnet/({'|'.join(SUBPACKAGE_FOLDERS)})/", r"\1/", result.stdout, flags=re.MULTILINE)
    if result.returncode != 0:
        pytest.fail(f"mypy (pyproject.toml [tool.mypy]):\n{findings}{result.stderr}", pytrace=False)


def test_the_imports_keep_the_layers(tmp_path):
    """pyproject.toml's [tool.importlinter] contracts: models at the bottom, runtime above them, training, then
    export and serving, which import neither each other nor (serving) training."""
    _import_name_tree(tmp_path)
    check = ("import sys\nfrom importlinter.cli import lint_imports\n"
             f"sys.exit(lint_imports(config_filename={str(REPO / 'pyproject.toml')!r}, no_cache=True))")
    # the tree first on the path, before the installed capsnet, so the graph is built from the files of REPO
    result = subprocess.run([sys.executable, "-c", check], cwd=tmp_path, capture_output=True, text=True, timeout=300,
                            env={**os.environ, "PYTHONPATH": str(tmp_path)})
    if result.returncode != 0:
        pytest.fail(f"lint-imports (pyproject.toml [tool.importlinter]):\n{result.stdout}{result.stderr}",
                    pytrace=False)
    # a graph of the whole product: every file under an import name, none missing
    files = sum(1 for folder in PRODUCT_FOLDERS for _ in (REPO / folder).rglob("*.py"))
    assert f"Analyzed {files} files" in result.stdout, result.stdout
