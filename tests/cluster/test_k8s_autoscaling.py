"""The autoscaling overlays (k8s/overlays/gpu-llama-8b-hpa and -keda; docs/design/observability.md, "Manifests"):
they render,
validate offline, scale the tpserve Deployment, and name only gauges the server exports.

The HorizontalPodAutoscaler and the adapter's ConfigMap are core kinds (``kubernetes-validate``,
strict). KEDA's ScaledObject has no schema in ../shared/k8s-schemas: it is validated against the
models that ``cloudcoil-models-keda`` generates from KEDA's own CRD (their JSON schema, made
strict as test_k8s.py does for the LeaderWorkerSet's, and the pydantic models themselves).
"""

from __future__ import annotations

import functools
import re

import pytest
import yaml

from coordinator.metrics import Metrics
from tests.cluster.k8s import by_kind, render, strict

#: PromQL's metric names (colons allowed) followed by a label selector or a bracket.
METRIC_IN_QUERY = re.compile(r"([a-zA-Z_:][a-zA-Z0-9_:]*)\s*[{\[]")


@functools.cache
def rendered(kind: str) -> tuple[dict, ...]:
    return tuple(render(f"k8s/overlays/gpu-llama-8b-{kind}"))


@functools.cache
def exported_gauges() -> frozenset[str]:
    """The gauge names the coordinator's registry exports (coordinator/metrics.py)."""
    return frozenset(family.name for family in Metrics().registry.collect() if family.type == "gauge")


def tpserve_deployment(docs: tuple[dict, ...]) -> dict:
    (deployment,) = [d for d in by_kind(list(docs), "Deployment") if d["metadata"]["name"] == "tpserve"]
    return deployment


@functools.cache
def adapter_config() -> tuple[dict, ...]:
    """k8s/prometheus-adapter: the adapter's rule, applied in the adapter's namespace, apart from the overlays."""
    return tuple(render("k8s/prometheus-adapter"))


def adapter_rule() -> dict:
    (config_map,) = [d for d in by_kind(list(adapter_config()), "ConfigMap")
                     if d["metadata"]["name"] == "tpserve-prometheus-adapter"]
    (rule,) = yaml.safe_load(config_map["data"]["config.yaml"])["rules"]
    return rule


def custom_metric_name(rule: dict, series: str) -> str | None:
    """The name the adapter serves ``series`` under (its ``name.matches``/``as``; Go's ``${1}``)."""
    match = re.match(rule["name"]["matches"], series)
    return None if match is None else re.sub(r"\$\{(\d+)\}", lambda m: match.group(int(m.group(1))),
                                             rule["name"]["as"])


def series_of(rule: dict) -> set[str]:
    """The series names the rule's seriesQuery selects, from its ``__name__=~"a:(b|c)"`` regex."""
    pattern = re.search(r'__name__=~"([^"]+)"', rule["seriesQuery"]).group(1)
    prefix, alternatives = re.fullmatch(r"([\w:]+)\(([\w|]+)\)", pattern).groups()
    return {prefix + name for name in alternatives.split("|")}


@pytest.mark.parametrize("kind", ["hpa", "keda"])
def test_the_autoscaler_owns_the_replicas_of_the_tpserve_deployment(kind: str) -> None:
    docs = rendered(kind)
    deployment = tpserve_deployment(docs)
    assert "replicas" not in deployment["spec"]  # an apply would otherwise reset the autoscaler's count
    (scaler,) = by_kind(list(docs), "HorizontalPodAutoscaler" if kind == "hpa" else "ScaledObject")
    assert scaler["spec"]["scaleTargetRef"] == {"apiVersion": "apps/v1", "kind": "Deployment", "name": "tpserve"}
    spec = scaler["spec"]
    low, high = (spec["minReplicas"], spec["maxReplicas"]) if kind == "hpa" else \
        (spec["minReplicaCount"], spec["maxReplicaCount"])
    assert (low, high) == (1, 8)
    behavior = spec["behavior"] if kind == "hpa" else spec["advanced"]["horizontalPodAutoscalerConfig"]["behavior"]
    assert behavior["scaleDown"]["policies"] == [{"type": "Pods", "value": 1, "periodSeconds": 120}]  # one drain
    # The same manifests without the component keep their replica count.
    assert tpserve_deployment(tuple(render("k8s/overlays/gpu-llama-8b")))["spec"]["replicas"] == 2


def test_the_hpa_and_the_adapter_config_validate_against_the_kubernetes_schemas() -> None:
    import kubernetes_validate

    docs = rendered("hpa")
    assert {d["kind"] for d in docs} == {"Deployment", "Service", "PodDisruptionBudget", "ServiceAccount", "Role",
                                         "RoleBinding", "PersistentVolumeClaim", "Job", "ConfigMap",
                                         "HorizontalPodAutoscaler"}
    # The overlay's ConfigMap is the model's (model-pvc); the adapter's rule is not applied with it.
    assert [d["metadata"]["name"] for d in by_kind(list(docs), "ConfigMap")] == ["tpserve-model"]
    for doc in docs + adapter_config():
        kubernetes_validate.validate(doc, kubernetes_validate.latest_version(), strict=True)
    (hpa,) = by_kind(list(docs), "HorizontalPodAutoscaler")
    assert hpa["apiVersion"] == "autoscaling/v2"


