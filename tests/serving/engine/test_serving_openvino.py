"""OpenVINO, the optional second CPU engine: the export's FP32 and INT8 graphs as they are, against ONNX Runtime on the
tiny and `paper` models; the same self-check and precision gate; `--backend auto` racing it; and what a server says
where OpenVINO is not installed."""

from __future__ import annotations

import importlib.util
import json
import logging
import math
import sys

import numpy as np
import onnx
import pytest
from onnx import numpy_helper
from serving_helpers import copy_export, rehash, scale_int8_weights, server_config

from capsnet.cli import main
from capsnet.errors import CapsNetError
from capsnet.model_description.backend_table import BACKEND_TABLE
from capsnet.model_description.precision_gate import FP32_TOLERANCE, compare_outputs
from capsnet.serving.engine.artifacts import load_artifacts
from capsnet.serving.engine.backends import Entrant, candidates, create_backend, describe_choice, load_backend, pick

OPENVINO = importlib.util.find_spec("openvino") is not None
needs_openvino = pytest.mark.skipif(not OPENVINO, reason="OpenVINO is not installed: pip install "
                                                          "'capsnet-serve[openvino]' (the dev extra has it)")


def _serve_errors(model_dir, capsys, *flags: str) -> tuple[int, list[str]]:
    code = main(["serve", "--model", str(model_dir), "--grpc-port", "0", "--http-port", "0", "--metrics-port", "0",
                 *flags])
    return code, [line for line in capsys.readouterr().err.splitlines() if line.startswith("capsnet serve: error: ")]


@needs_openvino
@pytest.mark.parametrize("precision", ["fp32", "int8"])
@pytest.mark.parametrize("model", ["tiny", pytest.param("paper", marks=pytest.mark.slow)])
def test_openvino_agrees_with_onnxruntime_on_the_same_graph(model, precision, request):
    """FP32 within the FP32 parity tolerance on every output with every class the same; INT8 passing the same
    precision gate as ONNX Runtime's run of the graph, and within that gate of ONNX Runtime's answers."""
    folder = request.getfixturevalue("int8_model_dir" if model == "tiny" else "paper_int8_export")
    artifacts = load_artifacts(folder)
    config = server_config(folder, max_batch_size=64)
    openvino = create_backend("openvino", precision, artifacts, config)
    onnxruntime = create_backend("onnxruntime", precision, artifacts, config)
    with np.load(artifacts.reference) as archive:
        images = archive["images"]  # (128, C, H, W): the export's reference images
    for batch in (images[:1], images[1:17], images[17:81]):
        compared = compare_outputs(onnxruntime.run(batch), openvino.run(batch), artifacts.output_names)
        if precision == "fp32":
            assert compared.passes(FP32_TOLERANCE), compared.describe()
        else:
            gate = artifacts.precision_gate["onnx_int8"]
            assert compared.max_abs_diff["probabilities"] <= gate.most_diff, compared.describe()
    check = _self_check(openvino, artifacts, config)
    assert check.passed, check.describe()
    assert bool(check.gate) is (precision == "int8")  # INT8 answers to the gate entry ONNX Runtime's run measured
    assert "f32 arithmetic" in openvino.description  # never bf16, whatever the CPU


def _self_check(backend, artifacts, config):
    from capsnet.serving.engine.backends import checked

    return checked(backend, artifacts, config)


@needs_openvino
def test_the_self_check_refuses_a_broken_int8_graph(int8_model_dir, tmp_path, capsys):
    copy = copy_export(int8_model_dir, tmp_path)
    scale_int8_weights(copy, 3.0)
    code, errors = _serve_errors(copy, capsys, "--backend", "openvino", "--precision", "int8")
    assert code == 2 and len(errors) == 1, errors
    assert "self-check failed: int8 against the FP32 reference on 128 images" in errors[0]
    assert "the precision gate: export measured" in errors[0]


