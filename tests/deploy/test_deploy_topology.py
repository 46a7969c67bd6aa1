"""The docker-compose topology run natively on loopback by deploy/local_stack.py: two `capsnet serve` replicas,
the real nginx balancing gRPC calls and KServe REST requests over them (deploy/nginx/grpc-lb.conf), the real
Prometheus scraping both (deploy/prometheus/prometheus.yml), and the Grafana dashboard's queries evaluated by that
Prometheus."""

from __future__ import annotations

import json
import math
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.parse
import urllib.request

import grpc
import pytest

from capsnet.v1 import capsnet_pb2 as pb
from capsnet.v1 import capsnet_pb2_grpc as pb_grpc
from deploy_support import (
    DEPLOY, REPO, as_promql, dashboard_queries, free_port, gpu_only_series, http_get, http_json, label_names, log_tail,
    metric_names, requests_total, running, scrape, tool, wait_for,
)

# PyYAML comes with the dev extra (pip install -e ".[dev]").
yaml = pytest.importorskip("yaml")

pytestmark = pytest.mark.slow
SCRAPE_INTERVAL_S = 1
CLASSIFY_OK = ("capsnet", "Classify", "OK")


@pytest.fixture(scope="module")
def exported_model(random_tiny_checkpoint, tmp_path_factory):
    from capsnet.export.exporter import export_model

    out = tmp_path_factory.mktemp("deploy-model") / "capsnet"
    export_model(random_tiny_checkpoint, out)
    return out


@pytest.fixture(scope="module")
def stack(exported_model, tmp_path_factory):
    """deploy/local_stack.py with two replicas; yields (its process, the addresses it wrote)."""
    tool("nginx", "Debian package nginx-light")
    tool("prometheus", "Debian package prometheus")
    workdir = tmp_path_factory.mktemp("stack")
    ready_file = workdir / "ready.json"
    log = workdir / "local_stack.log"
    args = [sys.executable, str(DEPLOY / "local_stack.py"), "--model", str(exported_model), "--replicas", "2",
            "--port", "0", "--rest-port", "0", "--prometheus-port", "0", "--threads", "1",
            "--scrape-interval", f"{SCRAPE_INTERVAL_S}s", "--workdir", str(workdir), "--ready-file", str(ready_file)]
    with running(args, log, stop_timeout=60) as proc:
        wait_for("local_stack.py to start everything", ready_file.is_file, timeout=240, alive=proc, log=log)
        yield proc, json.loads(ready_file.read_text()), log


def loadtest(address: str, seconds: float) -> dict:
    result = subprocess.run([sys.executable, str(DEPLOY / "loadtest.py"), "--server", address, "--concurrency", "4",
                             "--duration", str(seconds), "--warmup", "0.5"],
                            capture_output=True, text=True, timeout=seconds + 60, cwd=REPO)
    assert result.returncode == 0, result.stdout + result.stderr
    return json.loads(result.stdout)


def send_invalid_request(address: str) -> grpc.StatusCode:
    """A 2x2 image for a 1x28x28 model: the server must answer INVALID_ARGUMENT, through the balancer too."""
    with grpc.insecure_channel(address) as channel:
        bad = pb.Image(tensor=pb.Tensor(dtype=pb.DATA_TYPE_UINT8, shape=[1, 2, 2], data=bytes(4)))
        with pytest.raises(grpc.RpcError) as err:
            pb_grpc.CapsNetServiceStub(channel).Classify(pb.ClassifyRequest(images=[bad]), timeout=10)
    return err.value.code()


@pytest.fixture(scope="module")
def traffic(stack):
    """Two bursts of calls through nginx, each with two invalid requests, several scrapes apart, so that every
    rate() on the dashboard has an increase between two samples. Each burst also sends one invalid request
    straight to each replica: nginx's workers balance new connections on their own, so the two through nginx
    may reach one replica in the first burst and the other in the second, and a counter that first appears
    already at its final value has no increase for rate() to see."""
    _, ready, _ = stack
    results, codes = [], []
    for burst in range(2):
        if burst:
            time.sleep(3 * SCRAPE_INTERVAL_S)
        results.append(loadtest(ready["load_balancer"], seconds=2))
        codes += [send_invalid_request(ready["load_balancer"]) for _ in range(2)]
        for replica in ready["replicas"]:
            assert send_invalid_request(replica["grpc"]) == grpc.StatusCode.INVALID_ARGUMENT
    return results, codes


def test_deploy_calls_through_nginx_reach_every_replica(stack, traffic):
    _, ready, _ = stack
    results, codes = traffic
    for result in results:
        assert result["requests"] > 0 and result["errors"] == {}, result
    # nginx passes the server's gRPC status through, it does not turn errors into HTTP failures.
    assert set(codes) == {grpc.StatusCode.INVALID_ARGUMENT}
    served = [requests_total(scrape(r["metrics"]), *CLASSIFY_OK) for r in ready["replicas"]]
    assert sum(served) >= sum(r["requests"] for r in results)
    # Round robin per call over one client channel: each replica gets about half.
    assert min(served) >= 0.25 * sum(served), f"calls per replica: {served}"


def rest_infer(address: str, body: dict) -> tuple[int, dict]:
    """POST a KServe v2 inference request (JSON) to /v2/models/capsnet/infer: (HTTP status, JSON answer)."""
    request = urllib.request.Request(f"http://{address}/v2/models/capsnet/infer", data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=10) as reply:
            return reply.status, json.loads(reply.read())
    except urllib.error.HTTPError as err:
        return err.code, json.loads(err.read())


