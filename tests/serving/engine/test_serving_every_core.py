"""--threads 0 on the CPU: a backend keeps one core for the event loop, unless its runs are long enough that the loop's
share beside them is small; then the choice is made again on every core (a race runs again), self-checked again, and
the log says so."""

from __future__ import annotations

import logging
import time
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
from serving_helpers import server_config

from capsnet.errors import CapsNetError
from capsnet.serving.config import ServerConfig
from capsnet.serving.engine import backends
from capsnet.serving.engine.artifacts import load_artifacts
from capsnet.serving.engine.backends import EVERY_CORE_RUN_S, every_core, load_backend
from capsnet.serving.engine.backends.base import Backend

SHAPE = SimpleNamespace(input_shape=(1, 28, 28))


class Timed(Backend):
    """A backend whose runs take `seconds_per_image` an image."""

    name, precision, description, output_names = "onnxruntime", "fp32", "timed", ("probabilities",)

    def __init__(self, seconds_per_image: float, on_gpu: bool = False):
        self.seconds_per_image, self.on_gpu = seconds_per_image, on_gpu

    @classmethod
    def create(cls, artifacts, precision, config):
        raise NotImplementedError

    def run(self, images: np.ndarray) -> dict[str, np.ndarray]:
        if self.seconds_per_image:
            time.sleep(self.seconds_per_image * len(images))
        return {"probabilities": np.zeros((len(images), 10), np.float32)}


def cores(monkeypatch, count: int) -> None:
    monkeypatch.setattr(ServerConfig, "cores", property(lambda self: count))


def config(**overrides) -> ServerConfig:
    return server_config(Path("unread"), max_batch_size=16, **{"threads": 0, **overrides})


def test_long_runs_on_the_cpu_take_every_core(monkeypatch):
    cores(monkeypatch, 2)
    chosen = every_core(Timed(1.5 * EVERY_CORE_RUN_S), SHAPE, config())
    assert chosen is not None
    threads, per_image = chosen
    assert threads == 2 and per_image >= 1.5 * EVERY_CORE_RUN_S


@pytest.mark.parametrize("case", ["short runs", "--threads given", "one core", "on a GPU"])
def test_the_loop_keeps_its_core_otherwise(monkeypatch, case):
    cores(monkeypatch, 1 if case == "one core" else 4)
    backend = Timed(0.0 if case == "short runs" else 1.5 * EVERY_CORE_RUN_S, on_gpu=case == "on a GPU")
    assert every_core(backend, SHAPE, config(threads=1 if case == "--threads given" else 0)) is None


def test_a_served_model_with_long_runs_is_rebuilt_on_every_core_and_checked_again(random_tiny_export, monkeypatch,
                                                                                    caplog):
    """The tiny model's runs are short: it keeps cores - 1 threads. Held to a threshold it passes, the same export is
    loaded again on every core, self-checked, and one line says why."""
    cores(monkeypatch, 3)
    artifacts = load_artifacts(random_tiny_export)
    settings = server_config(random_tiny_export, backend="onnxruntime", precision="fp32", max_batch_size=16,
                             threads=0)
    kept = load_backend(artifacts, settings)
    try:
        assert kept.backend.description.endswith(", 2 threads") and "every core" not in kept.why
    finally:
        kept.backend.close()
    monkeypatch.setattr(backends, "EVERY_CORE_RUN_S", 0.0)
    with caplog.at_level(logging.INFO, logger="capsnet.serving"):
        widened = load_backend(artifacts, settings)
    try:
        assert widened.backend.description.endswith(", 3 threads") and widened.check.passed
        assert "every core (3 threads)" in widened.why
        lines = [record.message for record in caplog.records if "every core" in record.message]
        assert len(lines) == 1 and lines[0].startswith("runs of ") and ": 3 intra-op threads, every core" in lines[0]
    finally:
        widened.backend.close()


def test_a_raced_choice_is_raced_again_on_every_core(int8_tiny_export, monkeypatch, caplog):
    """--precision auto times its entrants on the threads it has: on every core their order can differ (OpenVINO
    and ONNX Runtime scale unlike each other), so the race runs again there and its winner serves."""
    cores(monkeypatch, 3)
    monkeypatch.setattr(backends, "EVERY_CORE_RUN_S", 0.0)
    settings = server_config(int8_tiny_export, max_batch_size=16, threads=0)  # backend and precision auto
    timings = []  # the batch size of each timing
    timed = backends.best_times
    monkeypatch.setattr(backends, "best_times", lambda runs, images, rounds: timings.append(len(images))
                        or timed(runs, images, rounds))
    with caplog.at_level(logging.INFO, logger="capsnet.serving"):
        loaded = load_backend(load_artifacts(int8_tiny_export), settings)
    try:
        messages = [record.message for record in caplog.records]
        races = [index for index, message in enumerate(messages) if message.startswith("precision auto: ")]
        widening = [index for index, message in enumerate(messages) if "every core" in message]
        assert len(races) == 2 and len(widening) == 1 and races[0] < widening[0] < races[1]
        assert messages[widening[0]].endswith(": raced again there")
        assert "3 threads" in loaded.backend.description and loaded.check.passed
        winner = loaded.race[backends.pick(loaded.race)]
        assert (loaded.backend.name, loaded.backend.precision) == (winner.name, winner.precision)
        assert messages[races[1]].startswith(f"precision auto: {winner.precision} on {winner.name}, ")
        assert loaded.why.endswith(" an image") and "every core (3 threads)" in loaded.why
        # each race times its entrants at each of its sizes; the first winner's own time decides, not a timing more
        assert timings == [*backends.race_batch_sizes(16)] * 2
    finally:
        loaded.backend.close()


def test_a_choice_that_fails_on_every_core_keeps_the_threads_it_passed_with(monkeypatch, caplog):
    cores(monkeypatch, 2)
    first = backends.LoadedBackend(Timed(1.5 * EVERY_CORE_RUN_S), check=None, why="asked for")  # type: ignore[arg-type]
    calls: list[int] = []

    def load(artifacts, settings):
        calls.append(settings.threads)
        if len(calls) > 1:
            raise CapsNetError("self-check failed: onnxruntime fp32 ...")
        return first

    monkeypatch.setattr(backends, "_load_backend", load)
    with caplog.at_level(logging.WARNING, logger="capsnet.serving"):
        assert load_backend(SHAPE, config()) is first
    assert calls == [0, 2]
    assert [record.message for record in caplog.records] == [
        "on every core: self-check failed: onnxruntime fp32 ...; kept on all cores but one (1)"]
