"""Dynamic batching: concurrent requests share backend runs, each caller gets its own answer, and the
bounded queue, deadlines and cancellation behave as documented."""

from __future__ import annotations

import asyncio
import threading
import time

import grpc
import numpy as np
import pytest
from serving_helpers import ServerThread, metric, scrape, server_config, wait_until

from capsnet.client.api import image_message
from capsnet.serving.engine import batcher
from capsnet.serving.engine.artifacts import load_artifacts
from capsnet.serving.engine.backends import create_backend
from capsnet.serving.errors import DeadlineExceeded
from capsnet.serving.observability.metrics import Metrics
from capsnet.serving.observability.statistics import ModelStatistics
from capsnet.v1 import capsnet_pb2 as pb
from capsnet.v1 import capsnet_pb2_grpc

RNG = np.random.default_rng(2)


def request(images: np.ndarray) -> pb.ClassifyRequest:
    return pb.ClassifyRequest(images=[image_message(image) for image in images])


def probabilities(response: pb.ClassifyResponse) -> np.ndarray:
    return np.array([list(result.probabilities) for result in response.results], dtype=np.float32)  # (N, J)


@pytest.fixture(scope="module")
def batching_server(model_dir):
    """A generous queue delay (100 ms), so requests sent together surely meet in one batch."""
    running = ServerThread(server_config(model_dir, max_batch_size=8, max_queue_delay_us=100_000))
    channel = grpc.insecure_channel(running.target)
    yield running, capsnet_pb2_grpc.CapsNetServiceStub(channel)
    channel.close()
    running.stop()


@pytest.fixture(scope="module")
def slow_queue_server(model_dir):
    """A 2-request queue whose batches wait 1.5 s for batch-mates: time to observe the queue."""
    running = ServerThread(server_config(model_dir, max_batch_size=8, max_queue_delay_us=1_500_000, max_queue_size=2))
    channel = grpc.insecure_channel(running.target)
    yield running, capsnet_pb2_grpc.CapsNetServiceStub(channel)
    channel.close()
    running.stop()


def test_concurrent_requests_are_batched_and_each_caller_gets_its_answer(batching_server):
    running, stub = batching_server
    backend = running.server.service.backend
    requests = [RNG.random((1 + k % 3, 1, 28, 28), dtype=np.float32) for k in range(16)]
    total = sum(len(images) for images in requests)  # 31
    before = scrape(running.metrics_url)
    futures = [stub.Classify.future(request(images), timeout=30) for images in requests]
    responses = [future.result() for future in futures]
    after = scrape(running.metrics_url)

    for images, response in zip(requests, responses):
        # Each image alone through the backend: its result must not depend on its batch-mates.
        alone = np.concatenate([backend.run(image[None].copy())["probabilities"] for image in images])
        np.testing.assert_allclose(probabilities(response), alone, rtol=0, atol=1e-5)
    batches = metric(after, "capsnet_batch_size_count") - metric(before, "capsnet_batch_size_count")
    images = metric(after, "capsnet_batch_size_sum") - metric(before, "capsnet_batch_size_sum")
    singles = (metric(after, "capsnet_batch_size_bucket", le="1.0")
               - metric(before, "capsnet_batch_size_bucket", le="1.0"))
    assert images == total and metric(after, "capsnet_images_total") - metric(before, "capsnet_images_total") == total
    assert batches < 16 and batches - singles > 0, f"{batches} backend runs for 16 requests, {singles} of one image"


