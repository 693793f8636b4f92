"""The wire protocol between the driver (executors) and workers: msgpack headers plus raw tensor frames.

A message is a ZMQ multipart: frame 0 is a msgpack map (the header), frames 1..n are raw buffers of the
tensors the header refers to. A tensor inside ``args``/``kwargs``/``result`` is encoded in the header as a
msgpack extension (code ``TENSOR_EXT``) holding ``[frame_index, kind, dtype, shape]``; its bytes travel in
their own frame, sent without a copy. A tensor of at most ``INLINE_TENSOR_MAX_BYTES`` travels inside the
header instead (code ``TENSOR_INLINE_EXT``, holding ``[kind, dtype, shape, bytes]``): below ZMQ's own copy
threshold a separate frame saves no copy and costs more than the bytes. Nothing else is allowed: no pickle,
no callables, no object graph.

Message kinds and their header keys (every key required, no others allowed):

- ``call``: ``{kind, id, method, args, kwargs, reply_rank, deadline}`` driver -> worker
- ``reply``: ``{kind, id, replica, rank, ok, result, error}`` worker -> driver; ``error`` is
  ``{type, message, traceback}`` or nil
- ``hello`` / ``heartbeat``: ``{kind, group, replica, rank, world_size, pod, routing_id, capabilities}``
  worker -> driver; a heartbeat repeats the hello so a restarted driver relearns its members;
  ``capabilities.incarnation`` says which creation of its rank the pod is (the driver refuses older ones);
  ``capabilities.draining: true`` says the worker is leaving (SIGTERM): its replica takes nothing new and
  finishes what it runs before the goodbye. ``capabilities`` is an open map (a driver ignores keys it does not
  know), so this travels to drivers of every version without a new kind or key
- ``goodbye``: ``{kind, replica, rank, reason, last_call}`` worker -> driver; ``last_call`` is the id of the
  last call the worker ran (it ran every earlier one it received, and will run none after); the one optional
  key, ``incarnation``, is sent by a pod that has one (a driver ignores the goodbye of a replaced incarnation)
- ``ping``: ``{kind, ts}`` driver -> worker heartbeat
- ``overflow``: ``{kind, id}`` driver -> worker through the shared-memory ring (`executor.shm_ring`): call
  ``id`` was too large for the ring and comes on the socket; the worker runs it in this place
- ``stream``: ``{kind, replica, rank, items}`` worker -> driver: one engine step's new output of every running
  request of the replica, each item ``{id, tokens, text, logprobs, token_texts, top_logprobs, finish_reason,
  error}``
  (`iwg_worker.engine.streams`)

Decoding is strict: anything that is not exactly one of these shapes (its optional keys aside) raises `ProtocolError`, which the
receiver logs and drops before serving the next message.
"""

from __future__ import annotations

import functools
import math
import warnings
from dataclasses import dataclass
from typing import Any, Final

import msgpack
import numpy as np

TENSOR_EXT: Final = 1
TENSOR_INLINE_EXT: Final = 2
INLINE_TENSOR_MAX_BYTES: Final = 8 * 1024
MAX_HEADER_BYTES: Final = 64 * 1024 * 1024
MAX_FRAMES: Final = 4096

# Tensors arrive as numpy or torch; both keep their kind across the wire.
_KIND_NUMPY: Final = "np"
_KIND_TORCH: Final = "pt"

_NUMPY_DTYPES: Final[dict[str, np.dtype[Any]]] = {
    name: np.dtype(name)
    for name in (
        "bool",
        "uint8",
        "int8",
        "int16",
        "int32",
        "int64",
        "float16",
        "float32",
        "float64",
        "complex64",
        "complex128",
    )
}
# bfloat16 has no numpy dtype: it travels as its raw 2-byte words.
_ITEMSIZE: Final[dict[str, int]] = {name: dt.itemsize for name, dt in _NUMPY_DTYPES.items()} | {"bfloat16": 2}


