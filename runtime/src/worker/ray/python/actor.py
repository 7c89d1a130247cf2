# A pyop worker as a Ray actor (`ray/mod.rs`): it runs after `worker/python/host.py`'s text (and
# `pickle_names.py`'s before it), in a module of its own in the actor's process (the relay's
# `PyopHost` runs it from the text the relay sends Ray by value), so no node needs a file of
# pyop's. Each actor runs one call at a time (`max_concurrency` 1) and keeps the modules of the
# bodies the program sent it, by key, as a worker process does.
#
# Arguments arrive as Ray deserialised them: NumPy arrays read-only (from the object store, without
# a copy on the node that holds them, or from the call's own bytes when small; a test checks
# both) and plain values. Every answer is a reply of the worker protocol (`protocol.rs`, `Reply`,
# the very dict a worker process sends) less where its buffers lie, which the relay adds once it
# has copied them into the program's shared memory: a call answers (reply, pickle, [buffers]),
# each buffer a uint8 array that Ray moves out of band:
#   array     a plain array of numbers: its dtype and shape; one buffer, its bytes
#   pickled   anything else, pickled by host.py's `_Pickler` (what the program's restricted
#             unpickler reads); its large buffers out of band
#   wrote     the body wrote the `out` arrays it was given; one buffer each
#   raised    an exception: host.py's `_exception_info`; no buffer

import os
import sys
import types
from typing import TYPE_CHECKING, Any, Optional

if TYPE_CHECKING:  # defined by host.py, whose text runs before this file's (relay.py)
    import pickle

    import numpy
    import numpy as _np
    from host import _PYOP, _exception_info, _Installer, _load_module, _Pickler, _PyopStub
    from numpy.typing import NDArray

# (`_np`, NumPy once the actor has imported it, is host.py's global: one namespace.)

# A call's answer: the reply, the pickle (or nothing) and the buffers, each a uint8 array.
_Parts = tuple[dict[str, Any], bytes, list["NDArray[numpy.uint8]"]]
# A call's `out` arrays, each as its dtype and shape (None: the body returns its outputs).
_Outs = Optional[list[tuple[str, list[int]]]]


class PyopActor:
    def __init__(self, importer: str, argv: list[str]) -> None:
        global _np
        import numpy

        _np = numpy
        sys.argv[:] = argv
        sys.modules["pyop"] = _PyopStub("pyop")
        ns: dict[str, Any] = {}
        exec(compile(importer, _PYOP, "exec"), ns)
        self._install_package: _Installer = ns["_install_package"]
        self._modules: dict[tuple[Any, ...], types.ModuleType] = {}

    def where(self) -> dict[str, Any]:
        """Where this actor runs, and with what: the program checks these against its own."""
        import ray

        ctx = ray.get_runtime_context()
        return {
            "pid": os.getpid(),
            "node": ctx.get_node_id(),
            "ip": ray.util.get_node_ip_address(),
            "versions": {
                "python": "%d.%d" % sys.version_info[:2],
                "numpy": _np.__version__,
                "ray": ray.__version__,
            },
        }

    def load(self, msg: dict[str, Any]) -> dict[str, Any]:
        """Loads a body's module from its load request (`Request::Load`, as the relay read it)."""
        key = tuple(msg["key"])
        for old in [k for k in self._modules if k[0] == key[0]]:
            del self._modules[old]
        try:
            module = _load_module(msg, self._install_package)
        except BaseException as e:  # noqa: BLE001 - reported to the program
            return {"s": "load_failed", "exc": _exception_info(e, "load")}
        self._modules[key] = module
        return {"s": "loaded"}

    def unload(self, base: str) -> None:
        for old in [k for k in self._modules if k[0] == base]:
            del self._modules[old]

    def ping(self, key: list[Any], fns: list[str]) -> dict[str, Any]:
        module = self._modules.get(tuple(key))
        return {"s": "pong", "missing": [n for n in fns if not callable(getattr(module, n, None))]}

    def call(self, key: list[Any], function: str, args: list[Any], outs: _Outs) -> _Parts:
        module = self._modules.get(tuple(key))
        if module is None:
            # Never, while the program's record of each relay's loads is right: the actor's
            # own machinery failed, and its relay ends.
            e = KeyError("the module %r is not loaded in this actor" % (key,))
            return {"s": "raised", "exc": _exception_info(e, "worker"), "retained": False}, b"", []
        kwargs: dict[str, Any] = {}
        try:
            if outs is not None:
                arrays = [_np.zeros(shape, dtype) for dtype, shape in outs]
                kwargs["out"] = arrays[0] if len(arrays) == 1 else tuple(arrays)
            result = getattr(module, function)(*args, **kwargs)
        except BaseException as e:  # noqa: BLE001 - every exception goes back to the program
            return {"s": "raised", "exc": _exception_info(e, "call"), "retained": False}, b"", []
        if outs is not None and (result is None or result is kwargs["out"]):
            return {"s": "wrote", "retained": False}, b"", [_bytes_of(a) for a in arrays]
        try:
            return _parts(result)
        except BaseException as e:  # noqa: BLE001 - a result that cannot be pickled
            return {"s": "raised", "exc": _exception_info(e, "result"), "retained": False}, b"", []


def _bytes_of(a: "NDArray[Any]") -> "NDArray[numpy.uint8]":
    # (`ascontiguousarray` would make a 0-d array 1-d.)
    c = a if a.flags.c_contiguous else _np.ascontiguousarray(a)
    return c.reshape(-1).view(_np.uint8)


def _parts(value: object) -> _Parts:
    if type(value) is _np.ndarray and value.dtype.kind in "biufc":
        reply: dict[str, Any] = {"s": "array", "dtype": value.dtype.str, "shape": list(value.shape)}
        reply["retained"] = False
        return reply, b"", [_bytes_of(value)]
    import io

    buffers: list[pickle.PickleBuffer] = []
    f = io.BytesIO()
    _Pickler(f, protocol=5, buffer_callback=buffers.append).dump(value)
    raws = [_np.frombuffer(pb.raw(), dtype=_np.uint8) for pb in buffers]
    return {"s": "pickled", "retained": False}, f.getvalue(), raws
