"""The one way every benchmark builds and times an engine (capsnet.bench.engines): named by the backend registry's own
"<kind>:<precision>", read from the registry so that a row added there is benchmarked without a bench edit, and
timed into the one results schema (capsnet.bench.results)."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from capsnet.bench import engines
from capsnet.bench.report_files import side_by_side
from capsnet.bench.results import cells, measurement
from capsnet.serving.engine import backend_registry


@pytest.fixture
def registry_with_a_new_row(monkeypatch):
    """The registry with one more CPU row, as a backend added to it would be."""
    onnxruntime = backend_registry.BACKEND_KINDS["onnxruntime"]
    added = dataclasses.replace(onnxruntime, name="newengine", precisions=("fp32", "int8"),
                                cpu_precisions=("fp32", "int8"))
    monkeypatch.setitem(backend_registry.BACKEND_KINDS, "newengine", added)
    return added


def test_every_registry_row_is_an_engine_at_each_precision_it_serves(registry_with_a_new_row):
    names = engines.engine_names()
    expected = [f"{kind.name}:{precision}" for kind in backend_registry.BACKEND_KINDS.values()
                for precision in kind.precisions]
    assert list(names) == expected and "newengine:int8" in names
    on_cpu = engines.served_here(gpu=False)
    assert {"onnxruntime:int8", "torch:fp32", "newengine:fp32", "newengine:int8"} <= set(on_cpu)
    assert "torch:fp16" not in on_cpu and not any(name.startswith("tensorrt:") for name in on_cpu)
    # a GPU host adds the rows that serve on a GPU only; the CPU rows' GPU precisions are the GPU check's
    assert set(engines.served_here(gpu=True)) - set(on_cpu) == {"tensorrt:fp32", "tensorrt:fp16", "tensorrt:int8"}


def test_side_by_side_shows_a_new_row_and_judges_int8_by_the_fastest_engines(registry_with_a_new_row):
    rows = [measurement(name, 8, {"images_per_s": ips}) for name, ips in (
        ("onnxruntime:fp32", 400.0), ("onnxruntime:int8", 800.0), ("newengine:fp32", 500.0),
        ("newengine:int8", 1500.0), ("torch:fp32", 250.0), ("public", 100.0))]
    results = {"machine": {"cpu_model": "Intel Xeon", "isa": ["avx512f", "avx512_vnni"]},
               "inprocess": {"threads": 2, "measurements": rows}}
    assert engines.fastest(cells(rows), "int8", 8) == "newengine:int8"
    text = "\n".join(side_by_side(results))
    assert "On Intel Xeon [avx512f, avx512_vnni], 2 threads" in text
    assert "| backend | batch | fp32 | int8 |" in text
    assert "| newengine | 8 | 500 (1.00×) | 1,500 (3.00×) |" in text
    assert "| onnxruntime | 8 | 400 (0.80×) | 800 (1.60×) |" in text
    assert "batch 8: `newengine:int8` 3.00× `newengine:fp32`" in text


def test_an_engine_is_built_as_the_server_builds_it_and_timed_into_the_schema(tiny_export):
    rows = engines.engine_figures(tiny_export, "onnxruntime:fp32", (1, 4), 0.05, threads=1)
    assert [(row["engine"], row["batch"], row["io"]) for row in rows] == [
        ("onnxruntime:fp32", 1, "numpy"), ("onnxruntime:fp32", 4, "numpy")]
    for row in rows:
        figures = row["figures"]
        assert figures["calls"] >= engines.MIN_CALLS and 0 < figures["p50_ms"] <= figures["p99_ms"]
        assert figures["images_per_s"] == pytest.approx(row["batch"] / figures["p50_ms"] * 1e3)
        assert figures["cpu_ms_per_image"] > 0 and figures["threads"] == 1
    built = engines.build_engine("onnxruntime:fp32", tiny_export, threads=1, max_batch=4, check=True)
    assert built.self_check is not None and built.self_check["passed"]
    outputs = built.run(np.zeros((2, 1, 28, 28), np.float32))
    assert outputs["probabilities"].shape == (2, 10)


def test_the_public_reference_computes_what_the_torch_engine_computes(tiny_export):
    images = np.random.default_rng(0).random((3, 1, 28, 28), dtype=np.float32)
    public = engines.build_engine("public", tiny_export, threads=1, max_batch=3)
    served = engines.build_engine("torch:fp32", tiny_export, threads=1, max_batch=3)
    assert public.on_device is not None and served.on_device is not None
    np.testing.assert_allclose(public.run(images)["probabilities"], served.run(images)["probabilities"], atol=1e-5)


@pytest.mark.parametrize("name, reason", [("torch:fp16", "runs on a GPU"), ("tensorrt:fp32", "tensorrt"),
                                          ("tflite:fp32", "no engine tflite:fp32")])
def test_an_engine_that_cannot_run_here_says_why(tiny_export, name, reason):
    with pytest.raises(engines.EngineUnavailable, match=reason):
        engines.build_engine(name, tiny_export, threads=1, max_batch=4)
