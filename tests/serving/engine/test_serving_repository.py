"""A model repository served: several models and versions, version policies, requests naming a version, answers
saying which version answered, the repository extension (index, load, unload) over gRPC and REST, statistics, labels,
and names that could reach outside the repository refused."""

from __future__ import annotations

import json
import sys
import urllib.parse

import grpc
import numpy as np
import pytest
import tritonclient.grpc as grpcclient
from serving_helpers import add_version, metric, repository_server, rest, scrape, wait_until
from tritonclient.utils import InferenceServerException

from capsnet.client.api import image_message
from capsnet.errors import CapsNetError
from capsnet.serving.engine.repository import check_name
from capsnet.serving.errors import InvalidInput
from capsnet.serving.version_policy import VersionPolicy
from capsnet.v1 import capsnet_pb2 as pb
from capsnet.v1 import capsnet_pb2_grpc

IMAGES = np.random.default_rng(5).random((2, 1, 28, 28), dtype=np.float32)  # (2, 1, 28, 28)
BAD_NAMES = ["../outside", "..", "a/b", "victim/../../outside", "x\x00y", "/etc", "a" * 10240, "", ".hidden"]


@pytest.mark.parametrize("policy, available, selected", [
    ("latest:1", ["1", "2", "10"], ["10"]),
    ("latest:2", ["3", "1", "2"], ["2", "3"]),
    ("latest:5", ["1", "2"], ["1", "2"]),
    ("specific:1,3", ["1", "2", "3"], ["1", "3"]),
    ("specific:4", ["1", "2"], []),
    ("all", ["2", "1"], ["1", "2"]),
])
def test_version_policies_select_as_tritons_do(policy, available, selected):
    assert VersionPolicy.parse(policy).select(available) == selected


@pytest.mark.parametrize("value, policy", [
    ({"latest": {"num_versions": 2}}, "latest:2"),
    ({"latest": {}}, "latest:1"),
    ({"specific": {"versions": [3, 1]}}, "specific:3,1"),
    ({"all": {}}, "all"),
])
def test_a_policy_reads_from_tritons_json_form(value, policy):
    assert VersionPolicy.from_json(value, "config.json").describe() == policy


@pytest.mark.parametrize("text", ["latest:0", "latest:x", "specific:", "specific:1,a", "specific:0", "all:2", "newest"])
def test_a_bad_policy_flag_is_one_line(text):
    with pytest.raises(CapsNetError, match="--version-policy"):
        VersionPolicy.parse(text)


@pytest.mark.parametrize("value", [{"latest": {"num_versions": 0}}, {"specific": {"versions": []}},
                                   {"specific": {"versions": ["1"]}}, {"newest": {}}, [], {"all": {}, "latest": {}}])
def test_a_bad_policy_in_config_json_names_the_file(value):
    with pytest.raises(CapsNetError, match=r"config.json"):
        VersionPolicy.from_json(value, "m/config.json")


@pytest.mark.parametrize("name", BAD_NAMES)
def test_names_that_are_not_plain_folder_names_are_refused(name):
    with pytest.raises(InvalidInput) as refused:
        check_name(name, "model_name")
    assert len(refused.value.message) < 300  # a 10 KB name is quoted cut


@pytest.fixture(scope="module")
def repository(model_dir, tmp_path_factory):
    """capsnet: versions 1 and 2, both served (config.json: latest 2); other: versions 3 and 7, the newest served
    (the server's default policy); outside/victim: a whole export next to the repository, never to be read."""
    root = tmp_path_factory.mktemp("repository")
    repository = root / "models"
    for version in (1, 2):
        add_version(repository, "capsnet", version, model_dir)
    (repository / "capsnet" / "config.json").write_text(json.dumps({"version_policy": {"latest": {"num_versions": 2}}}))
    for version in (3, 7):
        add_version(repository, "other", version, model_dir)
    add_version(root, "outside", 1, model_dir)
    return repository


@pytest.fixture(scope="module")
def served(repository):
    with repository_server(repository) as running:
        yield running


@pytest.fixture(scope="module")
def triton(served):
    return served.triton


def infer(triton, model: str, version: str = "") -> str:
    """The version that answered a KServe ModelInfer of IMAGES."""
    images = grpcclient.InferInput("images", list(IMAGES.shape), "FP32")
    images.set_data_from_numpy(IMAGES)
    return triton.infer(model, [images], model_version=version, client_timeout=30).get_response().model_version


