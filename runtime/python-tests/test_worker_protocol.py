"""`worker.py`'s side of the protocol (`runtime/src/worker/protocol.rs`): the exact fields of
each request, the arguments' encoding, and where a result's buffers go (`_place`, `_room`,
`_encode`), over real arenas (memfds mapped as the worker maps them)."""

import math
import os
import subprocess
import sys
import types
from pathlib import Path
from typing import Any, Iterator

import numpy
import pytest

ARENA = 4096


def key(base: str = "op", generation: int = 1) -> "dict[str, Any]":
    return {"base": base, "generation": generation}


def call(**more: Any) -> "dict[str, Any]":
    msg = {"op": "call", "key": key(), "function": "f", "args": [], "out": None, "spin": True}
    msg.update(more)
    return msg


# --- the requests' fields ---------------------------------------------------------------------


def test_a_request_with_its_exact_fields_passes_and_its_key_becomes_a_tuple(
    worker: types.ModuleType,
) -> None:
    msg = call()
    assert worker._checked(msg) is msg
    assert msg["key"] == ("op", 1)
    load = {"op": "load", "kind": "module", "key": key("m", 2), "name": "json"}
    assert worker._checked(load)["key"] == ("m", 2)
    assert worker._checked({"op": "unload", "base": "op"}) == {"op": "unload", "base": "op"}


@pytest.mark.parametrize(
    "msg, why",
    [
        (
            call(extra=1),
            "unexpected request 'call' with fields "
            "['args', 'extra', 'function', 'key', 'op', 'out', 'spin']",
        ),
        ({"op": "call", "key": key()}, "unexpected request 'call' with fields ['key', 'op']"),
        ({"op": "launch"}, "unexpected request 'launch' with fields ['op']"),
        ({"base": "op"}, "unexpected request None with fields ['base']"),
        (
            {"op": "load", "kind": "module", "key": key(), "name": "m", "text": ""},
            "unexpected request 'load' with fields ['key', 'kind', 'name', 'op', 'text']",
        ),
        (
            {"op": "load", "kind": "wheel", "key": key(), "name": "m"},
            "unexpected request 'load' with fields ['key', 'kind', 'name', 'op']",
        ),
        (call(key=["op", 1]), "a module key is not {base, generation}"),
        (call(key={"base": "op"}), "a module key is not {base, generation}"),
    ],
)
def test_any_other_request_is_a_protocol_error(
    worker: types.ModuleType, msg: "dict[str, Any]", why: str
) -> None:
    with pytest.raises(worker._ProtocolError) as e:
        worker._checked(msg)
    assert str(e.value) == why


def test_every_load_kind_has_its_fields(worker: types.ModuleType) -> None:
    assert worker._LOAD_FIELDS == {
        "code": {"op", "key", "kind", "op_name", "text", "filename", "first_line"},
        "file": {"op", "key", "kind", "op_name", "text", "filename"},
        "module": {"op", "key", "kind", "name"},
        "package": {"op", "key", "kind", "name", "root", "module", "files"},
    }


# --- arguments --------------------------------------------------------------------------------


class Inputs:
    """Stands in for `_Views`: records each input view asked for."""

    def __init__(self) -> None:
        self.asked: "list[tuple[Any, ...]]" = []

    def input(self, *args: Any) -> str:
        self.asked.append(args)
        return "view%d" % len(self.asked)


def test_arguments_decode_as_sent(worker: types.ModuleType) -> None:
    views = Inputs()
    tensor = {"t": {"at": 64, "dtype": "<f4", "shape": [2, 3], "strides": [12, 4]}}
    args = [tensor, {"u": [1, [2, {"f": "inf"}]]}, {"f": "nan"}, {"f": "-inf"}, "s", None, 3.5]
    got = worker._decode(args, views)
    assert views.asked == [(64, "<f4", [2, 3], [12, 4])]
    assert got[:2] == ["view1", (1, [2, math.inf])]
    assert math.isnan(got[2]) and got[3] == -math.inf
    assert got[4:] == ["s", None, 3.5]


@pytest.mark.parametrize(
    "arg",
    [
        {"f": "1.5"},
        {"t": {"at": 0, "dtype": "<f4", "shape": [1]}},
        {"u": [], "f": "nan"},
        {},
        {"x": "y" * 300},
    ],
)
def test_any_other_encoding_is_a_protocol_error(worker: types.ModuleType, arg: object) -> None:
    with pytest.raises(worker._ProtocolError) as e:
        worker._decode([arg], Inputs())
    assert str(e.value) == "unknown argument encoding " + repr(arg)[:200]


# --- arenas and where a result goes -----------------------------------------------------------


