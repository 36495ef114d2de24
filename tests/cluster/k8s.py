"""Rendering the kustomize overlays and reading their objects, shared by the Kubernetes manifest tests."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from collections.abc import Iterator

import pytest
import yaml

from tests.paths import REPO_ROOT
from tpserve.cli import build_parser, serve_config
from tpserve.config import ClusterConfig

#: overlay -> (single-host replicas' (tp, pp) or None, multi-host groups' (tp, pp, pods) or None).
LAYOUTS = {
    "cpu": ((2, 1), (4, 1, 2)),
    "gpu": ((4, 1), (8, 1, 2)),
    "gpu-pipeline": ((4, 1), (8, 2, 2)),
    "cpu-qwen3-0.6b": ((2, 1), None),
    "gpu-llama-8b": ((2, 1), None),
    "gpu-llama-8b-hostpath": ((2, 1), None),
    "gpu-llama-405b": (None, (8, 2, 2)),
    "gpu-llama-8b-hpa": ((2, 1), None),   # gpu-llama-8b + an autoscaler (test_k8s_autoscaling.py)
    "gpu-llama-8b-keda": ((2, 1), None),
}
OVERLAYS = tuple(LAYOUTS)
#: Overlays whose checkpoint a Job downloads into a claim (k8s/components/model-pvc).
MODEL_PVC_OVERLAYS = ("cpu-qwen3-0.6b", "gpu-llama-8b", "gpu-llama-405b")


def render(path: str) -> list[dict]:
    """``kubectl kustomize PATH`` (relative to the repository root), as documents; skips without kubectl."""
    if shutil.which("kubectl") is None:
        pytest.skip("kubectl is not installed (needed for `kubectl kustomize`)")
    out = subprocess.run(["kubectl", "kustomize", str(REPO_ROOT / path)], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    return [doc for doc in yaml.safe_load_all(out.stdout) if doc]


def by_kind(docs: list[dict], kind: str) -> list[dict]:
    return [doc for doc in docs if doc["kind"] == kind]


def strict(schema: object) -> object:
    """The schema with unknown fields refused, as ``kubectl apply --validate=strict`` does."""
    if isinstance(schema, dict):
        schema = {key: strict(value) for key, value in schema.items()}
        if ("properties" in schema and "additionalProperties" not in schema
                and not schema.get("x-kubernetes-preserve-unknown-fields")):
            schema["additionalProperties"] = False
    elif isinstance(schema, list):
        schema = [strict(value) for value in schema]
    return schema


def entrypoint_flags() -> list[str]:
    """The flags the image's ENTRYPOINT puts before a manifest's args (deploy/Dockerfile)."""
    dockerfile = (REPO_ROOT / "deploy" / "Dockerfile").read_text()
    entrypoint = json.loads(re.search(r"^ENTRYPOINT (\[.*\])$", dockerfile, re.M).group(1))
    assert entrypoint[:2] == ["tpserve", "serve"]
    return entrypoint[2:]


def pod_templates(docs: list[dict]) -> Iterator[tuple[str, dict, dict[str, str]]]:
    """(role, pod template, the variables LWS would set) of every tpserve pod."""
    for doc in by_kind(docs, "Deployment"):
        if doc["metadata"]["labels"]["app"] == "tpserve":  # not the gateway (test_k8s_gateway.py)
            yield "single-host", doc["spec"]["template"], {}
    for doc in by_kind(docs, "LeaderWorkerSet"):
        template = doc["spec"]["leaderWorkerTemplate"]
        lws_env = {"LWS_GROUP_SIZE": str(template["size"]),
                   "LWS_LEADER_ADDRESS": f"{doc['metadata']['name']}-0.{doc['metadata']['name']}.default"}
        yield "leader", template["leaderTemplate"], {**lws_env, "LWS_WORKER_INDEX": "0"}
        for index in range(1, template["size"]):
            yield "worker", template["workerTemplate"], {**lws_env, "LWS_WORKER_INDEX": str(index)}


def parse_container(container: dict, lws_env: dict[str, str]) -> ClusterConfig:
    """The configuration the container would run with; fails the test on a flag tpserve rejects."""
    args = [re.sub(r"\$\((\w+)\)", lambda m: lws_env[m.group(1)], arg) for arg in container.get("args", [])]
    try:
        return serve_config(build_parser().parse_args(["serve", *entrypoint_flags(), *args]))
    except SystemExit:
        pytest.fail(f"`tpserve serve` rejects the args of container {container['name']}: {args}")
