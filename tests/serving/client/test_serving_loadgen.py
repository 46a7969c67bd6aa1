"""The load generator that the benchmark numbers come from (and `capsnet bench` reuses)."""

from __future__ import annotations

import asyncio
import json

import pytest
from serving_helpers import free_port

from capsnet.bench.loadgen import main, random_images, run_inprocess, run_load


def test_closed_loop_load_is_bounded_by_count_and_answered(server):
    images = random_images(16, (1, 28, 28))
    result = asyncio.run(run_load(server.target, images, concurrency=4, batch_size=2, max_requests=40,
                                  max_seconds=60, warmup_requests=2))
    summary = result.summary()
    assert summary["requests"] == 40 and summary["errors"] == {}
    assert summary["images_per_s"] == 2 * summary["requests_per_s"] > 0
    assert 0 < summary["p50_ms"] <= summary["p99_ms"]
    short = asyncio.run(run_load(server.target, images, concurrency=2, max_requests=10_000, max_seconds=0.5,
                                 warmup_requests=0))
    assert 0 < len(short.latencies_s) < 10_000 and short.elapsed_s < 5


def test_inprocess_baseline(server):
    result = run_inprocess(server.server.service.backend, random_images(16, (1, 28, 28)), batch_size=4, max_runs=10)
    assert result.summary()["requests"] == 10 and result.name == "in-process onnxruntime"


def test_closed_loop_load_through_kserve(server):
    spec = server.server.service.spec
    result = asyncio.run(run_load(server.target, random_images(4, (1, 28, 28)), concurrency=2, max_requests=10,
                                  warmup_requests=1, api="kserve", model_name=spec.name, input_name=spec.input_name))
    assert result.name == "grpc-kserve" and len(result.latencies_s) == 10 and result.errors == {}


def test_closed_loop_load_through_kserve_rest(server, capsys):
    """REST with Triton's binary data, as tritonclient.http sends it; the command needs --rest with it, only then."""
    spec, rest = server.server.service.spec, f"127.0.0.1:{server.server.http_port}"
    result = asyncio.run(run_load(rest, random_images(4, (1, 28, 28)), concurrency=2, batch_size=2, max_requests=10,
                                  warmup_requests=1, api="kserve-http", model_name=spec.name,
                                  input_name=spec.input_name))
    assert result.name == "http-kserve" and len(result.latencies_s) == 10 and result.errors == {}
    wrong = asyncio.run(run_load(rest, random_images(2, (1, 28, 28)), concurrency=1, max_requests=3, warmup_requests=0,
                                 api="kserve-http", model_name="mnist", input_name=spec.input_name))
    assert wrong.errors == {"404": 3} and not wrong.latencies_s
    assert main(["--server", server.target, "--api", "kserve-http", "--rest", rest, "--concurrency", "1",
                 "--requests", "4", "--json"]) == 0
    assert [json.loads(line)["name"] for line in capsys.readouterr().out.splitlines()] == ["http-kserve"]
    for flags in (["--api", "kserve-http"], ["--rest", rest]):
        with pytest.raises(SystemExit) as exit_:
            main(["--server", server.target, *flags])
        assert exit_.value.code == 2
    assert "--rest HOST:PORT goes with --api kserve-http" in capsys.readouterr().err


def test_the_documented_command_times_the_server_and_the_backend_in_process(server, model_dir, capsys):
    """docs/serving.md's command, with --model: the gRPC rows, then the same model's backend in-process."""
    assert main(["--server", server.target, "--model", str(model_dir), "--concurrency", "1", "2", "--requests", "6",
                 "--seconds", "5", "--threads", "1", "--json"]) == 0
    rows = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert [(row["name"], row["batch_size"]) for row in rows] == [
        ("grpc", 1), ("grpc", 1), ("in-process onnxruntime", 1), ("in-process onnxruntime", 2)]
    assert all(row["requests"] == 6 and not row["errors"] for row in rows), rows


def test_warmup_seconds_are_not_counted(server):
    """deploy/loadtest.py's warm-up: every client runs for warmup_seconds first, and neither its requests nor that
    time count."""
    result = asyncio.run(run_load(server.target, random_images(4, (1, 28, 28)), concurrency=2,
                                  max_requests=10_000, max_seconds=0.3, warmup_requests=0, warmup_seconds=1.0,
                                  exclude_poses=True))
    assert result.errors == {} and result.latencies_s
    assert 0.3 <= result.elapsed_s < 1.0  # the counted span alone (the last answers may land after it)


def test_a_server_gone_is_counted_per_client_and_stop_on_error_ends_the_run():
    """A connection refused is a failed request, not an exception out of the run; with stop_on_error each client stops
    at its first (scripts/measure_serving_limits.py's drain: a real client goes to another replica)."""
    target = f"127.0.0.1:{free_port()}"
    for api, code in (("kserve-http", "ClientConnectorError"), ("capsnet", "UNAVAILABLE")):
        result = asyncio.run(run_load(target, random_images(2, (1, 28, 28)), concurrency=3, max_requests=1000,
                                      max_seconds=30, warmup_requests=0, stop_on_error=True, api=api,
                                      model_name="capsnet", input_name="images"))
        assert result.errors == {code: 3} and not result.latencies_s
