"""Field checks for the custom resources the chart renders, which kubernetes-validate has no
schema for: KEDA's ScaledObject, the Prometheus Operator's ServiceMonitor and PrometheusRule,
and KServe's ServingRuntime.

Each is a small declarative description of the documented fields, at every level the chart
uses: the keys allowed there, their types and the required ones. An unknown key fails, as the
API server's structural schema would prune or reject it. Values of built-in Kubernetes types
inside them (a core Container, a Volume, an HPA behavior) go to kubernetes-validate, strict,
wrapped in the smallest object that holds them.

>>> errors = check({"apiVersion": "monitoring.coreos.com/v1", "kind": "ServiceMonitor",
...                 "metadata": {"name": "m"}, "spec": {"selector": {},
...                 "endpoints": [{"port": "http", "pathh": "/metrics"}]}})
>>> errors
["spec.endpoints[0].pathh: unknown key (did you mean 'path'?)"]
"""

from __future__ import annotations

import difflib
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, TypeAlias

import kubernetes_validate

# The Kubernetes versions the chart claims (Chart.yaml kubeVersion >=1.25), oldest and newest.
KUBE_VERSIONS = ("1.25.0", "1.37.0")


@dataclass(frozen=True)
class Obj:
    """A mapping with these keys only; ``required`` ones must be present."""

    fields: Mapping[str, Spec]
    required: frozenset[str] = field(default_factory=frozenset)


@dataclass(frozen=True)
class ListOf:
    item: Spec


@dataclass(frozen=True)
class MapOf:
    """A free-form mapping (labels, annotations) whose values all match ``value``."""

    value: Spec


@dataclass(frozen=True)
class OneOf:
    """One of these exact values."""

    values: tuple[Any, ...]


@dataclass(frozen=True)
class Switch:
    """A mapping described by ``cases[value[on]]`` (a trigger by its ``type``)."""

    on: str
    cases: Mapping[str, Obj]


@dataclass(frozen=True)
class Core:
    """A value of a built-in Kubernetes type, validated by kubernetes-validate (strict, every
    version in KUBE_VERSIONS) inside the object ``wrap`` builds around it."""

    what: str
    wrap: Callable[[Any], dict[str, Any]]


Spec: TypeAlias = type | tuple[type, ...] | Obj | ListOf | MapOf | OneOf | Switch | Core


def _pod(spec: dict[str, Any]) -> dict[str, Any]:
    return {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "crd-check"}, "spec": spec}


def pod_spec_field(name: str) -> Core:
    """A field that KServe copies from a core PodSpec (``corev1.Volume``, ``[]Toleration``...)."""
    if name == "containers":
        return Core("[]io.k8s.api.core.v1.Container", lambda value: _pod({"containers": value}))
    placeholder = [{"name": "placeholder", "image": "placeholder"}]
    return Core(
        f"io.k8s.api.core.v1.PodSpec.{name}",
        lambda value: _pod({"containers": placeholder, name: value}),
    )


HPA_BEHAVIOR = Core(
    "io.k8s.api.autoscaling.v2.HorizontalPodAutoscalerBehavior",
    lambda value: {
        "apiVersion": "autoscaling/v2",
        "kind": "HorizontalPodAutoscaler",
        "metadata": {"name": "crd-check"},
        "spec": {
            "scaleTargetRef": {"apiVersion": "apps/v1", "kind": "Deployment", "name": "x"},
            "maxReplicas": 1,
            "behavior": value,
        },
    },
)

OBJECT_META = Obj(
    {"name": str, "namespace": str, "labels": MapOf(str), "annotations": MapOf(str)},
    required=frozenset({"name"}),
)
LABEL_SELECTOR = Obj(
    {
        "matchLabels": MapOf(str),
        "matchExpressions": ListOf(
            Obj(
                {
                    "key": str,
                    "operator": OneOf(("In", "NotIn", "Exists", "DoesNotExist")),
                    "values": ListOf(str),
                },
                required=frozenset({"key", "operator"}),
            )
        ),
    }
)


def _resource(api_version: str, kind: str, spec: Obj) -> Obj:
    return Obj(
        {
            "apiVersion": OneOf((api_version,)),
            "kind": OneOf((kind,)),
            "metadata": OBJECT_META,
            "spec": spec,
        },
        required=frozenset({"apiVersion", "kind", "metadata", "spec"}),
    )


_BOOL_STRING = OneOf(("true", "false"))

