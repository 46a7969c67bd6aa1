"""Per model version statistics, as Triton's statistics extension reports them (ModelStatistics over gRPC,
/v2/models/{name}[/versions/{v}]/stats over REST), which perf_analyzer reads to split a request's time.

- success / fail: requests that reached the model version, answered or failed, and their time from arrival to
  answer;
- queue, compute_input, compute_infer, compute_output: per successful request, the time it waited for a batch, and the
  time of the batches it ran in spent preparing their input (gathering the images), running the backend, and handing
  each request its rows of the outputs;
- batch_stats: per batch size, the backend runs of that size and the same three durations;
- inference_count: images inferred (a request of N images is N inferences, as Triton counts them);
  execution_count: backend runs; last_inference: when the last request was answered (ms since the epoch).

Everything is updated and read on the event loop; durations are summed in nanoseconds, as Triton's.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

PHASES = ("compute_input", "compute_infer", "compute_output")


@dataclass
class Duration:
    count: int = 0
    ns: int = 0

    def add(self, seconds: float, count: int = 1) -> None:
        self.count += count
        self.ns += round(seconds * 1e9)

    def to_json(self) -> dict:
        return {"count": self.count, "ns": self.ns}


@dataclass
class ModelStatistics:
    name: str
    version: str
    last_inference_ms: int = 0
    inference_count: int = 0
    execution_count: int = 0
    requests: dict[str, Duration] = field(
        default_factory=lambda: {name: Duration() for name in ("success", "fail", "queue", *PHASES)})
    batches: dict[int, dict[str, Duration]] = field(default_factory=dict)  # batch size -> phase -> runs

    def record_batch(self, size: int, seconds: dict[str, float]) -> None:
        """A backend run of `size` images; `seconds`: PHASES -> its time."""
        self.execution_count += 1
        phases = self.batches.setdefault(size, {name: Duration() for name in PHASES})
        for name in PHASES:
            phases[name].add(seconds[name])

    def record_request(self, answered: bool, total_s: float, images: int = 0, queue_s: float = 0.0,
                       phases: dict[str, float] | None = None) -> None:
        """A request that reached this version ended: answered (with its `images`, its queue wait and its batches'
        PHASES times) or failed."""
        if not answered:
            self.requests["fail"].add(total_s)
            return
        self.requests["success"].add(total_s)
        self.requests["queue"].add(queue_s)
        for name in PHASES:
            self.requests[name].add((phases or {}).get(name, 0.0))
        self.inference_count += images
        self.last_inference_ms = time.time_ns() // 1_000_000

    def add_requests(self, other: dict) -> None:
        """Another process's requests of this version (its to_json()), counted with these: a front end's, in the
        engine process that runs the batches."""
        for name, duration in self.requests.items():
            duration.count += other["inference_stats"][name]["count"]
            duration.ns += other["inference_stats"][name]["ns"]
        self.inference_count += other["inference_count"]
        self.last_inference_ms = max(self.last_inference_ms, other["last_inference"])

    def to_json(self) -> dict:
        """Triton's JSON form (REST), which gRPC's ModelStatistics message parses from."""
        empty = Duration().to_json()
        return {
            "name": self.name,
            "version": self.version,
            "last_inference": self.last_inference_ms,
            "inference_count": self.inference_count,
            "execution_count": self.execution_count,
            "inference_stats": {**{name: d.to_json() for name, d in self.requests.items()},
                                "cache_hit": empty, "cache_miss": empty},  # no response cache: always empty
            "batch_stats": [{"batch_size": size, **{name: d.to_json() for name, d in phases.items()}}
                            for size, phases in sorted(self.batches.items())],
        }
