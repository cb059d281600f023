"""Deployment files validate offline, and the dashboard's PromQL works on real metrics.

Tools (installed by `make install` through `make tools` and the `test` extra; a missing tool
is a failure, never a skip): docker-compose (Debian), promtool and prometheus (Debian),
kubernetes-validate, grafana-foundation-sdk and promql-parser (pip).
"""
from __future__ import annotations

import http.server
import json
import math
import os
import re
import shutil
import socket
import subprocess
import sys
import threading
import time
import urllib.parse
import urllib.request
from concurrent import futures
from pathlib import Path

import pytest
import yaml

from ppspec.router.metrics import RouterMetrics, sample_names

ROOT = Path(__file__).resolve().parents[1]
DEPLOY = ROOT / "deploy"
K8S = DEPLOY / "k8s"
DASHBOARD = DEPLOY / "grafana" / "dashboards" / "ppspec.json"
K8S_VERSIONS = ("1.29.0", "1.37.0")  # schemas kubernetes-validate ships offline
# Grafana's built-in variables, replaced by a plain duration to check the expressions.
GRAFANA_VARS = {"$__rate_interval": "1m", "$__range": "1m", "$__interval": "15s"}


def tool(name: str) -> str:
    path = shutil.which(name)
    assert path, f"{name} not found: run `make tools` (or `make install`)"
    return path


def run(cmd: list[str], cwd: Path | None = None, **kw) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, cwd=cwd, capture_output=True, text=True, timeout=120, **kw)


def ok(proc: subprocess.CompletedProcess) -> None:
    assert proc.returncode == 0, f"{proc.args} exited {proc.returncode}\n{proc.stdout}\n{proc.stderr}"


# ------------------------------------------------------------------ docker-compose

COMPOSE_SETS = [["docker-compose.yml"], ["docker-compose.yml", "docker-compose.cuda.yml"]]


@pytest.mark.parametrize("files", COMPOSE_SETS, ids=["cpu", "cuda"])
def test_compose_config_is_valid(files):
    args = [a for f in files for a in ("-f", f)]
    ok(run([tool("docker-compose"), *args, "config", "-q"], cwd=DEPLOY))


def test_compose_validator_rejects_a_bad_file(tmp_path):
    (tmp_path / "docker-compose.yml").write_text("services:\n  a:\n    image: x\n    not_a_key: 1\n")
    assert run([tool("docker-compose"), "config", "-q"], cwd=tmp_path).returncode != 0


def _flag(cmd: list[str], name: str) -> str | None:
    return cmd[cmd.index(name) + 1] if name in cmd else None


def test_compose_pipeline_wiring():
    proc = run([tool("docker-compose"), "-f", "docker-compose.yml", "-f", "docker-compose.cuda.yml", "config"],
               cwd=DEPLOY)
    ok(proc)
    services = yaml.safe_load(proc.stdout)["services"]
    stages = {name: svc for name, svc in services.items() if svc.get("command", [None])[0] == "stage"}
    n = len(stages)
    assert n == 2
    by_rank = {int(_flag(s["command"], "--pp-rank")): name for name, s in stages.items()}
    assert sorted(by_rank) == list(range(n))
    addresses = []
    for rank in range(n):
        cmd = stages[by_rank[rank]]["command"]
        assert _flag(cmd, "--pp-size") == str(n)
        assert _flag(cmd, "--model") == "/models/qwen35-demo"
        addresses.append(f"{by_rank[rank]}:{_flag(cmd, '--port')}")
        if rank + 1 < n:
            assert _flag(cmd, "--next-stage") == f"{by_rank[rank + 1]}:{_flag(stages[by_rank[rank + 1]]['command'], '--port')}"
        else:
            assert "--next-stage" not in cmd
        assert "ppspec-healthcheck" in stages[by_rank[rank]]["healthcheck"]["test"]
        # the CUDA overlay gives each stage a GPU
        devices = stages[by_rank[rank]]["deploy"]["resources"]["reservations"]["devices"]
        assert devices[0]["capabilities"] == ["gpu"]
    router = services["router"]
    assert router["command"][0] == "router"
    assert _flag(router["command"], "--stages") == ",".join(addresses)
    assert _flag(router["command"], "--port") == "8000"
    # router and stages read the one pipeline key secret
    for svc in [router, *stages.values()]:
        assert _flag(svc["command"], "--pipeline-key-file") == "/run/secrets/pipeline_key"
        assert [s if isinstance(s, str) else s["source"] for s in svc["secrets"]] == ["pipeline_key"]
    assert set(router["depends_on"]) == set(stages)
    # Prometheus scrapes the router; Grafana gets the provisioning and the dashboard
    prom = yaml.safe_load((DEPLOY / "prometheus" / "prometheus.yml").read_text())
    targets = [t for job in prom["scrape_configs"] for sc in job["static_configs"] for t in sc["targets"]]
    assert "router:8000" in targets
    mounts = " ".join(services["grafana"]["volumes"])
    assert "/etc/grafana/provisioning" in mounts and "/var/lib/grafana/dashboards" in mounts


