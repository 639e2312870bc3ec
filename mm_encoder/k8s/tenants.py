"""`render-k8s` with tenants (`tenants.header`, docs/tenants.md): the frontend reads the tenant key from
the Secret `<graph>-tenant-key` (key `tenant.key`), mounted read-only; the operator creates it once and
gives every model cluster whose tenants share an encoder site's entries the same one."""

from __future__ import annotations

from typing import Any

from ..graph.planned import ComponentPlan
from .names import TENANT_DIR, TENANT_FILE, K8sNames

VOLUME = "tenant-key"
SECRET_MODE = 0o400  # the kubelet adds group read for the pod's fsGroup: 0440 (security.tenants accepts it)


def secret_name(names: K8sNames) -> str:
    return f"{names.g.name}-tenant-key"


def add_to_pod(names: K8sNames, cp: ComponentPlan, container: dict[str, Any], spec: dict[str, Any]) -> None:
    """With tenants: the frontend's key from the graph's Secret, at TENANT_DIR."""
    if cp.kind != "frontend" or not names.g.tenants.header:
        return
    container.setdefault("volumeMounts", []).append({"name": VOLUME, "mountPath": TENANT_DIR, "readOnly": True})
    spec.setdefault("volumes", []).append({"name": VOLUME, "secret": {
        "secretName": secret_name(names), "defaultMode": SECRET_MODE,
        "items": [{"key": TENANT_FILE, "path": TENANT_FILE}]}})


def note(names: K8sNames) -> str:
    """What the operator provides for tenants: the Secret, and the gateway that sets the header."""
    header = names.g.tenants.header
    if not header:
        return ""
    return (f" Tenants: the frontend takes each request's tenant from the {header} header, which the operator's "
            f"gateway must set (and strip from clients); the Secret {secret_name(names)} (key tenant.key: at least "
            "32 random bytes, the same in every model cluster whose tenants share the encoder site's entries) "
            "is the operator's to create.")
