# Module-level forms of the methods of pyop.Tensor (`pyop.log(x)` as well as `x.log()`);
# numbers become tensors. Run in the `pyop` module's namespace when it is created.


def _method(name):
    def f(x, *args, **kwargs):
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


def _commutative(name):
    def f(a, b):
        if isinstance(a, Tensor):
            return getattr(a, name)(b)
        if isinstance(b, Tensor):
            return getattr(b, name)(a)
        return getattr(tensor(a), name)(b)

    f.__name__ = f.__qualname__ = name
    return f


maximum = _commutative("maximum")
minimum = _commutative("minimum")


def matmul(a, b):
    return a @ b


del _name