# ------------------------------------------------------------------ Kubernetes

def k8s_manifests() -> list[Path]:
    files = sorted(p for p in K8S.rglob("*.yaml") if p.name != "kustomization.yaml")
    assert len(files) >= 6
    return files


@pytest.mark.parametrize("version", K8S_VERSIONS)
@pytest.mark.parametrize("manifest", k8s_manifests(), ids=lambda p: str(p.relative_to(K8S)))
def test_k8s_manifest_is_valid(manifest, version):
    ok(run([sys.executable, "-m", "kubernetes_validate", "--strict", "-k", version, str(manifest)]))


def test_k8s_validator_rejects_an_unknown_field(tmp_path):
    bad = yaml.safe_load((K8S / "common" / "router-service.yaml").read_text())
    bad["spec"]["notAField"] = True
    path = tmp_path / "bad.yaml"
    path.write_text(yaml.safe_dump(bad))
    assert run([sys.executable, "-m", "kubernetes_validate", "--strict", "-k", K8S_VERSIONS[0],
                str(path)]).returncode != 0


def test_k8s_kustomizations_reference_existing_files():
    for kust in K8S.rglob("kustomization.yaml"):
        for res in yaml.safe_load(kust.read_text())["resources"]:
            target = (kust.parent / res).resolve()
            assert target.exists(), f"{kust}: {res} does not exist"
            if target.is_dir():
                assert (target / "kustomization.yaml").exists()


KEY_FILE = "/etc/ppspec/pipeline-key/key"


def assert_key_mounted(pod: dict, container: dict) -> None:
    """The pipeline key Secret (the name pipeline-key-secret.yaml gives it) at KEY_FILE's folder."""
    secret = load(K8S / "common" / "pipeline-key-secret.yaml")
    vols = {v["name"]: v for v in pod["volumes"]}
    (mount,) = [m for m in container["volumeMounts"] if m["mountPath"] == os.path.dirname(KEY_FILE)]
    assert vols[mount["name"]]["secret"]["secretName"] == secret["metadata"]["name"] and mount["readOnly"]
    assert set(secret["stringData"]) == {os.path.basename(KEY_FILE)}


def load(path: Path) -> dict:
    return yaml.safe_load(path.read_text())


