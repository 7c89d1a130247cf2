# What any process that runs pyop bodies outside the program needs, whatever carries its
# messages: loading a body's module from what the program sent, the `pyop` stand-in module, an
# exception as the program rebuilds it (kind, message, traceback), and a result pickled so that
# the program's restricted unpickler (`bridge/shared/python/reply.py`) can read it. A worker
# process runs this text (after `pickle_names.py`'s) before its main loop (`worker.py`); a Ray
# actor (`worker/ray/python/actor.py`) runs it too. Both run it under the file name `<pyop>`,
# whose frames are left out of tracebacks.
#
# Type-checked with `mypy --strict` (`scripts/dev.sh`). The texts run in one namespace are
# concatenated, so no file of them may start with a `from __future__` import: the annotations
# are evaluated as Python 3.9 evaluates them (`Optional`, not `X | None`), and names only
# imported for mypy (`TYPE_CHECKING`) are written in quotes.

import linecache
import pickle
import sys
import traceback
import types
from typing import TYPE_CHECKING, Any, Callable, NoReturn, Optional, TypedDict, cast

if TYPE_CHECKING:  # defined by pickle_names.py, whose text runs before this file's
    import numpy as _np
    from numpy.typing import NDArray
    from pickle_names import _PICKLED_BUILTINS, _PICKLED_CONSTRUCTORS
    from typing_extensions import Buffer
else:
    _np = None  # NumPy, once the process has imported it (worker.py's `_main`, actor.py)

_PYOP = "<pyop>"

# What a body's module is loaded with: the embedded-package importer's `_install_package`
# (`body/python/importer.py`): a package's name, root, files and whether to replace them.
_Installer = Callable[[str, str, Any, bool], None]


# --- loading bodies ---------------------------------------------------------------------------


def _cache_lines(filename: str, text: str, first_line: int) -> None:
    lines = text.splitlines(keepends=True)
    linecache.cache[filename] = (sum(map(len, lines)), None, lines, filename)


def _load_module(msg: dict[str, Any], install_package: _Installer) -> types.ModuleType:
    """The module of a load request's source (`protocol.rs`, `LoadSource`); raises what loading
    it raised."""
    kind = msg["kind"]
    if kind == "module":
        import importlib

        return importlib.import_module(msg["name"])
    if kind == "package":
        install_package(msg["name"], msg["root"], msg["files"], True)
        import importlib

        return importlib.import_module(msg["module"])
    text = msg["text"]
    filename = msg["filename"]
    first = msg.get("first_line", 1)  # a file's text starts at its first line
    if first > 1:
        text = "\n" * (first - 1) + text
    module = types.ModuleType("pyop_body_" + msg["op_name"])
    module.__file__ = filename
    if kind == "code":
        _cache_lines(filename, text, first)
    exec(compile(text, filename, "exec"), module.__dict__)
    return module


class _PyopStub(types.ModuleType):
    """The `pyop` module in a worker: the program's own (exposed Rust functions, nested ops,
    pyop.Tensor) lives in the program. Every attribute is missing, as `AttributeError` (what
    `hasattr`, `getattr(m, name, default)` and `inspect` expect), saying why."""

    def __getattr__(self, name: str) -> NoReturn:
        if name.startswith("__") and name.endswith("__"):
            raise AttributeError(name)
        err = AttributeError("pyop." + name + " is not available: " + _PYOP_HINT)
        # Set after: `AttributeError(name=, obj=)` takes them as keywords from Python 3.10 only.
        err.name, err.obj = name, self
        raise err


# --- exceptions -------------------------------------------------------------------------------


def _clean(text: object) -> str:
    """A string JSON (and the program) can take: lone surrogates escaped."""
    return str(text).encode("utf-8", "backslashreplace").decode("utf-8")


