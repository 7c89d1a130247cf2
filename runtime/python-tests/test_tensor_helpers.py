"""The `pyop` module's Python helpers (`bridge/tensor/python/tensor_helpers.py`): module-level
forms of the tensor methods, numbers made tensors first."""

import types

from conftest import FakeTensor

METHODS = (
    "abs exp log sqrt square sin cos tanh relu sigmoid erf gelu silu floor ceil round sign "
    "recip clamp sum mean max min argmax argmin reshape transpose t unsqueeze squeeze "
    "broadcast_to narrow to_dtype detach flatten contiguous numpy tolist"
).split()


def test_each_method_has_a_module_level_form(tensor_helpers: types.ModuleType) -> None:
    for name in METHODS:
        f = getattr(tensor_helpers, name)
        assert (f.__name__, f.__qualname__) == (name, name)
        assert f.__doc__ == "pyop.%s(x, ...) is x.%s(...)" % (name, name)
    assert not hasattr(tensor_helpers, "_name")


def test_a_form_calls_the_method_of_its_first_argument_made_a_tensor(
    tensor_helpers: types.ModuleType,
) -> None:
    assert tensor_helpers.log(3) == ("log", 3, (), {})
    assert tensor_helpers.clamp(FakeTensor(2), 0, max=1) == ("clamp", 2, (0,), {"max": 1})
    assert tensor_helpers.reshape([1, 2], 2, 1) == ("reshape", [1, 2], (2, 1), {})


def test_maximum_and_minimum_take_the_tensor_either_side(
    tensor_helpers: types.ModuleType,
) -> None:
    assert tensor_helpers.maximum(FakeTensor(1), 2) == ("maximum", 1, (2,), {})
    assert tensor_helpers.maximum(2, FakeTensor(5)) == ("maximum", 5, (2,), {})
    assert tensor_helpers.minimum(1, 2) == ("minimum", 1, (2,), {})
    assert tensor_helpers.minimum.__name__ == "minimum"


def test_matmul_is_the_operator(tensor_helpers: types.ModuleType) -> None:
    assert tensor_helpers.matmul(FakeTensor(1), 2) == ("@", 1, 2)
    assert tensor_helpers.matmul(2, FakeTensor(1)) == ("r@", 1, 2)
