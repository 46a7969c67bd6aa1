"""`capsnet serve --workers N` as real processes on loopback, driven by tritonclient: answers through every front end,
one set of statistics and metrics, health, a front end restarted after it dies (its calls UNAVAILABLE), SIGTERM
drained with no request lost, and an engine that dies stopping the server."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import grpc
import numpy as np
import pytest
import tritonclient.grpc as triton
from grpc_health.v1 import health_pb2, health_pb2_grpc
from serving_helpers import ServeProcess, graph_probabilities, metric, pairs, png, scrape, wait_until
from tritonclient.utils import InferenceServerException

from capsnet.client.api import CapsNetClient
from capsnet.serving.config import ServerConfig
from capsnet.serving.processes.front_end import EngineLink
from capsnet.serving.processes.supervisor import front_ends

IMAGES = np.random.default_rng(11).random((8, 1, 28, 28), dtype=np.float32)  # (8, 1, 28, 28)
WORKERS = ("--workers", "2", "--no-allow-client-shm", "--drain-window", "0.3", "--grace-period", "5")


def children(pid: int) -> list[int]:
    with open(f"/proc/{pid}/task/{pid}/children") as listed:
        return [int(child) for child in listed.read().split()]


def command_line(pid: int) -> list[str]:
    with open(f"/proc/{pid}/cmdline", "rb") as line:
        return line.read().decode().split("\0")


def roles(server: ServeProcess) -> tuple[int, list[int]]:
    """The engine's pid and the front ends'."""
    pids = children(server.process.pid)
    engine = [pid for pid in pids if "engine" in command_line(pid)]
    return engine[0], [pid for pid in pids if "front-end" in command_line(pid)]


def infer(client: triton.InferenceServerClient, images: np.ndarray, timeout: float | None = None) -> np.ndarray:
    tensor = triton.InferInput("images", list(images.shape), "FP32")
    tensor.set_data_from_numpy(images)
    result = client.infer("capsnet", [tensor], outputs=[triton.InferRequestedOutput("probabilities")],
                          client_timeout=timeout)
    return result.as_numpy("probabilities")


def clients(server: ServeProcess, count: int) -> list[triton.InferenceServerClient]:
    """`count` clients, each on a connection of its own (the kernel spreads connections over the front ends)."""
    return [triton.InferenceServerClient(server.target, channel_args=[("grpc.use_local_subchannel_pool", 1)])
            for _ in range(count)]


@pytest.fixture
def served(model_dir, tmp_path):
    server = ServeProcess("--model", str(model_dir), "--precision", "fp32", *WORKERS, stderr=tmp_path / "serve.log")
    yield server
    server.stop()


def test_the_default_is_one_front_end_per_two_cores_where_they_serve_everything(monkeypatch, model_dir):
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(16)))
    assert front_ends(ServerConfig(model_dir=model_dir, allow_client_shm=False)) == 8
    assert front_ends(ServerConfig(model_dir=model_dir)) == 1  # clients' shared memory is one process's
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1})
    assert front_ends(ServerConfig(model_dir=model_dir, allow_client_shm=False)) == 1


def test_what_front_ends_do_not_serve_is_refused_at_startup(model_dir):
    result = subprocess.run([sys.executable, "-m", "capsnet", "serve", "--model", str(model_dir), "--workers", "2"],
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 2 and "Traceback" not in result.stderr
    assert result.stderr.strip().splitlines()[-1].startswith(
        "capsnet serve: error: clients' shared memory is served by one process: with --workers 2 add "
        "--no-allow-client-shm")


def test_front_ends_answer_count_and_restart(served, model_dir):
    engine, front = roles(served)
    assert len(front) == 2
    expected = graph_probabilities(model_dir)(IMAGES)
    connections = clients(served, 6)
    for index, client in enumerate(connections):  # 1-image and 3-image requests, over six connections
        images = IMAGES[index:index + 1 + 2 * (index % 2)]
        assert np.abs(infer(client, images) - expected[index:index + len(images)]).max() < 1e-4
    # one set of statistics, whichever front end answers, and one scrape that sums every process
    stats = connections[0].get_inference_statistics("capsnet", as_json=True)["model_stats"][0]
    assert int(stats["inference_stats"]["success"]["count"]) == 6
    assert int(stats["inference_count"]) == 12
    samples = scrape(f"http://127.0.0.1:{served.metrics_port}/metrics")
    assert metric(samples, "capsnet_requests_total", method="ModelInfer", code="OK") == 6
    assert metric(samples, "capsnet_images_total") == 12
    with grpc.insecure_channel(served.target) as channel:
        health = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=10)
    assert health.status == health_pb2.HealthCheckResponse.SERVING
    # the model's decoder is served beside it through the front ends too
    assert [model.name for model in connections[1].get_model_repository_index().models] == ["capsnet",
                                                                                            "capsnet-decoder"]
    poses, classes = triton.InferInput("poses", [2, 10, 16], "FP32"), triton.InferInput("class_index", [2], "INT64")
    poses.set_data_from_numpy(np.full((2, 10, 16), 0.05, np.float32))
    classes.set_data_from_numpy(np.array([3, 7], np.int64))
    assert connections[1].infer("capsnet-decoder", [poses, classes]).as_numpy("reconstruction").shape == (2, 784)

    # Requests that reach the engine together are batched together: stopped while they arrive, it finds them all
    # received when it resumes, and none runs alone as a request the engine would be handling by itself.
    executions = int(stats["execution_count"])
    os.kill(engine, signal.SIGSTOP)
    answers: dict[int, np.ndarray] = {}
    together = [threading.Thread(target=lambda index, client: answers.update({index: infer(client, IMAGES[:1])}),
                                 args=(index, client)) for index, client in enumerate(connections)]
    for thread in together:
        thread.start()
    time.sleep(1.0)  # the calls reach their front ends, which send them on to the engine's socket
    os.kill(engine, signal.SIGCONT)
    for thread in together:
        thread.join(20)
    assert len(answers) == len(connections) and all(np.abs(answer - expected[:1]).max() < 1e-4
                                                   for answer in answers.values())
    stats = connections[0].get_inference_statistics("capsnet", as_json=True)["model_stats"][0]
    assert int(stats["execution_count"]) - executions < len(connections), stats["batch_stats"]

    # Requests held in the (stopped) engine: one past its deadline ends DEADLINE_EXCEEDED; those whose front ends
    # die end UNAVAILABLE, not in a hang.
    os.kill(engine, signal.SIGSTOP)
    with pytest.raises(InferenceServerException) as late:
        infer(connections[0], IMAGES[:1], timeout=0.5)
    assert late.value.status() == "StatusCode.DEADLINE_EXCEEDED"
    failures: list[str] = []

    def held(client) -> None:
        try:
            infer(client, IMAGES[:1], timeout=30)
        except InferenceServerException as err:
            failures.append(err.status())

    threads = [threading.Thread(target=held, args=(client,)) for client in connections]
    for thread in threads:
        thread.start()
    time.sleep(1.0)  # the calls reach their front ends and wait on the engine
    for pid in front:
        os.kill(pid, signal.SIGKILL)
    for thread in threads:
        thread.join(20)
    os.kill(engine, signal.SIGCONT)
    assert failures == ["StatusCode.UNAVAILABLE"] * len(connections)
    wait_until(lambda: len(roles(served)[1]) == 2 and not set(roles(served)[1]) & set(front), timeout=60)
    retry = clients(served, 2)
    wait_until(lambda: _answers(retry[0]), timeout=30, interval=0.2)
    assert np.abs(infer(retry[1], IMAGES[:1]) - expected[:1]).max() < 1e-4
    for client in connections + retry:
        client.close()


def test_a_slot_that_carries_requests_of_other_sizes_in_turn_answers_each_at_its_own(served, model_dir):
    """A front end's freed slot is the next one taken, whatever the next request's size: the engine reads its images
    and writes its outputs at that size, not at the slot's last one. Driven over the engine's own link (the front
    ends' client), so that one slot carries every request in turn."""
    engine, _ = roles(served)
    argv = command_line(engine)
    socket_path = argv[argv.index("engine") + 2]  # the supervisor's child: engine INDEX SOCKET SLOTS READY_FD
    expected = graph_probabilities(model_dir)(IMAGES)

    async def drive() -> list[np.ndarray]:
        link = await EngineLink.connect(socket_path, f"capsnet-test-{os.getpid()}", ServerConfig(model_dir=model_dir))
        try:
            version = next(index for index, spec in enumerate(link.specs) if spec.name == "capsnet")
            answers = []
            for start, stop in ((0, 1), (1, 4), (5, 6), (0, 8), (6, 8)):
                (output,) = await link.infer(version, [IMAGES[start:stop]], None)
                answers.append(output.outputs["probabilities"])
            return answers
        finally:
            await link.close()

    answers = asyncio.run(drive())
    for (start, stop), answer in zip(((0, 1), (1, 4), (5, 6), (0, 8), (6, 8)), answers):
        assert answer.shape == (stop - start, expected.shape[1])
        assert np.abs(answer - expected[start:stop]).max() < 1e-4


def test_a_request_of_several_sizes_is_counted_once_by_the_engine(shared_tiny_export, tmp_path):
    # a model of any size: the front end sends both sizes to the engine as one request, as one process counts it
    server = ServeProcess("--model", str(shared_tiny_export), "--precision", "fp32", *WORKERS,
                          stderr=tmp_path / "serve.log")
    try:
        wide, _ = pairs(2)  # (2, 1, 28, 56)
        square = IMAGES[:3]  # (3, 1, 28, 28)
        with CapsNetClient(server.target) as client:
            predictions = client.classify([png(image) for image in wide] + [png(image) for image in square], top_k=1,
                                          poses=False)
        assert len(predictions) == 5
        with triton.InferenceServerClient(server.target) as client:
            stats = client.get_inference_statistics("capsnet", as_json=True)["model_stats"][0]
        assert int(stats["inference_stats"]["success"]["count"]) == 1
        assert int(stats["inference_count"]) == 5
        assert int(stats["execution_count"]) == 2  # a batch of each size
    finally:
        server.stop()


def _answers(client) -> bool:
    try:
        infer(client, IMAGES[:1], timeout=5)
    except InferenceServerException:
        return False
    return True


def test_statistics_and_metrics_count_exactly_what_concurrent_clients_sent(served):
    # Requests are counted once, in the front end that handled them; batches in the engine. Under concurrent load
    # over both front ends, every count matches what the clients sent, whichever front end is asked.
    connections = clients(served, 8)
    sent: list[int] = []  # images of each answered request

    def load(index: int, client) -> None:
        for step in range(25):
            count = 1 + (index + step) % 3
            infer(client, IMAGES[:count], timeout=30)
            sent.append(count)

    threads = [threading.Thread(target=load, args=(index, client)) for index, client in enumerate(connections)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(120)
    assert len(sent) == 8 * 25
    for client in connections[:4]:  # connections spread over both front ends: each answers the same totals
        stats = client.get_inference_statistics("capsnet", as_json=True)["model_stats"][0]
        assert int(stats["inference_stats"]["success"]["count"]) == len(sent)
        assert int(stats["inference_stats"]["queue"]["count"]) == len(sent)
        assert int(stats["inference_stats"].get("fail", {}).get("count", 0)) == 0
        assert int(stats["inference_count"]) == sum(sent)
        batches = stats["batch_stats"]
        assert sum(int(batch["compute_infer"]["count"]) for batch in batches) == int(stats["execution_count"])
        assert sum(int(batch["batch_size"]) * int(batch["compute_infer"]["count"]) for batch in batches) == sum(sent)
    samples = scrape(f"http://127.0.0.1:{served.metrics_port}/metrics")
    assert metric(samples, "capsnet_requests_total", method="ModelInfer", code="OK") == len(sent)
    assert metric(samples, "capsnet_images_total") == sum(sent)
    assert metric(samples, "capsnet_queue_wait_seconds_count") == len(sent)
    assert metric(samples, "capsnet_batch_size_count") == int(stats["execution_count"])
    for client in connections:
        client.close()


def test_sigterm_drains_every_front_end_with_no_request_lost(served):
    outcomes: list[str] = []
    stop = threading.Event()

    def load(client) -> None:
        for _ in range(2000):  # bounded: the drain ends it within seconds
            if stop.is_set():
                return
            try:
                infer(client, IMAGES[:1], timeout=10)
                outcomes.append("OK")
            except InferenceServerException as err:
                outcomes.append(err.status())
                return  # refused: the server is stopping

    connections = clients(served, 4)
    threads = [threading.Thread(target=load, args=(client,)) for client in connections]
    for thread in threads:
        thread.start()
    wait_until(lambda: len(outcomes) >= 20, timeout=30)
    served.process.send_signal(signal.SIGTERM)
    assert served.process.wait(30) == 0
    stop.set()
    for thread in threads:
        thread.join(10)
    refused = [outcome for outcome in outcomes if outcome != "OK"]
    assert outcomes.count("OK") >= 20
    assert set(refused) <= {"StatusCode.UNAVAILABLE"}, refused  # refused once draining, never cut or lost
    for client in connections:
        client.close()


def test_an_engine_that_dies_stops_the_server(served, tmp_path):
    engine, _ = roles(served)
    os.kill(engine, signal.SIGKILL)
    assert served.process.wait(30) == 3
    log = Path(tmp_path / "serve.log").read_text()
    assert "the engine process exited with code -9: the server stops" in log
