"""Rollouts inside one server under load, against a real server on loopback (bounded loops): a reload loses no
request and switches at one instant; a bad version is refused while the current one serves; an unload answers every
request in flight; load/unload cycles do not grow the process."""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass

import grpc
import numpy as np
import pytest
from serving_helpers import (add_version, corrupt_onnx, fail_self_check, metric, repository_server, rss_bytes, scrape,
                             wait_until)
from tritonclient.utils import InferenceServerException

from capsnet.kserve import grpc_service_pb2 as kserve_pb
from capsnet.kserve import grpc_service_pb2_grpc as kserve_grpc

CLIENTS = 16
IMAGE = np.random.default_rng(6).random((1, 1, 28, 28), dtype=np.float32)  # (1, 1, 28, 28)
MEMORY_CYCLES = 100
WARM_CYCLES = 5
# A version left alive each cycle would hold its ONNX Runtime session, about 2.6 MB for the served model: some
# 260 MB over the cycles. Freed versions grow the process by a few MB at most (1.6 MB on a 2-core AMD EPYC with AVX2).
MEMORY_GROWTH_BYTES = 20 * 2 ** 20


@dataclass
class Outcome:
    client: int
    sent: float  # time.monotonic()
    version: str  # "" when refused
    code: str  # "OK" or the gRPC status code's name
    details: str = ""


class Load:
    """CLIENTS threads, each with its own channel, sending ModelInfer for `model` one after another until stopped
    (or for at most `limit_s`); every request sent gets an Outcome."""

    def __init__(self, target: str, model: str, limit_s: float = 60.0):
        self.outcomes: list[Outcome] = []
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._request = kserve_pb.ModelInferRequest(
            model_name=model, inputs=[kserve_pb.ModelInferRequest.InferInputTensor(
                name="images", datatype="FP32", shape=list(IMAGE.shape))],
            raw_input_contents=[IMAGE.astype("<f4").tobytes()])
        self._deadline = time.monotonic() + limit_s
        self._threads = [threading.Thread(target=self._client, args=(target, index), daemon=True)
                         for index in range(CLIENTS)]
        for thread in self._threads:
            thread.start()

    def _client(self, target: str, index: int) -> None:
        with grpc.insecure_channel(target) as channel:
            stub = kserve_grpc.GRPCInferenceServiceStub(channel)
            while not self._stop.is_set() and time.monotonic() < self._deadline:
                sent = time.monotonic()
                try:
                    answer = stub.ModelInfer(self._request, timeout=30)
                    outcome = Outcome(index, sent, answer.model_version, "OK")
                except grpc.RpcError as err:
                    outcome = Outcome(index, sent, "", err.code().name, err.details() or "")
                with self._lock:
                    self.outcomes.append(outcome)

    def wait_for(self, count: int, timeout: float = 60.0) -> None:
        """Until `count` more outcomes than now."""
        target = len(self.outcomes) + count
        wait_until(lambda: len(self.outcomes) >= target, timeout=timeout)

    def stop(self) -> list[Outcome]:
        self._stop.set()
        for thread in self._threads:
            thread.join(60)
        assert not any(thread.is_alive() for thread in self._threads)
        return self.outcomes


@pytest.fixture(scope="module")
def repository(model_dir, tmp_path_factory):
    root = tmp_path_factory.mktemp("rollout")
    for model in ("reload", "steady", "drain", "cycle"):
        add_version(root, model, 1, model_dir)
    return root


@pytest.fixture(scope="module")
def served(repository):
    with repository_server(repository, max_queue_delay_us=1000, grace_period_s=5.0) as running:
        yield running


@pytest.fixture(scope="module")
def triton(served):
    return served.triton


def index(triton, model: str) -> dict[str, tuple[str, str]]:
    """version -> (state, reason) of `model` in the repository index."""
    return {entry.get("version", ""): (entry["state"], entry.get("reason", ""))
            for entry in triton.get_model_repository_index(as_json=True)["models"] if entry["name"] == model}


