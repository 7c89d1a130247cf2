# The relay of a Ray pool's actor (`ray/mod.rs`): part of every worker's main loop (its text runs
# between `worker/python/host.py`'s and `worker.py`'s). A worker the program tells to `join`
# becomes a Ray driver of its own: it imports Ray, joins the cluster, starts its actor
# (`actor.py`, whose text it sends Ray by value) and from then on forwards each load, call, ping
# and unload to it. What the actor answers is a reply of the worker protocol less where its
# buffers lie; the relay copies the buffers into the result arena (asking for a larger one as a
# worker does), names their places and sends the reply on: the program reads a relay's answers as
# any worker's. So Ray runs only in processes pyop owns: the program's interpreter never imports
# it, and a relay killed (on a time limit, or with the program) takes its actor with it (Ray ends
# a driver's actors).
#
# A failed wait for the actor (it or its node died) is answered `lost`, and the relay exits.

from typing import TYPE_CHECKING, Any, cast

if TYPE_CHECKING:  # defined by host.py and worker.py, one namespace (process.rs)
    import numpy as _np
    from actor import PyopActor, _Outs, _Parts
    from host import _clean, _exception_info
    from typing_extensions import Buffer
    from worker import (
        _HANDLERS,
        _MAX_PICKLE,
        _Arena,
        _Copies,
        _decode,
        _Places,
        _ProtocolError,
        _result_arena,
        _room,
        _send,
        _too_large,
        _Views,
    )

_ray: Any = None  # the `ray` module, once joined
_actor: Any = None  # this relay's actor's handle
_importer_text = ""  # the embedded-package importer's code (`init`), which the actor runs too


class PyopHost:
    """The actor Ray runs: `actor.py`'s `PyopActor`, run from its text in the actor's process."""

    def __init__(self, text: str, importer: str, argv: list[str]) -> None:
        import sys
        import types

        module = types.ModuleType("pyop_ray_actor")
        sys.modules["pyop_ray_actor"] = module
        exec(compile(text, "<pyop>", "exec"), module.__dict__)
        self.actor: PyopActor = module.PyopActor(importer, argv)

    def where(self) -> dict[str, Any]:
        return self.actor.where()

    def load(self, msg: dict[str, Any]) -> dict[str, Any]:
        return self.actor.load(msg)

    def unload(self, base: str) -> None:
        return self.actor.unload(base)

    def ping(self, key: list[Any], fns: list[str]) -> dict[str, Any]:
        return self.actor.ping(key, fns)

    def call(self, key: list[Any], function: str, args: list[Any], outs: "_Outs") -> "_Parts":
        return self.actor.call(key, function, args, outs)


def _join(msg: dict[str, Any]) -> None:
    """Joins the cluster, starts the actor and says where it runs (`joined`), or at which step
    it failed (`join_failed`)."""
    global _ray, _actor
    import sys

    def failed(stage: str, e: BaseException) -> None:
        _send({"s": "join_failed", "stage": stage, "exc": _exception_info(e, "start")})

    try:
        import ray
    except BaseException as e:  # noqa: BLE001 - reported to the program
        return failed("import", e)
    try:
        import logging
        import os

        ray.init(
            # Never a cluster of the relay's own: it would end with the relay.
            address=msg["address"] or os.environ.get("RAY_ADDRESS") or "auto",
            namespace=msg["namespace"],
            logging_level=logging.ERROR,
            log_to_driver=True,
        )
    except BaseException as e:  # noqa: BLE001
        return failed("connect", e)
    import types

    module = types.ModuleType("pyop_ray_host")
    module.__dict__["PyopHost"] = PyopHost
    PyopHost.__module__ = "pyop_ray_host"
    sys.modules["pyop_ray_host"] = module
    ray.cloudpickle.register_pickle_by_value(module)
    options = {
        "max_concurrency": 1,
        "num_cpus": msg["num_cpus"],
        "scheduling_strategy": "SPREAD",
    }
    if msg["resources"]:
        options["resources"] = {k: v for k, v in msg["resources"]}
    try:
        remote: Any = ray.remote  # (typed by Ray for decorators, not for a class's handle)
        actor = remote(PyopHost).options(**options).remote(msg["actor"], _importer_text, sys.argv)
    except BaseException as e:  # noqa: BLE001
        return failed("submit", e)
    try:
        where = ray.get(actor.where.remote(), timeout=msg["timeout"])
    except BaseException as e:  # noqa: BLE001
        try:
            ray.kill(actor, no_restart=True)
        except BaseException:  # noqa: BLE001, S110 - the relay exits when the program sees this
            pass
        return failed("place" if isinstance(e, ray.exceptions.GetTimeoutError) else "start", e)
    _ray, _actor = ray, actor
    _HANDLERS.update(call=_relay_call, load=_relay_load, ping=_relay_ping, unload=_relay_unload)
    del _HANDLERS["join"]
    _send(
        {
            "s": "joined",
            "driver": {
                "python": "%d.%d" % sys.version_info[:2],
                "numpy": _np.__version__,
                "ray": ray.__version__,
            },
            "actor": where,
        }
    )


