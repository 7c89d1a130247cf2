"""The macro's build-time check (`macros/src/python/check.py`): what it answers for a body's
source, read from its syntax tree without running it."""

import ast
import subprocess
import sys
import types

from conftest import CHECK


def error(check: types.ModuleType, line: int, message: str) -> str:
    return "error\t%d\t%s" % (line, check.escape(message))


def defer(check: types.ModuleType, reason: str) -> str:
    return "defer\t" + check.escape(reason)


def test_fields_are_escaped_and_unescaped(check: types.ModuleType) -> None:
    text = "a\\b\nc\td\re"
    assert check.escape(text) == "a\\\\b\\nc\\td\\re"
    assert check.unescape(check.escape(text)) == text
    assert check.unescape("\\x\\\\") == "x\\"


def test_a_body_that_takes_its_arguments_is_ok(check: types.ModuleType) -> None:
    assert check.handle("f.py", "def f(x, y=1, *rest):\n    pass\n", "f", ["x"], "body") == "ok"
    grad = "def g(inputs, outputs, grads):\n    pass\n"
    assert check.handle("g.py", grad, "g", ["x"], "gradient") == "ok"


def test_a_syntax_error_names_the_file_and_line(check: types.ModuleType) -> None:
    answer = check.handle("f.py", "x = 1\ndef f(:\n    pass\n", "f", [], "body")
    assert answer.startswith("error\t2\tPython syntax error in f.py, line 2: ")
    assert answer.endswith("\\n    def f(:\\n          ^")


def test_a_missing_function_names_those_defined(check: types.ModuleType) -> None:
    assert check.handle("f.py", "def g(x):\n    pass\n", "f", ["x"], "body") == error(
        check, 0, "f.py defines no function `f`; it defines `g`"
    )
    assert check.handle("f.py", "x = 1\n", "f", [], "gradient") == error(
        check, 0, "f.py defines no gradient `f`; it defines no top-level functions"
    )


def test_a_call_the_signature_cannot_take_is_an_error_at_its_line(
    check: types.ModuleType,
) -> None:
    src = "\n\ndef f(x):\n    pass\n"
    assert check.handle("f.py", src, "f", ["a", "b"], "body") == error(
        check,
        3,
        "f.py, line 3: the body `f(x)` takes at most 1 positional argument, but pyop calls it "
        "as `f(a, b)` (2 positional arguments)",
    )
    src = "def f(x, y, z=1):\n    pass\n"
    assert check.handle("f.py", src, "f", ["a"], "body") == error(
        check,
        1,
        "f.py, line 1: the body `f(x, y, z=…)` takes at least 2 positional arguments, but pyop "
        "calls it as `f(a)` (1 positional argument)",
    )
    src = "def f(x, *, k, out):\n    pass\n"
    assert check.handle("f.py", src, "f", ["a"], "body") == error(
        check,
        1,
        "f.py, line 1: the body `f(x, *, k, out)` takes keyword-only `k` without a default, but "
        "pyop calls it as `f(a)` (1 positional argument)",
    )
    assert check.handle("g.py", "def g(a):\n    pass\n", "g", [], "gradient") == error(
        check,
        1,
        "g.py, line 1: the gradient `g(a)` takes at most 1 positional argument, but pyop calls "
        "it as `g(inputs, outputs, grads)` (3 positional arguments)",
    )


def test_what_only_running_can_tell_is_deferred(check: types.ModuleType) -> None:
    cases = {
        "def f(x, out):\n    pass\n": "a positional `out`",
        "@d\ndef f(x):\n    pass\n": "`f` is redefined, decorated, or may be rebound",
        "def f(x):\n    pass\ndef f(x, y):\n    pass\n": "`f` is redefined, decorated, or may "
        "be rebound",
        "if X:\n    def f(x):\n        pass\n": "`f` is not a plain top-level `def`",
        "from m import f\n": "`f` is not a plain top-level `def`",
        "globals()['f'] = print\n": "`f` is not a plain top-level `def`",
        "def __getattr__(name):\n    pass\n": "`f` is not a plain top-level `def`",
    }
    for src, reason in cases.items():
        assert check.handle("f.py", src, "f", ["x"], "body") == defer(check, reason), src


def test_a_signature_is_described_as_written(check: types.ModuleType) -> None:
    src = "def f(a, b=1, /, c=2, *args, d, e=3, **kw):\n    pass\n"
    fn = ast.parse(src).body[0]
    assert check.describe(fn) == "f(a, b=…, /, c=…, *args, d, e=…, **kw)"
    assert check.describe(ast.parse("def g(*, k):\n    pass\n").body[0]) == "g(*, k)"


def test_module_names_sorts_defs_from_other_bindings(check: types.ModuleType) -> None:
    tree = ast.parse(
        "import a.b as c\nx, (y, z) = 1, (2, 3)\nfor i in []:\n    pass\n"
        "def f():\n    global g\nclass K:\n    pass\ntry:\n    pass\nexcept E as err:\n"
        "    def h():\n        pass\n"
    )
    defs, other, dynamic = check.module_names(tree)
    assert sorted(defs) == ["f"]
    assert other == {"c", "x", "y", "z", "i", "g", "K", "err", "h"}
    assert dynamic is False
    assert check.module_names(ast.parse("from m import *\n"))[2] is True


def test_the_script_answers_one_line_per_request() -> None:
    # As pycheck.rs runs it: `python -I -c SCRIPT`, requests on stdin.
    request = "\t".join(["f.py", "def f(x):\\n    pass\\n", "f", "x,y", "body"])
    done = subprocess.run(
        [sys.executable, "-I", "-c", CHECK.read_text()],
        input=request + "\n" + "only\ttwo\n",
        capture_output=True,
        text=True,
        timeout=30,
        check=True,
    )
    answers = done.stdout.splitlines()
    assert answers[0].startswith("error\t1\tf.py, line 1: the body `f(x)` takes at most 1 ")
    assert answers[1].startswith("defer\tthe build-time check failed: ValueError(")
    assert len(answers) == 2
