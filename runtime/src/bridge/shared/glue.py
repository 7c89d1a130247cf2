# The program's side of a worker's reply (`bridge/shared/mod.rs`): unpickling what a worker sent,
# and rebuilding its exceptions. Run once, in a namespace of its own, under the file name
# `<pyop>`.

import builtins as _builtins
import io as _io
import pickle as _pickle

_classes = {}


def _standin_class(qualname, module):
    key = (qualname, module)
    cls = _classes.get(key)
    if cls is None:
        cls = type(qualname.rpartition(".")[2], (), {
            "__module__": module,
            "__qualname__": qualname,
            "__repr__": lambda self: "<%s.%s from a pyop worker>" % (module, qualname),
        })
        _classes[key] = cls
    return cls


def _standin(qualname, module):
    """A value the worker could not send as it is: an object of a class of the same name."""
    return _standin_class(qualname, module)()


# What a worker's pickle may name: exactly what pickling NumPy arrays, scalars and dtypes and the
# plain types needs (worker.py's `_NAMED`), nothing that runs other code.
_ALLOWED = {
    ("numpy", "ndarray"), ("numpy", "dtype"),
    ("numpy._core.multiarray", "_reconstruct"), ("numpy.core.multiarray", "_reconstruct"),
    ("numpy._core.multiarray", "scalar"), ("numpy.core.multiarray", "scalar"),
    ("numpy._core.numeric", "_frombuffer"), ("numpy.core.numeric", "_frombuffer"),
    ("builtins", "complex"), ("builtins", "set"), ("builtins", "frozenset"),
    ("builtins", "bytearray"), ("builtins", "slice"), ("builtins", "range"),
    ("builtins", "tuple"), ("builtins", "list"), ("builtins", "dict"), ("builtins", "int"),
    ("builtins", "float"), ("builtins", "str"), ("builtins", "bytes"), ("builtins", "bool"),
}


class _Unpickler(_pickle.Unpickler):
    def find_class(self, module, name):
        if module == "_pyop_worker" and name == "standin":
            return _standin
        if (module, name) in _ALLOWED:
            return super().find_class(module, name)
        raise _pickle.UnpicklingError(
            "a pyop worker sent %s.%s, which is not a value pyop reads" % (module, name))


def loads(data, buffers):
    return _Unpickler(_io.BytesIO(data), buffers=buffers).load()


def array(buffer, dtype, shape):
    """A plain array a worker sent without a pickle: a read-only view of its bytes."""
    import numpy

    return numpy.frombuffer(buffer, dtype=dtype).reshape(shape)


def exception(type_name, module, bases, message, name):
    """An exception of the worker's type name, deriving from the same builtin exception (so it
    maps to the same error kind), whose str() is the worker's message exactly."""
    for b in bases:
        base = getattr(_builtins, b, None)
        if not (isinstance(base, type) and issubclass(base, BaseException)):
            continue
        cls = type(type_name, (base,), {"__module__": module, "__str__": lambda self: message})
        try:
            e = cls.__new__(cls)
            BaseException.__init__(e, message)
        except Exception:  # noqa: BLE001 - a base that cannot be made this way
            continue
        if name is not None and isinstance(e, ImportError):
            e.name = name
        return e
    return type(type_name, (Exception,), {"__module__": module, "__str__": lambda self: message})(message)
