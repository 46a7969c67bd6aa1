"""`--backend torch --precision bf16`: the convolutions in bf16 where the CPU has native bf16, refused in one
line where it would be emulated (many times slower), and never offered to a backend without it; the emulation the
precision gate measures at export computes what the real bf16 convolutions compute."""

from __future__ import annotations

import grpc
import numpy as np
import pytest
import torch
from serving_helpers import ServerThread, server_config
from torch import nn

from capsnet.cli import main
from capsnet.client.api import image_message
from capsnet.errors import CapsNetError
from capsnet.model_description.precision_gate import GATE_MAX_DIFF
from capsnet.models.checkpoint import load_checkpoint
from capsnet.runtime.reduced_precision import convolutions_in
from capsnet.serving.config import ServerConfig
from capsnet.training.data import load_dataset, to_float
from capsnet.v1 import capsnet_pb2 as pb
from capsnet.v1 import capsnet_pb2_grpc


def test_bf16_convolutions_keep_routing_in_fp32_and_match_fp32(trained_tiny_checkpoint):
    """Runs wherever torch has bf16 kernels (emulated ones too): the numerics, not the speed."""
    checkpoint = load_checkpoint(trained_tiny_checkpoint)
    fp32, bf16 = checkpoint.build_model().eval(), checkpoint.build_model().eval()
    assert convolutions_in(bf16, "bf16") == 2  # Conv1 and PrimaryCaps
    dtypes = {name: p.dtype for name, p in bf16.named_parameters()}
    assert {dtypes[name] for name in dtypes if name.startswith(("conv1.", "primary_caps."))} == {torch.bfloat16}
    assert {dtypes[name] for name in dtypes if name.startswith(("digit_caps.", "decoder."))} == {torch.float32}
    images = to_float(load_dataset("embedded").test.images[:64])  # (64, 1, 28, 28)
    with torch.inference_mode():
        expected, got = fp32(images), bf16(images)
    assert got.probabilities.dtype == got.poses.dtype == torch.float32
    difference = (got.probabilities - expected.probabilities).abs().max().item()
    assert 0 < difference <= GATE_MAX_DIFF["bf16"]  # rounded, within what export accepts
    assert torch.equal(got.probabilities.argmax(1), expected.probabilities.argmax(1))
    emulated = checkpoint.build_model().eval()
    convolutions_in(emulated, "bf16", emulate=True)
    with torch.inference_mode():
        # fp32 sums of the same rounded products: close to bf16's own kernels, far closer than bf16 is to fp32
        apart = (emulated(images).probabilities - got.probabilities).abs().max().item()
    assert apart <= difference / 4, (apart, difference)


def test_bf16_conversion_leaves_a_model_without_convolutions_alone():
    model = nn.Sequential(nn.Linear(4, 2))
    assert convolutions_in(model, "bf16") == 0 and model[0].weight.dtype == torch.float32


def test_bf16_is_for_the_backends_that_run_the_checkpoint_only():
    for backend in ("auto", "onnxruntime", "tensorrt"):
        with pytest.raises(CapsNetError, match="--precision bf16 runs the checkpoint's convolutions in bf16 on the "
                                               "torch, aoti or fused backend: add --backend torch, aoti or fused"):
            ServerConfig.from_sources({"model_dir": "m", "backend": backend, "precision": "bf16"}, env={})


@pytest.mark.parametrize("cpu_kind", ["avx2", "avx512"], indirect=True)
def test_bf16_is_refused_in_one_line_without_native_bf16(model_dir, cpu_kind, capsys):
    code = main(["serve", "--model", str(model_dir), "--backend", "torch", "--precision", "bf16",
                 "--grpc-port", "0", "--http-port", "0", "--metrics-port", "0"])
    errors = [line for line in capsys.readouterr().err.splitlines() if line.startswith("capsnet serve: error: ")]
    assert code == 2 and errors == [f"capsnet serve: error: --precision bf16: this CPU has no native bf16 (no "
                                    f"avx512_bf16 or amx_bf16: {cpu_kind.describe()}); emulated bf16 runs many times "
                                    "slower than fp32"]


@pytest.mark.parametrize("cpu_kind", ["avx512-bf16", "amx"], indirect=True)
def test_bf16_serves_after_its_self_check_on_a_native_bf16_cpu(model_dir, cpu_kind):
    """On a host without native bf16 the kind's decision still holds; torch emulates the bf16 arithmetic."""
    running = ServerThread(server_config(model_dir, backend="torch", precision="bf16"))
    try:
        with grpc.insecure_channel(running.target) as channel:
            info = capsnet_pb2_grpc.CapsNetServiceStub(channel).GetModelInfo(pb.GetModelInfoRequest(), timeout=30)
            reply = capsnet_pb2_grpc.CapsNetServiceStub(channel).Classify(
                pb.ClassifyRequest(images=[image_message(np.full((1, 28, 28), 0.5, np.float32))]), timeout=30)
        check = info.self_check
        assert info.precision == check.precision == "bf16" and check.passed and check.images == 128
        assert 0 < check.max_abs_diff["probabilities"] <= running.server.service.spec.self_check.tolerance
        assert len(reply.results) == 1 and len(reply.results[0].probabilities) == 10
    finally:
        running.stop()
