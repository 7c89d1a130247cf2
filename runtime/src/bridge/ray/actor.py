# A pyop worker as a Ray actor (`bridge/ray/mod.rs`): it runs after `worker/host.py`'s text, in a
# module of its own in the actor's process (`driver.py`'s `_Host` runs it from the text the
# program sends), so no node needs a file of pyop's. Each actor runs one call at a time (`max_concurrency` 1) and keeps the modules of the
# bodies the program sent it, by key, as a worker process does.
#
# Arguments arrive as Ray deserialised them: NumPy arrays read-only (from the object store, without
# a copy on the node that holds them, or from the call's own bytes when small; a test checks
# both) and plain values. What a call returns to the
# program, always a tuple whose first item says what it is:
#   ("array", dtype, shape, bytes)     a plain array of numbers: its dtype string, shape and its
#                                      bytes as a uint8 array (Ray moves it out of band)
#   ("pickled", payload, [buffers])    anything else, pickled by host.py's `_Pickler` (what the
#                                      program's restricted unpickler reads), large buffers out
#                                      of band as uint8 arrays
#   ("wrote", [arrays])                the body wrote the `out` arrays it was given
#   ("raised", exc_json)               an exception: host.py's `_exception_info`, as JSON
#   ("unloaded",)                      the module is not loaded here (never, while the program's
#                                      record of each actor's loads is right: it ends the actor)

import json
import os
import sys
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # defined by host.py, whose text runs before this file's (driver.py)
    from host import _PYOP, _exception_info, _load_module, _Pickler, _PyopStub

_np: Any = None  # NumPy, once the actor has imported it (host.py's global: one namespace)


class PyopActor:
    def __init__(self, importer, argv):
        global _np
        import numpy

        _np = numpy
        sys.argv[:] = argv
        sys.modules["pyop"] = _PyopStub("pyop")
        ns = {}
        exec(compile(importer, _PYOP, "exec"), ns)
        self._install_package = ns["_install_package"]
        self._modules = {}

    def where(self):
        """Where this actor runs, and with what: the program checks these against its own."""
        import ray

        ctx = ray.get_runtime_context()
        return {
            "pid": os.getpid(),
            "node": ctx.get_node_id(),
            "ip": ray.util.get_node_ip_address(),
            "python": "%d.%d" % sys.version_info[:2],
            "numpy": _np.__version__,
            "ray": ray.__version__,
        }

    def load(self, message):
        """Loads a body's module from its load request (`protocol.rs`, `Request::Load`, as JSON);
        returns None, or the exception loading it raised (as JSON)."""
        msg = json.loads(message)
        key = (msg["key"]["base"], msg["key"]["generation"])
        for old in [k for k in self._modules if k[0] == key[0]]:
            del self._modules[old]
        try:
            module = _load_module(msg, self._install_package)
        except BaseException as e:  # noqa: BLE001 - reported to the program
            return json.dumps(_exception_info(e, "load"))
        self._modules[key] = module
        return None

    def unload(self, base):
        for old in [k for k in self._modules if k[0] == base]:
            del self._modules[old]

    def ping(self, base, generation, fns):
        module = self._modules.get((base, generation))
        return [name for name in fns if not callable(getattr(module, name, None))]

    def call(self, base, generation, function, args, outs):
        module = self._modules.get((base, generation))
        if module is None:
            return ("unloaded",)
        kwargs = {}
        if outs is not None:
            arrays = [_np.zeros(shape, dtype) for dtype, shape in outs]
            kwargs["out"] = arrays[0] if len(arrays) == 1 else tuple(arrays)
        try:
            result = getattr(module, function)(*args, **kwargs)
        except BaseException as e:  # noqa: BLE001 - every exception goes back to the program
            return ("raised", json.dumps(_exception_info(e, "call")))
        if outs is not None and (result is None or result is kwargs["out"]):
            return ("wrote", arrays)
        try:
            return _parts(result)
        except BaseException as e:  # noqa: BLE001 - a result that cannot be pickled
            return ("raised", json.dumps(_exception_info(e, "result")))


def _parts(value):
    if type(value) is _np.ndarray and value.dtype.kind in "biufc":
        # (`ascontiguousarray` would make a 0-d array 1-d.)
        c = value if value.flags.c_contiguous else _np.ascontiguousarray(value)
        return ("array", c.dtype.str, list(c.shape), c.reshape(-1).view(_np.uint8))
    import io

    buffers = []
    f = io.BytesIO()
    _Pickler(f, protocol=5, buffer_callback=buffers.append).dump(value)
    raws = [_np.frombuffer(pb.raw(), dtype=_np.uint8) for pb in buffers]
    return ("pickled", f.getvalue(), raws)
