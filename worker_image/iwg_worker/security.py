"""CURVE for every tcp socket of a group: the driver and the workers hold distinct keypairs.

A process's directory (the operator mounts it from the group's Secret) holds its own keypair as ``curve.key``
and ``curve.pub`` and the other side's public key as ``peer.pub`` (Z85 text): the driver's pods get the
driver's pair and the workers' public key, the workers' pods the workers' pair and the driver's public key.
Servers (the driver's bound sockets) authenticate clients through a ZAP handler that admits only the peer
key; clients (workers) accept only a server holding the peer key's secret. So a worker's key cannot pose as
the driver, nor the driver's as a worker. A directory without ``peer.pub`` is the one-keypair form (every
process holds the same pair, the peer key is its own public key): what groups made before distinct keys had.
"""

from __future__ import annotations

import logging
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Final

import zmq
import zmq.utils.z85
from iwg_operator.api import wiring

log = logging.getLogger(__name__)

ZAP_ENDPOINT: Final = "inproc://zeromq.zap.01"
ZAP_DOMAIN: Final = "iwg"


@dataclass(frozen=True, slots=True)
class CurveKeys:
    public: bytes  # Z85, 40 bytes
    secret: bytes  # Z85, 40 bytes
    peer: bytes | None = None  # the other side's public key (Z85); None: the one-keypair form

    @property
    def peer_public(self) -> bytes:
        """The key the other side must hold: the only client key a server admits, the server key a client
        accepts."""
        return self.peer if self.peer is not None else self.public

    @classmethod
    def generate(cls) -> CurveKeys:
        """One keypair for every process (the one-keypair form)."""
        public, secret = zmq.curve_keypair()
        return cls(public=public, secret=secret)

    @classmethod
    def generate_pair(cls) -> tuple[CurveKeys, CurveKeys]:
        """(the driver's keys, the workers' keys): two keypairs, each side holding the other's public key."""
        driver_public, driver_secret = zmq.curve_keypair()
        worker_public, worker_secret = zmq.curve_keypair()
        return (
            cls(public=driver_public, secret=driver_secret, peer=worker_public),
            cls(public=worker_public, secret=worker_secret, peer=driver_public),
        )

    @classmethod
    def load(cls, directory: str | Path) -> CurveKeys:
        """Read ``curve.key``, ``curve.pub`` and, where present, ``peer.pub`` from ``directory``; a clear error
        names a bad file."""
        root = Path(directory)
        keys = {}
        for name in (wiring.CURVE_PUBLIC_FILE, wiring.CURVE_SECRET_FILE, wiring.CURVE_PEER_FILE):
            path = root / name
            try:
                value = path.read_bytes().strip()
            except FileNotFoundError:
                if name == wiring.CURVE_PEER_FILE:
                    continue
                raise ValueError(
                    f"{wiring.CURVE_DIR}: cannot read {path}: No such file or directory"
                ) from None
            except OSError as exc:
                raise ValueError(f"{wiring.CURVE_DIR}: cannot read {path}: {exc.strerror}") from None
            if len(value) != 40:
                raise ValueError(f"{wiring.CURVE_DIR}: {path} must hold a 40-character Z85 key")
            keys[name] = value
        public, secret = keys[wiring.CURVE_PUBLIC_FILE], keys[wiring.CURVE_SECRET_FILE]
        peer = keys.get(wiring.CURVE_PEER_FILE)
        try:
            derived = zmq.curve_public(secret)
        except zmq.ZMQError as exc:
            raise ValueError(
                f"{wiring.CURVE_DIR}: {root / wiring.CURVE_SECRET_FILE} is not a Z85 key"
            ) from exc
        if peer is not None:
            try:
                zmq.utils.z85.decode(peer)
            except (KeyError, ValueError):
                raise ValueError(
                    f"{wiring.CURVE_DIR}: {root / wiring.CURVE_PEER_FILE} is not a Z85 key"
                ) from None
        if derived != public:
            raise ValueError(
                f"{wiring.CURVE_DIR}: {wiring.CURVE_PUBLIC_FILE} does not match {wiring.CURVE_SECRET_FILE}"
            )
        return cls(public=public, secret=secret, peer=peer)

    def save(self, directory: str | Path) -> Path:
        root = Path(directory)
        root.mkdir(parents=True, exist_ok=True)
        (root / wiring.CURVE_PUBLIC_FILE).write_bytes(self.public)
        secret = root / wiring.CURVE_SECRET_FILE
        secret.write_bytes(self.secret)
        secret.chmod(0o600)
        if self.peer is not None:
            (root / wiring.CURVE_PEER_FILE).write_bytes(self.peer)
        return root


def make_server(socket: zmq.Socket[bytes], keys: CurveKeys) -> None:
    """Make a to-be-bound socket a CURVE server with its own keypair; ZAP checks its clients against the peer
    key (`ZapAuthenticator` started with `keys.peer_public`)."""
    socket.curve_secretkey = keys.secret
    socket.curve_publickey = keys.public
    socket.curve_server = True
    socket.zap_domain = ZAP_DOMAIN.encode()


def make_client(socket: zmq.Socket[bytes], keys: CurveKeys) -> None:
    """Make a to-be-connected socket a CURVE client that only talks to a server holding the peer key."""
    socket.curve_secretkey = keys.secret
    socket.curve_publickey = keys.public
    socket.curve_serverkey = keys.peer_public


class ZapAuthenticator:
    """ZAP handler (RFC 27) for one context: admit CURVE clients holding one public key only (the peer key).

    Must be started before a CURVE server socket of the same context binds; refusals are logged.
    """

    def __init__(self, context: zmq.Context[zmq.Socket[bytes]], allowed_public_key: bytes) -> None:
        self._context = context
        self._allowed = allowed_public_key
        self._socket = context.socket(zmq.REP)
        self._socket.linger = 0
        self._socket.bind(ZAP_ENDPOINT)
        self._stop = threading.Event()
        self.refused = 0
        self._thread = threading.Thread(target=self._run, name="iwg-zap", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        poller = zmq.Poller()
        poller.register(self._socket, zmq.POLLIN)
        while not self._stop.is_set():
            try:
                if not poller.poll(100):
                    continue
                request = self._socket.recv_multipart()
            except zmq.ZMQError:
                break
            self._socket.send_multipart(self._answer(request))
        self._socket.close(linger=0)

    def _answer(self, request: list[bytes]) -> list[bytes]:
        if len(request) < 6:
            return [b"1.0", b"", b"400", b"malformed ZAP request", b"", b""]
        version, request_id, domain, address, _identity, mechanism = request[:6]
        credentials = request[6:]
        if mechanism == b"CURVE" and credentials and zmq.utils.z85.encode(credentials[0]) == self._allowed:
            return [version, request_id, b"200", b"OK", b"group", b""]
        self.refused += 1
        log.warning(
            "refused %s peer from %s (domain %s): not the group's CURVE key for this side",
            mechanism.decode(errors="replace"),
            address.decode(errors="replace"),
            domain.decode(errors="replace"),
        )
        return [version, request_id, b"400", b"not the group key", b"", b""]

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=2)
