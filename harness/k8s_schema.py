"""The part of the Dynamo operator's v1beta1 DynamoGraphDeployment schema that `render-k8s` emits,
written by hand from the CRD's openAPIV3Schema, plus a small checker (jsonschema is not installed); and
the other objects it emits beside it: NetworkPolicies and PodDisruptionBudgets, and for a graph with
`tls.issuer` cert-manager Certificates and approver-policy's CertificateRequestPolicies (below, with sources).

Source: ai-dynamo/dynamo `deploy/operator/config/crd/bases/nvidia.com_dynamographdeployments.yaml`
(stored version at commit 01cc1c3b677b20c5dd72d9eb76962dc04b55b8be, `versions[name=v1beta1]`), read with
the Go types it is generated from: `deploy/operator/api/v1beta1/dynamographdeployment_types.go`
(0fddc01b37244c4cfa5bcfd1c2e4f1a577ee833c), `dynamocomponentdeployment_types.go`
(006b6e1085b60436ba0f77378749ec3a0f01fc24), `common.go` (02911c80e47b443a6bae0741b9fd2ceb6883b47d, the
`type` enum), and the published v1.6.x API reference (docs.nvidia.com/dynamo/v1.6.2, DCD Reference).

Stricter than the CRD on purpose: every object here lists only the properties we may emit and refuses any
other (`additionalProperties: False`), so a misspelled or unplanned field fails. Each listed property,
type, enum, pattern and `required` is the CRD's; to emit a new field, copy its definition from the CRD
first. Pod and container fields are the CRD's embedded core/v1 schemas, cut to what we use.
"""

from __future__ import annotations

import re
from typing import Any

_NUM = r"(([0-9]+(\.[0-9]*)?)|(\.[0-9]+))"
QUANTITY = rf"^(\+|-)?{_NUM}(([KMGTPE]i)|[numkMGTPE]|([eE](\+|-)?{_NUM}))?$"  # the CRD's resource.Quantity pattern
STR: dict[str, Any] = {"type": "string"}
STR_MAP: dict[str, Any] = {"type": "object", "additionalProperties": STR}
STR_LIST: dict[str, Any] = {"type": "array", "items": STR}
QUANTITY_VALUE: dict[str, Any] = {"type": "int-or-string", "pattern": QUANTITY}
QUANTITY_MAP: dict[str, Any] = {"type": "object", "additionalProperties": QUANTITY_VALUE}


def obj(properties: dict[str, Any], required: tuple[str, ...] = ()) -> dict[str, Any]:
    return {"type": "object", "properties": properties, "required": list(required), "additionalProperties": False}


def listmap(item: dict[str, Any], key: str = "name", max_items: int | None = None) -> dict[str, Any]:
    """`x-kubernetes-list-type: map`: entries unique by `key`."""
    out = {"type": "array", "items": item, "listMapKey": key}
    return out | ({"maxItems": max_items} if max_items else {})


ENV_VAR = obj({"name": STR, "value": STR}, ("name",))
VOLUME_MOUNT = obj({"name": STR, "mountPath": STR, "readOnly": {"type": "boolean"}, "subPath": STR},
                   ("mountPath", "name"))
CONTAINER_PORT = obj({"name": STR, "containerPort": {"type": "integer"},
                      "protocol": {"type": "string"}}, ("containerPort",))