@pytest.fixture()
def arenas(worker: types.ModuleType) -> Iterator["list[Any]"]:
    """An input arena (mapped read-write and read-only) and a result arena, installed as the
    parent's arena messages install them."""
    for which in (0, 1):
        fd = os.memfd_create("pyop-test-arena")
        os.ftruncate(fd, ARENA)
        worker._install_arena(which, [fd], ARENA)
    yield worker._arenas
    worker._arenas[:] = [None, None]


def test_an_arena_knows_what_lies_in_its_mappings(
    worker: types.ModuleType, arenas: "list[Any]"
) -> None:
    inp, res = arenas
    assert inp.ro is not None and res.ro is None
    writable, readonly = inp.addrs
    assert inp.offset_of(writable + 100, 28) == 100
    assert inp.offset_of(readonly, ARENA) == 0
    assert inp.offset_of(writable + ARENA - 8, 16) is None  # runs past the end
    assert inp.offset_of(min(inp.addrs) - 1, 1) is None


def test_an_arena_message_names_arena_0_or_1_with_one_descriptor(
    worker: types.ModuleType,
) -> None:
    with pytest.raises(worker._ProtocolError) as e:
        worker._install_arena(0, [], ARENA)
    assert str(e.value) == "an arena came with 0 descriptors"


@pytest.mark.parametrize("need, off", [(0, 0), (1, 64), (63, 64), (64, 64), (65, 128), (130, 192)])
def test_room_in_the_result_arena_starts_64_byte_aligned(
    worker: types.ModuleType, need: int, off: int
) -> None:
    placed: "list[list[int]]" = []
    to_copy: "list[Any]" = []
    raw = memoryview(b"x" * 10)
    assert worker._room(10, placed, to_copy, raw, need) == off + 10
    assert placed == [[1, off, 10]]
    assert to_copy == [(off, raw)]


def test_a_buffer_is_named_where_it_lies_or_copied(
    worker: types.ModuleType, arenas: "list[Any]"
) -> None:
    writable, readonly = arenas[0].addrs
    placed: "list[list[int]]" = []
    to_copy: "list[Any]" = []
    raw = memoryview(b"")
    assert worker._place(0, 12345, placed, to_copy, raw, 7) == 7  # empty: nowhere
    assert worker._place(32, writable + 256, placed, to_copy, raw, 7) == 7
    assert worker._place(16, readonly + 8, placed, to_copy, raw, 7) == 7
    assert worker._place(16, writable + ARENA - 8, placed, to_copy, raw, 7) == 64 + 16
    assert placed == [[0, 0, 0], [0, 256, 32], [0, 8, 16], [1, 64, 16]]
    assert to_copy == [(64, raw)]


def test_without_an_input_arena_every_buffer_is_copied(worker: types.ModuleType) -> None:
    placed: "list[list[int]]" = []
    to_copy: "list[Any]" = []
    assert worker._place(8, 4096, placed, to_copy, memoryview(b"12345678"), 100) == 128 + 8
    assert placed == [[1, 128, 8]]


def test_a_new_array_is_sent_as_dtype_shape_and_a_copy(
    worker: types.ModuleType, arenas: "list[Any]"
) -> None:
    a = numpy.arange(6, dtype="<f8").reshape(2, 3)
    payload, placed, to_copy, need, arr = worker._encode(a, worker._Views())
    assert (payload, placed, need, arr) == (None, [[1, 0, 48]], 48, ("<f8", [2, 3]))
    assert [(off, bytes(raw)) for off, raw in to_copy] == [(0, a.tobytes())]
    empty = worker._encode(numpy.zeros((0, 4), dtype="<i2"), worker._Views())
    assert empty == (None, [[0, 0, 0]], [], 0, ("<i2", [0, 4]))


def test_an_input_returned_or_sliced_is_named_where_it_lies(
    worker: types.ModuleType, arenas: "list[Any]"
) -> None:
    arenas[0].map[128:160] = numpy.arange(4.0).tobytes()
    views = worker._Views()
    x = views.input(128, "<f8", [4], [8])
    assert x.tolist() == [0.0, 1.0, 2.0, 3.0] and not x.flags.writeable
    assert worker._encode(x, views) == (None, [[0, 128, 32]], [], 0, ("<f8", [4]))
    assert worker._encode(x[1:3], views) == (None, [[0, 136, 16]], [], 0, ("<f8", [2]))


def test_anything_else_is_pickled_with_its_buffers_out_of_band(
    worker: types.ModuleType, reply: types.ModuleType, arenas: "list[Any]"
) -> None:
    value = {"a": numpy.arange(5.0)[::2], "n": 3}
    payload, placed, to_copy, need, arr = worker._encode(value, worker._Views())
    assert arr is None and isinstance(payload, bytes)
    assert (placed, need) == ([[1, 0, 24]], 24)
    back = reply.loads(payload, [raw for _, raw in to_copy])
    assert back["a"].tolist() == [0.0, 2.0, 4.0] and back["n"] == 3


