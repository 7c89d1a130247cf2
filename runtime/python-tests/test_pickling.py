"""The two halves of the trust boundary: a worker's pickler (`host.py`'s `_Pickler`) and the
program's restricted unpickler (`reply.py`), which read one allow-list (`pickle_names.py`)."""

import builtins
import collections
import enum
import io
import pickle
import types
from typing import Any

import numpy
import pytest
from conftest import REPLY_TEXTS, run_texts


class Point:
    """A value the program cannot read as it is: it becomes a stand-in of its name."""

    def __init__(self) -> None:
        self.x = 1


class Color(enum.IntEnum):
    RED = 3


Pair = collections.namedtuple("Pair", "a b")


class Name(str):
    pass


def pickled(host: types.ModuleType, value: object) -> "tuple[bytes, list[Any]]":
    """`value` as a worker pickles it: the pickle and its out-of-band buffers."""
    buffers: "list[pickle.PickleBuffer]" = []
    f = io.BytesIO()
    host._Pickler(f, protocol=5, buffer_callback=buffers.append).dump(value)
    return f.getvalue(), [b.raw() for b in buffers]


def names_read(
    reply: types.ModuleType, data: bytes, buffers: "list[Any]"
) -> "set[tuple[str, str]]":
    """The (module, name) pairs the program's unpickler is asked for, reading `data`."""
    seen = set()

    class Recording(reply._Unpickler):
        def find_class(self, module: str, name: str) -> Any:
            seen.add((module, name))
            return super().find_class(module, name)

    Recording(io.BytesIO(data), buffers=buffers).load()
    return seen


def roundtrip(host: types.ModuleType, reply: types.ModuleType, value: object) -> Any:
    data, buffers = pickled(host, value)
    return reply.loads(data, buffers)


# --- the allow-list ---------------------------------------------------------------------------

BUILTINS = set(
    "complex set frozenset bytearray slice range tuple list dict int float str bytes bool".split()
)
CONSTRUCTORS = {"standin", "array", "scalar", "object_array", "structured", "masked"}


def test_the_allow_list_is_these_twenty_names(host: types.ModuleType) -> None:
    # A change to what crosses the boundary is a change to this test too.
    assert set(host._PICKLED_BUILTINS) == BUILTINS
    assert set(host._PICKLED_CONSTRUCTORS) == CONSTRUCTORS
    assert host._NAMED == {("builtins", n) for n in BUILTINS} | {
        ("_pyop_worker", n) for n in CONSTRUCTORS
    }


def test_both_sides_read_the_one_list(host: types.ModuleType, reply: types.ModuleType) -> None:
    assert reply._PICKLED_BUILTINS == host._PICKLED_BUILTINS
    assert reply._PICKLED_CONSTRUCTORS == host._PICKLED_CONSTRUCTORS
    # Every constructor the worker names is one the program defines, and the other way round.
    assert set(reply._CONSTRUCTORS) == set(host._PICKLED_CONSTRUCTORS)
    for name in host._PICKLED_CONSTRUCTORS:
        f = getattr(host._glue, name)
        assert (f.__module__, f.__qualname__) == ("_pyop_worker", name)
        with pytest.raises(RuntimeError, match="^pyop worker constructor$"):
            f()
    for name in host._PICKLED_BUILTINS:
        assert isinstance(getattr(builtins, name), type)


@pytest.mark.parametrize(
    "text, refused",
    [
        (b"cbuiltins\neval\n.", "builtins.eval"),
        (b"cos\nsystem\n.", "os.system"),
        (b"c_pyop_worker\nbogus\n.", "_pyop_worker.bogus"),
        (b"cnumpy\nndarray\n.", "numpy.ndarray"),
        (b"cbuiltins\nobject\n.", "builtins.object"),
    ],
)
def test_the_unpickler_refuses_any_other_name(
    reply: types.ModuleType, text: bytes, refused: str
) -> None:
    with pytest.raises(pickle.UnpicklingError) as e:
        reply.loads(text, [])
    assert str(e.value) == "a pyop worker sent %s, which is not a value pyop reads" % refused