# KEDA ScaledObject, keda.sh/v1alpha1:
#   https://keda.sh/docs/2.17/reference/scaledobject-spec/
# and the metrics-api trigger's metadata (a map of strings; credentials belong in a
# TriggerAuthentication, so they are not allowed here):
#   https://keda.sh/docs/2.17/scalers/metrics-api/
METRICS_API_METADATA = Obj(
    {
        "url": str,
        "format": OneOf(("json", "xml", "yaml", "prometheus")),
        "valueLocation": str,
        "targetValue": str,
        "activationTargetValue": str,
        "unsafeSsl": _BOOL_STRING,
        "aggregateFromKubeServiceEndpoints": _BOOL_STRING,
        "aggregationType": OneOf(("average", "sum", "max", "min")),
        "authMode": str,
        "method": OneOf(("header", "query")),
        "keyParamName": str,
    },
    required=frozenset({"url", "valueLocation", "targetValue"}),
)


def _trigger(metadata: Obj) -> Obj:
    return Obj(
        {
            "type": str,
            "metadata": metadata,
            "name": str,
            "useCachedMetrics": bool,
            "metricType": OneOf(("AverageValue", "Value", "Utilization")),
            "authenticationRef": Obj(
                {
                    "name": str,
                    "kind": OneOf(("TriggerAuthentication", "ClusterTriggerAuthentication")),
                },
                required=frozenset({"name"}),
            ),
        },
        required=frozenset({"type", "metadata"}),
    )


SCALED_OBJECT = _resource(
    "keda.sh/v1alpha1",
    "ScaledObject",
    Obj(
        {
            "scaleTargetRef": Obj(
                {"apiVersion": str, "kind": str, "name": str, "envSourceContainerName": str},
                required=frozenset({"name"}),
            ),
            "pollingInterval": int,
            "cooldownPeriod": int,
            "initialCooldownPeriod": int,
            "idleReplicaCount": int,
            "minReplicaCount": int,
            "maxReplicaCount": int,
            "fallback": Obj(
                {
                    "failureThreshold": int,
                    "replicas": int,
                    "behavior": OneOf(
                        (
                            "static",
                            "currentReplicas",
                            "currentReplicasIfHigher",
                            "currentReplicasIfLower",
                        )
                    ),
                },
                required=frozenset({"failureThreshold", "replicas"}),
            ),
            "advanced": Obj(
                {
                    "restoreToOriginalReplicaCount": bool,
                    "horizontalPodAutoscalerConfig": Obj({"name": str, "behavior": HPA_BEHAVIOR}),
                    "scalingModifiers": Obj(
                        {
                            "target": str,
                            "activationTarget": str,
                            "metricType": OneOf(("AverageValue", "Value")),
                            "formula": str,
                        },
                        required=frozenset({"target", "formula"}),
                    ),
                }
            ),
            # Only the trigger types the chart renders are described; another fails until it is.
            "triggers": ListOf(Switch("type", {"metrics-api": _trigger(METRICS_API_METADATA)})),
        },
        required=frozenset({"scaleTargetRef", "triggers"}),
    ),
)

# Prometheus Operator ServiceMonitor, monitoring.coreos.com/v1:
#   https://prometheus-operator.dev/docs/api-reference/api/#monitoring.coreos.com/v1.ServiceMonitorSpec
#   https://prometheus-operator.dev/docs/api-reference/api/#monitoring.coreos.com/v1.Endpoint
# (the CRD: example/prometheus-operator-crd/monitoring.coreos.com_servicemonitors.yaml, v0.84).
# Sections the chart does not render (TLS, OAuth2, credentials) are checked as mappings only.
_RELABEL = Obj(
    {
        "action": str,
        "modulus": int,
        "regex": str,
        "replacement": str,
        "separator": str,
        "sourceLabels": ListOf(str),
        "targetLabel": str,
    }
)
SERVICE_MONITOR_ENDPOINT = Obj(
    {
        "authorization": dict,
        "basicAuth": dict,
        "bearerTokenFile": str,
        "bearerTokenSecret": dict,
        "enableHttp2": bool,
        "filterRunning": bool,
        "followRedirects": bool,
        "honorLabels": bool,
        "honorTimestamps": bool,
        "interval": str,
        "metricRelabelings": ListOf(_RELABEL),
        "noProxy": str,
        "oauth2": dict,
        "params": MapOf(ListOf(str)),
        "path": str,
        "port": str,
        "proxyConnectHeader": dict,
        "proxyFromEnvironment": bool,
        "proxyUrl": str,
        "relabelings": ListOf(_RELABEL),
        "scheme": OneOf(("http", "https")),
        "scrapeTimeout": str,
        "targetPort": (int, str),
        "tlsConfig": dict,
        "trackTimestampsStaleness": bool,
    }
)
SERVICE_MONITOR = _resource(
    "monitoring.coreos.com/v1",
    "ServiceMonitor",
    Obj(
        {
            "attachMetadata": Obj({"node": bool}),
            "bodySizeLimit": str,
            "convertClassicHistogramsToNHCB": bool,
            "endpoints": ListOf(SERVICE_MONITOR_ENDPOINT),
            "fallbackScrapeProtocol": str,
            "jobLabel": str,
            "keepDroppedTargets": int,
            "labelLimit": int,
            "labelNameLengthLimit": int,
            "labelValueLengthLimit": int,
            "namespaceSelector": Obj({"any": bool, "matchNames": ListOf(str)}),
            "nativeHistogramBucketLimit": int,
            "nativeHistogramMinBucketFactor": (int, str),
            "podTargetLabels": ListOf(str),
            "sampleLimit": int,
            "scrapeClass": str,
            "scrapeClassicHistograms": bool,
            "scrapeProtocols": ListOf(str),
            "selector": LABEL_SELECTOR,
            "selectorMechanism": OneOf(("RelabelConfig", "RoleSelector")),
            "targetLabels": ListOf(str),
            "targetLimit": int,
        },
        required=frozenset({"endpoints", "selector"}),
    ),
)