def test_the_index_lists_each_model_and_the_state_of_its_versions(served, triton):
    # each export has its decoder: a model of its own beside it, of the same versions
    expected = [("capsnet", "1", "READY"), ("capsnet", "2", "READY"), ("capsnet-decoder", "1", "READY"),
                ("capsnet-decoder", "2", "READY"), ("other", "7", "READY"), ("other-decoder", "7", "READY")]
    index = triton.get_model_repository_index(as_json=True)["models"]
    assert [(m["name"], m["version"], m["state"]) for m in index] == expected
    status, body = rest(served, "POST", "/v2/repository/index", {"ready": True})
    assert status == 200 and [(m["name"], m["version"], m["state"]) for m in body] == expected


def test_a_request_names_a_version_or_gets_the_newest_and_the_answer_says_which(served, triton):
    assert infer(triton, "capsnet") == "2"
    assert infer(triton, "capsnet", "1") == "1"
    assert infer(triton, "other") == "7"
    body = {"inputs": [{"name": "images", "datatype": "FP32", "shape": [1, 1, 28, 28],
                        "data": IMAGES[0].ravel().tolist()}]}
    assert rest(served, "POST", "/v2/models/capsnet/versions/1/infer", body)[1]["model_version"] == "1"
    assert rest(served, "POST", "/v2/models/capsnet/infer", body)[1]["model_version"] == "2"
    with grpc.insecure_channel(served.target) as channel:
        stub = capsnet_pb2_grpc.CapsNetServiceStub(channel)
        images = [image_message(image) for image in IMAGES]
        answer = stub.Classify(pb.ClassifyRequest(images=images, model_name="capsnet", model_version="1"), timeout=30)
        assert (answer.model_name, answer.model_version) == ("capsnet", "1")
        answer = stub.Classify(pb.ClassifyRequest(images=images, model_name="other"), timeout=30)
        assert (answer.model_name, answer.model_version) == ("other", "7")
        assert stub.GetModelInfo(pb.GetModelInfoRequest(model_name="capsnet"), timeout=30).version == "2"
        with pytest.raises(grpc.RpcError) as unnamed:
            stub.Classify(pb.ClassifyRequest(images=images), timeout=30)
        assert unnamed.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert unnamed.value.details() == "model_name: this server serves several models ('capsnet', 'other'); name one"


def test_a_version_not_served_is_not_found_naming_those_that_are(served, triton):
    with pytest.raises(InferenceServerException) as missing:
        infer(triton, "other", "3")  # on disk, not selected by the policy
    assert missing.value.status() == "StatusCode.NOT_FOUND"
    assert missing.value.message() == "model_version: model 'other' has no version '3'; expected '' or '7'"
    status, body = rest(served, "GET", "/v2/models/capsnet/versions/9")
    assert status == 404 and body["error"] == ("model version: model 'capsnet' has no version '9'; expected '' or one "
                                               "of '1', '2'")
    assert triton.get_model_metadata("capsnet", as_json=True)["versions"] == ["1", "2"]


def test_statistics_count_what_each_version_served(served, triton):
    def stats(version: str) -> dict:
        [entry] = triton.get_inference_statistics("capsnet", version, as_json=True)["model_stats"]
        return entry

    before = stats("1")
    for _ in range(3):
        infer(triton, "capsnet", "1")
    after = stats("1")
    assert (after["name"], after["version"]) == ("capsnet", "1")
    success = lambda entry: int(entry.get("inference_stats", {}).get("success", {}).get("count", 0))  # noqa: E731
    assert success(after) == success(before) + 3
    assert int(after["inference_count"]) == int(before.get("inference_count", 0)) + 3 * len(IMAGES)
    executions = int(after["execution_count"]) - int(before.get("execution_count", 0))
    assert executions >= 1
    assert sum(int(b["compute_infer"]["count"]) for b in after["batch_stats"]) == int(after["execution_count"])
    for phase in ("queue", "compute_input", "compute_infer", "compute_output"):
        assert int(after["inference_stats"][phase]["count"]) == success(after), phase
    total = int(after["inference_stats"]["success"]["ns"])
    parts = sum(int(after["inference_stats"][phase]["ns"]) for phase in ("queue", "compute_infer"))
    assert 0 < parts <= total  # a request's wait and backend time are within its whole time
    assert int(after["last_inference"]) > 0
    status, body = rest(served, "GET", "/v2/models/capsnet/versions/1/stats")
    assert status == 200 and body["model_stats"][0]["inference_count"] == int(after["inference_count"])
    status, body = rest(served, "GET", "/v2/models/stats")
    assert status == 200 and [(s["name"], s["version"]) for s in body["model_stats"]] == [
        ("capsnet", "1"), ("capsnet", "2"), ("capsnet-decoder", "1"), ("capsnet-decoder", "2"), ("other", "7"),
        ("other-decoder", "7")]


