"""The benchmarks' `capsnet serve` child process and its metrics, read as every benchmark reads them
(capsnet.bench.server_process.scrape: the serving A/B, the GPU check and capsnet bench)."""

from __future__ import annotations

import asyncio

import numpy as np

from capsnet.bench.loadgen import run_load
from capsnet.bench.server_process import ServerProcess, scrape


def test_a_served_batch_shows_in_the_scraped_metrics_summed_over_their_labels(tiny_export):
    with ServerProcess(["--model", str(tiny_export), "--threads", "1"]) as server:
        before = server.scrape()
        images = np.zeros((4, 1, 28, 28), np.float32)
        result = asyncio.run(run_load(server.target, images, concurrency=1, batch_size=4, max_requests=3,
                                      max_seconds=60, warmup_requests=0, api="kserve", model_name="capsnet",
                                      input_name="images"))
        assert len(result.latencies_s) == 3 and not result.errors
        assert server.metrics_url is not None
        after = scrape(server.metrics_url)
    images_run = after["capsnet_batch_size_sum"] - before.get("capsnet_batch_size_sum", 0.0)
    assert images_run == 12  # three requests of four images
    assert after["capsnet_compute_seconds_count"] >= after["capsnet_batch_size_count"] - before.get(
        "capsnet_batch_size_count", 0.0) > 0
    assert not any(name.endswith("_bucket") for name in after)  # buckets carry `le`: left out