def test_each_hpa_metric_is_served_by_the_adapter_from_a_gauge_the_server_exports() -> None:
    (hpa,) = by_kind(list(rendered("hpa")), "HorizontalPodAutoscaler")
    rule = adapter_rule()
    served = {custom_metric_name(rule, series): series for series in series_of(rule)}
    assert series_of(rule) <= exported_gauges(), series_of(rule) - exported_gauges()
    targets = {m["pods"]["metric"]["name"]: m["pods"]["target"] for m in hpa["spec"]["metrics"]}
    assert {name: served[name] for name in targets} == {"tpserve_saturation": "tpserve:saturation",
                                                        "tpserve_num_requests_waiting": "tpserve:num_requests_waiting"}
    assert targets["tpserve_saturation"] == {"type": "AverageValue", "averageValue": "800m"}  # 0.8 of a 0-1 gauge
    # Per pod: the adapter maps the series' pod and namespace labels to the pods the HPA averages over.
    assert rule["resources"]["overrides"] == {"namespace": {"resource": "namespace"}, "pod": {"resource": "pod"}}
    assert "<<.GroupBy>>" in rule["metricsQuery"] and "<<.LabelMatchers>>" in rule["metricsQuery"]


@functools.cache
def keda_validator():
    """KEDA's ScaledObject schema (generated from its CRD by cloudcoil-models-keda), strict."""
    import jsonschema

    models = pytest.importorskip("cloudcoil.models.keda.v1alpha1",
                                 reason="cloudcoil-models-keda is not installed (pip install tpserve[test])")
    schema = strict(models.ScaledObject.model_json_schema(by_alias=True))
    return jsonschema.validators.validator_for(schema)(schema)


def test_the_scaled_object_validates_against_kedas_crd_models() -> None:
    import jsonschema

    (scaled,) = by_kind(list(rendered("keda")), "ScaledObject")
    assert scaled["apiVersion"] == "keda.sh/v1alpha1"
    error = jsonschema.exceptions.best_match(keda_validator().iter_errors(scaled))
    assert error is None, f"{error.message} at {'/'.join(map(str, error.absolute_path))}"
    with pytest.raises(jsonschema.ValidationError):  # the strict schema does refuse a misplaced field
        keda_validator().validate({**scaled, "spec": {**scaled["spec"], "minReplicas": 1}})
    from cloudcoil.models.keda.v1alpha1 import ScaledObject

    parsed = ScaledObject.model_validate(scaled)  # the models' own types (integers, strings, nested objects)
    assert parsed.spec.max_replica_count == 8 and [t.type for t in parsed.spec.triggers] == ["prometheus"] * 2


def test_each_keda_trigger_queries_a_gauge_the_server_exports_over_the_deployments_pods() -> None:
    (scaled,) = by_kind(list(rendered("keda")), "ScaledObject")
    thresholds = {}
    for trigger in scaled["spec"]["triggers"]:
        metadata = trigger["metadata"]
        assert set(metadata) == {"serverAddress", "query", "threshold"}  # KEDA's prometheus scaler's fields
        assert metadata["serverAddress"].startswith("http://")
        (metric,) = METRIC_IN_QUERY.findall(metadata["query"].removeprefix("sum("))
        assert metric in exported_gauges(), metric
        assert metadata["query"].startswith("sum(")  # KEDA divides by the replicas: a per-pod threshold
        thresholds[metric] = float(metadata["threshold"])
        pods = re.search(r'pod=~"([^"]+)"', metadata["query"]).group(1)
        assert re.fullmatch(pods, "tpserve-7d9c6b5f8-x2k4q")  # a Deployment's pod
        for other in ("tpserve-multihost-0", "tpserve-multihost-0-1", "tpserve-gateway-5f7d9c8b6-abcde"):
            assert not re.fullmatch(pods, other), other
    # The HPA's targets, so the two components scale alike.
    assert thresholds == {"tpserve:saturation": 0.8, "tpserve:num_requests_waiting": 4.0}


def test_the_adapter_rule_names_no_namespace_so_it_applies_in_the_adapters() -> None:
    # `kubectl apply -n monitoring -k k8s/prometheus-adapter` refuses an object that names another namespace,
    # as `kubectl apply -n NAMESPACE -k` of an overlay would refuse one naming monitoring.
    (config_map,) = adapter_config()
    assert config_map["kind"] == "ConfigMap" and "namespace" not in config_map["metadata"]
    assert config_map["metadata"]["name"] == "tpserve-prometheus-adapter"  # the helm install's rules.existing