def test_a_request_is_split_to_fill_a_batch(batching_server):
    running, stub = batching_server
    backend = running.server.service.backend
    first, second = RNG.random((5, 1, 28, 28), dtype=np.float32), RNG.random((6, 1, 28, 28), dtype=np.float32)
    before = scrape(running.metrics_url)
    futures = [stub.Classify.future(request(first), timeout=30), stub.Classify.future(request(second), timeout=30)]
    results = [probabilities(future.result()) for future in futures]
    after = scrape(running.metrics_url)
    # 11 images, at most 8 per run: 5 + 3 of the second request, then its last 3.
    assert metric(after, "capsnet_batch_size_count") - metric(before, "capsnet_batch_size_count") == 2
    assert metric(after, "capsnet_batch_size_bucket", le="8.0") \
        - metric(before, "capsnet_batch_size_bucket", le="4.0") >= 1
    for images, got in zip((first, second), results):
        np.testing.assert_allclose(got, backend.run(images.copy())["probabilities"], rtol=0, atol=1e-5)


def test_full_queue_answers_unavailable_at_once_and_cancelling_frees_a_slot(slow_queue_server):
    running, stub = slow_queue_server
    images = RNG.random((1, 1, 28, 28), dtype=np.float32)
    depth = lambda: metric(scrape(running.metrics_url), "capsnet_queue_depth")  # noqa: E731
    cancelled_before = metric(scrape(running.metrics_url), "capsnet_dropped_requests_total", reason="cancelled")
    first = stub.Classify.future(request(images), timeout=30)
    second = stub.Classify.future(request(images), timeout=30)
    wait_until(lambda: depth() == 2, timeout=1.0)

    started = time.monotonic()
    with pytest.raises(grpc.RpcError) as caught:
        stub.Classify(request(images), timeout=30)
    assert caught.value.code() == grpc.StatusCode.UNAVAILABLE
    assert caught.value.details().startswith("queue full: 2 requests are waiting (--max-queue-size 2)")
    assert time.monotonic() - started < 0.5, "queue full must be answered at once"

    second.cancel()
    wait_until(lambda: depth() == 1, timeout=1.0)
    third = stub.Classify.future(request(images), timeout=30)
    expected = running.server.service.backend.run(images.copy())["probabilities"]
    for future in (first, third):
        np.testing.assert_allclose(probabilities(future.result()), expected, rtol=0, atol=1e-5)
    assert second.cancelled()
    assert metric(scrape(running.metrics_url), "capsnet_dropped_requests_total", reason="cancelled") \
        == cancelled_before + 1


def test_request_past_its_deadline_is_dropped_before_compute(slow_queue_server):
    running, stub = slow_queue_server
    before = scrape(running.metrics_url)
    with pytest.raises(grpc.RpcError) as caught:
        stub.Classify(request(RNG.random((1, 1, 28, 28), dtype=np.float32)), timeout=0.3)
    assert caught.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    dropped = lambda: metric(scrape(running.metrics_url), "capsnet_dropped_requests_total")  # noqa: E731
    wait_until(lambda: dropped() == metric(before, "capsnet_dropped_requests_total") + 1, timeout=5)
    time.sleep(1.6)  # past the batch the request would have joined
    after = scrape(running.metrics_url)
    assert metric(after, "capsnet_images_total") == metric(before, "capsnet_images_total"), "it was computed"


def test_service_raises_deadline_exceeded_for_a_request_that_waited_too_long(slow_queue_server):
    running, _ = slow_queue_server
    service = running.server.service
    before = metric(scrape(running.metrics_url), "capsnet_dropped_requests_total", reason="deadline")
    images = RNG.random((2, 1, 28, 28), dtype=np.float32)
    with pytest.raises(DeadlineExceeded):
        running.call(service.infer(images, deadline=time.monotonic() + 0.1))
    assert metric(scrape(running.metrics_url), "capsnet_dropped_requests_total", reason="deadline") == before + 1
    assert metric(scrape(running.metrics_url), "capsnet_queue_depth") == 0


