"""Writes the OpenAPI v3 schemas of KServe's ServingRuntime and InferenceService CRDs, as KServe's repository
declares them, into tests/deploy/fixtures/kserve-crd-schemas.json.gz, which the deploy tests validate
deploy/k8s/kserve.yaml against.

The schemas are taken as they are from config/crd/full/ of a kserve checkout at one commit (recorded with each, with
the file's path), less their `description` texts (documentation only, most of the bytes); nothing is written by hand.
Gzipped: the InferenceService schema repeats a pod's spec for every component, 700 KB of JSON that packs to 5%.

    python scripts/extract_kserve_crd_schema.py --git-dir KSERVE/.git [--commit REV]
"""

from __future__ import annotations

import argparse
import gzip
import json
import subprocess
from pathlib import Path

import yaml

CRDS = {  # kind -> (the CRD's file in the kserve repository, the served version deploy/k8s uses)
    "ServingRuntime": ("config/crd/full/serving.kserve.io_servingruntimes.yaml", "v1alpha1"),
    "InferenceService": ("config/crd/full/serving.kserve.io_inferenceservices.yaml", "v1beta1"),
}
OUT = Path(__file__).resolve().parents[1] / "tests" / "deploy" / "fixtures" / "kserve-crd-schemas.json.gz"


def without_descriptions(node):
    """The schema without its documentation: every `description` whose value is text (a property that is named
    description is a schema, an object, and stays)."""
    if isinstance(node, dict):
        return {key: without_descriptions(value) for key, value in node.items()
                if not (key == "description" and isinstance(value, str))}
    if isinstance(node, list):
        return [without_descriptions(item) for item in node]
    return node


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--git-dir", required=True, help="a kserve/kserve clone's git directory")
    parser.add_argument("--commit", default="HEAD")
    args = parser.parse_args()
    git = ["git", "--git-dir", args.git_dir]
    commit = subprocess.run([*git, "rev-parse", args.commit], check=True, capture_output=True, text=True).stdout.strip()
    schemas = {}
    for kind, (path, version) in CRDS.items():
        text = subprocess.run([*git, "show", f"{commit}:{path}"], check=True, capture_output=True, text=True).stdout
        crd = yaml.safe_load(text)
        assert crd["spec"]["names"]["kind"] == kind, path
        [served] = [entry for entry in crd["spec"]["versions"] if entry["name"] == version]
        schemas[kind] = {
            "source": {"repository": "kserve/kserve", "commit": commit, "path": path},
            "apiVersion": f"{crd['spec']['group']}/{version}",
            "openAPIV3Schema": without_descriptions(served["schema"]["openAPIV3Schema"]),
        }
    OUT.parent.mkdir(parents=True, exist_ok=True)
    data = (json.dumps(schemas, indent=1, sort_keys=True) + "\n").encode()
    OUT.write_bytes(gzip.compress(data, mtime=0))  # the same bytes for the same schemas
    print(f"wrote {OUT} ({OUT.stat().st_size} bytes) from kserve {commit}")


if __name__ == "__main__":
    main()