@pytest.mark.parametrize("variant", ["cpu", "cuda"])
def test_k8s_stage_ranks_and_dns_names(variant, tmp_path):
    config = load(K8S / "common" / "configmap.yaml")["data"]
    sts = load(K8S / variant / "stage-statefulset.yaml")
    service = load(K8S / "common" / "stage-service.yaml")
    n = int(config["PPSPEC_PP_SIZE"])
    assert sts["spec"]["replicas"] == n
    assert sts["spec"]["serviceName"] == service["metadata"]["name"] == config["PPSPEC_STAGE_SERVICE"]
    assert sts["metadata"]["name"] == config["PPSPEC_STAGE_STATEFULSET"]
    assert service["spec"]["clusterIP"] == "None"  # headless: one DNS name per pod
    assert service["spec"]["selector"].items() <= sts["spec"]["template"]["metadata"]["labels"].items()
    pod = sts["spec"]["template"]["spec"]
    (container,) = pod["containers"]
    assert_key_mounted(pod, container)
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        assert container[probe]["grpc"]["port"] == int(config["PPSPEC_STAGE_PORT"])
    limits = container["resources"].get("limits", {})
    assert ("nvidia.com/gpu" in limits) == (variant == "cuda")
    if variant == "cuda":
        assert limits["nvidia.com/gpu"] == 1

    # run the pod's shell command with a stand-in `ppspec` that prints its arguments
    fake = tmp_path / "ppspec"
    fake.write_text('#!/bin/sh\nprintf "%s\\n" "$@"\n')
    fake.chmod(0o755)
    routed = config["PPSPEC_STAGES"].split(",")
    assert len(routed) == n
    for rank in range(n):
        env = dict(os.environ, **config, HOSTNAME=f"{sts['metadata']['name']}-{rank}",
                   PATH=f"{tmp_path}:{os.environ['PATH']}")
        proc = run(container["command"] + container["args"], env=env)
        ok(proc)
        argv = proc.stdout.split()
        assert argv[0] == "stage"
        assert _flag(argv, "--pp-rank") == str(rank)
        assert _flag(argv, "--pp-size") == str(n)
        assert _flag(argv, "--model") == config["PPSPEC_MODEL"]
        # the next stage is the address the router lists for rank + 1
        assert _flag(argv, "--next-stage") == (routed[rank + 1] if rank + 1 < n else None)
        assert _flag(argv, "--pipeline-key-file") == KEY_FILE
        assert routed[rank].startswith(f"{sts['metadata']['name']}-{rank}.{service['metadata']['name']}:")


def test_k8s_router(tmp_path):
    config = load(K8S / "common" / "configmap.yaml")["data"]
    dep = load(K8S / "common" / "router-deployment.yaml")
    svc = load(K8S / "common" / "router-service.yaml")
    assert dep["spec"]["replicas"] == 1 and dep["spec"]["strategy"]["type"] == "Recreate"
    (container,) = dep["spec"]["template"]["spec"]["containers"]
    for probe in ("readinessProbe", "livenessProbe"):
        assert container[probe]["httpGet"]["path"] == "/health"
    assert svc["spec"]["selector"].items() <= dep["spec"]["template"]["metadata"]["labels"].items()
    assert container["resources"]["requests"]
    fake = tmp_path / "ppspec"
    fake.write_text('#!/bin/sh\nprintf "%s\\n" "$@"\n')
    fake.chmod(0o755)
    proc = run(container["command"] + container["args"],
               env=dict(os.environ, **config, PATH=f"{tmp_path}:{os.environ['PATH']}"))
    ok(proc)
    argv = proc.stdout.split()
    assert argv[0] == "router" and _flag(argv, "--pipeline-key-file") == KEY_FILE
    assert_key_mounted(dep["spec"]["template"]["spec"], container)
    assert _flag(argv, "--stages") == config["PPSPEC_STAGES"]
    assert _flag(argv, "--port") == config["PPSPEC_ROUTER_PORT"]


# ------------------------------------------------------------------ every command line parses


def parse_ppspec(argv: list[str]):
    """``argv`` (``stage ...`` or ``router ...``) through the real argument parsers and
    their checks, as the program would read it; fails the test naming the line otherwise."""
    from ppspec.router.server import build_parser as router_parser
    from ppspec.stage_server.server import parse_args as stage_args

    assert argv[0] in ("stage", "router"), argv
    try:
        return stage_args(argv[1:]) if argv[0] == "stage" else router_parser().parse_args(argv[1:])
    except SystemExit as e:
        pytest.fail(f"ppspec {' '.join(argv)}: refused (exit {e.code}; the reason is on stderr)")