def test_an_array_pickled_by_numpy_itself_is_refused(reply: types.ModuleType) -> None:
    # NumPy's own reduce would rebuild a dtype from its pickled state: never run.
    with pytest.raises(pickle.UnpicklingError) as e:
        reply.loads(pickle.dumps(numpy.arange(3), protocol=5), [])
    assert str(e.value).startswith("a pyop worker sent numpy.")
    assert str(e.value).endswith(", which is not a value pyop reads")


# --- values, both ways ------------------------------------------------------------------------


PLAIN = [
    7,
    -2.5,
    True,
    None,
    1 + 2j,
    "text",
    b"bytes",
    bytearray(b"ba"),
    [1, [2, 3]],
    (1, "a"),
    {"k": [1.5]},
    {1, 2},
    frozenset({3}),
    slice(1, 9, 2),
    range(2, 5),
]


@pytest.mark.parametrize("value", PLAIN, ids=lambda v: type(v).__name__)
def test_plain_values_cross_as_they_are(
    host: types.ModuleType, reply: types.ModuleType, value: object
) -> None:
    back = roundtrip(host, reply, value)
    assert back == value
    assert type(back) is type(value)
    data, buffers = pickled(host, value)
    assert names_read(reply, data, buffers) <= {("builtins", n) for n in BUILTINS}


def test_an_array_crosses_as_dtype_shape_and_bytes_out_of_band(
    host: types.ModuleType, reply: types.ModuleType
) -> None:
    a = numpy.arange(6, dtype=">i4").reshape(2, 3)
    data, buffers = pickled(host, a)
    assert len(buffers) == 1 and bytes(buffers[0]) == a.tobytes()
    assert names_read(reply, data, buffers) == {("_pyop_worker", "array")}
    back = reply.loads(data, buffers)
    assert back.dtype == numpy.dtype(">i4") and back.shape == (2, 3)
    assert (back == a).all()


def test_a_strided_array_or_a_subclass_crosses_as_a_plain_copy(
    host: types.ModuleType, reply: types.ModuleType
) -> None:
    a = numpy.arange(10.0)[::3]
    back = roundtrip(host, reply, a)
    assert back.tolist() == [0.0, 3.0, 6.0, 9.0]
    m = numpy.arange(4).view(numpy.matrix)
    back = roundtrip(host, reply, m)
    assert type(back) is numpy.ndarray and back.tolist() == [[0, 1, 2, 3]]


def test_a_numpy_scalar_keeps_its_type(host: types.ModuleType, reply: types.ModuleType) -> None:
    back = roundtrip(host, reply, numpy.float32(1.5))
    assert type(back) is numpy.float32 and back == 1.5
    data, buffers = pickled(host, numpy.int16(-3))
    assert names_read(reply, data, buffers) == {("_pyop_worker", "scalar")}
    assert roundtrip(host, reply, numpy.int16(-3)) == -3


def test_the_values_the_output_check_refuses_keep_what_it_reads(
    host: types.ModuleType, reply: types.ModuleType
) -> None:
    objects = roundtrip(host, reply, numpy.array([1, "a", None], dtype=object))
    assert objects.dtype == numpy.dtype(object) and objects.shape == (3,)
    fields = numpy.zeros(2, dtype=[("a", "<i4"), ("b", "<f8")])
    back = roundtrip(host, reply, fields)
    assert back.dtype == fields.dtype and back.shape == (2,)
    masked = numpy.ma.masked_array([1.0, 2.0, 3.0], mask=[False, True, False])
    back = roundtrip(host, reply, masked)
    assert isinstance(back, numpy.ma.MaskedArray)
    assert back.data.tolist() == [1.0, 2.0, 3.0]
    assert back.mask.tolist() == [False, True, False]


def test_subclasses_of_numbers_and_sequences_cross_as_their_stored_value(
    host: types.ModuleType, reply: types.ModuleType
) -> None:
    back = roundtrip(host, reply, [Color.RED, Pair(1, 2)])
    assert back == [3, (1, 2)]
    assert [type(v) for v in back] == [int, tuple]


