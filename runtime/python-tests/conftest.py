"""The Python files embedded in pyop's crates, loaded by path as the crates run them.

Each fixture runs the texts one namespace gets, in the order the Rust code puts them together
(`include_str!`/`concat!`), each compiled under its own path so that a failure points at its
line: a worker's (`worker/process.rs`: `pickle_names.py`, `host.py`, `ray/python/relay.py`,
`worker.py`), the program's reply reader (`bridge/shared/mod.rs`: `pickle_names.py`,
`reply.py`), a Ray actor's (`worker/ray/mod.rs`: `pickle_names.py`, `host.py`, `actor.py`), the
importer, the macro's checker and the tensor helpers. Run as a module other than
`__pyop_worker__`, `worker.py` starts nothing (no guardian, no socket, no main loop); run as a
module other than `__main__`, `check.py` reads no stdin.

Run with `scripts/dev.sh test` (the `pytest` step), or by hand:
`.venv/bin/python -m pytest runtime/python-tests -q`.
"""

import sys
import types
from pathlib import Path
from typing import Any, Callable, Iterator, Optional

import numpy
import pytest

RUNTIME = Path(__file__).resolve().parent.parent / "src"
MACROS = RUNTIME.parent.parent / "macros" / "src"

PICKLE_NAMES = RUNTIME / "worker/python/pickle_names.py"
HOST = RUNTIME / "worker/python/host.py"
WORKER = RUNTIME / "worker/python/worker.py"
RELAY = RUNTIME / "worker/ray/python/relay.py"
ACTOR = RUNTIME / "worker/ray/python/actor.py"
REPLY = RUNTIME / "bridge/shared/python/reply.py"
TENSOR_HELPERS = RUNTIME / "bridge/tensor/python/tensor_helpers.py"
IMPORTER = RUNTIME / "body/python/importer.py"
CHECK = MACROS / "python/check.py"

# What each namespace runs, in order (the Rust side's `concat!`s and `run_pyop_code`s).
WORKER_TEXTS = (PICKLE_NAMES, HOST, RELAY, WORKER)
ACTOR_TEXTS = (PICKLE_NAMES, HOST, ACTOR)
REPLY_TEXTS = (PICKLE_NAMES, REPLY)


def run_texts(
    name: str, paths: "tuple[Path, ...]", namespace: Optional[dict[str, Any]] = None
) -> types.ModuleType:
    """A module named `name` that ran the files at `paths`, one after the other, in one
    namespace (starting from a copy of `namespace`, if given)."""
    module = types.ModuleType(name)
    if namespace is not None:
        module.__dict__.update(namespace)
        module.__dict__["__name__"] = name
    for path in paths:
        exec(compile(path.read_text(encoding="utf-8"), str(path), "exec"), module.__dict__)
    return module


@pytest.fixture(scope="session")
def worker() -> types.ModuleType:
    """A worker's namespace with NumPy imported, as `_main` leaves it: `host.py`'s names (its
    pickler, whose `_pyop_worker` module is put in `sys.modules`) and `worker.py`'s."""
    module = run_texts("pyop_worker_under_test", WORKER_TEXTS)
    module._np = numpy
    return module


@pytest.fixture(scope="session")
def host(worker: types.ModuleType) -> types.ModuleType:
    """`host.py`'s names: the worker's namespace (one `_pyop_worker` module for every test)."""
    return worker


@pytest.fixture(scope="session")
def reply() -> types.ModuleType:
    """The program's reply reader (`bridge/shared/mod.rs` runs it in a namespace of its own)."""
    return run_texts("pyop_reply_under_test", REPLY_TEXTS)


@pytest.fixture()
def actor(worker: types.ModuleType, monkeypatch: pytest.MonkeyPatch) -> types.ModuleType:
    """`actor.py` run after `host.py`'s names (the worker's, so that the pickler's
    `_pyop_worker` is the one in `sys.modules`). `PyopActor` sets `sys.argv` and
    `sys.modules["pyop"]`: both are put back after the test."""
    monkeypatch.setattr(sys, "argv", list(sys.argv))
    monkeypatch.delitem(sys.modules, "pyop", raising=False)
    return run_texts("pyop_ray_actor_under_test", (ACTOR,), worker.__dict__)


@pytest.fixture()
def importer() -> Iterator[types.ModuleType]:
    """The embedded-package importer; every finder it installed is taken off `sys.meta_path`,
    and every module it loaded out of `sys.modules`, after the test."""
    module = run_texts("pyop_importer_under_test", (IMPORTER,))
    yield module
    for name, finder in module._packages.items():
        if finder in sys.meta_path:
            sys.meta_path.remove(finder)
        for key in [k for k in sys.modules if k == name or k.startswith(name + ".")]:
            del sys.modules[key]


@pytest.fixture(scope="session")
def check() -> types.ModuleType:
    """The macro's build-time checker, imported (its request loop does not run)."""
    return run_texts("pyop_check_under_test", (CHECK,))


class FakeTensor:
    """Stands in for `pyop.Tensor` in the tensor helpers' namespace: records the method called
    on it and returns (method, value, arguments)."""

    def __init__(self, value: object) -> None:
        self.value = value

    def __getattr__(self, name: str) -> Callable[..., Any]:
        if name.startswith("__"):
            raise AttributeError(name)
        return lambda *args, **kwargs: (name, self.value, args, kwargs)

    def __matmul__(self, other: object) -> object:
        return ("@", self.value, other)

    def __rmatmul__(self, other: object) -> object:
        return ("r@", self.value, other)


@pytest.fixture(scope="session")
def tensor_helpers() -> types.ModuleType:
    """The tensor helpers run in a namespace that has `Tensor` and `tensor`, as the `pyop`
    module has (here `FakeTensor`, and `tensor` wrapping a value in one)."""
    namespace = {"Tensor": FakeTensor, "tensor": FakeTensor}
    return run_texts("pyop_tensor_helpers_under_test", (TENSOR_HELPERS,), namespace)