def _compose_services(files: list[str]) -> dict:
    args = [a for f in files for a in ("-f", f)]
    proc = run([tool("docker-compose"), *args, "config"], cwd=DEPLOY)
    ok(proc)
    return yaml.safe_load(proc.stdout)["services"]


def test_compose_commands_parse_and_cuda_stages_run_on_the_gpu_in_bf16():
    cpu, cuda = (_compose_services(files) for files in COMPOSE_SETS)
    for services, variant in ((cpu, "cpu"), (cuda, "cuda")):
        commands = {name: svc["command"] for name, svc in services.items()
                    if svc.get("command", [None])[0] in ("stage", "router")}
        assert sorted(commands) == ["router", "stage0", "stage1"]
        for name, cmd in commands.items():
            args = parse_ppspec(cmd)
            if cmd[0] == "stage":
                want = ("cuda", "bfloat16") if variant == "cuda" else ("cpu", "auto")
                assert (args.device, args.dtype) == want, (variant, name)
    for name in ("stage0", "stage1"):  # the overlay's command is the base one on the GPU, nothing else
        assert cuda[name]["command"] == cpu[name]["command"] + ["--device", "cuda", "--dtype", "bfloat16"]


def _kustomize_by_hand(folder: Path) -> list[dict]:
    """The objects ``kubectl apply -k folder`` applies (our kustomizations only list resources)."""
    docs = []
    for res in load(folder / "kustomization.yaml")["resources"]:
        target = (folder / res).resolve()
        docs += _kustomize_by_hand(target) if target.is_dir() else list(yaml.safe_load_all(target.read_text()))
    return docs


def _rendered(variant: str) -> list[dict]:
    by_hand = _kustomize_by_hand(K8S / variant)
    kubectl = shutil.which("kubectl")
    if kubectl:  # kustomize's own rendering, when installed, gives the same objects
        proc = run([kubectl, "kustomize", str(K8S / variant)])
        ok(proc)
        rendered = list(yaml.safe_load_all(proc.stdout))
        key = lambda d: (d["kind"], d["metadata"]["name"])  # noqa: E731
        assert sorted(rendered, key=key) == sorted(by_hand, key=key)
    return by_hand


def _documented_extra_args() -> dict[str, list[str]]:
    """The example values of PPSPEC_{STAGE,ROUTER}_EXTRA_ARGS that the ConfigMap's comments
    and deploy/README.md give, by variable."""
    examples: dict[str, list[str]] = {"PPSPEC_STAGE_EXTRA_ARGS": [], "PPSPEC_ROUTER_EXTRA_ARGS": []}
    lines = (K8S / "common" / "configmap.yaml").read_text().splitlines()
    for i, line in enumerate(lines):
        m = re.search(r'#.*e\.g\. "([^"]+)"', line)
        if m:
            var = next(lines[j].split(":")[0].strip() for j in range(i + 1, len(lines)) if not lines[j].strip()
                       .startswith("#"))
            examples[var].append(m.group(1))
    readme = " ".join((DEPLOY / "README.md").read_text().split())
    for var, value in re.findall(r"`(PPSPEC_(?:STAGE|ROUTER)_EXTRA_ARGS)`[^`]*?e\.g\. `([^`]+)`", readme):
        examples[var].append(value)
    assert all(len(v) == 2 for v in examples.values()), examples  # one in each place
    return examples