@functools.cache
def _torch_numpy_dtypes() -> dict[Any, str]:
    """torch dtype -> name, for dtypes numpy shares (imported on first tensor: operator code has no torch)."""
    torch = _torch_module()
    return {getattr(torch, name): name for name in _NUMPY_DTYPES if hasattr(torch, name)}


class ProtocolError(ValueError):
    """A message that does not follow the protocol; the receiver drops it and keeps serving."""


class EncodeError(TypeError):
    """A value that cannot travel on the wire: a type msgpack does not carry, text that is not UTF-8
    encodable (a lone surrogate), an integer outside [-2**63, 2**64). Raised before anything is sent."""


@dataclass(frozen=True, slots=True)
class Call:
    id: int
    method: str
    args: list[Any]
    kwargs: dict[str, Any]
    reply_rank: int | None
    deadline: float | None


@dataclass(frozen=True, slots=True)
class RemoteErrorInfo:
    type: str
    message: str
    traceback: str


@dataclass(frozen=True, slots=True)
class Reply:
    id: int
    replica: int
    rank: int
    ok: bool
    result: Any
    error: RemoteErrorInfo | None


@dataclass(frozen=True, slots=True)
class Hello:
    """Join (``kind='hello'``) or keep-alive (``kind='heartbeat'``) from a worker."""

    kind: str
    group: str
    replica: int
    rank: int
    world_size: int
    pod: str
    routing_id: bytes
    capabilities: dict[str, Any]


@dataclass(frozen=True, slots=True)
class Goodbye:
    replica: int
    rank: int
    reason: str
    last_call: int | None
    incarnation: int = 0  # of the pod that left (0: none given)


@dataclass(frozen=True, slots=True)
class Ping:
    ts: float


@dataclass(frozen=True, slots=True)
class Overflow:
    id: int


@dataclass(frozen=True, slots=True)
class Stream:
    replica: int
    rank: int
    items: list[dict[str, Any]]


Message = Call | Reply | Hello | Goodbye | Ping | Overflow | Stream

STREAM_ITEM_KEYS: Final = frozenset(
    {"id", "tokens", "text", "logprobs", "token_texts", "top_logprobs", "finish_reason", "error"}
)
# A failed request's last item may also say why in a code (``replica_failure``: its replica failed).
STREAM_ITEM_OPTIONAL_KEYS: Final = frozenset({"error_code"})
REPLICA_FAILURE: Final = "replica_failure"

# Tool-call formats a worker names in its admission answer (``tool_call_format``) and the driver reads back:
# ``hermes``, calls as ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>`` blocks in the text.
HERMES: Final = "hermes"
HERMES_TAGS: Final = ("<tool_call>", "</tool_call>")

_KEYS: Final[dict[str, frozenset[str]]] = {
    "call": frozenset({"kind", "id", "method", "args", "kwargs", "reply_rank", "deadline"}),
    "reply": frozenset({"kind", "id", "replica", "rank", "ok", "result", "error"}),
    "hello": frozenset(
        {"kind", "group", "replica", "rank", "world_size", "pod", "routing_id", "capabilities"}
    ),
    "heartbeat": frozenset(
        {"kind", "group", "replica", "rank", "world_size", "pod", "routing_id", "capabilities"}
    ),
    "goodbye": frozenset({"kind", "replica", "rank", "reason", "last_call"}),
    "ping": frozenset({"kind", "ts"}),
    "overflow": frozenset({"kind", "id"}),
    "stream": frozenset({"kind", "replica", "rank", "items"}),
}

# Keys a sender may add (added after the first release: a peer of an earlier version refuses the message, so
# only messages whose loss is survivable get them; a goodbye's loss costs a heartbeat timeout).
_OPTIONAL_KEYS: Final[dict[str, frozenset[str]]] = {"goodbye": frozenset({"incarnation"})}
_NONE: Final = frozenset[str]()


# --------------------------------------------------------------------------------------------- encoding