RESOURCES = obj({"limits": QUANTITY_MAP, "requests": QUANTITY_MAP})
INT: dict[str, Any] = {"type": "integer"}
INT_OR_STR: dict[str, Any] = {"type": "int-or-string"}
# core/v1 Probe (the CRD's embedded copy): one handler, and its timing. `scheme` is HTTP or HTTPS.
PROBE = obj({
    "exec": obj({"command": STR_LIST}),
    "httpGet": obj({"path": STR, "port": INT_OR_STR, "host": STR,
                    "scheme": {"type": "string", "enum": ["HTTP", "HTTPS"]}}, ("port",)),
    "tcpSocket": obj({"port": INT_OR_STR, "host": STR}, ("port",)),
    **{k: INT for k in ("initialDelaySeconds", "periodSeconds", "timeoutSeconds", "failureThreshold",
                        "successThreshold")},
})
# core/v1 Lifecycle: the preStop hook, an exec command (what a drain uses).
LIFECYCLE = obj({"preStop": obj({"exec": obj({"command": STR_LIST})})})
CONTAINER = obj({
    "name": STR, "image": STR, "command": STR_LIST, "args": STR_LIST,
    "env": listmap(ENV_VAR), "ports": {"type": "array", "items": CONTAINER_PORT},
    "resources": RESOURCES, "volumeMounts": listmap(VOLUME_MOUNT, "mountPath"),
    "livenessProbe": PROBE, "readinessProbe": PROBE, "startupProbe": PROBE, "lifecycle": LIFECYCLE,
}, ("name",))
VOLUME = obj({
    "name": STR,
    "emptyDir": obj({"medium": STR, "sizeLimit": QUANTITY_VALUE}),
    "persistentVolumeClaim": obj({"claimName": STR, "readOnly": {"type": "boolean"}}, ("claimName",)),
    "secret": obj({"secretName": STR, "defaultMode": INT, "optional": {"type": "boolean"}}),  # SecretVolumeSource
}, ("name",))
POD_SECURITY_CONTEXT = obj({name: {"type": "integer"} for name in ("runAsUser", "runAsGroup", "fsGroup")}
                           | {"runAsNonRoot": {"type": "boolean"}})
_LABEL_SELECTOR = obj({"matchLabels": STR_MAP})
# core/v1 TopologySpreadConstraint (listMapKey topologyKey + whenUnsatisfiable), cut to what we set.
TOPOLOGY_SPREAD = obj({"maxSkew": {"type": "integer", "minimum": 1}, "topologyKey": STR,
                       "whenUnsatisfiable": {"type": "string", "enum": ["DoNotSchedule", "ScheduleAnyway"]},
                       "labelSelector": _LABEL_SELECTOR}, ("maxSkew", "topologyKey", "whenUnsatisfiable"))
POD_TEMPLATE = obj({
    "metadata": obj({"labels": STR_MAP, "annotations": STR_MAP}),
    "spec": obj({
        "securityContext": POD_SECURITY_CONTEXT,
        "initContainers": listmap(CONTAINER),
        "containers": listmap(CONTAINER),
        "volumes": listmap(VOLUME),
        "terminationGracePeriodSeconds": {"type": "integer", "minimum": 0},
        "topologySpreadConstraints": {"type": "array", "items": TOPOLOGY_SPREAD},
    }, ("containers",)),
})
COMPONENT = obj({
    "name": {"type": "string", "minLength": 1, "maxLength": 63, "pattern": r"^[A-Za-z0-9]([-A-Za-z0-9]*[A-Za-z0-9])?$"},
    "type": {"type": "string", "enum": ["frontend", "worker", "prefill", "decode", "planner", "epp"]},
    "replicas": {"type": "integer", "minimum": 0},
    "runtimeVersionOverride": {"type": "string",
                               "pattern": r"^(0|[1-9][0-9]{0,3})\.(0|[1-9][0-9]{0,3})\.(0|[1-9][0-9]{0,3})$"},
    "podTemplate": POD_TEMPLATE,
    "scalingAdapter": obj({}),  # a marker object (v1beta1 `ScalingAdapter struct{}`): HPA, KEDA or a planner scale it
}, ("name",))
DYNAMO_GRAPH_DEPLOYMENT = obj({
    "apiVersion": {"const": "nvidia.com/v1beta1"},
    "kind": {"const": "DynamoGraphDeployment"},
    "metadata": obj({"name": STR, "labels": STR_MAP, "annotations": STR_MAP}, ("name",)),
    "spec": obj({"components": listmap(COMPONENT, max_items=25), "env": listmap(ENV_VAR),
                 "labels": STR_MAP, "annotations": STR_MAP}),
}, ("apiVersion", "kind", "metadata", "spec"))