def test_metrics_are_labelled_by_the_version_that_served_never_by_client_text(served, triton):
    infer(triton, "capsnet", "1")
    with pytest.raises(InferenceServerException):
        infer(triton, "no-such-model-4711")
    samples = scrape(served.metrics_url)
    assert metric(samples, "capsnet_requests_total", api="kserve", method="ModelInfer", code="OK", model="capsnet",
                  version="1") >= 1
    assert metric(samples, "capsnet_requests_total", api="kserve", method="ModelInfer", code="NOT_FOUND", model="",
                  version="") >= 1
    assert metric(samples, "capsnet_batch_size_count", model="capsnet", version="1") >= 1
    assert metric(samples, "capsnet_model_info", model="other", version="7") == 1
    labels = {dict(items).get("model") for (_, items) in samples}
    assert "no-such-model-4711" not in labels and labels >= {"capsnet", "other"}


def test_unload_then_load_over_rest_and_grpc(served, triton):
    assert rest(served, "POST", "/v2/repository/models/other/unload") == (200, {})
    assert not triton.is_model_ready("other")
    assert rest(served, "GET", "/v2/models/other/ready")[0] == 400
    with pytest.raises(InferenceServerException) as unloaded:
        infer(triton, "other")
    assert unloaded.value.status() == "StatusCode.UNAVAILABLE"
    assert "has no version loaded" in unloaded.value.message()
    index = {(m["name"], m.get("version", "")): m for m in triton.get_model_repository_index(as_json=True)["models"]}
    assert (index["other", "7"]["state"], index["other", "7"]["reason"]) == ("UNAVAILABLE", "unloaded")
    assert metric(scrape(served.metrics_url), "capsnet_model_info", model="other") == 0  # its series are gone
    triton.load_model("other")
    assert triton.is_model_ready("other") and infer(triton, "other") == "7"
    unload = {"parameters": {"unload_dependents": True}}
    assert rest(served, "POST", "/v2/repository/models/other/unload", unload)[0] == 200
    assert rest(served, "POST", "/v2/repository/models/other/load") == (200, {})
    assert infer(triton, "other") == "7"


def test_load_of_a_model_not_in_the_repository_is_not_found(served, triton):
    with pytest.raises(InferenceServerException) as missing:
        triton.load_model("absent")
    assert missing.value.status() == "StatusCode.NOT_FOUND"
    status, body = rest(served, "POST", "/v2/repository/models/capsnet/load", {"parameters": {"config": "{}"}})
    assert status == 400 and body["error"].startswith("parameters: 'config' not taken")


@pytest.fixture
def opened_paths():
    """Paths the process opens or lists while the test runs (Python's audit events: every thread's)."""
    seen: list[str] = []
    active = [True]

    def hook(event: str, args: tuple) -> None:
        if active[0] and event in ("open", "os.scandir", "os.listdir") and args:
            seen.append(str(args[0]))

    sys.addaudithook(hook)  # a hook cannot be removed: it goes quiet after the test
    yield seen
    active[0] = False


def test_bad_names_are_refused_and_nothing_outside_the_repository_is_read(served, triton, repository, opened_paths):
    outside = repository.parent / "outside"
    for name in BAD_NAMES:
        for call in (triton.load_model, triton.unload_model, lambda name: infer(triton, name),
                     lambda name: infer(triton, "capsnet", name or "-"), lambda name: triton.get_model_metadata(name)):
            with pytest.raises(InferenceServerException) as refused:
                call(name)
            assert refused.value.status() == "StatusCode.INVALID_ARGUMENT", (name[:20], refused.value.message())
        if len(name) < 1000:  # longer ones are cut by the HTTP parser (400) before a route is matched
            quoted = urllib.parse.quote(name, safe="")
            for path in (f"/v2/repository/models/{quoted}/load", f"/v2/repository/models/{quoted}/unload"):
                status, _ = rest(served, "POST", path)
                assert status in (400, 404), (name, path, status)
    assert not [path for path in opened_paths if str(outside) in path]
    assert "outside" not in {m["name"] for m in triton.get_model_repository_index(as_json=True)["models"]}


