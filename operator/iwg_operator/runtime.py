"""Startup wiring for the operator: Kopf settings and the controller, built from the environment."""

from __future__ import annotations

import logging
import os
from datetime import UTC, datetime

import kopf

from iwg_operator import builders, labels
from iwg_operator.controller import Controller
from iwg_operator.credentials import Credentials
from iwg_operator.kube import Connection, KubeApi

# Environment of the operator's own pod (the Helm chart sets them).
ENV_CLUSTER_DOMAIN = "IWG_CLUSTER_DOMAIN"
ENV_OPERATOR_NAMESPACE = "IWG_OPERATOR_NAMESPACE"

# The operator's worker pods (reconciled, probed) and driver pods (the DriverAvailable condition).
POD_SELECTOR = (
    f"{labels.MANAGED_BY}={labels.MANAGER},"
    f"{labels.COMPONENT} in ({labels.COMPONENT_WORKER},{labels.COMPONENT_DRIVER})"
)
# The groups' other children, watched so that one deleted or edited by hand is repaired (handlers.owned_event).
OWNED_KINDS = ("deployments", "services", "configmaps", "secrets", "networkpolicies", "poddisruptionbudgets")
OWNED_SELECTOR = f"{labels.MANAGED_BY}={labels.MANAGER}"


def configure_kopf(settings: kopf.OperatorSettings) -> None:
    # The operator posts its own Events (counted, deduplicated); Kopf's per-handler events would be noise writes.
    settings.posting.enabled = False
    # Watch only the operator's worker and driver pods, filtered by the API server.
    settings.watching.label_selectors["pods"] = POD_SELECTOR
    for plural in OWNED_KINDS:  # and only the operator's children of these kinds
        settings.watching.label_selectors[plural] = OWNED_SELECTOR
    settings.watching.server_timeout = 300
    settings.watching.client_timeout = 330
    # Resources are discovered once; no CRD/namespace scanning (smaller RBAC, fewer requests).
    settings.scanning.disabled = True
    settings.queueing.worker_limit = None
    # A per-object worker keeps the object's last body while it idles: let it go soon (memory at scale).
    settings.queueing.idle_timeout = 1.0
    logging.getLogger("aiohttp.access").setLevel(logging.WARNING)


def build_settings() -> builders.BuildSettings:
    defaults = builders.BuildSettings()
    return builders.BuildSettings(
        cluster_domain=os.environ.get(ENV_CLUSTER_DOMAIN, defaults.cluster_domain),
        operator_namespace=os.environ.get(ENV_OPERATOR_NAMESPACE, defaults.operator_namespace),
    )


def build_controller() -> Controller:
    return Controller(KubeApi(Connection.from_environment()), build_settings())


def login() -> kopf.ConnectionInfo:
    """Kopf's credentials: the same source as the operator's own client (in-cluster or KUBECONFIG).

    Kopf calls it again after a 401 (the token file is then read again) and when an exec plugin's credential
    reaches its expiry."""
    credentials = Credentials.from_environment()
    expires = credentials.expires_at
    return kopf.ConnectionInfo(
        server=credentials.server,
        ca_path=credentials.ca_file,
        insecure=not credentials.verify,
        scheme="Bearer" if credentials.token else None,
        token=credentials.token,
        certificate_path=credentials.cert_file,
        private_key_path=credentials.key_file,
        expiration=datetime.fromtimestamp(expires, UTC) if expires is not None else None,
    )
