"""`host.py`: what any process running bodies outside the program needs (loading a body's
module, the `pyop` stand-in, an exception as the program rebuilds it, base values of
subclasses)."""

import enum
import json
import linecache
import types
from typing import Any

import numpy
import pytest


class Shouting(KeyError):
    pass


class Unprintable(Exception):
    def __str__(self) -> str:
        raise RuntimeError("no str")


class Unrepresentable(Unprintable):
    def __repr__(self) -> str:
        raise RuntimeError("no repr")


def raised(e: BaseException) -> BaseException:
    """`e`, raised and caught (with its traceback)."""
    try:
        raise e
    except BaseException as caught:  # noqa: BLE001
        return caught


# --- the `pyop` stand-in ----------------------------------------------------------------------


def test_every_attribute_of_the_pyop_stand_in_is_missing_and_says_why(
    host: types.ModuleType,
) -> None:
    stub = host._PyopStub("pyop")
    assert not hasattr(stub, "Tensor")
    assert getattr(stub, "tensor", "default") == "default"
    with pytest.raises(AttributeError) as e:
        stub.exp  # noqa: B018
    assert str(e.value) == (
        "pyop.exp is not available: the pyop module (exposed Rust functions, nested ops, "
        "pyop.Tensor) lives in the program, not in a worker process; run this op in-process "
        "(without `workers`) to use it"
    )
    assert e.value.name == "exp"
    assert e.value.obj is stub
    with pytest.raises(AttributeError) as e:
        stub.__wrapped__  # noqa: B018
    assert str(e.value) == "__wrapped__"


# --- exceptions -------------------------------------------------------------------------------


def test_clean_escapes_lone_surrogates(host: types.ModuleType) -> None:
    assert host._clean("a\udcff b") == "a\\udcff b"
    assert host._clean(3) == "3"
    json.dumps(host._clean("\ud800"))  # a string JSON takes


def test_an_exception_as_the_program_rebuilds_it(host: types.ModuleType) -> None:
    info = host._exception_info(raised(ValueError("bad value")), "call")
    tb = info.pop("traceback")
    assert info == {
        "type": "ValueError",
        "module": "builtins",
        "bases": ["ValueError", "Exception", "BaseException"],
        "message": "bad value",
        "phase": "call",
        "syntax": None,
        "name": None,
    }
    assert tb.startswith("Traceback (most recent call last):\n")
    assert "raise e" in tb and __file__ in tb


def test_an_exception_of_a_class_of_its_own_names_its_builtin_bases(
    host: types.ModuleType,
) -> None:
    info = host._exception_info(Shouting("k"), "load")
    assert (info["type"], info["module"], info["phase"]) == ("Shouting", __name__, "load")
    assert info["bases"] == ["KeyError", "LookupError", "Exception", "BaseException"]
    assert info["message"] == "'k'"
    assert info["traceback"] == ""  # never raised


def test_a_message_that_cannot_be_made_is_its_repr_or_nothing(host: types.ModuleType) -> None:
    assert host._exception_info(Unprintable("x"), "call")["message"] == "Unprintable('x')"
    assert host._exception_info(Unrepresentable("x"), "call")["message"] == ""


def test_an_import_of_pyop_is_told_where_pyop_lives(host: types.ModuleType) -> None:
    e = ImportError("cannot import name 'Tensor' from 'pyop'", name="pyop")
    info = host._exception_info(e, "load")
    assert info["message"] == "cannot import name 'Tensor' from 'pyop': " + host._PYOP_HINT
    assert info["name"] == "pyop"
    other = host._exception_info(ModuleNotFoundError("no", name="scipy"), "load")
    assert (other["message"], other["name"]) == ("no", "scipy")


def test_a_syntax_error_keeps_its_message_and_location(host: types.ModuleType) -> None:
    try:
        compile("x = (1,\n", "body.py", "exec")
    except SyntaxError as e:
        info, msg = host._exception_info(e, "load"), e.msg
    assert info["syntax"] is not None
    assert info["syntax"]["msg"] == msg  # "'(' was never closed", on Python 3.10 and later
    assert info["syntax"]["location"].startswith('  File "body.py", line 1\n    x = (1,\n')


