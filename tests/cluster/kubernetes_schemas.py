"""`python -m tests.cluster.kubernetes_schemas`: regenerate iwg_operator/api/kubernetes_schemas.json.

Starts etcd and kube-apiserver (the pinned test binaries), reads `/openapi/v3/api/v1` and writes the schemas
of the Kubernetes types a group embeds (iwg_operator.api.embedded). `make crds` afterwards puts them in the
CRD. tests/cluster/test_kubernetes_schemas.py fails when the checked-in file drifts from the live server.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

from iwg_operator.api import embedded

from tests.cluster.control_plane import ControlPlane

OPENAPI_PATH = "/openapi/v3/api/v1"
TARGET = Path(__file__).resolve().parents[2] / "operator" / "iwg_operator" / "api" / embedded.SCHEMA_FILE


def source(control_plane: ControlPlane) -> str:
    version = json.loads(control_plane.kubectl("get", "--raw", "/version").stdout)["gitVersion"]
    return f"kube-apiserver {version} {OPENAPI_PATH}"


def fetch(control_plane: ControlPlane) -> dict[str, Any]:
    document: dict[str, Any] = json.loads(control_plane.kubectl("get", "--raw", OPENAPI_PATH).stdout)
    return document


def generated(control_plane: ControlPlane) -> str:
    return embedded.render(embedded.extract_all(fetch(control_plane)), source(control_plane))


def main() -> int:
    control_plane = ControlPlane(name="iwg-schemas").start()
    try:
        TARGET.write_text(generated(control_plane))
    finally:
        control_plane.stop()
    print(f"wrote {TARGET}; run `make crds`")
    return 0


if __name__ == "__main__":
    sys.exit(main())
