"""k8s/loadtest: the kustomization renders, validates strictly, and its pods' command lines mean what they say.

The master's and workers' command lines (the image's ENTRYPOINT, ``locust``, with the
ConfigMap's variables and the manifest's args) are parsed by Locust's own parser with
the tpserve user's options, in a subprocess (importing locust monkey-patches the process).
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys

import pytest
import yaml

from tests.paths import REPO_ROOT
from tpserve.bench import LOCUSTFILE

LOADTEST = REPO_ROOT / "k8s" / "loadtest"

# Parses ARGS with ENV as Locust would, with the tpserve user's options; prints the
# options and the LOCUST_* names that no option reads.
_PARSE = """
import json, sys
from locust import argument_parser
import tpserve.bench.locustfile
args, env = json.loads(sys.argv[1]), json.loads(sys.argv[2])
parser = argument_parser.get_parser(default_config_files=[])
known = {action.env_var for action in parser._actions if getattr(action, "env_var", None)}
options = parser.parse_args(args=args, env_vars=env)
print(json.dumps({"options": {k: v for k, v in vars(options).items() if isinstance(v, (str, int, float, bool, type(None)))},
                  "unknown": sorted(set(env) - known)}))
"""


@pytest.fixture(scope="module")
def docs() -> dict[tuple[str, str], dict]:
    if shutil.which("kubectl") is None:
        pytest.skip("kubectl is not installed (needed for `kubectl kustomize`)")
    out = subprocess.run(["kubectl", "kustomize", str(LOADTEST)], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    return {(doc["kind"], doc["metadata"]["name"].rsplit("-", 1)[0] if doc["kind"] == "ConfigMap"
             else doc["metadata"]["name"]): doc for doc in yaml.safe_load_all(out.stdout) if doc}


def container(doc: dict) -> dict:
    (only,) = doc["spec"]["template"]["spec"]["containers"]
    return only


def locust_options(args: list[str], env: dict[str, str]) -> dict:
    out = subprocess.run([sys.executable, "-c", _PARSE, json.dumps(args), json.dumps(env)], capture_output=True,
                         text=True, timeout=60, cwd=REPO_ROOT)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout)


def test_renders_the_four_objects_and_validates_strictly(docs) -> None:
    import kubernetes_validate

    assert sorted(docs) == [("ConfigMap", "locust-load"), ("Deployment", "locust-master"),
                            ("Deployment", "locust-worker"), ("Service", "locust-master")]
    for doc in docs.values():
        kubernetes_validate.validate(doc, kubernetes_validate.latest_version(), strict=True)


def test_workers_reach_the_master_service(docs) -> None:
    master, worker, service = docs["Deployment", "locust-master"], docs["Deployment", "locust-worker"], docs[
        "Service", "locust-master"]
    assert service["spec"]["selector"].items() <= master["spec"]["template"]["metadata"]["labels"].items()
    ports = {port["name"]: port for port in service["spec"]["ports"]}
    container_ports = {port["name"]: port["containerPort"] for port in container(master)["ports"]}
    assert container_ports == {"master": 5557, "web": 8089} and set(ports) == {"master", "web"}
    args = container(worker)["args"]
    assert args[args.index("--master-host") + 1] == service["metadata"]["name"]
    assert int(args[args.index("--master-port") + 1]) == ports["master"]["port"]
    assert container(master)["image"] == container(worker)["image"] == "tpserve-loadtest:0.1.0"


def test_the_load_targets_the_tpserve_service(docs) -> None:
    host, port = docs["ConfigMap", "locust-load"]["data"]["LOCUST_HOST"].split(":")
    services = [doc for doc in yaml.safe_load_all((REPO_ROOT / "k8s" / "base" / "services.yaml").read_text())
                if doc and doc["kind"] == "Service"]
    grpc_ports = {svc["metadata"]["name"]: [p["port"] for p in svc["spec"]["ports"] if p["name"] == "grpc"]
                  for svc in services}
    assert grpc_ports[host] == [int(port)]


def test_command_lines_parse_as_intended(docs) -> None:
    env = docs["ConfigMap", "locust-load"]["data"]
    master = locust_options(container(docs["Deployment", "locust-master"])["args"], env)
    assert master["unknown"] == []  # every LOCUST_* variable is read by some option: no typo
    o = master["options"]
    assert (o["master"], o["autostart"], o["autoquit"], o["headless"]) == (True, True, -1, False)
    assert (o["host"], o["num_users"], o["spawn_rate"], o["run_time"], o["expect_workers"]) == (
        "tpserve:50051", 64, 8.0, 600, 2)  # run_time in seconds
    assert (o["dataset"], o["input_len"], o["output_len"], o["ignore_eos"]) == ("random", 128, 128, True)
    worker = locust_options(container(docs["Deployment", "locust-worker"])["args"], {})["options"]
    assert (worker["worker"], worker["master_host"], worker["master_port"]) == (True, "locust-master", 5557)


def test_the_image_runs_the_packaged_user() -> None:
    dockerfile = (LOADTEST / "Dockerfile").read_text()
    assert "LOCUST_LOCUSTFILE=/opt/tpserve/tpserve/bench/locustfile.py" in dockerfile
    assert LOCUSTFILE.endswith("tpserve/bench/locustfile.py") and 'ENTRYPOINT ["locust"]' in dockerfile
    assert "COPY tpserve ./tpserve" in dockerfile
    installs = [line for line in dockerfile.splitlines() if line.startswith("RUN pip install")]
    assert len(installs) == 1 and "locust" in installs[0] and "torch" not in installs[0]  # a client image
