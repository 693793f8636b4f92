"""Cluster DNS for the node agent's pods: a real DNS server (dnslib) answering from the API's objects.

Names follow the Kubernetes DNS specification, as CoreDNS serves them:
  <service>.<ns>.svc.<domain>              headless: ready endpoint addresses (all with
                                           publishNotReadyAddresses); ClusterIP: see below
  <hostname>.<service>.<ns>.svc.<domain>   per-pod names of a headless Service's endpoints
  <a-b-c-d>.<ns>.pod.<domain>              pod addresses
There is no kube-proxy here, so a ClusterIP Service resolves to its ready endpoints' pod addresses (what
kube-proxy would forward to); while none is ready it resolves to the endpoints that exist, so a client that
must connect first (workers dialling their driver) finds it, as it would through a ClusterIP.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from dnslib import QTYPE, RCODE, RR, A, DNSRecord
from dnslib.server import BaseResolver, DNSHandler, DNSLogger, DNSServer

log = logging.getLogger("nodeagent.dns")

CLUSTER_DOMAIN = "cluster.local"
SERVICE_NAME_LABEL = "kubernetes.io/service-name"

Obj = dict[str, Any]


def _endpoint_ready(endpoint: Obj) -> bool:
    # The EndpointSlice API: an unset `ready` condition means ready.
    return (endpoint.get("conditions") or {}).get("ready") is not False


def build_table(
    services: Iterable[Obj], slices: Iterable[Obj], pods: Iterable[Obj], domain: str = CLUSTER_DOMAIN
) -> dict[str, tuple[str, ...]]:
    """Pure: fully qualified name (lower case, no trailing dot) -> IPv4 addresses."""
    table: dict[str, list[str]] = {}

    def add(name: str, address: str) -> None:
        entries = table.setdefault(name.lower(), [])
        if address not in entries:
            entries.append(address)

    slices_by_service: dict[tuple[str, str], list[Obj]] = {}
    for endpoint_slice in slices:
        meta = endpoint_slice["metadata"]
        service = (meta.get("labels") or {}).get(SERVICE_NAME_LABEL)
        if service and endpoint_slice.get("addressType", "IPv4") == "IPv4":
            slices_by_service.setdefault((meta["namespace"], service), []).append(endpoint_slice)

    for service in services:
        meta, spec = service["metadata"], service.get("spec") or {}
        namespace, name = meta["namespace"], meta["name"]
        fqdn = f"{name}.{namespace}.svc.{domain}"
        headless = spec.get("clusterIP") == "None"
        publish_not_ready = bool(spec.get("publishNotReadyAddresses"))
        ready: list[tuple[str, str | None]] = []
        other: list[tuple[str, str | None]] = []
        for endpoint_slice in slices_by_service.get((namespace, name), []):
            for endpoint in endpoint_slice.get("endpoints") or []:
                target = ready if (publish_not_ready or _endpoint_ready(endpoint)) else other
                for address in endpoint.get("addresses") or []:
                    target.append((address, endpoint.get("hostname")))
        chosen = ready if (headless or ready) else other
        for address, hostname in chosen:
            add(fqdn, address)
            if headless and hostname:
                add(f"{hostname}.{fqdn}", address)
        if not chosen:
            table.setdefault(fqdn.lower(), [])  # the name exists, without addresses yet

    for pod in pods:
        status = pod.get("status") or {}
        address = status.get("podIP")
        if address and ":" not in address:
            add(f"{address.replace('.', '-')}.{pod['metadata']['namespace']}.pod.{domain}", address)
    return {name: tuple(addresses) for name, addresses in table.items()}


@dataclass
class DnsTable:
    """The current answers; swapped whole, so the server threads never see a half-built table."""

    entries: Mapping[str, tuple[str, ...]] = field(default_factory=dict)
    domain: str = CLUSTER_DOMAIN
    lock: threading.Lock = field(default_factory=threading.Lock)

    def replace(self, entries: Mapping[str, tuple[str, ...]]) -> None:
        with self.lock:
            self.entries = entries

    def lookup(self, name: str) -> tuple[str, ...] | None:
        """Addresses of a name; None when the name does not exist."""
        with self.lock:
            return self.entries.get(name.lower().rstrip("."))


class ClusterResolver(BaseResolver):  # type: ignore[misc]
    def __init__(self, table: DnsTable, ttl: int = 1) -> None:
        self.table = table
        self.ttl = ttl

    def resolve(self, request: DNSRecord, handler: DNSHandler) -> DNSRecord:
        reply = request.reply()
        qname = str(request.q.qname)
        addresses = self.table.lookup(qname)
        if addresses is None:
            reply.header.rcode = RCODE.NXDOMAIN
            return reply
        if request.q.qtype in (QTYPE.A, QTYPE.ANY):
            for address in addresses:
                reply.add_answer(RR(qname, QTYPE.A, rdata=A(address), ttl=self.ttl))
        return reply


class _QuietLogger(DNSLogger):  # type: ignore[misc]
    def __init__(self) -> None:
        super().__init__(log="-request,-reply,-truncated,-data", prefix=False)


class ClusterDnsServer:
    """UDP and TCP on (address, port), answering from `table`."""

    def __init__(self, table: DnsTable, address: str, port: int = 53) -> None:
        resolver = ClusterResolver(table)
        self._servers = [
            DNSServer(resolver, address=address, port=port, logger=_QuietLogger()),
            DNSServer(resolver, address=address, port=port, tcp=True, logger=_QuietLogger()),
        ]

    def start(self) -> None:
        for server in self._servers:
            server.start_thread()

    def stop(self) -> None:
        for server in self._servers:
            server.stop()
            server.server.server_close()
