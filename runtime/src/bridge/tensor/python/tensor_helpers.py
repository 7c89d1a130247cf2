# Module-level forms of the methods of pyop.Tensor (`pyop.log(x)` as well as `x.log()`);
# numbers become tensors. Run in the `pyop` module's namespace when it is created
# (`bridge/tensor/module.rs`), where `Tensor` and `tensor` are defined: mypy reads them from the
# module's stub (`build/pyop.pyi`). Every name this adds is one of the module's functions or
# private (`_`), so the stub's test (`stub_tests.rs`) still finds the module it describes.

import typing as _typing

if _typing.TYPE_CHECKING:  # the `pyop` module's own, defined before this runs
    from pyop import Tensor, tensor


def _method(name: str) -> _typing.Callable[..., _typing.Any]:
    def f(x: _typing.Any, *args: _typing.Any, **kwargs: _typing.Any) -> _typing.Any:
        if not isinstance(x, Tensor):
            x = tensor(x)
        return getattr(x, name)(*args, **kwargs)

    f.__name__ = f.__qualname__ = name
    f.__doc__ = "pyop.%s(x, ...) is x.%s(...)" % (name, name)
    return f


for _name in (
    "abs",
    "exp",
    "log",
    "sqrt",
    "square",
    "sin",
    "cos",
    "tanh",
    "relu",
    "sigmoid",
    "erf",
    "gelu",
    "silu",
    "floor",
    "ceil",
    "round",
    "sign",
    "recip",
    "clamp",
    "sum",
    "mean",
    "max",
    "min",
    "argmax",
    "argmin",
    "reshape",
    "transpose",
    "t",
    "unsqueeze",
    "squeeze",
    "broadcast_to",
    "narrow",
    "to_dtype",
    "detach",
    "flatten",
    "contiguous",
    "numpy",
    "tolist",
):
    globals()[_name] = _method(_name)


def _commutative(name: str) -> _typing.Callable[[_typing.Any, _typing.Any], _typing.Any]:
    def f(a: _typing.Any, b: _typing.Any) -> _typing.Any:
        if isinstance(a, Tensor):
            return getattr(a, name)(b)
        if isinstance(b, Tensor):
            return getattr(b, name)(a)
        return getattr(tensor(a), name)(b)

    f.__name__ = f.__qualname__ = name
    return f


maximum = _commutative("maximum")
minimum = _commutative("minimum")


def matmul(a: _typing.Any, b: _typing.Any) -> _typing.Any:
    return a @ b


del _name