# Ray's errors that say the actor (or its node, or Ray on this node) is gone.
_LOST = (
    "RayActorError",
    "ActorDiedError",
    "ActorUnavailableError",
    "NodeDiedError",
    "ObjectLostError",
    "OwnerDiedError",
    "WorkerCrashedError",
    "LocalRayletDiedError",
)


def _get(ref: Any) -> Any:
    """What the actor answered. If it (or its node) is gone, the program is told (`lost`); if
    the actor's own machinery raised, as a worker's (`raised`, phase `worker`). Either way the
    relay exits."""
    import os

    try:
        return _ray.get(ref)
    except BaseException as e:  # noqa: BLE001 - the actor's end, or Ray's
        lost = tuple(getattr(_ray.exceptions, n) for n in _LOST if hasattr(_ray.exceptions, n))
        if isinstance(e, lost):
            _send({"s": "lost", "why": _clean("%s: %s" % (type(e).__name__, e))})
            os._exit(75)
        _send({"s": "raised", "exc": _exception_info(e, "worker"), "retained": False})
        os._exit(70)


def _relay_load(msg: dict[str, Any]) -> None:
    _send(_get(_actor.load.remote(msg)))


def _relay_ping(msg: dict[str, Any]) -> None:
    _send(_get(_actor.ping.remote(msg["key"], msg["fns"])))


def _relay_unload(msg: dict[str, Any]) -> None:
    _actor.unload.remote(msg["base"])  # not waited for: the actor runs its requests in order


def _relay_call(msg: dict[str, Any]) -> None:
    views = _Views()
    args = _decode(msg["args"], views)
    outs = msg["out"]
    spec = None if outs is None else [(o["dtype"], o["shape"]) for o in outs]
    # Ray copies the arguments (into the call, or its object store) as the call is sent.
    ref = _actor.call.remote(msg["key"], msg["function"], args, spec)
    del args
    views.inputs.clear()
    reply, payload, bufs = _get(ref)
    del ref
    kind = reply["s"]
    if kind == "raised":
        _send(reply)
        if reply["exc"]["phase"] == "worker":
            import os

            os._exit(70)  # the actor's own machinery failed: as a worker's, it ends
        return
    placed: _Places = []
    to_copy: _Copies = []
    need = 0
    for raw in bufs:
        if raw.nbytes == 0:
            placed.append([0, 0, 0])
        else:
            need = _room(raw.nbytes, placed, to_copy, raw, need)
    if kind == "array" and len(placed) == 1:
        reply["place"] = placed[0]
    elif kind == "pickled" and len(payload) > _MAX_PICKLE:
        return _send(_too_large(len(payload), False))
    elif kind == "pickled":
        reply["bufs"] = placed
    elif kind == "wrote" and len(placed) == len(outs or ()):
        reply["outs"] = placed
    else:
        raise _ProtocolError("the actor answered a call with %r and %d buffers" % (kind, len(bufs)))
    res = cast("_Arena", _result_arena(need))  # (None only when nothing is copied)
    for off, raw in to_copy:
        # (An array is a buffer; NumPy's stubs say so for Python 3.12 and later only.)
        res.view[off : off + raw.nbytes] = cast("Buffer", raw)
    del to_copy, bufs
    _send(reply, payload if kind == "pickled" else b"")