def test_a_reload_under_load_loses_nothing_and_switches_at_one_instant(served, triton, repository, model_dir):
    load = Load(served.target, "reload")
    try:
        load.wait_for(50)
        add_version(repository, "reload", 2, model_dir)
        triton.load_model("reload")  # returns once version 2 serves: the switch is behind us
        switched = time.monotonic()
        load.wait_for(100)
    finally:
        outcomes = load.stop()
    failed = [outcome for outcome in outcomes if outcome.code != "OK"]
    assert not failed, failed[:5]
    assert {outcome.version for outcome in outcomes} == {"1", "2"}
    assert {outcome.version for outcome in outcomes if outcome.sent > switched} == {"2"}
    for client in range(CLIENTS):  # no client sees the old version after the new one
        versions = [outcome.version for outcome in outcomes if outcome.client == client]
        assert versions == sorted(versions), client
    wait_until(lambda: index(triton, "reload") == {"1": ("UNAVAILABLE", "unloaded"), "2": ("READY", "")})


def test_bad_versions_are_refused_under_load_and_the_current_one_serves_on(served, triton, repository, model_dir,
                                                                          caplog):
    caplog.set_level(logging.ERROR, logger="capsnet.serving.engine.model_manager")
    load = Load(served.target, "steady")
    try:
        load.wait_for(30)
        corrupt_onnx(add_version(repository, "steady", 2, model_dir))
        with pytest.raises(InferenceServerException) as corrupt:
            triton.load_model("steady")
        load.wait_for(30)
        fail_self_check(add_version(repository, "steady", 3, model_dir))
        with pytest.raises(InferenceServerException) as wrong:
            triton.load_model("steady")
        load.wait_for(30)
    finally:
        outcomes = load.stop()
    assert [outcome for outcome in outcomes if outcome.code != "OK"] == []
    assert {outcome.version for outcome in outcomes} == {"1"}
    assert corrupt.value.status() == wrong.value.status() == "StatusCode.FAILED_PRECONDITION"
    assert "version 2 refused" in corrupt.value.message() and "does not match" in corrupt.value.message()
    # under --backend auto each engine raced names its own refusal ("onnxruntime fp32: self-check failed: ...")
    assert "version 3 refused: " in wrong.value.message() and "self-check failed" in wrong.value.message()
    states = index(triton, "steady")
    assert states["1"] == ("READY", "")
    assert states["2"][0] == states["3"][0] == "UNAVAILABLE"
    assert "does not match" in states["2"][1] and "self-check failed" in states["3"][1]
    refusals = [record.getMessage() for record in caplog.records if "refused" in record.getMessage()]
    assert any(line.startswith("model steady version 2 refused:") and line.endswith("version 1 serves on")
               for line in refusals), refusals
    assert any(line.startswith("model steady version 3 refused: ") and "self-check failed" in line
               for line in refusals), refusals
    samples = scrape(served.metrics_url)
    for version in ("2", "3"):
        assert metric(samples, "capsnet_model_loads_total", model="steady", version=version, outcome="refused") == 1
    assert triton.is_model_ready("steady")


def test_an_unload_answers_every_request_in_flight_or_refuses_it_unavailable(served, triton):
    load = Load(served.target, "drain")
    try:
        load.wait_for(50)
        triton.unload_model("drain")  # returns once the requests it had taken are answered
        unloaded = time.monotonic()
        load.wait_for(50)
    finally:
        outcomes = load.stop()
    assert {outcome.code for outcome in outcomes} <= {"OK", "UNAVAILABLE"}
    assert {outcome.code for outcome in outcomes if outcome.sent > unloaded} == {"UNAVAILABLE"}
    refusals = {outcome.details for outcome in outcomes if outcome.code == "UNAVAILABLE"}
    assert refusals == {"model_name: model 'drain' has no version loaded (unloaded); retry later, or on another "
                        "replica"}
    assert sum(outcome.code == "OK" for outcome in outcomes) >= 50
    assert not triton.is_model_ready("drain")
    assert index(triton, "drain") == {"1": ("UNAVAILABLE", "unloaded")}


def test_load_unload_cycles_do_not_grow_the_process(served, triton):
    def cycle() -> None:
        triton.unload_model("cycle")
        triton.load_model("cycle")

    for _ in range(WARM_CYCLES):  # the allocators' pools and caches reach their size
        cycle()
    first = rss_bytes()
    for _ in range(MEMORY_CYCLES):
        cycle()
    grown = rss_bytes() - first
    assert grown <= MEMORY_GROWTH_BYTES, f"RSS grew {grown / 2 ** 20:.1f} MB over {MEMORY_CYCLES} cycles"
    assert triton.is_model_ready("cycle")
