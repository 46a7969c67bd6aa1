"""deploy/k8s/kserve.yaml against KServe's own CRD schemas (tests/deploy/fixtures/kserve-crd-schemas.json.gz, taken
from the kserve repository by scripts/extract_kserve_crd_schema.py, with the commit and path they came from), as the
API server's strict field validation reads them: a wrong type, a missing required field or an unknown field is an
error. And what the runtime runs is what this server takes."""

from __future__ import annotations

import copy
import gzip
import json
import re

import pytest
from deploy_support import DEPLOY

yaml = pytest.importorskip("yaml")
jsonschema = pytest.importorskip("jsonschema")

SCHEMAS = DEPLOY.parent / "tests" / "deploy" / "fixtures" / "kserve-crd-schemas.json.gz"
MANIFEST = DEPLOY / "k8s" / "kserve.yaml"


def strict(schema):
    """The schema as strict field validation applies it: an object schema that lists its properties takes no other
    field, unless it keeps unknown fields (x-kubernetes-preserve-unknown-fields) or declares additionalProperties."""
    if isinstance(schema, list):
        return [strict(item) for item in schema]
    if not isinstance(schema, dict):
        return schema
    schema = {key: strict(value) if key not in ("enum", "required", "default", "example") else value
              for key, value in schema.items()}
    if ("properties" in schema and "additionalProperties" not in schema
            and not schema.get("x-kubernetes-preserve-unknown-fields")):
        schema["additionalProperties"] = False
    return schema


@pytest.fixture(scope="module")
def schemas() -> dict:
    return json.loads(gzip.decompress(SCHEMAS.read_bytes()))


@pytest.fixture(scope="module")
def validators(schemas) -> dict:
    return {kind: jsonschema.Draft7Validator(strict(entry["openAPIV3Schema"])) for kind, entry in schemas.items()}


@pytest.fixture(scope="module")
def documents() -> dict:
    return {doc["kind"]: doc for doc in yaml.safe_load_all(MANIFEST.read_text())}


def errors(validators, document) -> list[str]:
    return [f"{'.'.join(map(str, error.absolute_path))}: {error.message}"
            for error in validators[document["kind"]].iter_errors(document)]


def test_the_schemas_come_from_the_kserve_repository(schemas):
    assert set(schemas) == {"ServingRuntime", "InferenceService"}
    for kind, entry in schemas.items():
        source = entry["source"]
        assert source["repository"] == "kserve/kserve" and re.fullmatch(r"[0-9a-f]{40}", source["commit"]), kind
        assert source["path"].startswith("config/crd/full/serving.kserve.io_"), kind
        assert entry["openAPIV3Schema"]["properties"]["spec"]["properties"], kind


def test_the_runtime_and_the_inference_service_validate_against_kserves_schemas(schemas, validators, documents):
    assert set(documents) == {"ServingRuntime", "InferenceService"}
    for kind, document in documents.items():
        assert document["apiVersion"] == schemas[kind]["apiVersion"], kind
        assert errors(validators, document) == [], kind


@pytest.mark.parametrize("kind, path, value, error", [
    ("InferenceService", ["spec", "predictor", "model", "storageURI"], "pvc://x", "Additional properties"),
    ("InferenceService", ["spec", "predictor", "minReplicas"], "one", "is not of type 'integer'"),
    ("ServingRuntime", ["spec", "containers", 0, "args"], "serve", "is not of type 'array'"),
    ("ServingRuntime", ["spec", "supportedModelFormats", 0, "autoSelect"], "yes", "is not of type 'boolean'"),
    ("ServingRuntime", ["spec", "containers", 0, "name"], None, "is a required property"),
])
def test_a_broken_manifest_fails_the_schema(validators, documents, kind, path, value, error):
    document = copy.deepcopy(documents[kind])
    target = document
    for key in path[:-1]:
        target = target[key]
    if value is None:
        del target[path[-1]]
    else:
        target[path[-1]] = value
    assert any(error in message for message in errors(validators, document)), errors(validators, document)


def test_the_runtime_serves_the_v2_protocol_this_server_speaks(documents):
    from capsnet.cli import build_parser
    from capsnet.serving.config import ServerConfig
    from capsnet.serving.transports.kserve_http import KServeHTTP

    runtime, service = documents["ServingRuntime"], documents["InferenceService"]
    [container] = runtime["spec"]["containers"]
    args = build_parser().parse_args(container["args"])
    config = ServerConfig(model_repository=args.model_repository, http_port=args.http_port,
                          grpc_port=args.grpc_port, metrics_port=args.metrics_port)
    assert str(config.model_repository) == "/mnt/models"  # where KServe's storage initializer puts storageUri
    assert [port["containerPort"] for port in container["ports"]] == [config.http_port]
    assert runtime["spec"]["annotations"]["prometheus.kserve.io/port"] == str(config.metrics_port)
    routes = set(KServeHTTP(None, None, 1).paths)
    for probe in ("readinessProbe", "livenessProbe", "startupProbe"):
        assert container[probe]["httpGet"]["port"] == config.http_port, probe
        assert container[probe]["httpGet"]["path"] in routes, probe
    assert set(runtime["spec"]["protocolVersions"]) == {"v2", "grpc-v2"}
    model = service["spec"]["predictor"]["model"]
    assert (model["runtime"], model["protocolVersion"]) == (runtime["metadata"]["name"], "v2")
    assert model["modelFormat"]["name"] in {fmt["name"] for fmt in runtime["spec"]["supportedModelFormats"]}
    assert model["storageUri"].startswith("pvc://")
    assert service["metadata"]["annotations"]["serving.kserve.io/enable-prometheus-scraping"] == "true"
