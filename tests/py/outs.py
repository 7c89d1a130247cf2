"""Bodies that write into `out` in each of its forms (tests/in_process/numpy_tests.rs): each records the
address of every buffer it was given, which `out_addresses` hands back to Rust."""

import numpy as np

seen = []
kept = []


def _record(*arrays):
    seen[:] = [a.__array_interface__["data"][0] for a in arrays]


def out_addresses(x):
    return np.array(seen, dtype=np.int64)


def returns_out(x, out=None):
    _record(out)
    np.add(x, np.float32(1), out=out)
    return out


def returns_none(x, out=None):
    _record(out)
    out[...] = x * 2


def declared_shape(x, out=None):
    _record(out)
    out[...] = np.arange(12, dtype=np.float32).reshape(4, 3)


def two_outputs(x, out=None):
    a, b = out
    _record(a, b)
    np.add(x, np.float32(1), out=a)
    b[...] = np.arange(x.size, dtype=np.int64)


def returns_other(x, out=None):
    _record(out)
    return x + np.float32(1)


def keeps_a_view(x, out=None):
    _record(out)
    out[...] = x
    kept.append(out[1:])


def scribble_on_kept(x):
    kept[-1][...] = -5
