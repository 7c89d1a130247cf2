"""A Ray pool's actor (`worker/ray/python/actor.py`) without Ray: what it answers a load, a
call, a ping and an unload; the relay's `PyopHost` running the actor's text as `ray/mod.rs`
puts it together; and each namespace's texts compiling as one text."""

import io
import sys
import types
from typing import Any

import numpy
import pytest
from conftest import ACTOR_TEXTS, IMPORTER, REPLY_TEXTS, WORKER_TEXTS

KEY = ["op", 1]


def load(actor: Any, text: str) -> "dict[str, Any]":
    msg = {"key": KEY, "kind": "code", "op_name": "op", "text": text, "filename": "op.py"}
    reply: "dict[str, Any]" = actor.load(msg)
    return reply


@pytest.fixture()
def started(actor: types.ModuleType) -> Any:
    return actor.PyopActor(IMPORTER.read_text(), ["program", "--flag"])


def test_an_actor_starts_as_a_worker_does(actor: types.ModuleType, started: Any) -> None:
    assert sys.argv == ["program", "--flag"]
    assert isinstance(sys.modules["pyop"], actor._PyopStub)
    assert callable(started._install_package)


def test_a_plain_array_is_answered_as_dtype_shape_and_its_bytes(started: Any) -> None:
    assert load(started, "def plus(x):\n    return x + 1\n") == {"s": "loaded"}
    reply, payload, bufs = started.call(KEY, "plus", [numpy.arange(3.0)], None)
    assert reply == {"s": "array", "dtype": "<f8", "shape": [3], "retained": False}
    assert payload == b""
    assert [b.dtype for b in bufs] == [numpy.uint8]
    assert bytes(bufs[0]) == numpy.array([1.0, 2.0, 3.0]).tobytes()


def test_anything_else_is_pickled_for_the_programs_unpickler(
    started: Any, reply: types.ModuleType
) -> None:
    load(started, "import numpy\ndef f(n):\n    return {'n': n, 'a': numpy.ones(n)[::2]}\n")
    answer, payload, bufs = started.call(KEY, "f", [4], None)
    assert answer == {"s": "pickled", "retained": False}
    back = reply.loads(payload, bufs)
    assert back["n"] == 4 and back["a"].tolist() == [1.0, 1.0]


def test_out_arrays_written_are_answered_with_their_bytes(started: Any) -> None:
    load(started, "def fill(x, out):\n    out[...] = x * 2\n")
    reply, payload, bufs = started.call(KEY, "fill", [numpy.arange(2.0)], [("<f8", [2])])
    assert (reply, payload) == ({"s": "wrote", "retained": False}, b"")
    assert bytes(bufs[0]) == numpy.array([0.0, 2.0]).tobytes()
    # A body that returns something else than its `out`: the value is the answer.
    load(started, "def other(x, out):\n    return 5\n")
    reply, _, _ = started.call(KEY, "other", [1], [("<f8", [1])])
    assert reply["s"] == "pickled"


def test_an_exception_is_answered_with_its_phase(started: Any) -> None:
    load(started, "def f():\n    return 1 / 0\n")
    reply, payload, bufs = started.call(KEY, "f", [], None)
    assert (reply["s"], reply["retained"], payload, bufs) == ("raised", False, b"", [])
    assert (reply["exc"]["type"], reply["exc"]["phase"]) == ("ZeroDivisionError", "call")
    failed = load(started, "def f(:\n")
    assert (failed["s"], failed["exc"]["type"], failed["exc"]["phase"]) == (
        "load_failed",
        "SyntaxError",
        "load",
    )


def test_a_call_of_a_module_not_loaded_is_the_actors_own_failure(started: Any) -> None:
    reply, _, _ = started.call(["x", 9], "f", [], None)
    assert reply["exc"]["type"] == "KeyError"
    assert reply["exc"]["phase"] == "worker"
    assert reply["exc"]["message"] == "\"the module ['x', 9] is not loaded in this actor\""


def test_ping_names_the_missing_functions_and_unload_drops_every_generation(
    started: Any,
) -> None:
    load(started, "def f():\n    pass\ng = 3\n")
    assert started.ping(KEY, ["f", "g", "h"]) == {"s": "pong", "missing": ["g", "h"]}
    started.unload("op")
    assert started.ping(KEY, ["f"]) == {"s": "pong", "missing": ["f"]}


def test_the_relays_host_runs_the_actors_text_as_ray_mod_rs_builds_it(
    worker: types.ModuleType, monkeypatch: pytest.MonkeyPatch
) -> None:
    for name in ("_pyop_worker", "pyop_ray_actor", "pyop"):
        monkeypatch.delitem(sys.modules, name, raising=False)
    monkeypatch.setattr(sys, "argv", list(sys.argv))
    text = "".join(p.read_text() for p in ACTOR_TEXTS)
    host = worker.PyopHost(text, IMPORTER.read_text(), ["prog"])
    assert host.load({"key": KEY, "kind": "module", "name": "json"}) == {"s": "loaded"}
    assert host.ping(KEY, ["dumps", "nope"]) == {"s": "pong", "missing": ["nope"]}
    reply, payload, bufs = host.call(KEY, "loads", ["[1, 2]"], None)
    assert reply == {"s": "pickled", "retained": False} and bufs == []
    unpickled = types.ModuleType("check")
    exec(compile("".join(p.read_text() for p in REPLY_TEXTS), "<pyop>", "exec"), unpickled.__dict__)
    assert unpickled.loads(payload, []) == [1, 2]


@pytest.mark.parametrize("texts", [WORKER_TEXTS, ACTOR_TEXTS, REPLY_TEXTS])
def test_each_namespaces_texts_compile_as_one(texts: "tuple[Any, ...]") -> None:
    # (A `from __future__` import anywhere but at the top of the first would not.)
    compile("".join(p.read_text() for p in texts), "<pyop>", "exec")


def test_the_actors_pickler_sends_a_result_the_worker_would(
    actor: types.ModuleType, worker: types.ModuleType
) -> None:
    buffers: "list[Any]" = []
    f = io.BytesIO()
    worker._Pickler(f, protocol=5, buffer_callback=buffers.append).dump([numpy.int8(1)])
    assert actor._parts([numpy.int8(1)])[1] == f.getvalue()
