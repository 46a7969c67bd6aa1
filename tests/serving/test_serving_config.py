"""Server settings: flags win over environment variables, which win over the defaults."""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import math
from pathlib import Path

import numpy as np
import pytest
from serving_helpers import ServerThread, server_config

from capsnet.errors import CapsNetError
from capsnet.serving.config import ServerConfig
from capsnet.serving.engine.artifacts import load_artifacts
from capsnet.serving.transports.server import IMAGE_OVERHEAD_BYTES, CapsNetServer


def test_defaults_are_loopback_and_triton_ports():
    config = ServerConfig.from_sources({"model_dir": "m"}, env={})
    assert (config.host, config.http_port, config.grpc_port, config.metrics_port) == ("127.0.0.1", 8000, 8001, 8002)
    assert config.http
    assert config.model_dir == Path("m")


@pytest.mark.parametrize("cores", [{0}, {0, 1}, set(range(16))])
def test_intra_op_threads_leave_the_event_loop_a_core(monkeypatch, cores):
    """By default the backend takes every core but one, so that the event loop never waits for intra-op threads;
    --threads sets the count whatever the host has."""
    monkeypatch.setattr("os.sched_getaffinity", lambda pid: cores)
    assert ServerConfig(model_dir=Path("m")).intra_op_threads == max(1, len(cores) - 1)
    assert ServerConfig(model_dir=Path("m"), threads=len(cores) + 3).intra_op_threads == len(cores) + 3


def test_environment_then_flags():
    env = {"CAPSNET_HOST": "0.0.0.0", "CAPSNET_GRPC_PORT": "9001", "CAPSNET_METRICS_PORT": "9002",
           "CAPSNET_HTTP_PORT": "9000"}
    from_env = ServerConfig.from_sources({"model_dir": "m", "grpc_port": None}, env=env)
    assert (from_env.host, from_env.http_port, from_env.grpc_port, from_env.metrics_port) == ("0.0.0.0", 9000, 9001,
                                                                                              9002)
    from_flags = ServerConfig.from_sources({"model_dir": "m", "grpc_port": 7001, "http_port": 7000,
                                            "host": "127.0.0.2"}, env=env)
    assert (from_flags.host, from_flags.http_port, from_flags.grpc_port, from_flags.metrics_port) == (
        "127.0.0.2", 7000, 7001, 9002)


def test_every_setting_is_a_serve_flag_unset_by_default():
    """`capsnet serve` reads every ServerConfig field from the flag of its name: a field without one fails here rather
    than at the first start. Left out, a flag is None, so the environment or the field's default decides."""
    from capsnet.cli import build_parser

    args = vars(build_parser("serve").parse_args(["serve", "--model", "m"]))
    settings = {setting.name for setting in dataclasses.fields(ServerConfig)}
    assert settings - set(args) == set()
    assert {name: args[name] for name in settings - {"model_dir"} if args[name] is not None} == {}


@pytest.mark.parametrize("flags, warmup", [([], True), (["--no-warmup"], False)])
def test_no_warmup_serves_without_running_the_batch_sizes_first(model_dir, caplog, flags, warmup):
    """--no-warmup: the version serves once loaded and self-checked; its first batches of each size warm it."""
    from capsnet.cli import build_parser
    from capsnet.client.api import CapsNetClient

    args = build_parser().parse_args(["serve", "--model", str(model_dir), *flags])
    assert args.warmup is (None if warmup else False)  # None: not given, the default (on)
    caplog.set_level(logging.INFO, logger="capsnet.serving.engine.service")
    running = ServerThread(server_config(model_dir, warmup=warmup))
    try:
        with CapsNetClient(running.target) as client:
            assert len(client.classify([np.zeros((1, 28, 28), dtype=np.float32)] * 3)) == 3
    finally:
        running.stop()
    assert ("warmed up batch sizes [1, 2, 4, 8]" in caplog.text) is warmup


