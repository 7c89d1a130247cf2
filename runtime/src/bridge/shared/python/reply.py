# The program's side of a worker's reply (`bridge/shared/mod.rs`): unpickling what a worker sent,
# and rebuilding its exceptions. Run once, in a namespace of its own, under the file name
# `<pyop>`, after `worker/python/pickle_names.py`'s text, which names what a worker's pickle may
# name: the plain types' constructors and the constructors below, which rebuild arrays from a
# dtype string, a shape and bytes. No NumPy reduce and no dtype state is ever unpickled, so
# nothing a body returns can make the program run code or read plain bytes as objects.

import builtins as _builtins
import io as _io
import pickle as _pickle
from typing import TYPE_CHECKING, Any, Callable, Iterable, Optional

if TYPE_CHECKING:  # defined by pickle_names.py, whose text runs before this file's
    import numpy
    from numpy.typing import NDArray
    from pickle_names import _PICKLED_BUILTINS, _PICKLED_CONSTRUCTORS

# The stand-in classes made lately, by (qualname, module), least recently used first: a body
# returning objects of generated classes (`type("Gen%d" % n, ...)`, `make_dataclass`) names a new
# class each call, so at most `_CLASSES_KEPT` are kept (an evicted one is freed with its last
# stand-in, and made again if its names come back).
_classes: dict[tuple[str, str], type] = {}
_CLASSES_KEPT = 256


def _standin_class(qualname: str, module: str) -> type:
    key = (qualname, module)
    cls = _classes.pop(key, None)
    if cls is None:
        cls = type(
            qualname.rpartition(".")[2],
            (),
            {
                "__module__": module,
                "__qualname__": qualname,
                "__repr__": lambda self: "<%s.%s from a pyop worker>" % (module, qualname),
            },
        )
        while len(_classes) >= _CLASSES_KEPT:
            try:
                del _classes[next(iter(_classes))]
            except (KeyError, RuntimeError, StopIteration):  # another thread changed it
                break
    _classes[key] = cls
    return cls


def _standin(qualname: str, module: str) -> object:
    """A value the worker could not send as it is: an object of a class of the same name."""
    return _standin_class(qualname, module)()


def _ml_dtype_refused(name: str) -> _pickle.UnpicklingError:
    # One of ml_dtypes' types (sent as `ml_dtypes.<name>`: its `str` is a void's, `<V2`). A
    # worker op is in numpy mode, whose outputs are NumPy's dtypes, so none is ever read: refused
    # by name, without importing ml_dtypes in the program for a worker.
    return _pickle.UnpicklingError(
        "a pyop worker sent values of ml_dtypes' %s, which a worker op cannot return: its "
        "outputs are NumPy's dtypes (ml_dtypes' bfloat16 and float8_e4m3fn are read as bf16 and "
        "f8e4m3 in the program, in tensor mode or numpy mode with dlpack); convert it in the "
        "body (`.astype(numpy.float32)`)" % name
    )


def _plain_dtype(text: object) -> "numpy.dtype[Any]":
    import numpy

    text = str(text)
    if text.startswith("ml_dtypes."):
        raise _ml_dtype_refused(text[len("ml_dtypes.") :])
    dt = numpy.dtype(text)
    if dt.hasobject or dt.fields is not None:
        raise _pickle.UnpicklingError("a pyop worker sent bytes of a dtype with objects or fields")
    return dt


# The dtypes `_array` was sent, checked (each a string a worker chose: the cache stops growing at
# 64), and NumPy's `frombuffer` once NumPy is imported.
_array_dtypes: "dict[str, numpy.dtype[Any]]" = {}
_frombuffer: Optional[Callable[..., Any]] = None


def _array(dtype: str, shape: tuple[int, ...], buffer: Any) -> "NDArray[Any]":
    global _frombuffer
    dt = _array_dtypes.get(dtype)
    if dt is None:
        dt = _plain_dtype(dtype)
        if len(_array_dtypes) < 64:
            _array_dtypes[dtype] = dt
    if _frombuffer is None:
        import numpy

        _frombuffer = numpy.frombuffer
    # (Positional: NumPy parses keywords slower than it makes the array.)
    return _frombuffer(buffer, dt).reshape(shape)


def _scalar(dtype: str, data: bytes) -> Any:
    import numpy

    return numpy.frombuffer(bytes(data), dtype=_plain_dtype(dtype))[0]


def _object_array(shape: Iterable[int]) -> "NDArray[Any]":
    # Its values do not matter: the output check refuses object arrays. One element broadcast to
    # the shape, so a tiny result in the worker (itself a broadcast) costs nothing here.
    import numpy

    return numpy.broadcast_to(numpy.empty((), dtype=object), tuple(shape))


def _structured(shape: Iterable[int], descr: list[Any]) -> "NDArray[Any]":
    # The same: refused for having fields, whatever they hold.
    import numpy

    one = numpy.zeros((), dtype=numpy.dtype([tuple(f) for f in descr]))
    return numpy.broadcast_to(one, tuple(shape))


def _masked(data: "NDArray[Any]", mask: "NDArray[Any]") -> "numpy.ma.MaskedArray[Any, Any]":
    import numpy

    return numpy.ma.masked_array(data, mask=mask)


# What each of `_PICKLED_CONSTRUCTORS` is in the program.
_CONSTRUCTORS: dict[str, Callable[..., object]] = {
    "standin": _standin,
    "array": _array,
    "scalar": _scalar,
    "object_array": _object_array,
    "structured": _structured,
    "masked": _masked,
}


class _Unpickler(_pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        if module == "_pyop_worker" and name in _PICKLED_CONSTRUCTORS:
            return _CONSTRUCTORS[name]
        if module == "builtins" and name in _PICKLED_BUILTINS:
            return super().find_class(module, name)
        raise _pickle.UnpicklingError(
            "a pyop worker sent %s.%s, which is not a value pyop reads" % (module, name)
        )


def loads(data: bytes, buffers: Iterable[Any]) -> Any:
    return _Unpickler(_io.BytesIO(data), buffers=buffers).load()


def exception(
    type_name: str, module: str, bases: Iterable[str], message: str, name: Optional[str]
) -> BaseException:
    """An exception of the worker's type name, deriving from the same builtin exception (so it
    maps to the same error kind), whose str() is the worker's message exactly."""
    for b in bases:
        base = getattr(_builtins, b, None)
        if not (isinstance(base, type) and issubclass(base, BaseException)):
            continue
        cls: type[BaseException] = type(
            type_name, (base,), {"__module__": module, "__str__": lambda self: message}
        )
        try:
            e = cls.__new__(cls)
            BaseException.__init__(e, message)
        except Exception:  # noqa: BLE001 - a base that cannot be made this way
            continue
        if name is not None and isinstance(e, ImportError):
            e.name = name
        return e
    other: type[Exception] = type(
        type_name, (Exception,), {"__module__": module, "__str__": lambda self: message}
    )
    return other(message)