@needs_openvino
def test_the_self_check_refuses_a_broken_fp32_graph(int8_model_dir, tmp_path, capsys):
    copy = copy_export(int8_model_dir, tmp_path)
    graph = onnx.load(str(copy / "model.onnx"))
    first = graph.graph.initializer[0]
    first.CopyFrom(numpy_helper.from_array(numpy_helper.to_array(first) * np.float32(1.01), first.name))
    onnx.save(graph, str(copy / "model.onnx"))
    rehash(copy, "model.onnx")
    code, errors = _serve_errors(copy, capsys, "--backend", "openvino", "--precision", "fp32")
    assert code == 2 and len(errors) == 1, errors
    assert "self-check failed: fp32 against the FP32 reference" in errors[0] and "allowed 0.0001" in errors[0]


@pytest.mark.parametrize("precision", ["fp16", "bf16"])
def test_openvino_refuses_what_its_table_row_does_not_serve_and_names_who_does(int8_model_dir, capsys, precision):
    """The server's flags refuse the pair before anything loads; a backend made directly (as bench makes engines)
    says which of the table's rows serve that precision. Neither needs OpenVINO installed."""
    code, errors = _serve_errors(int8_model_dir, capsys, "--backend", "openvino", "--precision", precision)
    assert code == 2 and len(errors) == 1, errors
    from capsnet.serving.engine.backends.openvino_backend import OpenVinoBackend

    with pytest.raises(CapsNetError) as refused:
        OpenVinoBackend(load_artifacts(int8_model_dir), precision, 1)
    served_by = [row.name for row in BACKEND_TABLE.values() if precision in row.precisions]
    assert str(refused.value) == (f"the openvino backend runs the export's fp32 and int8 graphs; --precision "
                                  f"{precision} needs {' or '.join(served_by)}")
    assert "torch" in served_by and "openvino" not in served_by


@needs_openvino
def test_the_gate_holds_openvino_to_what_export_measured(int8_model_dir, tmp_path, capsys):
    """The onnx_int8 entry, as export measured it with ONNX Runtime, holds OpenVINO's INT8: made exact (nothing
    changed class, no difference), the variant's real differences fail it; refused at export, it does not load."""
    copy = copy_export(int8_model_dir, tmp_path)
    sidecar = json.loads((copy / "model.json").read_text())
    gate = sidecar["precision_gate"]["variants"]["onnx_int8"]
    gate.update(argmax_agreement=1.0, max_abs_diff=0.0)
    (copy / "model.json").write_text(json.dumps(sidecar))
    code, errors = _serve_errors(copy, capsys, "--backend", "openvino", "--precision", "int8")
    assert code == 2 and len(errors) == 1 and "self-check failed: int8" in errors[0], errors
    assert "allowed 0.001)" in errors[0]
    gate.update(accuracy_change_points=-50.0, max_drop_points=1.0)
    (copy / "model.json").write_text(json.dumps(sidecar))
    code, errors = _serve_errors(copy, capsys, "--backend", "openvino", "--precision", "int8")
    assert code == 2 and len(errors) == 1 and "export did not accept it for this model" in errors[0], errors


@needs_openvino
def test_auto_races_openvino_and_says_what_won_and_by_how_much(int8_model_dir, cpu_kind, caplog):
    """Under every CPU kind: every candidate of the table raced, the one `pick` names served, never slower than the
    fastest ONNX Runtime graph that the rule allows to serve, and one line saying so."""
    config = server_config(int8_model_dir, max_batch_size=16)
    with caplog.at_level(logging.INFO, logger="capsnet.serving"):
        loaded = load_backend(load_artifacts(int8_model_dir), config)
    try:
        raced = [(entrant.name, entrant.precision) for entrant in loaded.race]
        assert {("openvino", "fp32"), ("onnxruntime", "fp32")} <= set(raced)
        best = pick(loaded.race)
        winner = loaded.race[best]
        assert (loaded.backend.name, loaded.backend.precision) == (winner.name, winner.precision)
        assert loaded.check.passed and loaded.check.cpu == cpu_kind.describe()
        onnxruntime_alone = [entrant for entrant in loaded.race if entrant.name == "onnxruntime"]
        assert winner.score <= onnxruntime_alone[pick(onnxruntime_alone)].score
        lines = [r.message for r in caplog.records if r.message.startswith("precision auto: ")]
        assert len(lines) == 1 and lines[0].startswith(f"precision auto: {winner.precision} on {winner.name}, at "
                                                       "batch 1/16: ")
    finally:
        loaded.backend.close()


