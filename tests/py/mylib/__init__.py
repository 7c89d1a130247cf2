"""A package embedded with `#[py_op(package = "tests/py/mylib")]`: relative imports work."""

from . import helpers
from .sub import deep


def lib_fn(x):
    return helpers.double(x) + deep.ONE


def where_from(x):
    import pyop

    loader = type(__spec__.loader).__name__
    return pyop.tensor([int(loader == "_EmbeddedPackage"), int(__name__ == "mylib")])