# Prometheus Operator PrometheusRule, monitoring.coreos.com/v1:
#   https://prometheus-operator.dev/docs/api-reference/api/#monitoring.coreos.com/v1.PrometheusRuleSpec
#   https://prometheus-operator.dev/docs/api-reference/api/#monitoring.coreos.com/v1.RuleGroup
#   https://prometheus-operator.dev/docs/api-reference/api/#monitoring.coreos.com/v1.Rule
# (the CRD: example/prometheus-operator-crd/monitoring.coreos.com_prometheusrules.yaml, v0.84).
_RULE = Obj(
    {
        "alert": str,
        "record": str,
        "expr": (str, int),
        "for": str,
        "keep_firing_for": str,
        "labels": MapOf(str),
        "annotations": MapOf(str),
    },
    required=frozenset({"expr"}),
)
PROMETHEUS_RULE = _resource(
    "monitoring.coreos.com/v1",
    "PrometheusRule",
    Obj(
        {
            "groups": ListOf(
                Obj(
                    {
                        "name": str,
                        "labels": MapOf(str),
                        "interval": str,
                        "query_offset": str,
                        "limit": int,
                        "partial_response_strategy": str,
                        "rules": ListOf(_RULE),
                    },
                    required=frozenset({"name"}),
                )
            ),
        }
    ),
)

# KServe ServingRuntime, serving.kserve.io/v1alpha1 (ServingRuntimeSpec, with
# ServingRuntimePodSpec inline):
#   https://kserve.github.io/website/docs/reference/crd-api (ServingRuntimeSpec)
#   https://github.com/kserve/kserve/blob/master/pkg/apis/serving/v1alpha1/servingruntime_types.go
_SERVING_RUNTIME_POD_SPEC: dict[str, Spec] = {
    "containers": pod_spec_field("containers"),
    "volumes": pod_spec_field("volumes"),
    "nodeSelector": MapOf(str),
    "affinity": pod_spec_field("affinity"),
    "tolerations": pod_spec_field("tolerations"),
    "labels": MapOf(str),
    "annotations": MapOf(str),
    "imagePullSecrets": pod_spec_field("imagePullSecrets"),
    "hostIPC": bool,
}
SERVING_RUNTIME = _resource(
    "serving.kserve.io/v1alpha1",
    "ServingRuntime",
    Obj(
        {
            **_SERVING_RUNTIME_POD_SPEC,
            "supportedModelFormats": ListOf(
                Obj(
                    {"name": str, "version": str, "autoSelect": bool, "priority": int},
                    required=frozenset({"name"}),
                )
            ),
            "multiModel": bool,
            "disabled": bool,
            "protocolVersions": ListOf(OneOf(("v1", "v2", "grpc-v1", "grpc-v2"))),
            "workerSpec": Obj(
                {
                    **_SERVING_RUNTIME_POD_SPEC,
                    "pipelineParallelSize": int,
                    "tensorParallelSize": int,
                },
                required=frozenset({"containers"}),
            ),
            "grpcEndpoint": str,
            "grpcDataEndpoint": str,
            "httpDataEndpoint": str,
            "replicas": int,
            "storageHelper": Obj({"disabled": bool}),
            "builtInAdapter": Obj(
                {
                    "serverType": str,
                    "runtimeManagementPort": int,
                    "memBufferBytes": int,
                    "modelLoadingTimeoutMillis": int,
                    "env": ListOf(dict),
                }
            ),
        },
        required=frozenset({"containers"}),
    ),
)

