"""ruff over the product code, its tests and scripts, and mypy over the product code, with the rules and settings of
pyproject.toml: as tests, so that scripts/test.sh (and CI) fails with their findings, and
`pytest tests/test_static_checks.py` runs them alone."""
from __future__ import annotations

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


@pytest.mark.slow
def test_mypy_finds_nothing(tmp_path):
    # mypy finds a module by its folder, and serving/ is imported as capsnet.serving: a tree of links under the
    # import names lets it check each file under the name the rest of the code imports it by.
    package = tmp_path / "capsnet"
    package.mkdir()
    for entry in (REPO / "capsnet").iterdir():
        if entry.name != "__pycache__":
            (package / entry.name).symlink_to(entry)
    for folder in SUBPACKAGE_FOLDERS:
        (package / folder).symlink_to(REPO / folder)
    result = _run([sys.executable, "-m", "mypy", "--config-file", str(REPO / "pyproject.toml"),
                   "--cache-dir", str(tmp_path / "cache"), "capsnet"], tmp_path)
    # back to the paths in the repository: capsnet/serving/x.py is serving/x.py
    findings = re.sub(rf"^capsnet/({'|'.join(SUBPACKAGE_FOLDERS)})/", r"\1/", result.stdout, flags=re.MULTILINE)
    if result.returncode != 0:
        pytest.fail(f"mypy (pyproject.toml [tool.mypy]):\n{findings}{result.stderr}", pytrace=False)