@pytest.mark.parametrize("variant", ["cpu", "cuda"])
def test_k8s_commands_parse_with_the_documented_extra_args(variant, tmp_path):
    """Each overlay, rendered, run as its pods would (the containers' shell commands with the
    ConfigMap's environment and each documented EXTRA_ARGS example, a stand-in ``ppspec``
    printing its arguments), gives stage and router command lines the programs accept."""
    docs = _rendered(variant)
    (config,) = [d["data"] for d in docs if d["kind"] == "ConfigMap"]
    (sts,) = [d for d in docs if d["kind"] == "StatefulSet"]
    (router,) = [d for d in docs if d["kind"] == "Deployment"]
    fake = tmp_path / "ppspec"
    fake.write_text('#!/bin/sh\nprintf "%s\\n" "$@"\n')
    fake.chmod(0o755)
    path = f"{tmp_path}:{os.environ['PATH']}"
    examples = _documented_extra_args()
    n = int(config["PPSPEC_PP_SIZE"])
    for extra in [""] + examples["PPSPEC_STAGE_EXTRA_ARGS"]:
        (container,) = sts["spec"]["template"]["spec"]["containers"]
        for rank in range(n):
            env = {**os.environ, **config, "PPSPEC_STAGE_EXTRA_ARGS": extra,
                   "HOSTNAME": f"{sts['metadata']['name']}-{rank}", "PATH": path}
            proc = run(container["command"] + container["args"], env=env)
            ok(proc)
            args = parse_ppspec(proc.stdout.split())
            assert args.pp_rank == rank and args.pp_size == n
            want = ("cuda", "bfloat16") if variant == "cuda" else ("cpu", "auto")
            assert (args.device, args.dtype) == want
    for extra in [""] + examples["PPSPEC_ROUTER_EXTRA_ARGS"]:
        (container,) = router["spec"]["template"]["spec"]["containers"]
        env = {**os.environ, **config, "PPSPEC_ROUTER_EXTRA_ARGS": extra, "PATH": path}
        proc = run(container["command"] + container["args"], env=env)
        ok(proc)
        args = parse_ppspec(proc.stdout.split())
        assert args.stages == config["PPSPEC_STAGES"].split(",")


def test_a_router_given_stage_options_is_refused():
    """What the deploy files once passed the router: the check above would catch it."""
    with pytest.raises(pytest.fail.Exception, match="refused"):
        parse_ppspec(["router", "--stages", "a:1", "--speculative-num-steps", "3"])


# ------------------------------------------------------------------ Prometheus config

def test_promtool_check_config():
    ok(run([tool("promtool"), "check", "config", str(DEPLOY / "prometheus" / "prometheus.yml")]))


def test_promtool_rejects_a_bad_config(tmp_path):
    (tmp_path / "p.yml").write_text("scrape_configs:\n  - job_name: x\n    scrape_interval: fast\n")
    assert run([tool("promtool"), "check", "config", str(tmp_path / "p.yml")]).returncode != 0


# ------------------------------------------------------------------ dashboard

def dashboard_targets() -> list[tuple[str, str]]:
    """(panel title, expression) of every query, re-read through grafana-foundation-sdk."""
    from grafana_foundation_sdk.cog.plugins import register_default_plugins
    from grafana_foundation_sdk.models.dashboard import Dashboard, Panel

    register_default_plugins()
    dash = Dashboard.from_json(json.loads(DASHBOARD.read_text()))
    out = []
    for panel in dash.panels or []:
        if isinstance(panel, Panel):
            for target in panel.targets or []:
                out.append((panel.title, target.expr))
    return out


def promql(expr: str) -> str:
    for var, value in GRAFANA_VARS.items():
        expr = expr.replace(var, value)
    assert "$" not in expr, f"unknown Grafana variable in {expr}"
    return expr


