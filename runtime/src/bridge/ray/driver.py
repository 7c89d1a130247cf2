# The program's side of a Ray pool (`bridge/ray/mod.rs`), run once in the program's interpreter,
# which is the Ray driver. An actor is `_Host` below, shipped to the nodes by value (Ray's
# cloudpickle); it runs `worker/host.py` and `actor.py`, whose text it is given, in a module of its
# own, so nothing of pyop is installed on the nodes. The functions below are what the Rust side
# calls; every wait has a time limit.

import sys
import types
from typing import Any

_ray: Any = None  # the `ray` module, once connected
_Actor: Any = None  # `_Host` as a Ray actor class
_actor_text = ""


class _Host:
    """The actor Ray runs: the actor's code, run from its text in the actor's process."""

    def __init__(self, text, importer, argv):
        import sys
        import types

        module = types.ModuleType("pyop_ray_actor")
        sys.modules["pyop_ray_actor"] = module
        exec(compile(text, "<pyop>", "exec"), module.__dict__)
        self.actor = module.PyopActor(importer, argv)

    def where(self):
        return self.actor.where()

    def load(self, message):
        return self.actor.load(message)

    def unload(self, base):
        return self.actor.unload(base)

    def ping(self, base, generation, fns):
        return self.actor.ping(base, generation, fns)

    def call(self, base, generation, function, args, outs):
        return self.actor.call(base, generation, function, args, outs)


def connect(address, namespace, actor_text):
    """Connects this interpreter to the cluster, once, and defines the actor class. Returns
    the driver's versions (Python, NumPy, Ray), which each actor's must match."""
    global _ray, _Actor, _actor_text
    import numpy
    import ray

    if not ray.is_initialized():
        import logging

        ray.init(
            address=address,
            namespace=namespace,
            logging_level=logging.ERROR,
            log_to_driver=True,
            include_dashboard=False if address is None else None,
        )
    if _Actor is None:
        module = types.ModuleType("pyop_ray_host")
        module.__dict__["_Host"] = _Host
        _Host.__module__ = "pyop_ray_host"
        sys.modules["pyop_ray_host"] = module
        ray.cloudpickle.register_pickle_by_value(module)
        _Actor = ray.remote(_Host)
    _ray = ray
    _actor_text = actor_text
    return {
        "python": "%d.%d" % sys.version_info[:2],
        "numpy": numpy.__version__,
        "ray": ray.__version__,
    }


def same_cluster(address):
    """Whether `address` names the cluster this driver joined (another spelling of it: the
    loopback address for the head's own, say)."""
    try:
        from ray._private.services import canonicalize_bootstrap_address

        ours = _ray.get_runtime_context().gcs_address
        return canonicalize_bootstrap_address(address) == ours
    except Exception:  # noqa: BLE001 - Ray's private helper moved: only the same text is
        return False


def start(options, importer, argv, timeout):
    """Starts an actor and says where it runs (`PyopActor.where`): (the actor, that dict). An
    actor that does not answer in `timeout` seconds is killed."""
    actor = _Actor.options(max_concurrency=1, **options).remote(_actor_text, importer, argv)
    try:
        return actor, _ray.get(actor.where.remote(), timeout=timeout)
    except BaseException:
        _ray.kill(actor, no_restart=True)
        raise


def load(actor, message, timeout):
    return _ray.get(actor.load.remote(message), timeout=timeout)


def call(actor, key, function, args, outs, timeout):
    return _ray.get(actor.call.remote(key[0], key[1], function, args, outs), timeout=timeout)


def ping(actor, key, fns, timeout):
    return _ray.get(actor.ping.remote(key[0], key[1], fns), timeout=timeout)


def unload(actor, base):
    actor.unload.remote(base)  # not waited for: the actor runs its calls in order


def kill(actor):
    _ray.kill(actor, no_restart=True)


def shutdown():
    """Disconnects the driver (at the program's exit: Ray's threads must stop before the
    process's own destructors run, and an embedded interpreter runs no `atexit` of Python's)."""
    if _ray is not None and _ray.is_initialized():
        import gc

        # No collection from here on: a handle of an actor collected during `shutdown` calls
        # into Ray's worker as it goes (an abort), and the process is ending anyway.
        gc.disable()
        _ray.shutdown()


def failure(e):
    """What a failed wait means: "timeout" (the limit passed), "lost" (the actor or its node is
    gone), or None (anything else, reported as it is)."""
    ex = _ray.exceptions
    if isinstance(e, ex.GetTimeoutError):
        return "timeout"
    lost = tuple(
        getattr(ex, name)
        for name in (
            "RayActorError",
            "ActorDiedError",
            "ActorUnavailableError",
            "NodeDiedError",
            "ObjectLostError",
            "OwnerDiedError",
            "WorkerCrashedError",
            "LocalRayletDiedError",
        )
        if hasattr(ex, name)
    )
    return "lost" if isinstance(e, lost) else None
