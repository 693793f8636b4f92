"""`iwg-operator`: run the operator (Kopf, standalone) with its handlers and an optional metrics endpoint.

With `--leader-elect` (the chart's replicas run so) only the replica holding the Lease runs Kopf; the others
stand by (iwg_operator.leader).

The Helm chart's arguments (helm/iwg-operator/templates/_args.tpl) are this parser's.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys

# Kopf imports the official client's generated models whenever the `kubernetes` package is importable (about
# 40 MB of resident memory), only to accept them as arguments. This operator passes plain dicts and reads its
# credentials itself (iwg_operator.credentials), so its process keeps the package out.
sys.modules.setdefault("kubernetes", None)  # type: ignore[arg-type]

import kopf  # noqa: E402

from iwg_operator import leader, metrics  # noqa: E402

LOG_LEVELS = ("debug", "info", "warning", "error")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="iwg-operator", description="Run the InferenceWorkerGroup operator."
    )
    scope = parser.add_mutually_exclusive_group()
    scope.add_argument(
        "-n", "--namespace", action="append", default=[], help="handle this namespace (repeatable)"
    )
    scope.add_argument("-A", "--all-namespaces", action="store_true", help="handle all namespaces (default)")
    parser.add_argument(
        "--standalone", action="store_true", help="no peering (always the case; accepted for clarity)"
    )
    parser.add_argument(
        "--liveness", default=None, help="liveness endpoint, e.g. http://0.0.0.0:8080/healthz"
    )
    parser.add_argument(
        "--metrics-port",
        type=int,
        default=None,
        help="serve Prometheus metrics on this port (or IWG_METRICS_PORT)",
    )
    parser.add_argument("--log-level", choices=LOG_LEVELS, default="info", help="log level (default: info)")
    election = parser.add_argument_group("leader election (two or more replicas, one active)")
    election.add_argument(
        "--leader-elect",
        action="store_true",
        help="run Kopf only while holding a coordination.k8s.io Lease; stand by otherwise",
    )
    election.add_argument(
        "--leader-elect-namespace",
        default=None,
        help="the Lease's namespace (default: IWG_OPERATOR_NAMESPACE, else iwg-system)",
    )
    election.add_argument(
        "--leader-elect-lease-name", default=leader.DEFAULT_LEASE_NAME, help="the Lease's name"
    )
    election.add_argument(
        "--leader-elect-identity",
        default=None,
        help="this candidate's holderIdentity (default: IWG_OPERATOR_POD_NAME, else host name and a UUID)",
    )
    return parser.parse_args(argv)


def election_config(args: argparse.Namespace) -> leader.ElectionConfig:
    namespace = args.leader_elect_namespace or os.environ.get("IWG_OPERATOR_NAMESPACE") or "iwg-system"
    return leader.ElectionConfig(
        namespace=namespace,
        name=args.leader_elect_lease_name,
        identity=args.leader_elect_identity or leader.default_identity(),
    )


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    kopf.configure(verbose=args.log_level == "debug", quiet=args.log_level in ("warning", "error"))
    logging.getLogger().setLevel(args.log_level.upper())
    if args.log_level != "debug":
        # One line per handled pod event is noise at scale; the operator's own logs and Events say what it did.
        logging.getLogger("kopf.objects").setLevel(logging.WARNING)
    port = metrics.port_from_env(args.metrics_port)
    if port is not None:
        metrics.serve(port)
    election = None
    if args.leader_elect:
        # Standing by: nothing but the Lease is read, nothing at all is written, no handler is registered.
        election = leader.Election(election_config(args)).start()
        standby = leader.serve_standby_liveness(args.liveness, election) if args.liveness else None
        election.leading.wait()
        if standby is not None:
            standby.shutdown()
            standby.server_close()  # Kopf's liveness endpoint takes the address over
    import iwg_operator.handlers  # noqa: F401  (registers the handlers)

    try:
        kopf.run(
            standalone=True,
            clusterwide=not args.namespace,
            namespaces=args.namespace,
            liveness_endpoint=args.liveness,
        )
    finally:
        if election is not None:
            election.release()  # a graceful stop hands over at once


if __name__ == "__main__":
    main()
