"""The Kubernetes manifests: every overlay renders, validates, and starts what it claims.

``kubectl kustomize`` renders each of k8s/overlays/ (the embedded model's cpu, gpu and
gpu-pipeline, and the real checkpoints' cpu-qwen3-0.6b, gpu-llama-8b, gpu-llama-8b-hostpath,
gpu-llama-405b, and gpu-llama-8b-hpa and -keda with an autoscaler, docs/kubernetes.md); core kinds are validated with
``kubernetes-validate`` (its bundled schemas, offline, strict: unknown fields fail),
the LeaderWorkerSet with ``jsonschema`` against the CRD's own schema from
../shared/k8s-schemas (made strict the same way). Every tpserve container's command
line (the image's ENTRYPOINT from deploy/Dockerfile + the manifest's args, with the
variables LWS sets filled in) must parse with the real ``tpserve serve`` parser
into a valid configuration.
"""

from __future__ import annotations

import functools
import shutil

import pytest
import yaml

from launch.local_ranks import WORKER_EXIT_SECONDS
from launch.public_server import GENERATION_SERVICE, LIVENESS_SERVICE
from launch.shutdown import NODES_GOODBYE_SECONDS
from tests.cluster.k8s import (
    LAYOUTS,
    MODEL_PVC_OVERLAYS,
    by_kind,
    parse_container,
    pod_templates,
    strict,
)
from tests.paths import SHARED_DIR
from tpserve.config import ClusterConfig

LWS_CRD = SHARED_DIR / "k8s-schemas" / "leaderworkerset.x-k8s.io_leaderworkersets.yaml"
#: Overlays that add an autoscaler to another: (that overlay, the core kinds they add). KEDA's
#: ScaledObject is a CRD's kind, validated by test_k8s_autoscaling.py.
AUTOSCALED = {"gpu-llama-8b-hpa": ("gpu-llama-8b", {"HorizontalPodAutoscaler"}),
              "gpu-llama-8b-keda": ("gpu-llama-8b", set())}

#: Where the multi-host pods mount the Secret tpserve-cluster-secret.
SECRET_DIR = "/etc/tpserve/cluster-secret"
#: --worker-start-timeout-seconds' default.
DEFAULT_START_TIMEOUT_S = ClusterConfig().server.worker_start_timeout_seconds

requires_kubectl = pytest.mark.skipif(shutil.which("kubectl") is None, reason="kubectl is not installed")


def test_core_kinds_validate_against_the_kubernetes_schemas(rendered) -> None:
    import kubernetes_validate

    overlay, docs = rendered
    core = [doc for doc in docs if doc["kind"] not in ("LeaderWorkerSet", "ScaledObject")]
    base, autoscaler = AUTOSCALED.get(overlay, (overlay, set()))
    model_pvc = {"PersistentVolumeClaim", "Job", "ConfigMap"} if base in MODEL_PVC_OVERLAYS else set()
    multi_host = {"NetworkPolicy"} if LAYOUTS[overlay][1] is not None else set()
    assert {doc["kind"] for doc in core} == {"Deployment", "Service", "PodDisruptionBudget", "ServiceAccount", "Role",
                                             "RoleBinding"} | model_pvc | autoscaler | multi_host  # + the gateway's
    for doc in core:
        kubernetes_validate.validate(doc, kubernetes_validate.latest_version(), strict=True)


@functools.cache
def lws_validator():
    """A validator of the CRD's v1 schema (the C YAML loader: the CRD is 1.3 MB)."""
    import jsonschema

    crd = yaml.load(LWS_CRD.read_text(), Loader=getattr(yaml, "CSafeLoader", yaml.SafeLoader))
    (version,) = [v for v in crd["spec"]["versions"] if v["name"] == "v1"]
    schema = strict(version["schema"]["openAPIV3Schema"])
    return jsonschema.validators.validator_for(schema)(schema)


def test_the_leader_worker_set_validates_against_its_crd(rendered) -> None:
    import jsonschema

    overlay, docs = rendered
    if LAYOUTS[overlay][1] is None:  # single-host only: no LWS controller needed
        assert not by_kind(docs, "LeaderWorkerSet")
        return
    if not LWS_CRD.is_file():
        pytest.skip(f"the LeaderWorkerSet CRD is not under {LWS_CRD.parent} (set TPSERVE_SHARED_DIR)")
    (lws,) = by_kind(docs, "LeaderWorkerSet")
    assert lws["apiVersion"] == "leaderworkerset.x-k8s.io/v1"
    error = jsonschema.exceptions.best_match(lws_validator().iter_errors(lws))
    assert error is None, f"{error.message} at {'/'.join(map(str, error.absolute_path))}"  # not the whole schema
    with pytest.raises(jsonschema.ValidationError):  # the strict schema does refuse a misplaced field
        lws_validator().validate({**lws, "spec": {**lws["spec"], "restartPolicy": "None"}})
    # A worker pod's restart must not recreate the leader (docs/design/cluster.md, "A lost node is a paused group"):
    # the leader pauses the group instead.
    assert lws["spec"]["leaderWorkerTemplate"]["restartPolicy"] == "None"


