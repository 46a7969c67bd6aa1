"""The docker-compose topology without Docker: N `capsnet serve` replicas on loopback, nginx as their gRPC and
KServe REST load balancer and Prometheus scraping every replica, from the same deploy/ files the containers use.

    python deploy/local_stack.py --model models/quickstart --replicas 2
    capsnet predict models/quickstart-samples/*.png --server 127.0.0.1:8001      # gRPC through nginx
    curl -s http://127.0.0.1:8000/v2/models/capsnet                              # REST through nginx

Needs nginx (HTTP/2 and grpc_pass: Debian's nginx-light) and, unless --no-prometheus, Prometheus and PyYAML
(the dev extra). What changes from deploy/: nginx's upstream servers and listen addresses (loopback ports instead
of the `capsnet` service name, for gRPC and for REST), Prometheus's replica discovery (static loopback targets instead of Docker's DNS,
and only the capsnet job), and the paths nginx writes to (a work folder). It runs until SIGTERM or Ctrl-C,
then stops everything; a child that dies stops the rest too (exit 1). `--ready-file` gets a JSON object of the
addresses once every part answers, for scripts and tests.
"""

from __future__ import annotations

import argparse
import json
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from contextlib import ExitStack
from pathlib import Path

from capsnet.children import terminate_with_parent

DEPLOY = Path(__file__).resolve().parent
NGINX_LB_CONF = DEPLOY / "nginx" / "grpc-lb.conf"
PROMETHEUS_CONF = DEPLOY / "prometheus" / "prometheus.yml"
START_TIMEOUT_S = 120  # a replica loads and warms its model up before it reports SERVING
STOP_TIMEOUT_S = 20  # the server's own grace period is 10 s


def nginx_lb_conf(upstreams: list[str], listen: str, rest_upstreams: list[str], rest_listen: str) -> str:
    """deploy/nginx/grpc-lb.conf with its upstream servers and listen addresses replaced, gRPC's (`upstreams`,
    `listen`) and REST's; everything else as is."""
    text = NGINX_LB_CONF.read_text()
    counts = []
    for pattern, replacement in [
        (r"server capsnet:8001;", "\n    ".join(f"server {address};" for address in upstreams)),
        (r"listen 8001 http2;", f"listen {listen} http2;"),
        (r"server capsnet:8000;", "\n    ".join(f"server {address};" for address in rest_upstreams)),
        (r"listen 8000;", f"listen {rest_listen};"),
    ]:
        text, count = re.subn(pattern, lambda _: replacement, text)
        counts.append(count)
    if counts != [1, 1, 1, 1]:
        raise SystemExit(f"{NGINX_LB_CONF} no longer has the `server capsnet:8001;`, `listen 8001 http2;`, "
                         "`server capsnet:8000;` and `listen 8000;` lines this script substitutes")
    return text


def nginx_main_conf(workdir: Path, include: Path) -> Path:
    """A main nginx.conf like the nginx image's (it includes the LB file inside http {}), in the foreground and
    with every path nginx writes under `workdir`, so it runs unprivileged."""
    for sub in ("body", "proxy", "fastcgi", "uwsgi", "scgi"):
        (workdir / sub).mkdir(exist_ok=True)
    conf = workdir / "nginx.conf"
    conf.write_text(f"""daemon off;
worker_processes 1;
pid {workdir}/nginx.pid;
error_log {workdir}/nginx-error.log notice;
events {{ worker_connections 1024; }}
http {{
    access_log {workdir}/nginx-access.log;
    client_body_temp_path {workdir}/body;
    proxy_temp_path {workdir}/proxy;
    fastcgi_temp_path {workdir}/fastcgi;
    uwsgi_temp_path {workdir}/uwsgi;
    scgi_temp_path {workdir}/scgi;
    include {include};
}}
""")
    return conf


def prometheus_conf(targets: list[str], scrape_interval: str | None = None) -> dict:
    """deploy/prometheus/prometheus.yml's `capsnet` job with static targets in place of its DNS discovery (the
    other jobs look for compose services, and DNS names that only Docker's resolver knows); optionally another
    scrape and evaluation interval."""
    import yaml

    config = yaml.safe_load(PROMETHEUS_CONF.read_text())
    jobs = [job for job in config["scrape_configs"] if job["job_name"] == "capsnet"]
    if len(jobs) != 1 or "dns_sd_configs" not in jobs[0]:
        raise SystemExit(f"{PROMETHEUS_CONF} no longer has the `capsnet` job with dns_sd_configs this script replaces")
    job = jobs[0]
    del job["dns_sd_configs"]
    job["static_configs"] = [{"targets": targets}]
    config["scrape_configs"] = [job]
    if scrape_interval:
        config["global"].update(scrape_interval=scrape_interval, evaluation_interval=scrape_interval)
    return config


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def grpc_status(address: str, timeout: float = 2.0) -> str:
    """The overall grpc.health.v1 status of the server at `address`, or the RPC's error code."""
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    with grpc.insecure_channel(address) as channel:
        try:
            reply = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=timeout)
        except grpc.RpcError as err:
            return err.code().name
    return health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)