def _torch_module() -> Any:
    import torch

    return torch


@functools.cache
def _torch_tensor_type() -> type:
    return _torch_module().Tensor  # type: ignore[no-any-return]


def _is_torch_tensor(obj: Any) -> bool:
    # Only an object from a torch module can be a tensor; checking that first keeps torch unimported in
    # processes that never send one (the operator).
    return type(obj).__module__.startswith("torch") and isinstance(obj, _torch_tensor_type())


class _Encoder:
    __slots__ = ("frames",)

    def __init__(self) -> None:
        self.frames: list[Any] = []

    def default(self, obj: Any) -> Any:
        if isinstance(obj, np.ndarray):
            if obj.dtype.name not in _NUMPY_DTYPES:
                raise TypeError(f"cannot send an array of dtype {obj.dtype}")
            return self._array(_KIND_NUMPY, obj.dtype.name, obj)
        if _is_torch_tensor(obj):
            return self._torch(obj)
        if isinstance(obj, tuple):
            return list(obj)
        if isinstance(obj, np.generic):
            return obj.item()
        if isinstance(obj, int):  # msgpack hands over the integers it has no encoding for
            raise EncodeError(f"the integer {obj} is outside the wire's range [-2**63, 2**64)")
        raise EncodeError(
            f"cannot send a {type(obj).__qualname__} over the wire (msgpack types and tensors only)"
        )

    def _torch(self, tensor: Any) -> msgpack.ExtType:
        dtype, shape, raw = tensor_bytes(tensor)
        return self._array(_KIND_TORCH, dtype, raw, shape)

    def _array(
        self, kind: str, dtype: str, array: np.ndarray[Any, Any], shape: list[int] | None = None
    ) -> msgpack.ExtType:
        """``array`` holds the tensor's bytes (its own shape unless ``shape`` is given)."""
        shape = list(array.shape) if shape is None else shape
        if array.nbytes <= INLINE_TENSOR_MAX_BYTES:
            return msgpack.ExtType(TENSOR_INLINE_EXT, msgpack.packb([kind, dtype, shape, array.tobytes()]))
        array = np.ascontiguousarray(array)
        return self._frame(kind, dtype, shape, array.reshape(-1).view(np.uint8))

    def _frame(self, kind: str, dtype: str, shape: list[int], raw: Any) -> msgpack.ExtType:
        index = len(self.frames)
        self.frames.append(memoryview(raw) if not isinstance(raw, bytes) else raw)
        return msgpack.ExtType(TENSOR_EXT, msgpack.packb([index, kind, dtype, shape]))


def encode(header: dict[str, Any]) -> list[Any]:
    """Header dict -> multipart frames: the msgpack header, then one raw buffer per tensor (no copies)."""
    encoder = _Encoder()
    try:
        packed = msgpack.packb(header, default=encoder.default, use_bin_type=True, datetime=False)
    except EncodeError:
        raise
    except (TypeError, UnicodeEncodeError, OverflowError) as exc:
        raise EncodeError(str(exc)) from exc
    return [packed, *encoder.frames]


def unencodable(value: Any) -> str | None:
    """Why `value` cannot travel on the wire, or None when it can."""
    try:
        encode({"value": value})
    except EncodeError as exc:
        return str(exc)
    return None


def encode_call(
    call_id: int,
    method: str,
    args: tuple[Any, ...] | list[Any] = (),
    kwargs: dict[str, Any] | None = None,
    reply_rank: int | None = None,
    deadline: float | None = None,
) -> list[Any]:
    return encode(
        {
            "kind": "call",
            "id": call_id,
            "method": method,
            "args": list(args),
            "kwargs": kwargs or {},
            "reply_rank": reply_rank,
            "deadline": deadline,
        }
    )