def test_every_tpserve_command_line_parses_with_the_real_parser(rendered) -> None:
    overlay, docs = rendered
    groups = {}
    for role, template, lws_env in pod_templates(docs):
        (container,) = template["spec"]["containers"]
        config = parse_container(container, lws_env)
        par = config.parallel
        assert par.headless == (role == "worker")
        groups.setdefault(role, []).append(par)
        gpus = int(container["resources"].get("limits", {}).get("nvidia.com/gpu", 0))
        assert gpus == (0 if overlay.startswith("cpu") else par.world_size // par.nnodes)  # one GPU per local rank
    single_host, group = LAYOUTS[overlay]
    assert [(p.tensor_parallel_size, p.pipeline_parallel_size, p.nnodes) for p in groups.get("single-host", [])] == \
        ([] if single_host is None else [single_host + (1,)])
    if group is None:
        assert "leader" not in groups and "worker" not in groups
        return
    leader, (worker,) = groups["leader"][0], groups["worker"]
    # gpu: a tp 8 group over 2 nodes; gpu-pipeline: 2 stages of tp 8, one stage per node (tp within, pp across).
    assert (leader.tensor_parallel_size, leader.pipeline_parallel_size, leader.nnodes, worker.node_rank) == \
        (group + (1,))
    assert (worker.tensor_parallel_size, worker.pipeline_parallel_size) == \
        (leader.tensor_parallel_size, leader.pipeline_parallel_size)
    if leader.pipeline_parallel_size > 1:
        assert leader.pipeline_parallel_size % leader.nnodes == 0  # whole stages on each pod
        assert config.load.enforce_eager  # stages refuse CUDA graphs (worker/pipeline_checks.py)
    assert (worker.master_addr, worker.master_port) == (leader.master_addr, leader.master_port)


def drain_seconds(container: dict, config: ClusterConfig) -> float:
    """Longest stop of the container: its preStop sleep, then tpserve's drain (launch/shutdown.py) with
    the container's own --shutdown-grace-seconds."""
    pre_stop = container.get("lifecycle", {}).get("preStop", {}).get("sleep", {}).get("seconds", 0)
    return pre_stop + config.server.shutdown_grace_seconds + NODES_GOODBYE_SECONDS + WORKER_EXIT_SECONDS


def test_api_pods_have_grpc_probes_metrics_annotations_and_a_drain_grace(rendered) -> None:
    _, docs = rendered
    for role, template, lws_env in pod_templates(docs):
        spec = template["spec"]
        (container,) = spec["containers"]
        config = parse_container(container, lws_env)
        # The kubelet kills the container when the grace ends: every drain must fit, preStop included.
        assert spec["terminationGracePeriodSeconds"] > drain_seconds(container, config)
        assert spec["enableServiceLinks"] is False
        if role == "worker":
            continue
        # The probes reach the health port, which answers while the public port is at its
        # connection cap (docs/design/faults.md, "Silent connections"), and which the container runs with.
        health_port = config.server.health_port
        assert health_port == 50052 and {"name": "health", "containerPort": 50052} in container["ports"]
        for probe in ("startupProbe", "readinessProbe"):  # the service "": SERVING once every rank has loaded
            assert container[probe]["grpc"] == {"port": health_port}, probe
        # Liveness never asks the readiness service: that one is NOT_SERVING while the group restarts (a lost
        # worker pod, a rank), and the kubelet would restart the leader and drop the requests it holds.
        liveness = container["livenessProbe"]["grpc"]
        assert liveness == {"port": health_port, "service": LIVENESS_SERVICE}
        assert liveness.get("service", "") not in ("", GENERATION_SERVICE)
        startup = container["startupProbe"]
        # Ranks may take --worker-start-timeout-seconds to load: the startup probe must wait longer (then the model loads).
        assert startup["periodSeconds"] * startup["failureThreshold"] > config.server.worker_start_timeout_seconds
        # A restart of the group loads every rank again: where loading was given longer than the default,
        # the leader holds its requests that long too.
        if config.server.worker_start_timeout_seconds > DEFAULT_START_TIMEOUT_S:
            assert config.server.worker_recovery_timeout_seconds >= config.server.worker_start_timeout_seconds
        annotations = template["metadata"]["annotations"]
        assert annotations["prometheus.io/scrape"] == "true" and annotations["prometheus.io/port"] == "9400"
        assert template["metadata"]["labels"]["tpserve.io/role"] == "api"


def test_services_select_only_api_pods_and_a_budget_covers_every_pod(rendered) -> None:
    _, docs = rendered
    services = {doc["metadata"]["name"]: doc for doc in by_kind(docs, "Service")
                if doc["metadata"]["labels"]["app"] == "tpserve"}  # not the gateway's
    assert services["tpserve-replicas"]["spec"]["clusterIP"] == "None"  # DNS gives every replica's address
    assert "clusterIP" not in services["tpserve"]["spec"]
    for service in services.values():
        assert service["spec"]["selector"] == {"app": "tpserve", "tpserve.io/role": "api"}
    (budget,) = by_kind(docs, "PodDisruptionBudget")
    assert budget["spec"]["selector"]["matchLabels"] == {"app": "tpserve"} and budget["spec"]["maxUnavailable"] == 1
    for _, template, _ in pod_templates(docs):
        assert template["metadata"]["labels"]["app"] == "tpserve"


def test_no_object_names_a_namespace(rendered) -> None:
    # docs/kubernetes.md: `kubectl apply -n NAMESPACE -k OVERLAY` puts everything in NAMESPACE; kubectl refuses
    # an object whose metadata.namespace differs ("the namespace from the provided object ... does not match").
    _, docs = rendered
    assert [(d["kind"], d["metadata"]["name"]) for d in docs if "namespace" in d["metadata"]] == []


def test_multi_host_pods_share_a_cluster_secret_and_only_the_set_reaches_their_group_ports(rendered) -> None:
    overlay, docs = rendered
    if LAYOUTS[overlay][1] is None:
        assert not by_kind(docs, "NetworkPolicy")
        return
    # Every pod of a group, leader and workers, reads the same Secret (docs/cluster.md, "Give the group a secret").
    for role, template, lws_env in pod_templates(docs):
        if role == "single-host":
            continue
        spec = template["spec"]
        (container,) = spec["containers"]
        path = parse_container(container, lws_env).parallel.cluster_secret_file
        assert path == f"{SECRET_DIR}/secret", role
        (mount,) = [m for m in container["volumeMounts"] if m["mountPath"] == SECRET_DIR]
        assert mount.get("readOnly") is True
        (volume,) = [v for v in spec["volumes"] if v["name"] == mount["name"]]
        assert volume["secret"] == {"secretName": "tpserve-cluster-secret", "defaultMode": 0o400}
    (policy,) = by_kind(docs, "NetworkPolicy")
    (lws,) = by_kind(docs, "LeaderWorkerSet")
    template = lws["spec"]["leaderWorkerTemplate"]
    group_labels = policy["spec"]["podSelector"]["matchLabels"]
    for pod in (template["leaderTemplate"], template["workerTemplate"]):  # it covers every pod of the set
        assert group_labels.items() <= pod["metadata"]["labels"].items()
    for _, pod, _ in pod_templates(docs):  # and no single-host pod
        if pod["metadata"]["labels"].get("tpserve.io/group") == "single-host":
            assert not group_labels.items() <= pod["metadata"]["labels"].items()
    assert policy["spec"]["policyTypes"] == ["Ingress"]
    peers, public = policy["spec"]["ingress"]
    # The set's own pods: every port (the TCPStore and gloo/NCCL's ephemeral ports take no credentials).
    assert peers == {"from": [{"podSelector": {"matchLabels": group_labels}}]}
    # Anyone else: the leader's API, health and /metrics ports alone, never the registry, store or rank ports.
    leader = parse_container(template["leaderTemplate"]["spec"]["containers"][0],
                             {"LWS_GROUP_SIZE": "2", "LWS_WORKER_INDEX": "0", "LWS_LEADER_ADDRESS": "x"})
    assert "from" not in public
    assert {p["port"] for p in public["ports"]} == {leader.server.port, leader.server.health_port,
                                                     leader.server.metrics_port} == {50051, 50052, 9400}
    assert leader.parallel.master_port == 29500  # the registry; 29501 the store; 29502+ the ranks: peers only