def http_ok(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=2) as reply:
            return reply.status == 200
    except OSError:
        return False


class Interrupted(Exception):
    """SIGTERM or SIGINT came while the stack was starting."""


class Stack:
    """The child processes, each with its log in the work folder; stopped in reverse order of start."""

    def __init__(self, workdir: Path):
        self.workdir = workdir
        self.children: list[tuple[str, subprocess.Popen]] = []
        self.stop_requested = False  # set by SIGTERM / SIGINT

    def start(self, name: str, args: list[str]) -> subprocess.Popen:
        with open(self.workdir / f"{name}.log", "wb") as log:
            # Its own session: Ctrl-C reaches only this script, which stops the children in order; if this
            # script is killed outright, the kernel sends them SIGTERM.
            proc = subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                    start_new_session=True, preexec_fn=terminate_with_parent())
        self.children.append((name, proc))
        return proc

    def wait_until(self, what: str, check, timeout: float = START_TIMEOUT_S) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline and not self.stop_requested:
            self.check_alive()
            if check():
                return
            time.sleep(0.2)
        if self.stop_requested:
            raise Interrupted
        raise SystemExit(f"local_stack: {what} not ready after {timeout:.0f} s (logs in {self.workdir})")

    def check_alive(self) -> None:
        for name, proc in self.children:
            if proc.poll() is not None:
                raise SystemExit(f"local_stack: {name} exited with {proc.returncode}: see {self.workdir}/{name}.log")

    def stop(self) -> list[str]:
        """SIGTERM every child (the load balancer first), SIGKILL those still there after STOP_TIMEOUT_S;
        returns the names of those that did not exit with 0."""
        unclean = []
        for name, proc in reversed(self.children):
            if proc.poll() is None:
                proc.terminate()
        for name, proc in reversed(self.children):
            try:
                code = proc.wait(timeout=STOP_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                proc.kill()
                code = proc.wait()
            if code != 0:
                unclean.append(f"{name} ({code})")
        return unclean


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", required=True, type=Path, help="exported model folder (capsnet export --out)")
    parser.add_argument("--replicas", type=int, default=2, help="capsnet serve processes (default 2)")
    parser.add_argument("--port", type=int, default=8001, help="nginx's gRPC port on 127.0.0.1 (default 8001; 0: any free one)")
    parser.add_argument("--rest-port", type=int, default=8000,
                        help="nginx's KServe REST port on 127.0.0.1 (default 8000; 0: any free one)")
    parser.add_argument("--prometheus-port", type=int, default=9090, help="Prometheus on 127.0.0.1 (default 9090; 0: any free one)")
    parser.add_argument("--no-prometheus", action="store_true", help="replicas and load balancer only")
    parser.add_argument("--scrape-interval", help="Prometheus scrape interval, e.g. 1s (default: deploy/'s)")
    parser.add_argument("--threads", type=int, help="each replica's --threads (default: the server's, one per core)")
    parser.add_argument("--workdir", type=Path, help="configs, logs and Prometheus data (default: a new temp folder)")
    parser.add_argument("--ready-file", type=Path, help="write the addresses here as JSON once everything is ready")
    parser.add_argument("serve_args", nargs="*", help="more `capsnet serve` flags for every replica, after --")
    args = parser.parse_args(argv)
    if args.replicas < 1:
        parser.error("--replicas must be at least 1")
    if not (args.model / "model.json").is_file():
        parser.error(f"{args.model} has no model.json: export a model there first (capsnet export ... --out DIR)")
    tools = {"nginx": shutil.which("nginx") or "/usr/sbin/nginx"}
    if not args.no_prometheus:
        tools["prometheus"] = shutil.which("prometheus")
    missing = [name for name, path in tools.items() if not path or not Path(path).is_file()]
    if missing:
        parser.error(f"not installed: {', '.join(missing)} (Debian: apt-get install nginx-light prometheus)")

    workdir = args.workdir or Path(tempfile.mkdtemp(prefix="capsnet-stack-"))
    try:
        workdir.mkdir(parents=True, exist_ok=True)
    except OSError as err:
        parser.error(f"--workdir {workdir}: {err.strerror or err}")
    stack = Stack(workdir)

    def request_stop(signum, frame) -> None:
        stack.stop_requested = True

    signal.signal(signal.SIGTERM, request_stop)
    signal.signal(signal.SIGINT, request_stop)
    unclean: list[str] = []
    try:
        run(args, stack, tools, unclean)
    except Interrupted:
        pass
    if unclean:
        print(f"local_stack: did not stop cleanly: {', '.join(unclean)}", file=sys.stderr)
        return 1
    return 0


def run(args: argparse.Namespace, stack: Stack, tools: dict[str, str], unclean: list[str]) -> None:
    """Start everything, wait for a stop request, stop everything (also when starting fails)."""
    workdir = stack.workdir
    with ExitStack() as cleanup:
        cleanup.callback(lambda: unclean.extend(stack.stop()))
        replicas = []
        for i in range(args.replicas):
            grpc_port, rest_port, metrics_port = free_port(), free_port(), free_port()
            threads = [] if args.threads is None else ["--threads", str(args.threads)]
            stack.start(f"replica{i}", [sys.executable, "-m", "capsnet", "serve", "--model", str(args.model),
                                        "--host", "127.0.0.1", "--grpc-port", str(grpc_port), "--http-port",
                                        str(rest_port), "--metrics-port", str(metrics_port), *threads, *args.serve_args])
            replicas.append({"grpc": f"127.0.0.1:{grpc_port}", "rest": f"127.0.0.1:{rest_port}",
                             "metrics": f"127.0.0.1:{metrics_port}"})
        for i, replica in enumerate(replicas):
            stack.wait_until(f"replica{i}", lambda: grpc_status(replica["grpc"]) == "SERVING")

        lb_address = f"127.0.0.1:{args.port or free_port()}"
        rest_lb_address = f"127.0.0.1:{args.rest_port or free_port()}"
        lb_file = workdir / "grpc-lb.conf"
        lb_file.write_text(nginx_lb_conf([r["grpc"] for r in replicas], lb_address,
                                         [r["rest"] for r in replicas], rest_lb_address))
        stack.start("nginx", [tools["nginx"], "-p", str(workdir), "-c", str(nginx_main_conf(workdir, lb_file))])
        stack.wait_until("nginx", lambda: grpc_status(lb_address) == "SERVING"
                         and http_ok(f"http://{rest_lb_address}/v2/health/ready"))
        ready = {"load_balancer": lb_address, "rest_load_balancer": rest_lb_address, "replicas": replicas,
                 "workdir": str(workdir)}

        if not args.no_prometheus:
            import yaml

            prometheus_address = f"127.0.0.1:{args.prometheus_port or free_port()}"
            config_file = workdir / "prometheus.yml"
            config_file.write_text(yaml.safe_dump(prometheus_conf([r["metrics"] for r in replicas], args.scrape_interval),
                                                  sort_keys=False))
            stack.start("prometheus", [tools["prometheus"], f"--config.file={config_file}",
                                       f"--storage.tsdb.path={workdir / 'prometheus-data'}",
                                       f"--web.listen-address={prometheus_address}"])
            stack.wait_until("prometheus", lambda: http_ok(f"http://{prometheus_address}/-/ready"))
            ready["prometheus"] = f"http://{prometheus_address}"

        if args.ready_file:  # written whole, then renamed: a reader never sees half of it
            partial = args.ready_file.with_name(args.ready_file.name + ".tmp")
            partial.write_text(json.dumps(ready, indent=2))
            partial.replace(args.ready_file)
        print(f"gRPC through nginx: {lb_address}", flush=True)
        print(f"KServe REST through nginx: http://{rest_lb_address}", flush=True)
        for i, replica in enumerate(replicas):
            print(f"replica{i}: gRPC {replica['grpc']}, REST http://{replica['rest']}, "
                  f"metrics http://{replica['metrics']}/metrics", flush=True)
        if "prometheus" in ready:
            print(f"Prometheus: {ready['prometheus']}", flush=True)
        print(f"configs and logs: {workdir}; Ctrl-C stops everything", flush=True)
        while not stack.stop_requested:
            stack.check_alive()
            time.sleep(0.5)


if __name__ == "__main__":
    sys.exit(main())