def test_a_result_too_large_for_a_frame_is_an_overflow_error(worker: types.ModuleType) -> None:
    assert worker._too_large(5 << 30, True) == {
        "s": "raised",
        "retained": True,
        "exc": {
            "type": "OverflowError",
            "module": "builtins",
            "bases": ["OverflowError", "ArithmeticError", "Exception", "BaseException"],
            "message": "the result pickles to 5368709120 bytes, more than a reply can carry "
            "(4 GiB); return it as an array",
            "traceback": "",
            "phase": "result",
            "syntax": None,
            "name": None,
        },
    }


def test_count_is_the_product_of_a_shape(worker: types.ModuleType) -> None:
    assert worker._count([2, 3, 4]) == 24
    assert worker._count([]) == 1
    assert worker._count([5, 0]) == 0


# --- views a body kept ------------------------------------------------------------------------


def test_an_input_or_out_view_the_body_kept_is_seen(
    worker: types.ModuleType, arenas: "list[Any]"
) -> None:
    # One call's views at a time, as `_call` makes them: the count is of what holds the arena
    # when the call starts.
    views = worker._Views()
    views.input(0, "<f8", [4], [8])  # handed to the body, dropped
    assert views.retained() is False
    del views
    views = worker._Views()
    kept = views.input(0, "<f8", [4], [8])[1:]
    assert views.retained() is True
    del views, kept
    views = worker._Views()
    out = views.out(64, "<i4", [2, 2])
    out[...] = 7
    assert bytes(arenas[0].map[64:80]) == numpy.full(4, 7, dtype="<i4").tobytes()
    assert views.retained() is True
    del views, out
    views = worker._Views()
    views.out(64, "<i4", [2])
    assert views.retained() is False


def test_a_forked_child_gets_private_copies_of_the_arenas(
    worker: types.ModuleType, arenas: "list[Any]"
) -> None:
    # What the at-fork handler does to every arena, here in this process: the bytes stay, the
    # program no longer sees writes (the memfd is no longer behind the mapping).
    inp = arenas[0]
    inp.map[0:4] = b"abcd"
    before = (inp.addrs, bytes(inp.ro[0:4]))
    inp.privatize()
    assert (inp.addrs, bytes(inp.ro[0:4])) == before
    inp.map[0:4] = b"wxyz"
    assert bytes(inp.map[0:4]) == b"wxyz"
    assert bytes(inp.ro[0:4]) == b"abcd"  # private now: the writable mapping no longer shows
    with pytest.raises(TypeError):
        inp.ro[0:1] = b"!"


# --- reading requests, writing replies ---------------------------------------------------------


@pytest.fixture()
def sock(worker: types.ModuleType, monkeypatch: pytest.MonkeyPatch) -> Iterator[Any]:
    """The program's end of a socket pair whose other end is the worker's `_SOCK`; the requests
    read so far forgotten."""
    import socket

    ours, theirs = socket.socketpair()
    ours.settimeout(10)  # a reply shorter than said fails the test instead of hanging it
    monkeypatch.setattr(worker, "_SOCK", theirs, raising=False)
    monkeypatch.setattr(worker, "_SEEN", {})
    yield ours
    ours.close()
    theirs.close()


def framed(text: str) -> bytes:
    data = text.encode()
    return len(data).to_bytes(4, "little") + data


TENSOR_CALL = (
    '{"op":"call","key":{"base":"op","generation":1},"function":"f",'
    '"args":[{"t":{"at":64,"dtype":"<f4","shape":[2,3],"strides":[12,4]}}],"out":null,'
    '"spin":true}'
)