CUSTOM_RESOURCES: dict[tuple[str, str], Obj] = {
    ("keda.sh/v1alpha1", "ScaledObject"): SCALED_OBJECT,
    ("monitoring.coreos.com/v1", "ServiceMonitor"): SERVICE_MONITOR,
    ("monitoring.coreos.com/v1", "PrometheusRule"): PROMETHEUS_RULE,
    ("serving.kserve.io/v1alpha1", "ServingRuntime"): SERVING_RUNTIME,
}


def is_custom(doc: Mapping[str, Any]) -> bool:
    """Whether ``doc`` is one of the custom resources described here."""
    return (doc.get("apiVersion"), doc.get("kind")) in CUSTOM_RESOURCES


def check(doc: Mapping[str, Any]) -> list[str]:
    """Every way ``doc`` strays from its description, as ``path: problem`` lines; [] if none."""
    key = (str(doc.get("apiVersion")), str(doc.get("kind")))
    spec = CUSTOM_RESOURCES.get(key)
    if spec is None:
        return [f"{key[0]} {key[1]}: no field description in tests/k8s/crds.py"]
    return check_value(doc, spec, "")


def _type_name(expected: type | tuple[type, ...]) -> str:
    types = expected if isinstance(expected, tuple) else (expected,)
    return " or ".join(t.__name__ for t in types)


def _is_instance(value: Any, expected: type | tuple[type, ...]) -> bool:
    types = expected if isinstance(expected, tuple) else (expected,)
    # YAML's true is no integer here, as it is none to the API server.
    if isinstance(value, bool) and bool not in types:
        return False
    return isinstance(value, types)


def _join(path: str, key: str) -> str:
    return f"{path}.{key}" if path else key


def check_value(value: Any, spec: Spec, path: str) -> list[str]:
    """``value`` against ``spec``; ``path`` names it in the messages."""
    where = path or "<root>"
    if isinstance(spec, (type, tuple)):
        if not _is_instance(value, spec):
            return [f"{where}: expected {_type_name(spec)}, got {type(value).__name__} {value!r}"]
        return []
    if isinstance(spec, OneOf):
        return (
            []
            if value in spec.values
            else [f"{where}: {value!r} is not one of {list(spec.values)}"]
        )
    if isinstance(spec, ListOf):
        if not isinstance(value, list):
            return [f"{where}: expected a list, got {type(value).__name__}"]
        return [
            error
            for i, item in enumerate(value)
            for error in check_value(item, spec.item, f"{path}[{i}]")
        ]
    if isinstance(spec, MapOf):
        if not isinstance(value, dict):
            return [f"{where}: expected a mapping, got {type(value).__name__}"]
        return [
            error
            for k, v in value.items()
            for error in check_value(v, spec.value, _join(path, str(k)))
        ]
    if isinstance(spec, Switch):
        if not isinstance(value, dict):
            return [f"{where}: expected a mapping, got {type(value).__name__}"]
        case = spec.cases.get(str(value.get(spec.on)))
        if case is None:
            return [
                f"{_join(path, spec.on)}: {value.get(spec.on)!r} is not described (known: {sorted(spec.cases)})"
            ]
        return check_value(value, case, path)
    if isinstance(spec, Core):
        return _check_core(value, spec, where)
    return _check_object(value, spec, path)


def _check_object(value: Any, spec: Obj, path: str) -> list[str]:
    where = path or "<root>"
    if not isinstance(value, dict):
        return [f"{where}: expected a mapping, got {type(value).__name__}"]
    errors = [
        f"{_join(path, key)}: required key missing" for key in sorted(spec.required - value.keys())
    ]
    for key, item in value.items():
        if key not in spec.fields:
            near = difflib.get_close_matches(str(key), spec.fields, n=1)
            hint = f" (did you mean {near[0]!r}?)" if near else ""
            errors.append(f"{_join(path, str(key))}: unknown key{hint}")
            continue
        errors.extend(check_value(item, spec.fields[key], _join(path, key)))
    return errors


def _check_core(value: Any, spec: Core, where: str) -> list[str]:
    errors = []
    for version in KUBE_VERSIONS:
        try:
            kubernetes_validate.validate(spec.wrap(value), version, strict=True)
        except kubernetes_validate.ValidationError as error:
            inner = ".".join(str(part) for part in error.path)
            errors.append(
                f"{where}: not a valid {spec.what} for Kubernetes {version} ({inner}: {error.message})"
            )
        except (
            kubernetes_validate.SchemaNotFoundError,
            kubernetes_validate.InvalidSchemaError,
        ) as error:
            errors.append(
                f"{where}: {spec.what} cannot be checked for Kubernetes {version}: {error.message}"
            )
    return errors