def encode_reply(
    call_id: int, replica: int, rank: int, result: Any = None, error: RemoteErrorInfo | None = None
) -> list[Any]:
    return encode(
        {
            "kind": "reply",
            "id": call_id,
            "replica": replica,
            "rank": rank,
            "ok": error is None,
            "result": result if error is None else None,
            "error": None
            if error is None
            else {"type": error.type, "message": error.message, "traceback": error.traceback},
        }
    )


def encode_hello(hello: Hello) -> list[Any]:
    return encode(
        {
            "kind": hello.kind,
            "group": hello.group,
            "replica": hello.replica,
            "rank": hello.rank,
            "world_size": hello.world_size,
            "pod": hello.pod,
            "routing_id": hello.routing_id,
            "capabilities": hello.capabilities,
        }
    )


def encode_goodbye(
    replica: int, rank: int, reason: str, last_call: int | None, incarnation: int = 0
) -> list[Any]:
    header = {"kind": "goodbye", "replica": replica, "rank": rank, "reason": reason, "last_call": last_call}
    if incarnation:
        header["incarnation"] = incarnation
    return encode(header)


def encode_ping(ts: float) -> list[Any]:
    return encode({"kind": "ping", "ts": ts})


def encode_overflow(call_id: int) -> list[Any]:
    return encode({"kind": "overflow", "id": call_id})


def encode_stream(replica: int, rank: int, items: list[dict[str, Any]]) -> list[Any]:
    return encode({"kind": "stream", "replica": replica, "rank": rank, "items": items})


# --------------------------------------------------------------------------------------------- decoding


class _Decoder:
    __slots__ = ("frames", "used")

    def __init__(self, frames: list[Any]) -> None:
        self.frames = frames
        self.used = 0

    def ext_hook(self, code: int, data: bytes) -> Any:
        if code == TENSOR_INLINE_EXT:
            spec = self._spec(data)
            if len(spec) != 4:
                raise ProtocolError("inline tensor must be [kind, dtype, shape, bytes]")
            kind, dtype, shape, raw = spec
            if not isinstance(raw, bytes):
                raise ProtocolError("inline tensor bytes must be msgpack bin")
            _check_tensor(kind, dtype, shape, len(raw), "inline tensor")
            return _tensor_from(kind, dtype, shape, bytearray(raw))  # writable, like any received tensor
        if code != TENSOR_EXT:
            raise ProtocolError(f"unknown msgpack extension type {code}")
        spec = self._spec(data)
        if len(spec) != 4:
            raise ProtocolError("tensor descriptor must be [frame, kind, dtype, shape]")
        index, kind, dtype, shape = spec
        if type(index) is not int or not 0 <= index < len(self.frames):
            raise ProtocolError(f"tensor frame index {index!r} out of range ({len(self.frames)} frames)")
        buf = _buffer(self.frames[index])
        _check_tensor(kind, dtype, shape, len(buf), f"tensor frame {index}")
        self.used += 1
        return _tensor_from(kind, dtype, shape, buf)

    @staticmethod
    def _spec(data: bytes) -> list[Any]:
        try:
            spec = msgpack.unpackb(data, raw=False, strict_map_key=True, use_list=True)
        except Exception as exc:
            raise ProtocolError(f"malformed tensor descriptor: {exc}") from None
        if not isinstance(spec, list):
            raise ProtocolError("tensor descriptor must be a list")
        return spec


def _check_tensor(kind: Any, dtype: Any, shape: Any, nbytes: int, what: str) -> None:
    if kind not in (_KIND_NUMPY, _KIND_TORCH):
        raise ProtocolError(f"unknown tensor kind {kind!r}")
    if dtype not in _ITEMSIZE or (kind == _KIND_NUMPY and dtype not in _NUMPY_DTYPES):
        raise ProtocolError(f"tensor dtype {dtype!r} is not allowed")
    if not (isinstance(shape, list) and all(type(d) is int and d >= 0 for d in shape)) or len(shape) > 32:
        raise ProtocolError(f"tensor shape {shape!r} is not a list of non-negative ints")
    if nbytes != math.prod(shape) * _ITEMSIZE[dtype]:
        raise ProtocolError(
            f"{what} holds {nbytes} bytes, shape {shape} of {dtype} needs {math.prod(shape) * _ITEMSIZE[dtype]}"
        )