def test_a_lone_request_runs_at_once_on_the_event_loop(model_dir, monkeypatch):
    # With no queue delay, a request that finds nothing queued or running, and nothing else ready on the event loop,
    # is its own batch, run by its caller (the batches of requests that meet, and those a queue delay waits for, are
    # tested above and below).
    # Every run counts as short here, whatever the host's load: this checks where runs go, not how long they take.
    monkeypatch.setattr(batcher, "INLINE_RUN_S", 10.0)
    running = ServerThread(server_config(model_dir, max_batch_size=8, max_queue_delay_us=0))
    backend = running.server.service.backend
    run, runs = backend.run, []

    def recorded(images):
        on_loop = threading.current_thread() is running.thread
        runs.append(asyncio.current_task().get_name() if on_loop else threading.current_thread().name)
        return run(images)

    backend.run = recorded
    try:
        with grpc.insecure_channel(running.target) as channel:
            stub = capsnet_pb2_grpc.CapsNetServiceStub(channel)
            images = RNG.random((1, 1, 28, 28), dtype=np.float32)  # (1, 1, 28, 28)
            # the first run of a size has no estimate yet, so it goes to the thread; later ones run on the loop, in
            # the call's own task rather than the batcher's scheduler, unless gRPC happened to have another callback
            # ready at that moment (on a busy host, its own housekeeping): then the thread, never the scheduler inline.
            # So requests go one at a time, each once the loop has finished the last one's answer, until 5 ran at
            # once (at most 24: a loaded CI host sent some of them to the thread).
            alone: list[np.ndarray] = []

            def ran_at_once() -> list[str]:
                return [task for task in runs[1:] if task not in {"capsnet-batcher", "capsnet-backend_0"}]

            while len(alone) < 24 and (len(alone) < 8 or len(ran_at_once()) < 5):
                alone.append(probabilities(stub.Classify(request(images), timeout=10)))
                time.sleep(0.05)
            assert runs[0] == "capsnet-backend_0" and len(runs) == len(alone), runs
            assert len(ran_at_once()) >= 5 and "capsnet-batcher" not in runs, runs
            assert all(np.array_equal(answer, alone[0]) for answer in alone)
            assert metric(scrape(running.metrics_url), "capsnet_queue_depth") == 0
    finally:
        running.stop()


def test_requests_that_arrive_together_form_one_batch_without_a_queue_delay(model_dir, monkeypatch):
    # Triton's model with no queue delay: a request alone on the loop runs at once; requests ready to run together
    # (other calls' handlers, a burst from a front end) queue and form one batch; what queues while a batch runs
    # forms the next one.
    monkeypatch.setattr(batcher, "INLINE_RUN_S", 10.0)  # where runs go is checked here, not how long they take
    backend = create_backend("onnxruntime", "fp32", load_artifacts(model_dir), server_config(model_dir))
    images = RNG.random((12, 1, 28, 28), dtype=np.float32)  # (12, 1, 28, 28)
    expected = backend.run(images)["probabilities"]  # (12, J)
    stats = ModelStatistics("capsnet", "1")

    async def main() -> list:
        queue = batcher.Batcher(backend, batcher.BatcherConfig(8, 0.0, 64),
                                Metrics(8).for_version("capsnet", "1"), stats)
        lone = await queue.submit(images[:1])  # nothing beside it: its own batch (in the thread: no estimate yet)
        together = await asyncio.gather(*(queue.submit(images[i:i + 1]) for i in range(12)))
        threads.clear()
        await queue.submit(images[:1])  # alone on an idle loop, its size's run known: run by this task, at once
        assert threads == [threading.current_thread().name]
        await queue.drain()
        return [lone, *together]

    threads: list[str] = []
    run = backend.run
    backend.run = lambda batch: threads.append(threading.current_thread().name) or run(batch)
    outputs = asyncio.run(main())
    assert [run.size for run in outputs[0].runs] == [1]
    # 12 requests ready in one loop iteration: a batch of the 8 that fit, then one of the 4 that waited for it
    assert [output.runs[0].size for output in outputs[1:]] == [8] * 8 + [4] * 4
    np.testing.assert_allclose(np.concatenate([output.outputs["probabilities"] for output in outputs[1:]]),
                               expected, rtol=1e-5, atol=1e-6)
    assert stats.execution_count == 4 and set(stats.batches) == {1, 4, 8}  # the 4th: the lone request at once