@pytest.mark.parametrize("values, env, message", [
    ({}, {"CAPSNET_GRPC_PORT": "eighty"}, "CAPSNET_GRPC_PORT must be an integer, got 'eighty'"),
    ({"metrics_port": 70000}, {}, "metrics-port must be in 0..65535"),
    ({"http_port": -1}, {}, "http-port must be in 0..65535 (0: any free port), got -1"),
    ({}, {"CAPSNET_HTTP_PORT": "8o00"}, "CAPSNET_HTTP_PORT must be an integer, got '8o00'"),
    ({"max_batch_size": 0}, {}, "--max-batch-size must be >= 1, got 0"),
    ({"max_queue_delay_us": -1}, {}, "--max-queue-delay-us must be >= 0, got -1"),
    ({"tls_cert": "cert.pem"}, {}, "--tls-cert and --tls-key go together"),
    ({"tls_client_ca": "ca.pem"}, {}, "--tls-client-ca (mutual TLS) needs --tls-cert and --tls-key"),
    ({"backend": "tpu"}, {},
     "--backend must be one of auto, onnxruntime, openvino, tensorrt, torch, aoti, fused, got 'tpu'"),
    ({"max_pending_rpcs": 100}, {}, "--max-pending-rpcs (100) must be >= --max-queue-size (256)"),
    ({"max_image_scale": 0}, {}, "--max-image-scale must be >= 1, got 0"),
    ({"max_shm_regions": 0}, {}, "--max-shm-regions must be >= 1, got 0"),
    ({"max_shm_bytes": -5}, {}, "--max-shm-bytes must be >= 1, got -5"),
    ({"drain_window_s": -1}, {}, "--drain-window must be >= 0, got -1"),
    ({"drain_window_s": float("nan")}, {}, "--drain-window must be >= 0, got nan"),
    ({"drain_window_s": float("inf")}, {}, "--drain-window must be <= 300 seconds, got inf"),
    ({"drain_window_s": 1e9}, {}, "--drain-window must be <= 300 seconds, got 1e+09"),
    ({"grace_period_s": float("nan")}, {}, "--grace-period must be >= 0, got nan"),
    ({"grace_period_s": float("inf")}, {}, "--grace-period must be a number of seconds, got inf"),
    ({"max_message_bytes": 2 ** 31}, {}, "--max-message-bytes must be <= 2147483647 (gRPC's limit), got 2147483648"),
    ({"max_pending_rpcs": 10 ** 12}, {}, "--max-pending-rpcs must be <= 2147483647 (gRPC's limit)"),
])
def test_bad_settings_are_user_errors(values, env, message):
    with pytest.raises(CapsNetError) as caught:
        ServerConfig.from_sources({"model_dir": "m", **values}, env=env)
    assert message in str(caught.value)


def test_largest_drain_window_is_accepted():
    assert ServerConfig.from_sources({"model_dir": "m", "drain_window_s": 300}, env={}).drain_window_s == 300


@pytest.mark.parametrize("values", [{"max_image_scale": 1000}, {"max_batch_size": 50000}])
def test_derived_message_limit_over_grpcs_is_a_user_error(model_dir, values):
    server = CapsNetServer(server_config(model_dir, **values))
    with pytest.raises(CapsNetError) as caught:
        asyncio.run(server.start())
    assert "over gRPC's limit of 2147483647: lower them, or set --max-message-bytes" in str(caught.value)


def test_message_limit_below_one_image_is_a_user_error(model_dir):
    server = CapsNetServer(server_config(model_dir, max_message_bytes=1000))
    with pytest.raises(CapsNetError) as caught:
        asyncio.run(server.start())
    spec = load_artifacts(model_dir)
    # the larger of a float32 image and its float32 outputs (probabilities, poses and the reconstruction if exported)
    outputs = sum(math.prod(shape) for shape in spec.output_shapes.values())
    least = 4 * max(math.prod(spec.input_shape), outputs) + IMAGE_OVERHEAD_BYTES
    assert str(caught.value) == (f"--max-message-bytes 1000 cannot hold one float32 image of this model or its answer; "
                                 f"it must be at least {least}")