# Whether this process takes torch tensors off the wire as numpy arrays: `decode_tensors_as_numpy`.
_tensors_as_numpy = False


def decode_tensors_as_numpy() -> None:
    """From now on this process decodes every received tensor as a numpy array (bfloat16 widened to float32),
    never as a torch tensor: for a process that only reads what workers computed (the driver), so that it never
    imports torch. The import costs seconds of CPU with the GIL held, and it came with a new driver's first
    reply: under a CPU limit that driver sent no ping and answered nothing for seconds (its workers counted it
    lost; under CI's load two requests waited past their clients' 30 s)."""
    global _tensors_as_numpy
    _tensors_as_numpy = True


def _tensor_from(kind: str, dtype: str, shape: list[int], buf: Any) -> Any:
    if kind == _KIND_NUMPY or (_tensors_as_numpy and dtype in _NUMPY_DTYPES):
        return np.frombuffer(buf, dtype=_NUMPY_DTYPES[dtype]).reshape(shape)
    if _tensors_as_numpy:  # bfloat16, the high half of a float32: widened exactly
        high = np.frombuffer(buf, dtype=np.uint16).astype(np.uint32) << 16
        return high.view(np.float32).reshape(shape)
    return tensor_from_bytes(buf, dtype, shape)


def _buffer(frame: Any) -> memoryview:
    if isinstance(frame, bytes | bytearray | memoryview):
        return memoryview(frame)
    return memoryview(frame.buffer)  # zmq.Frame received with copy=False


# A received tensor shares the frame's read-only memory (zero copy); torch warns about that on every
# conversion, which would cost more than the conversion itself. Receivers never write into their inputs.
warnings.filterwarnings("ignore", message="The given NumPy array is not writable", category=UserWarning)


def tensor_bytes(tensor: Any) -> tuple[str, list[int], np.ndarray[Any, np.dtype[np.uint8]]]:
    """A torch tensor as what travels: its dtype name, its shape, and its bytes as a flat uint8 numpy array
    (a view, no copy, for a contiguous CPU tensor). The ZMQ wire sends the bytes as a frame, Ray as a numpy
    array; `tensor_from_bytes` turns them back into a tensor. The one tensor codec of the project."""
    if tensor.is_cpu and not tensor.requires_grad:
        dtype = _torch_numpy_dtypes().get(tensor.dtype)
        if dtype is not None:  # fast path: one call to torch, the rest in numpy
            array = tensor.numpy()  # its shape before ascontiguousarray, which makes a 0-d array 1-d
            return dtype, list(array.shape), np.ascontiguousarray(array).reshape(-1).view(np.uint8)
    torch = _torch_module()
    tensor = tensor.detach()
    if tensor.device.type != "cpu":
        tensor = tensor.cpu()
    tensor = tensor.contiguous()
    dtype = str(tensor.dtype).removeprefix("torch.")
    if dtype not in _ITEMSIZE:
        raise TypeError(f"cannot send a tensor of dtype {tensor.dtype}")
    raw = tensor.reshape(-1).view(torch.uint8).numpy() if tensor.numel() else np.empty(0, np.uint8)
    return dtype, list(tensor.shape), raw


def tensor_from_bytes(buf: Any, dtype: str, shape: list[int]) -> Any:
    """The torch tensor `tensor_bytes` took apart, sharing `buf`'s (read-only) memory."""
    torch = _torch_module()
    if len(buf) == 0:
        return torch.empty(shape, dtype=getattr(torch, dtype))
    numpy_dtype = _NUMPY_DTYPES.get(dtype)
    if numpy_dtype is not None:
        return torch.from_numpy(np.frombuffer(buf, dtype=numpy_dtype).reshape(shape))
    flat = torch.from_numpy(np.frombuffer(buf, dtype=np.uint8))
    return flat.view(getattr(torch, dtype)).reshape(shape)