# Measured ratios (OpenVINO 2026.4 over ONNX Runtime, images/s at batch 1/16/64, same run; ONNX Runtime's INT8 over
# its FP32) of the issue that brought OpenVINO into the race, on two CPU kinds
MEASURED = {
    "avx512": {"openvino fp32": (0.76, 0.76, 0.76), "openvino int8": (1.14, 1.35, 1.36), "int8": 1.99},
    "avx512-bf16": {"openvino fp32": (1.02, 1.34, 1.72), "openvino int8": (1.11, 0.90, 1.04), "int8": 1.9},
}


@pytest.mark.parametrize("kind", list(MEASURED))
def test_the_race_picks_by_its_rule_on_measured_ratios(kind):
    """Times built from each kind's measured ratios: the pick is the best geometric mean over the batch sizes, a
    reduced precision only 1.1x faster than FP32; the line gives each rival's ratio at every batch size."""
    sizes = (1, 16, 64)
    ratios = MEASURED[kind]
    onnxruntime_fp32 = {size: size / 300.0 for size in sizes}
    onnxruntime_int8 = {size: seconds / ratios["int8"] for size, seconds in onnxruntime_fp32.items()}
    entrants = [
        Entrant("onnxruntime", "fp32", onnxruntime_fp32),
        Entrant("onnxruntime", "int8", onnxruntime_int8),
        Entrant("openvino", "fp32", {s: onnxruntime_fp32[s] / r for s, r in zip(sizes, ratios["openvino fp32"])}),
        Entrant("openvino", "int8", {s: onnxruntime_int8[s] / r for s, r in zip(sizes, ratios["openvino int8"])}),
    ]
    best = pick(entrants)
    expected = min(range(4), key=lambda index: entrants[index].score)
    assert best == expected and entrants[best].precision == "int8"
    gain = math.prod(ratios["openvino int8"]) ** (1 / 3)
    assert entrants[best].name == ("openvino" if gain > 1 else "onnxruntime")
    line = describe_choice(entrants, best)
    assert line.startswith(f"int8 on {entrants[best].name}, at batch 1/16/64: ")
    if entrants[best].name == "openvino":
        at = "/".join(f"{r:.2f}" for r in ratios["openvino int8"])
        assert f", {at}x onnxruntime int8 ({gain:.2f}x)" in line
    # INT8 no longer 1.1x faster than the fastest FP32: FP32 serves
    slow = [Entrant(e.name, e.precision, {s: t * (3 if e.precision == "int8" else 1) for s, t in e.seconds.items()})
            for e in entrants]
    assert slow[pick(slow)].precision == "fp32"
    assert "x fp32's speed here, short of 1.1x" in describe_choice(slow, pick(slow))


def test_without_openvino_auto_races_onnxruntime_alone_and_a_named_openvino_is_refused(int8_model_dir, monkeypatch,
                                                                                       capsys):
    monkeypatch.setitem(sys.modules, "openvino", None)  # as where it is not installed
    artifacts = load_artifacts(int8_model_dir)
    assert {name for name, _ in candidates("cpu", artifacts, server_config(int8_model_dir))} == {"onnxruntime"}
    code, errors = _serve_errors(int8_model_dir, capsys, "--backend", "openvino")
    assert code == 2 and errors == ["capsnet serve: error: --backend openvino: OpenVINO is not installed (pip install "
                                    "'capsnet-serve[openvino]')"]
    row = BACKEND_TABLE["openvino"]
    assert (row.requires, row.extra, row.cpu_precisions, row.gpu_precisions) == ("openvino", "openvino",
                                                                                 ("fp32", "int8"), ())