# What a body using the program's `pyop` module is told.
_PYOP_HINT = (
    "the pyop module (exposed Rust functions, nested ops, pyop.Tensor) lives in the "
    "program, not in a worker process; run this op in-process (without `workers`) to "
    "use it"
)


class _ExcInfo(TypedDict):
    """An exception as the program rebuilds it (protocol.rs, `ExcInfo`)."""

    type: str
    module: str
    bases: list[str]
    message: str
    traceback: str
    phase: str
    syntax: Optional[dict[str, str]]
    name: Optional[str]


def _exception_info(e: BaseException, phase: str) -> _ExcInfo:
    t = type(e)
    bases = [
        c.__name__ for c in t.__mro__ if c.__module__ == "builtins" and issubclass(c, BaseException)
    ]
    try:
        message = str(e)
    except BaseException:  # noqa: BLE001 - an exception whose __str__ raises
        try:
            message = repr(e)
        except BaseException:  # noqa: BLE001
            message = ""
    if (
        isinstance(e, ImportError)
        and getattr(e, "name", None) == "pyop"
        and _PYOP_HINT not in message
    ):
        # `from pyop import Tensor` fails in the import machinery, which words it itself.
        message = message + ": " + _PYOP_HINT
    try:
        frames = [
            f
            for f in traceback.extract_tb(e.__traceback__)
            if f.filename != _PYOP and not f.filename.startswith("<frozen importlib")
        ]
        # The worker loads a package by `importlib.import_module`: its frame, before any of the
        # user's, is the worker's machinery (as in the program).
        while frames and frames[0].filename.replace("\\", "/").endswith("importlib/__init__.py"):
            del frames[0]
        tb = "".join(traceback.format_list(frames))
    except BaseException:  # noqa: BLE001 - a traceback that cannot be formatted
        tb = ""
    syntax = None
    if isinstance(e, SyntaxError):
        try:
            syntax = {
                "msg": _clean(e.msg),
                "location": _clean("".join(traceback.format_exception_only(type(e), e)[:-1])),
            }
        except BaseException:  # noqa: BLE001
            syntax = None
    name = None
    if isinstance(e, ImportError) and isinstance(getattr(e, "name", None), str):
        name = _clean(e.name)
    return {
        "type": _clean(t.__name__),
        "module": _clean(getattr(t, "__module__", "") or ""),
        "bases": bases,
        "message": _clean(message),
        "traceback": _clean("Traceback (most recent call last):\n" + tb) if tb else "",
        "phase": phase,
        "syntax": syntax,
        "name": name,
    }


# --- results ----------------------------------------------------------------------------------

# Values sent as they are.
_PLAIN = (
    int,
    float,
    bool,
    complex,
    str,
    bytes,
    bytearray,
    list,
    tuple,
    dict,
    set,
    frozenset,
    slice,
    range,
    type(None),
)


# Subclasses of the number and sequence types the output check reads (an IntEnum, a namedtuple)
# are sent as their base type, read as the program reads them: through the base type's own slots
# (the stored value), never through a method the subclass may override (`__int__`, `__iter__`,
# `__getitem__`). Subclasses of the types it refuses (str, bytes, dict, set) are sent as stand-ins
# of their own name, so the refusal names the same type as in the program.
def _as_base(obj: Any, t: type) -> object:
    if issubclass(t, bool):
        return bool(int.__int__(obj))
    if issubclass(t, int):
        return int.__int__(obj)
    if issubclass(t, float):
        return float.__float__(obj)
    if issubclass(t, complex):
        return complex(complex.__dict__["real"].__get__(obj), complex.__dict__["imag"].__get__(obj))
    if issubclass(t, tuple):
        return tuple.__getitem__(obj, slice(None))
    if issubclass(t, list):
        return list.__getitem__(obj, slice(None))
    return None