def _require(header: dict[str, Any], key: str, types: type | tuple[type, ...], nullable: bool = False) -> Any:
    value = header[key]
    if value is None and nullable:
        return None
    if isinstance(value, bool) and bool not in (types if isinstance(types, tuple) else (types,)):
        raise ProtocolError(f"field {key!r} must be {types}, got bool")
    if not isinstance(value, types):
        raise ProtocolError(f"field {key!r} must be {types}, got {type(value).__name__}")
    return value


def decode(frames: list[Any]) -> Message:
    """Multipart frames -> a message; raises `ProtocolError` for anything else (pickle, junk, bad shapes)."""
    if not frames:
        raise ProtocolError("empty message")
    if len(frames) > MAX_FRAMES:
        raise ProtocolError(f"too many frames ({len(frames)})")
    head = frames[0] if type(frames[0]) is bytes else _buffer(frames[0])
    if len(head) > MAX_HEADER_BYTES:
        raise ProtocolError(f"header of {len(head)} bytes exceeds {MAX_HEADER_BYTES}")
    decoder = _Decoder(frames[1:])
    try:
        header = msgpack.unpackb(
            head,
            raw=False,
            strict_map_key=True,
            ext_hook=decoder.ext_hook,
            use_list=True,
        )
    except ProtocolError:
        raise
    except Exception as exc:
        raise ProtocolError(f"header is not a msgpack message: {type(exc).__name__}: {exc}") from None
    if not isinstance(header, dict):
        raise ProtocolError(f"header must be a map, got {type(header).__name__}")
    kind = header.get("kind")
    if not isinstance(kind, str) or kind not in _KEYS:
        raise ProtocolError(f"unknown message kind {kind!r}")
    if header.keys() != _KEYS[kind] and not (
        _KEYS[kind] < header.keys() <= _KEYS[kind] | _OPTIONAL_KEYS.get(kind, _NONE)
    ):
        keys = set(header)
        missing = sorted(_KEYS[kind] - keys)
        extra = sorted(str(k) for k in keys - _KEYS[kind] - _OPTIONAL_KEYS.get(kind, _NONE))
        raise ProtocolError(f"{kind} header: missing fields {missing}, unexpected fields {extra}")
    if decoder.used != len(decoder.frames):
        raise ProtocolError(f"{len(decoder.frames)} tensor frames sent, {decoder.used} referenced")
    return _build(kind, header)


def _build(kind: str, h: dict[str, Any]) -> Message:
    # Fast paths for the two hot kinds: msgpack yields exact types, so one combined check accepts what the
    # field-by-field checks below accept; anything else goes through them for the error message.
    if kind == "call":
        call_id, method, args, kwargs = h["id"], h["method"], h["args"], h["kwargs"]
        reply_rank, deadline = h["reply_rank"], h["deadline"]
        if (
            type(call_id) is int
            and type(method) is str
            and method
            and type(args) is list
            and type(kwargs) is dict
            and (reply_rank is None or type(reply_rank) is int)
            and (deadline is None or type(deadline) is float or type(deadline) is int)
        ):
            return Call(call_id, method, args, kwargs, reply_rank, deadline)
    elif kind == "reply" and h["ok"] is True and h["error"] is None:
        reply_id, replica, rank = h["id"], h["replica"], h["rank"]
        if type(reply_id) is int and type(replica) is int and type(rank) is int:
            return Reply(reply_id, replica, rank, True, h["result"], None)
    return _build_checked(kind, h)