def selected_metric_names(expr: str) -> set[str]:
    """Metric names of every selector in a PromQL expression, from its syntax tree."""
    import promql_parser as pp

    names: set[str] = set()

    def walk(node):
        if isinstance(node, pp.VectorSelector):
            name = node.name or next((m.value for m in node.matchers.matchers if m.name == "__name__"), None)
            assert name, f"selector without a metric name in {expr}"
            names.add(name)
        elif isinstance(node, pp.MatrixSelector):
            walk(node.vector_selector)
        elif isinstance(node, pp.Call):
            for arg in node.args:
                walk(arg)
        elif isinstance(node, pp.AggregateExpr):
            walk(node.expr)
            if node.param is not None:
                walk(node.param)
        elif isinstance(node, pp.BinaryExpr):
            walk(node.lhs)
            walk(node.rhs)
        elif isinstance(node, (pp.ParenExpr, pp.UnaryExpr, pp.SubqueryExpr)):
            walk(node.expr)
        elif not isinstance(node, (pp.NumberLiteral, pp.StringLiteral)):
            raise AssertionError(f"unhandled PromQL node {type(node).__name__} in {expr}")

    walk(pp.parse(expr))
    return names


def test_dashboard_json_is_what_the_script_writes():
    ok(run([sys.executable, str(DEPLOY / "grafana" / "build_dashboard.py"), "--check"]))


def test_dashboard_panels_and_metric_names():
    targets = dashboard_targets()
    titles = {t for t, _ in targets}
    for needed in ("Mean accept length over time", "Acceptance by draft position", "Acceptance rate over time",
                   "Throughput", "Time to first token", "Inter-token latency",
                   "Stage Forward / Verify latency", "Stage busy fraction", "Stage pool usage"):
        assert needed in titles
    known = sample_names()
    used: set[str] = set()
    for title, expr in targets:
        names = selected_metric_names(promql(expr))
        assert names, f"{title}: {expr} selects no metric"
        unknown = names - known
        assert not unknown, f"panel {title!r} uses metrics RouterMetrics does not define: {unknown}"
        used |= names
    # the parser really finds names (a typo would be caught)
    assert selected_metric_names("sum(rate(ppspec:nope_total[1m])) / ppspec:x") == {"ppspec:nope_total", "ppspec:x"}
    assert {"ppspec:spec_decode_num_accepted_tokens_per_pos_total", "ppspec:stage_pool_usage",
            "ppspec:time_to_first_token_seconds_bucket"} <= used


def test_dashboard_expressions_pass_promtool_check_rules(tmp_path):
    rules = [{"record": f"ppspec_dashboard:query_{i}", "expr": promql(expr)}
             for i, (_, expr) in enumerate(dashboard_targets())]
    path = tmp_path / "rules.yml"
    path.write_text(yaml.safe_dump({"groups": [{"name": "ppspec-dashboard", "rules": rules}]}))
    proc = run([tool("promtool"), "check", "rules", str(path)])
    ok(proc)
    assert f"{len(rules)} rules found" in proc.stdout
    path.write_text(yaml.safe_dump({"groups": [{"name": "bad", "rules": [
        {"record": "x:y", "expr": "sum(rate(ppspec:generation_tokens_total[1m])"}]}]}))
    assert run([tool("promtool"), "check", "rules", str(path)]).returncode != 0


# ------------------------------------------------------------------ a real Prometheus

def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Exporter:
    """Serves one consistent snapshot of a registry at /metrics (published explicitly, so a
    scrape never sees half of an update)."""

    def __init__(self, rm: RouterMetrics):
        self.rm = rm
        self.body, self.content_type = rm.exposition()
        exporter = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_GET(self):
                body = exporter.body
                self.send_response(200)
                self.send_header("Content-Type", exporter.content_type)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args):
                pass

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.port = self.server.server_address[1]
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def publish(self) -> None:
        self.body, _ = self.rm.exposition()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


