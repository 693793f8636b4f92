"""Run the node agent: python -m tests.nodeagent --kubeconfig K --node NAME [--node NAME ...] --workdir D.

SIGTERM or SIGINT: every pod process is killed, the pods and nodes are deleted from the API, and the
network namespaces, veths and the bridge are removed.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import secrets
import signal
from pathlib import Path

from tests.nodeagent import network
from tests.nodeagent.agent import AgentConfig, NodeAgent


def parse_args(argv: list[str] | None = None) -> tuple[AgentConfig, Path | None]:
    parser = argparse.ArgumentParser(prog="python -m tests.nodeagent", description=__doc__)
    parser.add_argument("--kubeconfig", type=Path, required=True)
    parser.add_argument("--node", action="append", required=True, help="node to register (repeatable)")
    parser.add_argument("--workdir", type=Path, required=True)
    parser.add_argument("--gpus", type=int, default=8, help="nvidia.com/gpu capacity per node")
    parser.add_argument("--taint-gpu", action="store_true", help="taint the nodes like the kwok GPU nodes")
    parser.add_argument("--label", action="append", default=[], metavar="K=V")
    parser.add_argument("--env", action="append", default=[], metavar="K=V", help="added to every container")
    parser.add_argument("--ready-file", type=Path, help="written (JSON) once the nodes are Ready")
    parser.add_argument("--restart-backoff", type=float, default=1.0)
    parser.add_argument("--max-restart-backoff", type=float, default=10.0)
    parser.add_argument("--verbose", action="store_true")
    args = parser.parse_args(argv)
    logging.basicConfig(
        level=logging.DEBUG if args.verbose else logging.INFO,
        format="%(asctime)s %(name)s %(levelname)s %(message)s",
    )

    def pairs(items: list[str], flag: str) -> dict[str, str]:
        result = {}
        for item in items:
            key, sep, value = item.partition("=")
            if not sep:
                parser.error(f"{flag} {item!r}: expected K=V")
            result[key] = value
        return result

    config = AgentConfig(
        kubeconfig=args.kubeconfig,
        nodes=args.node,
        workdir=args.workdir,
        token=secrets.token_hex(2),
        gpus_per_node=args.gpus,
        taint_gpu=args.taint_gpu,
        labels=pairs(args.label, "--label"),
        extra_env=pairs(args.env, "--env"),
        restart_backoff_s=args.restart_backoff,
        max_restart_backoff_s=args.max_restart_backoff,
    )
    return config, args.ready_file


async def amain(config: AgentConfig, ready_file: Path | None) -> None:
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    network.sweep_stale_agents()
    agent = NodeAgent(config)
    try:
        await agent.run(ready_file, stop)
    finally:
        await agent.shutdown()


def main(argv: list[str] | None = None) -> None:
    config, ready_file = parse_args(argv)
    config.workdir.mkdir(parents=True, exist_ok=True)
    try:
        asyncio.run(amain(config, ready_file))
    finally:
        network.remove_agent_network(config.token)


if __name__ == "__main__":
    main()
