"""Bodies for tests/in_process/numpy_tests.rs, embedded at compile time with `file = ...`."""

import numpy as np

calls = 0


def zscore(x):
    global calls
    calls += 1
    return ((x - x.mean()) / x.std()).astype(np.float32)


def call_count(x):
    # Shares the module instance with `zscore`: sees its counter.
    return np.int64(calls)


def fails(x):
    helper_that_fails(x)


def helper_that_fails(x):
    raise ValueError("x must be positive, got %r" % float(x.min()))


seen = []


def log_stats(x, tag):
    seen.append((tag, float(x.sum())))


def last_logged(x):
    return np.array([len(seen), seen[-1][1]], dtype=np.float64)