# Kubernetes' networking.k8s.io/v1 NetworkPolicy (the API reference, v1.25+: `endPort` is GA), cut to what we emit.
_PEER = obj({"podSelector": _LABEL_SELECTOR, "namespaceSelector": _LABEL_SELECTOR,
             "ipBlock": obj({"cidr": STR, "except": STR_LIST}, ("cidr",))})  # an encoder site's door
_POLICY_PORT = obj({"protocol": {"type": "string", "enum": ["TCP", "UDP", "SCTP"]}, "port": INT_OR_STR,
                    "endPort": INT})
NETWORK_POLICY = obj({
    "apiVersion": {"const": "networking.k8s.io/v1"},
    "kind": {"const": "NetworkPolicy"},
    "metadata": obj({"name": STR, "labels": STR_MAP}, ("name",)),
    "spec": obj({
        "podSelector": _LABEL_SELECTOR,
        "policyTypes": {"type": "array", "items": {"type": "string", "enum": ["Ingress", "Egress"]}},
        "ingress": {"type": "array", "items": obj({"from": {"type": "array", "items": _PEER},
                                                   "ports": {"type": "array", "items": _POLICY_PORT}})},
    }, ("podSelector",)),
}, ("apiVersion", "kind", "metadata", "spec"))

# cert-manager's cert-manager.io/v1 Certificate (its API reference: CertificateSpec), cut to what we emit; no CRD
# file here, so this is its structure: the required secretName and issuerRef, and the enums of what we set.
CERTIFICATE = obj({
    "apiVersion": {"const": "cert-manager.io/v1"},
    "kind": {"const": "Certificate"},
    "metadata": obj({"name": STR, "labels": STR_MAP}, ("name",)),
    "spec": obj({
        "secretName": STR,
        "commonName": {"type": "string", "minLength": 1, "maxLength": 64},
        "subject": obj({"organizations": STR_LIST, "organizationalUnits": STR_LIST}),
        "duration": STR,  # a Go duration (metav1.Duration)
        "renewBefore": STR,
        "dnsNames": STR_LIST,
        "ipAddresses": STR_LIST,  # an encoder site's LoadBalancer address (render-k8s --site-host IP)
        "uris": STR_LIST,
        "usages": {"type": "array", "items": {"type": "string", "enum": [
            "signing", "digital signature", "content commitment", "key encipherment", "key agreement",
            "data encipherment", "cert sign", "crl sign", "encipher only", "decipher only", "any", "server auth",
            "client auth", "code signing", "email protection", "s/mime", "ipsec end system", "ipsec tunnel",
            "ipsec user", "timestamping", "ocsp signing", "microsoft sgc", "netscape sgc"]}},
        "privateKey": obj({"algorithm": {"type": "string", "enum": ["RSA", "ECDSA", "Ed25519"]}, "size": INT,
                           "encoding": {"type": "string", "enum": ["PKCS1", "PKCS8"]}}),
        "issuerRef": obj({"name": STR, "kind": {"type": "string", "enum": ["Issuer", "ClusterIssuer"]},
                          "group": STR}, ("name",)),
    }, ("secretName", "issuerRef")),
}, ("apiVersion", "kind", "metadata", "spec"))

# Kubernetes' policy/v1 PodDisruptionBudget (the API reference), cut to what we emit.
POD_DISRUPTION_BUDGET = obj({
    "apiVersion": {"const": "policy/v1"},
    "kind": {"const": "PodDisruptionBudget"},
    "metadata": obj({"name": STR, "labels": STR_MAP}, ("name",)),
    "spec": obj({"maxUnavailable": INT_OR_STR, "minAvailable": INT_OR_STR, "selector": _LABEL_SELECTOR}),
}, ("apiVersion", "kind", "metadata", "spec"))

