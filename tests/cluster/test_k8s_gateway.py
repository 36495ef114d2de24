"""The gateway component (k8s/components/gateway): smg finds exactly the tpserve API pods,
on their gRPC port, with the permissions that takes, and its command line parses with
smg's own parser. Every overlay includes it; kinds are validated by test_k8s.py."""

from __future__ import annotations

import pytest

from tests.cluster.k8s import by_kind, pod_templates


def gateway(docs: list[dict]) -> dict:
    (deployment,) = [d for d in by_kind(docs, "Deployment") if d["metadata"]["name"] == "tpserve-gateway"]
    return deployment


def flag(args: list[str], name: str) -> list[str]:
    """The values after ``--name`` (``--name=v`` or ``--name v1 v2 ...``)."""
    for i, arg in enumerate(args):
        if arg.startswith(f"--{name}="):
            return [arg.split("=", 1)[1]]
        if arg == f"--{name}":
            values = []
            for value in args[i + 1:]:
                if value.startswith("--"):
                    break
                values.append(value)
            return values
    raise KeyError(name)


def test_the_gateway_command_line_parses_with_smgs_own_parser(rendered) -> None:
    launch_router = pytest.importorskip("smg.launch_router", reason="smg is not installed (pip install tpserve[gateway])")
    (container,) = gateway(rendered[1])["spec"]["template"]["spec"]["containers"]
    args = [a.replace("$(POD_NAMESPACE)", "default") for a in container["args"]]
    assert args[0] == "launch"
    router = launch_router.parse_router_args(args[1:])
    assert (router.backend, router.policy, router.service_discovery) == ("vllm", "cache_aware", True)
    assert router.service_discovery_namespace == "default"
    assert {e["name"] for e in container["env"]} == {"POD_NAMESPACE"}


def test_the_gateway_discovers_exactly_the_api_pods_on_their_grpc_port(rendered) -> None:
    docs = rendered[1]
    (container,) = gateway(docs)["spec"]["template"]["spec"]["containers"]
    selector = dict(pair.split("=") for pair in flag(container["args"], "selector"))
    api_pods = [template for role, template, _ in pod_templates(docs) if role != "worker"]
    assert api_pods
    for template in pod_templates(docs):
        role, labels = template[0], template[1]["metadata"]["labels"]
        assert (selector.items() <= labels.items()) == (role != "worker"), role  # headless ranks serve no API
    ports = {p["containerPort"] for t in api_pods for p in t["spec"]["containers"][0]["ports"] if p["name"] == "grpc"}
    assert ports == {int(flag(container["args"], "service-discovery-port")[0])}


def test_the_gateway_may_watch_pods_in_its_namespace_and_nothing_more(rendered) -> None:
    docs = rendered[1]
    account = gateway(docs)["spec"]["template"]["spec"]["serviceAccountName"]
    (binding,) = by_kind(docs, "RoleBinding")
    assert binding["subjects"] == [{"kind": "ServiceAccount", "name": account}]
    (role,) = [r for r in by_kind(docs, "Role") if r["metadata"]["name"] == binding["roleRef"]["name"]]
    assert role["rules"] == [{"apiGroups": [""], "resources": ["pods"], "verbs": ["get", "list", "watch"]}]
    assert not by_kind(docs, "ClusterRole")
    (service,) = [s for s in by_kind(docs, "Service") if s["metadata"]["name"] == "tpserve-gateway"]
    assert service["spec"]["selector"] == gateway(docs)["spec"]["selector"]["matchLabels"]