def test_pyops_own_frames_are_left_out_of_a_traceback(host: types.ModuleType) -> None:
    ns: "dict[str, Any]" = {}
    exec(compile("def run(f):\n    f()\n", host._PYOP, "exec"), ns)

    def body() -> None:
        raise ZeroDivisionError("in the body")

    try:
        ns["run"](body)
    except ZeroDivisionError as e:
        tb = host._exception_info(e, "call")["traceback"]
    assert "<pyop>" not in tb
    assert 'raise ZeroDivisionError("in the body")' in tb


# --- base values ------------------------------------------------------------------------------


class Loud(int):
    def __int__(self) -> int:
        return 99


class Reversed(tuple):  # type: ignore[type-arg]
    def __getitem__(self, i: Any) -> Any:
        return tuple(reversed(tuple.__getitem__(self, slice(None))))[i]


class Flag(enum.IntFlag):
    A = 1
    B = 2


def test_subclasses_are_read_through_their_base_types_slots(host: types.ModuleType) -> None:
    cases: "list[tuple[object, object]]" = [
        (Loud(5), 5),
        (Flag.A | Flag.B, 3),
        (Reversed((1, 2, 3)), (1, 2, 3)),
        (type("F", (float,), {"__float__": lambda self: 0.0})(2.5), 2.5),
        (type("C", (complex,), {})(1, 2), 1 + 2j),
        (type("L", (list,), {"__getitem__": lambda self, i: 0})([4, 5]), [4, 5]),
        (True, True),
    ]
    for value, base in cases:
        got = host._as_base(value, type(value))
        assert got == base and type(got) is type(base), value
    assert host._as_base(type("S", (str,), {})("s"), type("S", (str,), {})) is None


# --- loading bodies ---------------------------------------------------------------------------


def test_code_is_loaded_at_its_first_line_with_its_lines_for_tracebacks(
    host: types.ModuleType,
) -> None:
    msg = {
        "kind": "code",
        "op_name": "plus",
        "text": "def plus(x):\n    return x + 1\n",
        "filename": "src/main.rs",
        "first_line": 40,
    }
    module = host._load_module(msg, None)
    assert module.__name__ == "pyop_body_plus" and module.__file__ == "src/main.rs"
    assert module.plus(1) == 2
    assert module.plus.__code__.co_firstlineno == 40
    assert linecache.getline("src/main.rs", 41) == "    return x + 1\n"


def test_a_file_is_loaded_from_its_text(host: types.ModuleType) -> None:
    msg = {"kind": "file", "op_name": "f", "text": "X = 2\n", "filename": "/ops/f_never.py"}
    assert host._load_module(msg, None).X == 2
    assert linecache.getline("/ops/f_never.py", 1) == ""  # a file's lines are read from it


def test_a_module_is_imported_and_a_package_installed_first(
    host: types.ModuleType, importer: types.ModuleType
) -> None:
    assert host._load_module({"kind": "module", "name": "json"}, None) is json
    msg = {
        "kind": "package",
        "name": "pyopt_loaded",
        "root": "/pkg",
        "files": [["__init__.py", ""], ["ops.py", "def f():\n    return 7\n"]],
        "module": "pyopt_loaded.ops",
    }
    module = host._load_module(msg, importer._install_package)
    assert module.f() == 7 and module.__file__ == "/pkg/ops.py"


def test_a_load_raises_what_loading_raised(host: types.ModuleType) -> None:
    msg = {"kind": "code", "op_name": "f", "text": "1 / 0\n", "filename": "f.py"}
    with pytest.raises(ZeroDivisionError):
        host._load_module(msg, None)


# --- dtypes -----------------------------------------------------------------------------------


def test_a_dtype_is_sent_as_its_str_or_ml_dtypes_name(host: types.ModuleType) -> None:
    assert host._dtype_text(numpy.dtype(">f4")) == ">f4"
    assert host._dtype_text(numpy.dtype("V2")) == "|V2"
    ml_dtypes = pytest.importorskip("ml_dtypes")
    assert host._dtype_text(numpy.dtype(ml_dtypes.bfloat16)) == "ml_dtypes.bfloat16"
