"""Bodies declared with #[py_op(file = ...)] and hot reloaded in a child process
(tests/in_process/reload_tests.rs edits K, then restores this text)."""

K = 2


def reloaded(x):
    return x * K


def reloaded_grad(inputs, outputs, grads):
    return grads[0] * K


def sibling(x):
    return x * 0 + K