# cert-manager approver-policy's policy.cert-manager.io/v1alpha1 CertificateRequestPolicy (cluster-scoped), from its
# Go types: cert-manager/approver-policy `pkg/apis/policy/v1alpha1/types_certificaterequestpolicy.go` at commit
# 0661b2f5dadcffdd929d86dda23a804e042dcb53, cut to what we emit. Allowed strings take `value`/`values`, `required`
# and CEL `validations`; an omitted `allowed` field means the request must leave it empty.
_ALLOWED_STRING = obj({"value": STR, "required": {"type": "boolean"}})
_ALLOWED_STRINGS = obj({"values": STR_LIST, "required": {"type": "boolean"}})
CERTIFICATE_REQUEST_POLICY = obj({
    "apiVersion": {"const": "policy.cert-manager.io/v1alpha1"},
    "kind": {"const": "CertificateRequestPolicy"},
    "metadata": obj({"name": STR, "labels": STR_MAP}, ("name",)),
    "spec": obj({
        "allowed": obj({
            "commonName": _ALLOWED_STRING, "dnsNames": _ALLOWED_STRINGS, "ipAddresses": _ALLOWED_STRINGS,
            "uris": _ALLOWED_STRINGS,
            "usages": CERTIFICATE["properties"]["spec"]["properties"]["usages"],
            "subject": obj({"organizations": _ALLOWED_STRINGS, "organizationalUnits": _ALLOWED_STRINGS}),
        }),
        "constraints": obj({
            "maxDuration": STR,
            "privateKey": obj({"algorithm": {"type": "string", "enum": ["RSA", "ECDSA", "Ed25519"]},
                               "minSize": INT, "maxSize": INT}),
        }),
        "selector": obj({
            "issuerRef": obj({"name": STR, "kind": STR, "group": STR}),
            "namespace": obj({"matchNames": STR_LIST, "matchLabels": STR_MAP}),
        }),
    }, ("selector",)),
}, ("apiVersion", "kind", "metadata", "spec"))

_TYPES = {"object": dict, "array": list, "string": str, "boolean": bool, "int-or-string": (int, str)}


def errors(value: Any, schema: dict[str, Any], path: str = "$") -> list[str]:
    """Every place `value` breaks `schema`, by path (empty: it conforms)."""
    out: list[str] = []
    if "const" in schema and value != schema["const"]:
        return [f"{path}: {value!r} is not {schema['const']!r}"]
    kind = schema.get("type")
    if kind == "integer":
        if type(value) is not int:
            return [f"{path}: {value!r} is not an integer"]
    elif kind and (not isinstance(value, _TYPES[kind]) or (isinstance(value, bool) and kind != "boolean")):
        return [f"{path}: {type(value).__name__} is not {kind}"]
    if "enum" in schema and value not in schema["enum"]:
        out.append(f"{path}: {value!r} is not one of {schema['enum']}")
    if isinstance(value, str):
        if "pattern" in schema and not re.search(schema["pattern"], value):
            out.append(f"{path}: {value!r} does not match {schema['pattern']}")
        if not schema.get("minLength", 0) <= len(value) <= schema.get("maxLength", len(value)):
            out.append(f"{path}: length {len(value)} out of bounds")
    if isinstance(value, int) and "minimum" in schema and value < schema["minimum"]:
        out.append(f"{path}: {value} < {schema['minimum']}")
    if isinstance(value, dict):
        props, extra = schema.get("properties", {}), schema.get("additionalProperties", True)
        out += [f"{path}: missing required {k!r}" for k in schema.get("required", []) if k not in value]
        for k, v in value.items():
            if k in props:
                out += errors(v, props[k], f"{path}.{k}")
            elif extra is False:
                out.append(f"{path}: unknown field {k!r}")
            elif isinstance(extra, dict):
                out += errors(v, extra, f"{path}.{k}")
    if isinstance(value, list):
        if len(value) > schema.get("maxItems", len(value)):
            out.append(f"{path}: more than {schema['maxItems']} items")
        key = schema.get("listMapKey")
        if key:
            keys = [v.get(key) for v in value if isinstance(v, dict)]
            out += [f"{path}: duplicate {key} {k!r}" for k in {k for k in keys if keys.count(k) > 1}]
        for i, v in enumerate(value):
            out += errors(v, schema.get("items", {}), f"{path}[{i}]")
    return out