class Prometheus:
    def __init__(self, tmp: Path, target_port: int):
        self.port = free_port()
        cfg = tmp / "prometheus.yml"
        cfg.write_text(yaml.safe_dump({
            "global": {"scrape_interval": "1s", "scrape_timeout": "900ms"},
            "scrape_configs": [{"job_name": "ppspec-router",
                                "static_configs": [{"targets": [f"127.0.0.1:{target_port}"]}]}],
        }))
        self.log = open(tmp / "prometheus.log", "w")
        self.proc = subprocess.Popen(
            [tool("prometheus"), f"--config.file={cfg}", f"--storage.tsdb.path={tmp / 'data'}",
             f"--web.listen-address=127.0.0.1:{self.port}"],
            stdout=self.log, stderr=subprocess.STDOUT)
        self.wait(lambda: self.query("up") == [1.0], "Prometheus scraping the exporter")

    def query(self, expr: str) -> list[float] | dict:
        url = f"http://127.0.0.1:{self.port}/api/v1/query?" + urllib.parse.urlencode({"query": expr})
        try:
            with urllib.request.urlopen(url, timeout=5) as resp:
                data = json.load(resp)
        except OSError:
            return []
        assert data["status"] == "success", data
        return [float(r["value"][1]) for r in data["data"]["result"]]

    def query_by(self, expr: str, label: str) -> dict[str, float]:
        url = f"http://127.0.0.1:{self.port}/api/v1/query?" + urllib.parse.urlencode({"query": expr})
        with urllib.request.urlopen(url, timeout=5) as resp:
            data = json.load(resp)
        return {r["metric"].get(label, ""): float(r["value"][1]) for r in data["data"]["result"]}

    def wait(self, cond, what: str, timeout: float = 60.0) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            assert self.proc.poll() is None, f"prometheus exited: {Path(self.log.name).read_text()[-2000:]}"
            if cond():
                return
            time.sleep(0.2)
        raise AssertionError(f"timed out waiting for {what}")

    def close(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self.log.close()


def test_dashboard_queries_on_a_real_prometheus(tmp_path):
    from prometheus_client import CollectorRegistry

    rm = RouterMetrics(CollectorRegistry(), num_stages=2, num_spec_tokens=3)
    exporter = Exporter(rm)  # every series at zero
    prom = Prometheus(tmp_path, exporter.port)
    try:
        drafts = "ppspec:spec_decode_num_drafts_total"
        prom.wait(lambda: prom.query(f"count_over_time({drafts}[1m])") >= [2.0], "two scrapes at zero")

        # known traffic: 10 verify rounds of three chain drafts of 3 tokens, accept lengths 4, 2, 1
        for _ in range(10):
            rm.on_verify_requests([3, 3, 3], [4, 2, 1])
        for i in range(4):
            rm.on_request_arrived(i, now=0.0)
            rm.on_request_scheduled(i, prompt_tokens=8, now=0.1)
            rm.on_tokens(i, 1, now=0.5)
            rm.on_tokens(i, 3, now=0.8)
            rm.on_request_finished(i, "stop" if i % 2 else "length", now=1.0)
        rm.set_queue(running=3, waiting=1)
        rm.set_in_flight(2)
        for stage in (0, 1):
            rm.on_stage_rpc(stage, "forward", 0.02)
            rm.on_stage_rpc(stage, "verify", 0.004)
            rm.on_stage_rpc(stage, "commit", 0.0005)
            rm.set_stage_busy(stage, 0.5 + 0.25 * stage)
            for pool, used in (("rows", 0.5), ("kv", 0.25), ("state", 0.5)):
                rm.set_pool_usage(stage, pool, used)
        rm.on_prefix_cache(100, 40, 0.5)  # 40 of 100 prompt tokens cached, half the snapshot slots used
        for tokens in (64, 64, 64, 300):
            rm.on_pipeline_step("forward", 0.003, tokens)
        for stage in (0, 1):
            rm.set_stage_forwards(stage, {"graph": 50, "eager": 2})
        zero_samples = prom.query(f"count_over_time({drafts}[1m])")[0]
        exporter.publish()
        prom.wait(lambda: prom.query(drafts) == [30.0]
                  and prom.query(f"count_over_time({drafts}[1m])")[0] >= zero_samples + 2, "the traffic scraped")

        by_title: dict[str, list[float]] = {}
        for title, expr in dashboard_targets():
            values = prom.query(promql(expr))
            assert values, f"panel {title!r}: {expr} returned no series"
            assert all(math.isfinite(v) for v in values), f"panel {title!r}: {values}"
            by_title.setdefault(title, []).extend(values)

        assert [round(v, 6) for v in by_title["Prefix cache"]] == [0.4, 0.5]
        p50, p99 = by_title["Tokens per micro-batch"]
        assert 32 < p50 <= 64 and 256 < p99 <= 512  # three of 64 tokens, one of 300
        assert len(by_title["Stage forwards by how they ran"]) == 4  # two stages x graph, eager
        # the speculation panels read back exactly what the rounds were:
        # 30 drafts, 90 draft tokens, 40 accepted (positions 20, 10, 10)
        assert by_title["Mean accept length"] == [pytest.approx(1 + 40 / 30)]
        assert by_title["Acceptance rate"] == [pytest.approx(40 / 90)]
        assert by_title["Mean accept length over time"][0] == pytest.approx(1 + 40 / 30)
        assert by_title["Acceptance rate over time"] == [pytest.approx(40 / 90)]
        per_pos_expr = next(e for t, e in dashboard_targets() if t == "Acceptance by draft position")
        assert prom.query_by(promql(per_pos_expr), "position") == {
            "0": pytest.approx(20 / 30), "1": pytest.approx(10 / 30), "2": pytest.approx(10 / 30)}
        # the accept-length histogram's mean agrees with the counters
        hist_mean = prom.query("sum(increase(ppspec:spec_decode_accept_length_sum[1m])) / "
                               "sum(increase(ppspec:spec_decode_accept_length_count[1m]))")
        assert hist_mean == [pytest.approx(1 + 40 / 30)]
        busy_expr = next(e for t, e in dashboard_targets() if t == "Stage busy fraction")
        assert prom.query_by(promql(busy_expr), "stage") == {"0": 0.5, "1": 0.75}
    finally:
        prom.close()
        exporter.close()


# ------------------------------------------------------------------ healthcheck script

def test_healthcheck_script_grpc_and_http():
    import grpc
    from grpc_health.v1 import health, health_pb2, health_pb2_grpc

    script = [sys.executable, str(DEPLOY / "healthcheck.py")]
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    servicer = health.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    try:
        servicer.set("", health_pb2.HealthCheckResponse.SERVING)
        ok(run([*script, "grpc", f"127.0.0.1:{port}"]))
        servicer.set("", health_pb2.HealthCheckResponse.NOT_SERVING)
        proc = run([*script, "grpc", f"127.0.0.1:{port}"])
        assert proc.returncode == 1 and "NOT_SERVING" in proc.stderr
    finally:
        server.stop(None)
    assert run([*script, "--timeout", "1", "grpc", f"127.0.0.1:{port}"]).returncode == 1

    status = {"code": 200}

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            self.send_response(status["code"] if self.path == "/health" else 404)
            self.end_headers()

        def log_message(self, *args):
            pass

    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    url = f"http://127.0.0.1:{httpd.server_address[1]}/health"
    try:
        ok(run([*script, "http", url]))
        status["code"] = 503
        proc = run([*script, "http", url])
        assert proc.returncode == 1 and "503" in proc.stderr
    finally:
        httpd.shutdown()
        httpd.server_close()


def test_dockerfile_variants_and_entrypoint():
    text = (DEPLOY / "Dockerfile").read_text()
    assert re.search(r"^ARG VARIANT=cpu$", text, re.M)
    assert "cpu)" in text and "cuda)" in text
    assert re.search(r'^ENTRYPOINT \["ppspec"\]$', text, re.M)
    assert "pip install -e ." in text
