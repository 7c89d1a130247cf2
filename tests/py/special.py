"""Numpy-mode bodies with registered gradients, for tests/in_process/grad_tests.rs."""

import math

import numpy as np

_erfc = np.vectorize(math.erfc, otypes=[np.float64])


def erfcx(x):
    """The scaled complementary error function exp(x²)·erfc(x)."""
    return np.exp(x * x) * _erfc(x)


def erfcx_grad(inputs, outputs, grads):
    (x,), (y,), (g,) = inputs, outputs, grads
    return g * (2 * x * y - 2 / math.sqrt(math.pi))


def four_in_three_out(a, b, n, d):
    # a, d: f64; b: f32; n: i64 (no gradient). Outputs: f64, f32, i64.
    return a * b.astype(np.float64) + d**2, (b * 3).astype(np.float32), n * 2


def four_in_three_out_grad(inputs, outputs, grads):
    a, b, n, d = inputs
    ga, gb, gn = grads
    assert gn.dtype == np.int64 and not gn.any(), "an integer output's gradient is zeros"
    return (
        ga * b.astype(np.float64),
        (ga * a).astype(np.float32) + (gb * 3).astype(np.float32),
        None,
        ga * 2 * d,
    )


def weighted(xs, w):
    return sum(x * w for x in xs)


def weighted_grad(inputs, outputs, grads):
    # One entry per tensor argument: `xs` is the only one, so its tuple of gradients may come
    # bare; `(tuple(...),)` is accepted too.
    (xs, w), (g,) = inputs, grads
    assert isinstance(xs, tuple), "a list argument reaches the gradient as a tuple"
    return tuple(g * w for x in xs)


def wrong_shape(x):
    return x * 2


def wrong_shape_grad(inputs, outputs, grads):
    return np.zeros(3)


def wrong_count(x, y):
    return x + y


def wrong_count_grad(inputs, outputs, grads):
    return (grads[0],)