def test_anything_else_becomes_a_stand_in_of_its_name(
    host: types.ModuleType, reply: types.ModuleType
) -> None:
    point, name, function, cls = roundtrip(host, reply, [Point(), Name("n"), len, Point])
    assert type(point).__qualname__ == "Point"
    assert type(point).__module__ == __name__
    assert repr(point) == "<%s.Point from a pyop worker>" % __name__
    assert not hasattr(point, "x")
    assert (type(name).__module__, type(name).__qualname__) == (__name__, "Name")
    assert type(function).__qualname__ == "builtin_function_or_method"
    # A class (a value of type `type`) that is not a plain type.
    assert (type(cls).__module__, type(cls).__qualname__) == ("builtins", "type")
    # The plain types themselves cross as they are.
    assert roundtrip(host, reply, [int, dict]) == [int, dict]


# --- the program's constructors ---------------------------------------------------------------


def test_a_dtype_with_objects_or_fields_is_never_read_from_bytes(reply: types.ModuleType) -> None:
    for dtype in ("|O", "<i4,<f8"):
        with pytest.raises(pickle.UnpicklingError) as e:
            reply._plain_dtype(dtype)
        assert str(e.value) == "a pyop worker sent bytes of a dtype with objects or fields"
    with pytest.raises(pickle.UnpicklingError) as e:
        reply._array("|O", (1,), bytes(8))
    assert str(e.value) == "a pyop worker sent bytes of a dtype with objects or fields"


def test_ml_dtypes_values_are_refused_by_name(reply: types.ModuleType) -> None:
    with pytest.raises(pickle.UnpicklingError) as e:
        reply._scalar("ml_dtypes.bfloat16", b"\0\0")
    assert str(e.value).startswith(
        "a pyop worker sent values of ml_dtypes' bfloat16, which a worker op cannot return: "
    )
    assert str(e.value).endswith("convert it in the body (`.astype(numpy.float32)`)")


def test_the_checked_dtypes_are_cached_up_to_64() -> None:
    reply = run_texts("pyop_reply_cache", REPLY_TEXTS)
    for n in range(1, 71):
        assert reply._array("V%d" % n, (0,), b"").shape == (0,)
    assert len(reply._array_dtypes) == 64
    assert reply._array("V70", (2,), bytes(140)).dtype == numpy.dtype("V70")


def test_stand_in_classes_are_kept_256_at_a_time_least_recently_used_first() -> None:
    reply = run_texts("pyop_reply_classes", REPLY_TEXTS)
    first = reply._standin_class("A", "m")
    assert reply._standin_class("A", "m") is first
    for n in range(255):
        reply._standin_class("C%d" % n, "m")
    assert reply._standin_class("A", "m") is first  # used again: now the most recent
    reply._standin_class("C255", "m")  # the 257th: C0 goes
    assert len(reply._classes) == 256
    assert ("C0", "m") not in reply._classes
    assert reply._standin_class("A", "m") is first


# --- exceptions -------------------------------------------------------------------------------


def test_an_exception_is_rebuilt_with_its_name_base_and_exact_message(
    reply: types.ModuleType,
) -> None:
    e = reply.exception(
        "TableError", "tables", ["KeyError", "LookupError", "Exception", "BaseException"], "x", None
    )
    assert isinstance(e, KeyError)
    assert (type(e).__name__, type(e).__module__) == ("TableError", "tables")
    assert str(e) == "x"  # a KeyError's str would be "'x'"
    e = reply.exception("ModuleNotFoundError", "builtins", ["ModuleNotFoundError"], "m", "mod")
    assert isinstance(e, ModuleNotFoundError) and e.name == "mod"


def test_an_exception_of_no_builtin_base_is_an_exception(reply: types.ModuleType) -> None:
    e = reply.exception("Odd", "mod", ["NotAType", "print"], "why", None)
    assert type(e).__bases__ == (Exception,)
    assert (type(e).__name__, str(e)) == ("Odd", "why")