# The only classes and functions a reply's pickle may name (`pickle_names.py`, which the
# program's unpickler reads too): the plain types' constructors and the constructors of arrays,
# scalars and the values the output check refuses, which this module names and the program
# defines. Anything else becomes a stand-in.
_NAMED = {("builtins", n) for n in _PICKLED_BUILTINS} | {
    ("_pyop_worker", n) for n in _PICKLED_CONSTRUCTORS
}


def _never(*args: object) -> NoReturn:  # the program's reply.py defines what these names do
    raise RuntimeError("pyop worker constructor")


_glue = types.ModuleType("_pyop_worker")
sys.modules["_pyop_worker"] = _glue
for _name in _PICKLED_CONSTRUCTORS:
    _f = types.FunctionType(_never.__code__, {}, _name)
    _f.__module__ = "_pyop_worker"
    _f.__qualname__ = _name
    setattr(_glue, _name, _f)
_standin = _glue.standin


def _dtype_text(dt: "_np.dtype[Any]") -> str:
    """A dtype as the program's glue reads it back: its `str`, or for one of ml_dtypes' types
    (whose `str` is a void's, `<V2`) `ml_dtypes.` and its name."""
    if dt.kind == "V" and dt.fields is None and getattr(dt.type, "__module__", None) == "ml_dtypes":
        return "ml_dtypes." + dt.type.__name__
    text: str = dt.str
    return text


def _array_parts(a: "NDArray[Any]") -> tuple[str, tuple[int, ...], pickle.PickleBuffer]:
    """A plain array as (dtype string, shape, its bytes out of band)."""
    c = a if a.flags.c_contiguous else _np.ascontiguousarray(a)
    return (
        _dtype_text(c.dtype),
        tuple(c.shape),
        # (An array is a buffer; NumPy's stubs say so for Python 3.12 and later only.)
        pickle.PickleBuffer(cast("Buffer", c.reshape(-1).view(_np.uint8))),
    )


class _Pickler(pickle.Pickler):
    """Pickles what the output check needs: arrays (subclasses as plain arrays, masked arrays
    with their masks), NumPy scalars, numbers, strings, lists, tuples and dicts. Anything else
    becomes a stand-in of the same type name, which the parent's check describes as it would
    the object itself (and refuses as the in-process check would). Every value is read through
    its base type's own methods, as the program reads it, whatever a subclass overrides."""

    def reducer_override(self, obj: Any) -> Any:
        t = type(obj)
        if t in _PLAIN:
            return NotImplemented
        if issubclass(t, (type, types.FunctionType, types.BuiltinFunctionType)):
            name = (getattr(obj, "__module__", None), getattr(obj, "__qualname__", None))
            if name in _NAMED:
                return NotImplemented
            return (_standin, (t.__qualname__, t.__module__))
        if issubclass(t, _np.ndarray):
            if issubclass(t, _np.ma.MaskedArray):
                # (NumPy's stubs type the property `data` as a method.)
                data = _np.ndarray.view(cast(Any, _np.ma.MaskedArray.data).fget(obj), _np.ndarray)
                return (_glue.masked, (data, _np.asarray(_np.ma.getmaskarray(obj))))
            a = obj if t is _np.ndarray else _np.ndarray.view(obj, _np.ndarray)
            if a.dtype.fields is not None:
                return (_glue.structured, (tuple(a.shape), a.dtype.descr))
            if a.dtype.hasobject:
                return (_glue.object_array, (tuple(a.shape),))
            return (_glue.array, _array_parts(a))
        if issubclass(t, _np.generic):
            dtype = _np.generic.__dict__["dtype"].__get__(obj)
            if dtype.fields is not None:
                return (_glue.structured, ((), dtype.descr))
            if dtype.hasobject:
                return (_glue.object_array, ((),))
            return (_glue.scalar, (_dtype_text(dtype), _np.generic.tobytes(obj)))
        base = _as_base(obj, t)
        if base is not None:
            return (type(base), (base,))
        return (_standin, (t.__qualname__, getattr(t, "__module__", "") or ""))