def test_a_call_read_again_is_the_request_checked_the_first_time(
    worker: types.ModuleType, sock: Any
) -> None:
    sock.sendall(framed('{"q":7,"m":%s}' % TENSOR_CALL))
    q, msg, fds = worker._recv_frame()
    assert (q, fds) == (7, [])
    assert msg["key"] == ("op", 1) and msg["function"] == "f"
    plan = ((64, numpy.dtype("<f4"), (2, 3), (12, 4)),)
    assert worker._plan == plan
    assert worker._SEEN == {TENSOR_CALL: (msg, plan)}
    for q in (8, 0, 12345678901234567890):
        sock.sendall(framed('{"q":%d,"m":%s}' % (q, TENSOR_CALL)))
        got = worker._recv_frame()
        assert got[0] == q and got[1] is msg and worker._plan == plan
    # Another request resets the plan; a number JSON does not write so is read as JSON reads it.
    sock.sendall(framed('{"q":9,"m":{"op":"unload","base":"op"}}'))
    assert worker._recv_frame()[1] == {"op": "unload", "base": "op"} and worker._plan is None
    for q, read in (("-3", -3), ("1.5", 1.5), ("1e2", 100.0), (" 1", 1)):
        sock.sendall(framed('{"q":%s,"m":%s}' % (q, TENSOR_CALL)))
        got = worker._recv_frame()
        assert got[0] == read and type(got[0]) is type(read) and got[1] == msg
    for q in ("01", "+1", "1_0", "\u0661"):
        sock.sendall(framed('{"q":%s,"m":%s}' % (q, TENSOR_CALL)))
        with pytest.raises(worker._ProtocolError, match="a frame is not {q, m} in JSON"):
            worker._recv_frame()


def test_calls_read_are_remembered_up_to_a_bound(worker: types.ModuleType, sock: Any) -> None:
    for i in range(worker._SEEN_MAX + 3):
        text = TENSOR_CALL.replace('"at":64', '"at":%d' % (64 * i))
        sock.sendall(framed('{"q":%d,"m":%s}' % (i, text)))
        worker._recv_frame()
        assert worker._plan[0][0] == 64 * i
    assert len(worker._SEEN) == 3


@pytest.mark.parametrize(
    "args",
    [
        [{"t": {"at": 0, "dtype": "<f4", "shape": [1], "strides": [4]}}, 1.5],
        [{"t": {"at": 0, "dtype": ["<f4"], "shape": [1], "strides": [4]}}],
        [{"t": {"at": 0, "dtype": "no such dtype", "shape": [1], "strides": [4]}}],
        [{"t": {"at": 0, "dtype": "<f4", "shape": [1]}}],
        [{"t": {"at": "0", "dtype": "<f4", "shape": [1], "strides": [4]}}],
        [{"t": {"at": 0, "dtype": "<f4", "shape": [1], "strides": [4]}, "u": []}],
        {"t": {}},
    ],
)
def test_a_call_with_anything_but_arrays_has_no_plan(
    worker: types.ModuleType, args: object
) -> None:
    assert worker._args_plan(args) is None


def test_arrays_planned_are_the_views_decoded(
    worker: types.ModuleType, arenas: "list[Any]"
) -> None:
    args = [
        {"t": {"at": 64, "dtype": "<f4", "shape": [2, 3], "strides": [12, 4]}},
        {"t": {"at": 128, "dtype": "<i8", "shape": [3, 2], "strides": [8, 24]}},
    ]
    planned = [worker._Views().view(*p) for p in worker._args_plan(args)]
    decoded = worker._decode(args, worker._Views())
    for a, b in zip(planned, decoded):
        assert (a.dtype, a.shape, a.strides, a.flags.writeable) == (
            b.dtype,
            b.shape,
            b.strides,
            False,
        )
        assert a.__array_interface__["data"] == b.__array_interface__["data"]


@pytest.mark.parametrize("shape", [[], [1], [2, 3], [0, 4]])
@pytest.mark.parametrize("dtype", ["<f4", "|b1", "<c16", ">i2"])
def test_an_array_reply_is_the_text_send_writes(
    worker: types.ModuleType,
    sock: Any,
    monkeypatch: pytest.MonkeyPatch,
    shape: "list[int]",
    dtype: str,
) -> None:
    monkeypatch.setattr(worker, "_seq", 123456789)
    for retained, waited in ((False, [2, 0]), (True, [0, 17])):
        monkeypatch.setattr(worker, "_waited", waited)
        place = [1, 192, 24]
        worker._send(
            {"s": "array", "place": place, "dtype": dtype, "shape": shape, "retained": retained}
        )
        worker._send_array(place, dtype, shape, retained)
        n = int.from_bytes(sock.recv(4), "little")
        sent = sock.recv(n, 0x100)  # MSG_WAITALL
        assert sock.recv(4 + n, 0x100)[4:] == sent


def test_the_worker_call_cost_script_runs_the_call_path_it_times() -> None:
    # `scripts/worker_call_cost.py` (the figure in the performance chapter) loads this worker and
    # checks its replies before it times them; a change that breaks its harness fails here.
    script = Path(__file__).resolve().parents[2] / "scripts" / "worker_call_cost.py"
    out = subprocess.run(
        [sys.executable, str(script), "50", "1"], capture_output=True, text=True, timeout=60
    )
    assert out.returncode == 0, out.stderr
    name, _, value = out.stdout.strip().partition("=")
    assert name == "worker_call_python_us" and float(value) > 0
