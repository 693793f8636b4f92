"""TCP relays between network namespaces, so that nothing is added to the host's network.

The real nodes and their pods live in network namespaces of their own (tests/realnodes/nodes.py); the
control plane listens on the host's loopback. This process (root, in the host's namespace) creates sockets
in other namespaces by entering them for the one `socket()` call (`setns` is per thread; the loop is
single-threaded), so each relay is a listening socket in one namespace and connections made from another:

  --api-port P --netns PATH ...   in each namespace, 127.0.0.1:P -> the host's 127.0.0.1:P (kubelet,
                                  kube-proxy, CoreDNS and the operator reach the apiserver by the URL and
                                  certificate of the host's kubeconfig)
  --egress SOCKET --egress-netns PATH
                                  an HTTP CONNECT proxy on a unix socket, connecting in that namespace: the
                                  apiserver's egress to kubelets (`kubectl logs`, `exec`, `port-forward`)
  --control SOCKET                a line `NETNS_PATH IP PORT` asks for a relay from the host's loopback to
                                  IP:PORT in that namespace; the answer is the host port (tests reach pods)
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import ctypes
import os
import socket
from pathlib import Path

CONNECT_TIMEOUT_S = 2.0
_HOST_NS = os.open("/proc/self/ns/net", os.O_RDONLY)
_CLONE_NEWNET = 0x40000000
_libc = ctypes.CDLL(None, use_errno=True)


def _setns(fd: int) -> None:
    """setns(2) for a network namespace (os.setns is Python 3.12's)."""
    if _libc.setns(fd, _CLONE_NEWNET) != 0:
        errno = ctypes.get_errno()
        raise OSError(errno, os.strerror(errno))


def socket_in(netns: int | None) -> socket.socket:
    """A TCP socket of the namespace `netns` (an open namespace file; None: this process's own)."""
    if netns is None:
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    else:
        _setns(netns)
        try:
            sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        finally:
            _setns(_HOST_NS)
    sock.setblocking(False)
    return sock


async def _pipe(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    try:
        while data := await reader.read(65536):
            writer.write(data)
            await writer.drain()
    except (ConnectionError, OSError):
        pass
    finally:
        with contextlib.suppress(OSError, RuntimeError):
            writer.close()


async def _relay(
    client_reader: asyncio.StreamReader,
    client_writer: asyncio.StreamWriter,
    netns: int | None,
    target: tuple[str, int],
) -> None:
    loop = asyncio.get_running_loop()
    upstream = socket_in(netns)
    try:
        # Bounded as a client bounds its connect: one whose SYN goes unanswered would otherwise hold the
        # client's request until its own read timeout, which a client connecting itself would not see.
        await asyncio.wait_for(loop.sock_connect(upstream, target), CONNECT_TIMEOUT_S)
    except OSError:  # refused, unreachable, or TimeoutError (an OSError) from the bound
        upstream.close()
        client_writer.close()
        return
    reader, writer = await asyncio.open_connection(sock=upstream)
    await asyncio.gather(_pipe(client_reader, writer), _pipe(reader, client_writer))


async def listen(
    listen_ns: int | None, address: tuple[str, int], connect_ns: int | None, target: tuple[str, int]
) -> int:
    """A relay from `address` in `listen_ns` to `target` in `connect_ns`; returns the port it listens on."""
    sock = socket_in(listen_ns)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(address)
    server = await asyncio.start_server(
        lambda r, w: _relay(r, w, connect_ns, target), sock=sock, limit=1 << 20
    )
    port: int = server.sockets[0].getsockname()[1]
    return port


async def _control(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    try:
        line = (await reader.readline()).decode().split()
        netns_path, ip, port = line[0], line[1], int(line[2])
        netns = os.open(netns_path, os.O_RDONLY)
        local = await listen(None, ("127.0.0.1", 0), netns, (ip, port))
        writer.write(f"{local}\n".encode())
    except (OSError, ValueError, IndexError) as error:
        writer.write(f"error {error}\n".encode())
    await writer.drain()
    writer.close()


async def _http_connect(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, netns: int) -> None:
    """An HTTP CONNECT proxy (the apiserver's egress for `cluster` traffic: logs, exec, port-forward), whose
    connections are made in the cluster network."""
    request = await reader.readuntil(b"\r\n\r\n")
    method, authority = request.decode(errors="replace").split()[:2]
    host, _, port = authority.rpartition(":")
    if method != "CONNECT" or not port.isdigit():
        writer.write(b"HTTP/1.1 405 Method Not Allowed\r\n\r\n")
        writer.close()
        return
    loop = asyncio.get_running_loop()
    upstream = socket_in(netns)
    try:
        await loop.sock_connect(upstream, (host, int(port)))
    except OSError as error:
        upstream.close()
        writer.write(f"HTTP/1.1 502 Bad Gateway\r\n\r\n{error}".encode())
        writer.close()
        return
    writer.write(b"HTTP/1.1 200 Connection established\r\n\r\n")
    up_reader, up_writer = await asyncio.open_connection(sock=upstream)
    await asyncio.gather(_pipe(reader, up_writer), _pipe(up_reader, writer))


async def main(args: argparse.Namespace) -> None:
    for path in args.netns:
        netns = os.open(path, os.O_RDONLY)
        await listen(netns, ("127.0.0.1", args.api_port), None, ("127.0.0.1", args.api_port))
    if args.egress:
        cluster = os.open(args.egress_netns, os.O_RDONLY)
        await asyncio.start_unix_server(lambda r, w: _http_connect(r, w, cluster), path=args.egress)
    control = Path(args.control)
    server = await asyncio.start_unix_server(_control, path=str(control))
    Path(f"{control}.ready").write_text("ok\n")
    async with server:
        await server.serve_forever()


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    parser.add_argument("--api-port", type=int, required=True)
    parser.add_argument("--netns", action="append", default=[])
    parser.add_argument("--control", required=True)
    parser.add_argument("--egress", help="a unix socket for the apiserver's HTTP CONNECT egress")
    parser.add_argument("--egress-netns", help="the namespace egress connections are made in")
    asyncio.run(main(parser.parse_args()))