def _build_checked(kind: str, h: dict[str, Any]) -> Message:
    if kind == "call":
        method = _require(h, "method", str)
        if not method:
            raise ProtocolError("field 'method' must not be empty")
        return Call(
            id=_require(h, "id", int),
            method=method,
            args=_require(h, "args", list),
            kwargs=_require(h, "kwargs", dict),
            reply_rank=_require(h, "reply_rank", int, nullable=True),
            deadline=_require(h, "deadline", (float, int), nullable=True),
        )
    if kind == "reply":
        ok = _require(h, "ok", bool)
        error = _require(h, "error", dict, nullable=True)
        info = None
        if error is not None:
            if set(error) != {"type", "message", "traceback"} or not all(
                isinstance(v, str) for v in error.values()
            ):
                raise ProtocolError("field 'error' must be {type, message, traceback} strings")
            info = RemoteErrorInfo(error["type"], error["message"], error["traceback"])
        if ok == (info is not None):
            raise ProtocolError("field 'ok' contradicts field 'error'")
        return Reply(
            id=_require(h, "id", int),
            replica=_require(h, "replica", int),
            rank=_require(h, "rank", int),
            ok=ok,
            result=h["result"],
            error=info,
        )
    if kind in ("hello", "heartbeat"):
        return Hello(
            kind=kind,
            group=_require(h, "group", str),
            replica=_require(h, "replica", int),
            rank=_require(h, "rank", int),
            world_size=_require(h, "world_size", int),
            pod=_require(h, "pod", str),
            routing_id=_require(h, "routing_id", bytes),
            capabilities=_require(h, "capabilities", dict),
        )
    if kind == "goodbye":
        return Goodbye(
            replica=_require(h, "replica", int),
            rank=_require(h, "rank", int),
            reason=_require(h, "reason", str),
            last_call=_require(h, "last_call", int, nullable=True),
            incarnation=_require(h, "incarnation", int) if "incarnation" in h else 0,
        )
    if kind == "overflow":
        return Overflow(id=_require(h, "id", int))
    if kind == "stream":
        items = _require(h, "items", list)
        for item in items:
            _check_stream_item(item)
        return Stream(replica=_require(h, "replica", int), rank=_require(h, "rank", int), items=items)
    return Ping(ts=_require(h, "ts", (float, int)))


def _check_stream_item(item: Any) -> None:
    if not isinstance(item, dict) or not STREAM_ITEM_KEYS <= item.keys() <= (
        STREAM_ITEM_KEYS | STREAM_ITEM_OPTIONAL_KEYS
    ):
        raise ProtocolError(
            f"a stream item must be a map with exactly the keys {sorted(STREAM_ITEM_KEYS)}"
            f" (and optionally {sorted(STREAM_ITEM_OPTIONAL_KEYS)})"
        )
    if not isinstance(item["id"], str) or not isinstance(item["text"], str):
        raise ProtocolError("stream item 'id' and 'text' must be strings")
    tokens = item["tokens"]
    if not isinstance(tokens, list) or not all(type(t) is int for t in tokens):
        raise ProtocolError("stream item 'tokens' must be a list of ints")
    for key in ("finish_reason", "error", "error_code"):
        if item.get(key) is not None and not isinstance(item[key], str):
            raise ProtocolError(f"stream item {key!r} must be a string or nil")
    logprobs = item["logprobs"]
    if logprobs is not None and (
        not isinstance(logprobs, list) or not all(type(v) is float for v in logprobs)
    ):
        raise ProtocolError("stream item 'logprobs' must be a list of floats or nil")
    texts = item["token_texts"]
    if texts is not None and (not isinstance(texts, list) or not all(isinstance(t, str) for t in texts)):
        raise ProtocolError("stream item 'token_texts' must be a list of strings or nil")
    top = item["top_logprobs"]
    if top is not None and not (
        isinstance(top, list)
        and all(
            isinstance(row, list)
            and all(
                isinstance(p, list)
                and len(p) == 3
                and type(p[0]) is int
                and type(p[1]) is float
                and isinstance(p[2], str)
                for p in row
            )
            for row in top
        )
    ):
        raise ProtocolError("stream item 'top_logprobs' must be lists of [token id, logprob, text] or nil")
