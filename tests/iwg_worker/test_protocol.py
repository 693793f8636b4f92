"""The wire format: round trips with zero-copy tensor frames, and strict rejection of anything else."""

from __future__ import annotations

import contextlib
import json
import pickle
from typing import Any

import msgpack
import numpy as np
import pytest
import torch
import zmq
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from iwg_worker import protocol


def _wire(frames: list[object]) -> list[zmq.Frame]:
    """What a receiver gets: each part as a zmq.Frame, as recv_multipart(copy=False) returns."""
    return [zmq.Frame(bytes(memoryview(f))) if not isinstance(f, bytes) else zmq.Frame(f) for f in frames]


@pytest.mark.parametrize("inline", [True, False], ids=["small tensors inline", "every tensor framed"])
def test_call_round_trip_keeps_tensors_dtypes_and_shapes(
    inline: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    if not inline:
        monkeypatch.setattr(protocol, "INLINE_TENSOR_MAX_BYTES", 0)
    args = [
        torch.arange(12, dtype=torch.float32).reshape(3, 4),
        torch.tensor([1.5, -2.0], dtype=torch.bfloat16),
        np.arange(6, dtype=np.int64).reshape(2, 3),
        torch.empty((0, 5)),
        {"nested": [torch.ones(2, dtype=torch.int8), "text", 3, None, b"raw"]},
    ]
    frames = protocol.encode_call(7, "echo", args, {"k": torch.zeros(1)}, reply_rank=1, deadline=12.5)
    # Inline: everything in the header. Framed: one frame per tensor but the empty one (0 bytes is inline).
    assert len(frames) == (1 if inline else 1 + 5)
    message = protocol.decode(_wire(frames))
    assert isinstance(message, protocol.Call)
    assert (message.id, message.method, message.reply_rank, message.deadline) == (7, "echo", 1, 12.5)
    got = message.args
    assert torch.equal(got[0], args[0]) and got[0].dtype == torch.float32
    assert torch.equal(got[1], args[1]) and got[1].dtype == torch.bfloat16
    assert isinstance(got[2], np.ndarray) and np.array_equal(got[2], args[2])
    assert got[3].shape == (0, 5)
    assert torch.equal(got[4]["nested"][0], torch.ones(2, dtype=torch.int8))
    assert got[4]["nested"][1:] == ["text", 3, None, b"raw"]
    assert torch.equal(message.kwargs["k"], torch.zeros(1))


TENSORS = [
    torch.arange(12, dtype=torch.float32).reshape(3, 4).t(),  # not contiguous
    torch.tensor([[1.5, -2.0]], dtype=torch.bfloat16),  # no numpy dtype: raw 2-byte words
    torch.tensor(7, dtype=torch.int64),  # 0-d
    torch.empty((0, 5), dtype=torch.float16),
    torch.ones(3, requires_grad=True),
]


@pytest.mark.parametrize("tensor", TENSORS, ids=["strided", "bfloat16", "scalar", "empty", "requires grad"])
def test_one_tensor_codec_for_the_zmq_wire_and_for_ray(tensor: torch.Tensor) -> None:
    from iwg_worker.executor.ray_data import TensorBytes, from_ray, to_ray

    dtype, shape, raw = protocol.tensor_bytes(tensor)
    assert (dtype, shape) == (str(tensor.dtype).removeprefix("torch."), list(tensor.shape))
    assert raw.dtype == np.uint8 and raw.nbytes == tensor.numel() * tensor.element_size()
    back = protocol.tensor_from_bytes(raw, dtype, shape)
    assert back.dtype == tensor.dtype and torch.equal(back, tensor.detach())
    # Ray's plain-data form is the same codec's bytes, and comes back as the same tensor.
    packed, nbytes = to_ray({"t": tensor}, "args")
    assert isinstance(packed["t"], TensorBytes) and nbytes == raw.nbytes
    assert bytes(packed["t"].data) == bytes(raw)
    assert torch.equal(from_ray(packed)["t"], tensor.detach())


def test_tensors_travel_inline_up_to_the_limit_and_framed_above_it() -> None:
    limit = protocol.INLINE_TENSOR_MAX_BYTES
    at_limit, above = torch.ones(limit, dtype=torch.uint8), torch.ones(limit + 1, dtype=torch.uint8)
    assert len(protocol.encode_call(1, "echo", [at_limit])) == 1
    assert len(protocol.encode_call(1, "echo", [above])) == 2
    # An inline tensor arrives as its own writable memory, like a framed one; a non-contiguous one arrives
    # with the right values.
    strided = torch.arange(20, dtype=torch.float32).reshape(4, 5).t()
    decoded = protocol.decode(_wire(protocol.encode_call(1, "echo", [at_limit, strided])))
    assert isinstance(decoded, protocol.Call)
    got, got_strided = decoded.args
    got += 1
    assert torch.equal(got, at_limit + 1) and torch.equal(got_strided, strided)


def test_tensor_frames_are_not_copied() -> None:
    tensor = torch.arange(protocol.INLINE_TENSOR_MAX_BYTES // 4 + 1, dtype=torch.float32)
    frames = protocol.encode_call(1, "echo", [tensor])
    # Sender side: the frame is a view on the tensor's memory.
    assert np.frombuffer(frames[1], dtype=np.uint8).ctypes.data == tensor.data_ptr()
    # Receiver side: the tensor is a view on the received frame's memory.
    wire = _wire(frames)
    decoded = protocol.decode(wire)
    assert isinstance(decoded, protocol.Call)
    assert decoded.args[0].data_ptr() == np.frombuffer(wire[1].buffer, dtype=np.uint8).ctypes.data


def test_reply_carries_structured_error() -> None:
    error = protocol.RemoteErrorInfo("ValueError", "bad", "Traceback ...")
    message = protocol.decode(_wire(protocol.encode_reply(3, 1, 2, error=error)))
    assert message == protocol.Reply(id=3, replica=1, rank=2, ok=False, result=None, error=error)


def test_unsendable_objects_are_refused_at_the_sender() -> None:
    with pytest.raises(TypeError, match="cannot send a function"):
        protocol.encode_call(1, "echo", [lambda: None])


@pytest.mark.parametrize(
    "frames, reason",
    [
        ([pickle.dumps({"kind": "call"})], "msgpack"),
        ([pickle.dumps(print)], "msgpack"),
        ([b""], "msgpack"),
        ([msgpack.packb([1, 2])], "must be a map"),
        ([msgpack.packb({"kind": "exec"})], "unknown message kind"),
        ([msgpack.packb({"kind": "ping", "ts": 1.0, "extra": 1})], "unexpected fields"),
        ([msgpack.packb({"kind": "call", "id": 1})], "missing fields"),
        (
            [
                msgpack.packb(
                    {
                        "kind": "call",
                        "id": "1",
                        "method": "m",
                        "args": [],
                        "kwargs": {},
                        "reply_rank": None,
                        "deadline": None,
                    }
                )
            ],
            "field 'id'",
        ),
        ([msgpack.packb({"kind": "ping", "ts": 1.0}), b"stray"], "1 tensor frames sent, 0 referenced"),
        (
            [
                msgpack.packb(
                    {"kind": "ping", "ts": msgpack.ExtType(1, msgpack.packb([0, "pt", "float32", [4]]))}
                ),
                b"\x00" * 8,
            ],
            "holds 8 bytes",
        ),
        (
            [
                msgpack.packb(
                    {"kind": "ping", "ts": msgpack.ExtType(1, msgpack.packb([0, "pt", "object", [1]]))}
                ),
                b"\x00" * 8,
            ],
            "dtype 'object' is not allowed",
        ),
        ([msgpack.packb({"kind": "ping", "ts": msgpack.ExtType(9, b"")})], "extension type 9"),
        (
            [
                msgpack.packb(
                    {"kind": "ping", "ts": msgpack.ExtType(2, msgpack.packb(["pt", "uint8", [4], b"abc"]))}
                )
            ],
            "inline tensor holds 3 bytes",
        ),
        (
            [
                msgpack.packb(
                    {"kind": "ping", "ts": msgpack.ExtType(2, msgpack.packb(["pt", "uint8", [3], "abc"]))}
                )
            ],
            "must be msgpack bin",
        ),
        (
            [msgpack.packb({"kind": "ping", "ts": msgpack.ExtType(2, msgpack.packb(["pt", "uint8", [3]]))})],
            r"\[kind, dtype, shape, bytes\]",
        ),
    ],
)
def test_malformed_messages_are_rejected_with_a_reason(frames: list[bytes], reason: str) -> None:
    with pytest.raises(protocol.ProtocolError, match=reason):
        protocol.decode(_wire(frames))


# One inline tensor and one framed: the fuzzer mutates both kinds of descriptor.
_VALID = protocol.encode_call(
    5,
    "execute_model",
    [{"inputs": ["a"]}, torch.ones(3), torch.ones(protocol.INLINE_TENSOR_MAX_BYTES)],
    {"x": 1},
)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    st.one_of(
        st.lists(st.binary(max_size=256), min_size=0, max_size=4),
        st.tuples(st.integers(0, len(bytes(_VALID[0])) - 1), st.integers(0, 255)).map(
            lambda m: [
                bytes(_VALID[0])[: m[0]] + bytes([m[1]]) + bytes(_VALID[0])[m[0] + 1 :],
                bytes(_VALID[1]),
            ]
        ),
    )
)
def test_decoding_arbitrary_frames_never_escapes_protocol_error(frames: list[bytes]) -> None:
    try:
        message = protocol.decode(_wire(frames))
    except protocol.ProtocolError:
        return
    assert isinstance(
        message, protocol.Call | protocol.Reply | protocol.Hello | protocol.Goodbye | protocol.Ping
    )


def test_protocol_works_without_importing_torch() -> None:
    """Numpy-only peers (e.g. a prober) can speak the protocol without pulling torch in."""
    import subprocess
    import sys

    code = (
        "import sys, numpy as np\n"
        "from iwg_worker import protocol\n"
        "import zmq\n"
        "frames = protocol.encode_call(1, 'echo', [np.arange(3)])\n"
        "message = protocol.decode([zmq.Frame(bytes(memoryview(f))) for f in frames])\n"
        "assert list(message.args[0]) == [0, 1, 2]\n"
        "assert 'torch' not in sys.modules, 'torch was imported'\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)


def test_a_reader_of_replies_takes_torch_tensors_as_numpy_without_importing_torch(tmp_path: Any) -> None:
    """A worker's reply holding torch tensors (float32 embeddings, int64 counts, a bfloat16 tensor inline and
    framed) decodes, after `decode_tensors_as_numpy` (the driver calls it), to numpy arrays of the same values
    (bfloat16 widened to float32), and torch is never imported."""
    import subprocess
    import sys

    torch.manual_seed(0)
    result = {
        "embeddings": torch.randn(4, 384),
        "prompt_tokens": torch.tensor([3, 7, 1, 12]),
        "small": torch.randn(2, 3).to(torch.bfloat16),  # inline (below the frame limit)
        "large": torch.randn(64, 384).to(torch.bfloat16),  # a frame of its own
    }
    frames = protocol.encode_reply(5, 0, 0, result)
    (tmp_path / "frames").write_bytes(msgpack.packb([bytes(memoryview(f)) for f in frames]))
    code = (
        "import json, sys, msgpack, numpy as np\n"
        "from iwg_worker import protocol\n"
        "protocol.decode_tensors_as_numpy()\n"
        f"frames = msgpack.unpackb(open({str(tmp_path / 'frames')!r}, 'rb').read())\n"
        "reply = protocol.decode(frames)\n"
        "out = {k: [type(v).__name__, str(v.dtype), v.tolist()] for k, v in reply.result.items()}\n"
        "out['torch'] = 'torch' in sys.modules\n"
        "print(json.dumps(out))\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    seen = json.loads(done.stdout)
    assert seen.pop("torch") is False, "decoding imported torch"
    for key, tensor in result.items():
        kind, dtype, values = seen[key]
        assert kind == "ndarray", (key, kind)
        expected = tensor.float() if tensor.dtype == torch.bfloat16 else tensor
        assert dtype == str(expected.numpy().dtype), (key, dtype)
        assert values == expected.tolist(), key


_ITEM = {
    "id": "g1-1",
    "tokens": [5, 6],
    "text": "hi",
    "logprobs": [-0.5, -1.25],
    "token_texts": ["h", "i"],
    "top_logprobs": [[[5, -0.5, "h"], [9, -2.0, "x"]], [[6, -1.25, "i"]]],
    "finish_reason": None,
    "error": None,
}


def test_a_stream_message_carries_a_steps_items_for_many_requests() -> None:
    items = [
        _ITEM,
        {
            **_ITEM,
            "id": "g1-2",
            "logprobs": None,
            "token_texts": None,
            "top_logprobs": None,
            "finish_reason": "stop",
        },
        # a failed request's last item, its replica's failure (the driver may retry it elsewhere)
        {
            **_ITEM,
            "id": "g1-3",
            "tokens": [],
            "text": "",
            "error": "gloo: reset",
            "error_code": "replica_failure",
        },
    ]
    message = protocol.decode(_wire(protocol.encode_stream(2, 0, items)))
    assert message == protocol.Stream(replica=2, rank=0, items=items)


@pytest.mark.parametrize(
    ("item", "reason"),
    [
        ({k: v for k, v in _ITEM.items() if k != "error"}, "exactly the keys"),
        ({**_ITEM, "extra": 1}, "exactly the keys"),
        ({**_ITEM, "tokens": [1, "2"]}, "'tokens' must be a list of ints"),
        ({**_ITEM, "text": b"hi"}, "'id' and 'text' must be strings"),
        ({**_ITEM, "finish_reason": 3}, "'finish_reason' must be a string or nil"),
        ({**_ITEM, "error_code": 3}, "'error_code' must be a string or nil"),
        ({**_ITEM, "logprobs": [1]}, "'logprobs' must be a list of floats"),
        ({**_ITEM, "top_logprobs": [[[5]]]}, "token id, logprob, text"),
        ({**_ITEM, "top_logprobs": [[[5, -0.5]]]}, "token id, logprob, text"),
        ({**_ITEM, "token_texts": ["h", 1]}, "'token_texts' must be a list of strings"),
        ("not a map", "exactly the keys"),
    ],
)
def test_malformed_stream_items_are_rejected(item: Any, reason: str) -> None:
    frames = [msgpack.packb({"kind": "stream", "replica": 0, "rank": 0, "items": [item]})]
    with pytest.raises(protocol.ProtocolError, match=reason):
        protocol.decode(_wire(frames))


@settings(max_examples=200, deadline=None)
@given(
    st.recursive(
        st.none() | st.booleans() | st.integers(-(2**63), 2**64 - 1) | st.floats() | st.text(max_size=8),
        lambda c: st.lists(c, max_size=3) | st.dictionaries(st.text(max_size=8), c, max_size=7),
        max_leaves=20,
    )
)
def test_arbitrary_stream_items_decode_or_raise_protocol_error(items: Any) -> None:
    frames = [msgpack.packb({"kind": "stream", "replica": 0, "rank": 0, "items": items})]
    with contextlib.suppress(protocol.ProtocolError):
        protocol.decode(_wire(frames))