def test_model_control_is_refused_when_off(server):
    """The session's server serves --model: loads and unloads are refused with PERMISSION_DENIED, the index works."""
    client = grpcclient.InferenceServerClient(url=server.target)
    try:
        with pytest.raises(InferenceServerException) as refused:
            client.unload_model("capsnet")
        assert refused.value.status() == "StatusCode.PERMISSION_DENIED"
        assert refused.value.message().startswith("model control is off on this server (--model-control none)")
        assert [(m["name"], m["version"], m["state"]) for m in client.get_model_repository_index(as_json=True)["models"]
                ] == [("capsnet", "1", "READY"), ("capsnet-decoder", "1", "READY")]
        assert client.is_model_ready("capsnet")
    finally:
        client.close()
    status, body = rest(server, "POST", "/v2/repository/models/capsnet/load")
    assert status == 403 and "--model-control none" in body["error"]


def test_poll_mode_loads_a_new_version_and_refuses_explicit_control(model_dir, tmp_path):
    repository = tmp_path / "models"
    add_version(repository, "capsnet", 1, model_dir)
    with repository_server(repository, model_control="poll", poll_seconds=0.1) as running:
        client = running.triton
        add_version(repository, "capsnet", 2, model_dir)
        wait_until(lambda: infer(client, "capsnet") == "2", timeout=60, interval=0.1)
        wait_until(lambda: {(m["version"], m["state"]) for m in client.get_model_repository_index(
            as_json=True)["models"]} == {("1", "UNAVAILABLE"), ("2", "READY")}, timeout=30)
        with pytest.raises(InferenceServerException) as refused:
            client.load_model("capsnet")
        assert refused.value.status() == "StatusCode.PERMISSION_DENIED" and "polls" in refused.value.message()


def serve_error(capsys, *flags: str) -> str:
    """The one error line `capsnet serve FLAGS` exits 2 with."""
    from capsnet.cli import main

    code = main(["serve", "--grpc-port", "0", "--http-port", "0", "--metrics-port", "0", *flags])
    stderr = capsys.readouterr().err
    errors = [line for line in stderr.splitlines() if line.startswith("capsnet serve: error: ")]
    assert code == 2 and len(errors) == 1 and "Traceback" not in stderr, stderr
    return errors[0].removeprefix("capsnet serve: error: ")


@pytest.mark.parametrize("flags, message", [
    (["--model", "m", "--model-control", "explicit"], "--model-control explicit changes the models of a repository"),
    (["--model-repository", "r", "--poll-seconds", "5"], "--poll-seconds sets how often --model-control poll"),
    (["--model-repository", "r", "--model-control", "poll", "--poll-seconds", "0"], "--poll-seconds must be > 0"),
    (["--model-repository", "r", "--version-policy", "newest"], "--version-policy: expected latest:N"),
])
def test_bad_repository_settings_are_one_line(capsys, flags, message):
    assert serve_error(capsys, *flags).startswith(message)


def test_a_repository_that_cannot_serve_is_one_line_at_start(capsys, tmp_path, model_dir):
    repository = tmp_path / "models"
    assert serve_error(capsys, "--model-repository", str(repository)) == (
        f"--model-repository {repository}: no such directory")
    (repository / "lost+found").mkdir(parents=True)
    assert serve_error(capsys, "--model-repository", str(repository)) == (
        f"the model repository {repository} holds no model: put export folders in <model>/<version>/ folders in it")
    (repository / "capsnet" / "v1").mkdir(parents=True)  # not a version: versions are numbers
    assert serve_error(capsys, "--model-repository", str(repository)).startswith(
        "model capsnet: no version folder matches its version policy latest:1 (version folders: none; ")
    add_version(repository, "capsnet", 1, model_dir)
    (repository / "capsnet" / "config.json").write_text('{"version_policy": {"all": {}}, "max_batch_size": 8}')
    assert serve_error(capsys, "--model-repository", str(repository)) == (
        f"{repository / 'capsnet' / 'config.json'}: only version_policy is read from a model's config.json, got "
        "'version_policy', 'max_batch_size'")
    (repository / "capsnet" / "config.json").write_text('{"version_policy": {"specific": {"versions": [2]}}}')
    assert serve_error(capsys, "--model-repository", str(repository)).startswith(
        "model capsnet: no version folder matches its version policy specific:2 (version folders: 1; ")
