"""What the server records of each request, whatever carried it: its metrics, an access log line and a trace.

Each transport opens a RequestRecord when a call arrives (the gRPC interceptor, the REST middleware) and ends it with
the call's outcome; in between the record is the context's current one (CURRENT), where the model version that
serves the request notes itself, its images and its backend runs (InferenceService.infer). When it ends:
- `capsnet_requests_total` and `capsnet_request_duration_seconds` count it, labelled with the model version that
  served it (a name of the repository, so the labels stay bounded whatever clients send);
- with `--log-format json`, one access line: time, API, method, model, version, status, duration, images, batch size,
  trace id, peer (health checks and reflection aside: probes every few seconds are not traffic);
- with tracing on (`serving/observability/tracing.py`), its spans.
The peer and the W3C traceparent are read from the call only when a log line or a trace will use them.
"""

from __future__ import annotations

import json
import logging
import re
import time
from contextvars import ContextVar
from datetime import datetime, timezone

from capsnet.serving.observability.metrics import Metrics

ACCESS_LOG = logging.getLogger("capsnet.access")
# The request being handled in this context (a task of the gRPC server or of aiohttp); None outside requests.
CURRENT: ContextVar["RequestRecord | None"] = ContextVar("capsnet_request", default=None)
# APIs that are not traffic: no access line (their calls are still counted in the metrics).
NOT_LOGGED = frozenset({"health", "reflection"})
TRACEPARENT = "traceparent"
# W3C trace context: version-traceid-parentid-flags; an all-zero id is invalid.
_TRACEPARENT = re.compile(r"[0-9a-f]{2}-([0-9a-f]{32})-[0-9a-f]{16}-[0-9a-f]{2}")


def trace_id_of(traceparent: str | None) -> str:
    """The trace id a valid traceparent header carries, else ""."""
    match = _TRACEPARENT.fullmatch(traceparent.strip().lower()) if traceparent else None
    return match[1] if match and match[1].strip("0") else ""


class RequestRecord:
    """One call from arrival to answer (a stream: its whole life, holding its last request's model and batches)."""

    __slots__ = ("api", "method", "started", "peer", "traceparent", "model", "version", "images", "output")

    def __init__(self, api: str, method: str, started: float, peer: str = "", traceparent: str | None = None):
        self.api, self.method, self.started = api, method, started
        self.peer, self.traceparent = peer, traceparent
        self.model = self.version = ""  # the model version serving it, once one is
        self.images = 0
        self.output = None  # the batcher's BatchOutput once answered: its queue wait and backend runs

    def served_by(self, model: str, version: str) -> None:
        self.model, self.version = model, version

    def answered(self, images: int, output) -> None:
        self.images, self.output = images, output

    @property
    def batch_size(self) -> int:
        """The largest backend batch the request ran in (0: none)."""
        return max((run.size for run in self.output.runs), default=0) if self.output is not None else 0


class Observer:
    """Ends records: counts them, and logs and traces them where asked (`access_log`: --log-format json)."""

    def __init__(self, metrics: Metrics, access_log: bool = False, tracing=None):
        self.metrics = metrics
        self.access_log = access_log
        self.tracing = tracing  # observability.tracing.Tracing, or None: off
        self.wants_details = access_log or tracing is not None  # read the peer and traceparent of each call
        # (api, method, code, model, version) -> its request counter and duration histogram: prometheus-client's
        # labels() checks and locks at each call; the values are few (APIs' methods, codes, the repository's names)
        self._series: dict[tuple[str, ...], tuple] = {}

    def end(self, record: RequestRecord, code: str, http_status: int | None = None) -> None:
        ended = time.monotonic()
        key = (record.api, record.method, code, record.model, record.version)
        series = self._series.get(key)
        if series is None:
            metrics = self.metrics
            series = self._series[key] = (metrics.requests.labels(*key), metrics.request_duration.labels(
                record.api, record.method, record.model, record.version))
        series[0].inc()
        series[1].observe(ended - record.started)
        if not self.wants_details or record.api in NOT_LOGGED:
            return
        trace_id = (self.tracing.record(record, code, ended) if self.tracing is not None
                    else trace_id_of(record.traceparent))
        if self.access_log:
            fields = {"api": record.api, "method": record.method, "model": record.model, "version": record.version,
                      "status": code, "duration_ms": round((ended - record.started) * 1e3, 3),
                      "images": record.images, "batch_size": record.batch_size, "trace_id": trace_id,
                      "peer": record.peer}
            if http_status is not None:
                fields["http_status"] = http_status
            ACCESS_LOG.info("%s %s %s", record.api, record.method, code, extra={"access": fields})


def grpc_peer(peer: str) -> str:
    """gRPC's "ipv4:127.0.0.1:5555" or "ipv6:[::1]:5555" as an address, as REST's peers are written."""
    return peer.partition(":")[2] if peer.startswith(("ipv4:", "ipv6:")) else peer


class JsonFormatter(logging.Formatter):
    """--log-format json: every log line one JSON object (time, level, logger, message), an access line's fields
    beside them, a traceback as `exception`."""

    def format(self, record: logging.LogRecord) -> str:
        line = {"time": datetime.fromtimestamp(record.created, timezone.utc).isoformat(timespec="milliseconds"),
                "level": record.levelname, "logger": record.name, "message": record.getMessage()}
        line.update(getattr(record, "access", {}))
        if record.exc_info:
            line["exception"] = self.formatException(record.exc_info)
        return json.dumps(line, default=str)


def use_json_logs() -> None:
    """Every handler of the root logger writes JSON lines (the CLI installed one on stderr)."""
    root = logging.getLogger()
    if not root.handlers:
        logging.basicConfig()
    for handler in root.handlers:
        handler.setFormatter(JsonFormatter())