def test_deploy_rest_requests_through_nginx_reach_every_replica(stack):
    """KServe v2 REST through nginx's `listen 8000` server: answered, balanced per request over the replicas (on one
    keep-alive connection each, as urllib opens a new one anyway), and the server's own 400 passed through."""
    _, ready, _ = stack
    address = ready["rest_load_balancer"]
    assert json.loads(http_get(f"http://{address}/v2/models/capsnet"))["name"] == "capsnet"
    before = [requests_total(scrape(r["metrics"]), "kserve_http", "ModelInfer", "OK") for r in ready["replicas"]]
    image = {"name": "images", "datatype": "UINT8", "shape": [1, 1, 28, 28], "data": [0] * 784}
    for i in range(20):
        status, answer = rest_infer(address, {"id": f"lb-{i}", "inputs": [image],
                                              "outputs": [{"name": "probabilities"}]})
        assert status == 200 and answer["id"] == f"lb-{i}", answer
        assert answer["outputs"][0]["shape"] == [1, 10]
    served = [requests_total(scrape(r["metrics"]), "kserve_http", "ModelInfer", "OK") - b
              for r, b in zip(ready["replicas"], before)]
    assert sum(served) == 20 and min(served) >= 5, f"requests per replica: {served}"
    status, answer = rest_infer(address, {"inputs": [{**image, "shape": [1, 1, 2, 2], "data": [0] * 4}]})
    assert status == 400 and answer["error"].startswith("inputs[0].shape: "), answer


def test_deploy_docker_healthcheck_probe(stack):
    """docker/healthcheck.py, the images' HEALTHCHECK: 0 for a serving server (direct or via nginx), 1 for none."""
    _, ready, _ = stack
    probe = [sys.executable, str(REPO / "docker" / "healthcheck.py")]
    for address in (ready["replicas"][0]["grpc"], ready["load_balancer"]):
        result = subprocess.run([*probe, address], capture_output=True, text=True, timeout=30)
        assert result.returncode == 0 and "SERVING" in result.stdout, result.stdout + result.stderr
    result = subprocess.run([*probe, f"127.0.0.1:{free_port()}", "--timeout", "1"], capture_output=True, text=True,
                            timeout=30)
    assert result.returncode == 1 and "UNAVAILABLE" in result.stderr, result.stdout + result.stderr


def test_deploy_prometheus_scrapes_every_replica(stack):
    _, ready, _ = stack
    expected = {f"http://{r['metrics']}/metrics" for r in ready["replicas"]}

    def all_up():
        targets = http_json(f"{ready['prometheus']}/api/v1/targets")["data"]["activeTargets"]
        health = {t["scrapeUrl"]: t["health"] for t in targets if t["labels"]["job"] == "capsnet"}
        return health if set(health) == expected and set(health.values()) == {"up"} else None

    wait_for("Prometheus to report both replicas up", all_up, timeout=30, interval=0.5)


def test_deploy_dashboard_names_only_metrics_the_server_exports(stack, traffic):
    """Checked against a live replica's /metrics, not a list typed here (and the HPA's metric too); the GPU panels'
    series, which a replica exports only on a GPU, against the code that registers them there."""
    _, ready, _ = stack
    samples = scrape(ready["replicas"][0]["metrics"])
    labels_of = gpu_only_series()
    for sample in samples:
        labels_of.setdefault(sample.name, set()).update(sample.labels)
    for title, expr in dashboard_queries():
        metrics = metric_names(expr)
        assert metrics, f"{title}: no capsnet_ or nv_ metric in {expr}"
        missing = metrics - set(labels_of)
        assert not missing, f"{title}: the server exports no {sorted(missing)}"
        unknown = label_names(expr) - set().union(*(labels_of[m] for m in metrics))
        assert not unknown, f"{title}: no label {sorted(unknown)} on {sorted(metrics)}"
    # The Kubernetes HPA scales on a per-pod metric too.
    hpa = next(doc for doc in yaml.safe_load_all((DEPLOY / "k8s" / "capsnet-serve.yaml").read_text())
               if doc["kind"] == "HorizontalPodAutoscaler")
    assert hpa["spec"]["metrics"][0]["pods"]["metric"]["name"] in labels_of


def test_deploy_dashboard_queries_return_data(stack, traffic):
    """Every panel's query, as Grafana would send it, gives Prometheus at least one finite value; but the GPU
    panels', whose series these replicas serving on the CPU do not export (absent, not zero)."""
    _, ready, _ = stack
    on_gpu_only = set(gpu_only_series())

    def evaluate(expr: str) -> list:
        query = urllib.parse.urlencode({"query": as_promql(expr)})
        reply = http_json(f"{ready['prometheus']}/api/v1/query?{query}")
        assert reply["status"] == "success", reply
        return [float(series["value"][1]) for series in reply["data"]["result"]]

    def empty_queries() -> list[str]:
        return [f"{title}: {expr}" for title, expr in dashboard_queries()
                if not metric_names(expr) <= on_gpu_only and not any(math.isfinite(v) for v in evaluate(expr))]

    # Prometheus needs a scrape or two after the last burst; the queries look back a minute.
    wait_for("every dashboard query to return data", lambda: not empty_queries(), timeout=30, interval=1)
    # its own window is wide, so the slower tests between the traffic and this query cannot let it slide past
    errors = 'sum by (code) (increase(capsnet_requests_total{code="INVALID_ARGUMENT"}[5m]))'
    wait_for("the invalid requests' increase", lambda: any(v > 0 for v in evaluate(errors)), timeout=30, interval=1)


def test_deploy_stack_stops_cleanly(stack):
    """SIGTERM to local_stack.py stops nginx, Prometheus and both replicas, each exiting 0."""
    proc, ready, log = stack
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=60) == 0, log_tail(log)
    for replica in ready["replicas"]:
        with pytest.raises(OSError):
            http_get(f"http://{replica['metrics']}/metrics", timeout=2)
