"""A #[py_op(package = ...)] body; tests/in_process/reload_tests.rs adds `extra.py` under hot reload."""


def pkg_body(x):
    try:
        from . import extra  # type: ignore[attr-defined]  # added by the test, under hot reload
    except ImportError:
        return x * 0 - 1
    return x * 0 + extra.VALUE
