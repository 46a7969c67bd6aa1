"""The committed generated code is exactly what scripts/gen_protos.sh makes from the protos."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import tomllib
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
GENERATED_PACKAGES = ("capsnet/v1", "capsnet/kserve")


def test_generated_code_matches_protos(tmp_path):
    result = subprocess.run(["bash", str(REPO / "scripts/gen_protos.sh"), str(tmp_path)],
                            env={**os.environ, "PYTHON": sys.executable}, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    regenerated = {p.relative_to(tmp_path).as_posix() for p in tmp_path.rglob("*") if p.is_file()}
    committed = {p.relative_to(REPO).as_posix() for package in GENERATED_PACKAGES
                 for p in (REPO / package).iterdir() if p.is_file() and p.name != "__init__.py"}
    assert "capsnet/v1/capsnet_pb2.py" in regenerated
    assert regenerated == committed, "run scripts/gen_protos.sh: the generated file set differs"
    for name in sorted(regenerated):
        assert (tmp_path / name).read_bytes() == (REPO / name).read_bytes(), (
            f"{name} is stale: run scripts/gen_protos.sh")


def test_protobuf_floor_is_the_gencode_version():
    """The generated code runs on protobuf's runtime of its gencode version or newer (7.x too), so that version is
    the floor pyproject declares; a regeneration with a newer protoc must raise both together."""
    dependencies = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["dependencies"]
    [floor] = [re.fullmatch(r"protobuf>=([\d.]+),<\d+", dep).group(1) for dep in dependencies
               if dep.startswith("protobuf")]
    for package in GENERATED_PACKAGES:
        for generated in (REPO / package).glob("*_pb2.py"):
            gencode = re.search(r"^# Protobuf Python Version: ([\d.]+)$", generated.read_text(), re.MULTILINE).group(1)
            assert gencode == floor, f"{generated.name} is protobuf {gencode} gencode, pyproject asks protobuf>={floor}"
