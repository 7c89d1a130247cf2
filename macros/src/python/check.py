# The build-time check of #[py_op] bodies, run by the interpreter pyo3 builds against (one
# process per rustc run, started on the first check). It compiles the source without running it
# and reads the named functions' signatures from its syntax tree.
#
# Protocol, one request per line on stdin, fields separated by tabs, each field escaped (`\\`,
# `\n`, `\t`, `\r`): filename, source, function, positional argument names (comma-separated),
# role ("body" or "gradient"). One answer per line on stdout:
#   ok
#   error <TAB> python line (0: none) <TAB> message
#   defer <TAB> reason   (what only running the source can tell; validate() checks it)
#
# Run as a script (`python -I -c`, `__name__` "__main__"); imported (the tests in
# `runtime/python-tests/`), it only defines its functions. Type-checked with `mypy --strict`; the
# interpreter may be any pyo3 builds against, so the annotations are Python 3.9's.
import ast
import io
import re
import sys
import warnings
from typing import Optional, Union

# A function definition, as the syntax tree has it.
_Def = Union[ast.FunctionDef, ast.AsyncFunctionDef]


_ESCAPES = {"n": "\n", "t": "\t", "r": "\r", "\\": "\\"}


def unescape(s: str) -> str:
    return re.sub(r"\\(.)", lambda m: _ESCAPES.get(m.group(1), m.group(1)), s, flags=re.S)


def escape(s: str) -> str:
    return s.replace("\\", "\\\\").replace("\n", "\\n").replace("\t", "\\t").replace("\r", "\\r")


def syntax_error(e: SyntaxError, filename: str) -> tuple[int, str]:
    # An error inside an f-string on Python < 3.9 is numbered within the f-string: no line then.
    line = 0 if e.filename == "<fstring>" else (e.lineno or 0)
    where = f", line {line}" if line else ""
    msg = f"Python syntax error in {filename}{where}: {e.msg}"
    text = (e.text or "").rstrip("\n")
    if text and line:
        stripped = text.lstrip()
        indent = len(text) - len(stripped)
        shown = stripped[:200].expandtabs()
        msg += "\n    " + shown + ("…" if len(stripped) > 200 else "")
        at = (e.offset or 0) - 1 - indent
        if 0 <= at < 200:
            msg += "\n    " + " " * len(stripped[:at].expandtabs()) + "^"
    return line, msg


NAMED_EXPR = getattr(ast, "NamedExpr", ())  # Python 3.8+
DYNAMIC = {"globals", "exec", "eval", "setattr", "vars", "__import__", "locals"}


def module_names(tree: ast.Module) -> tuple[dict[str, list[_Def]], set[str], bool]:
    """Names bound at module level: (functions defined directly, other bindings, dynamic?)."""
    defs: dict[str, list[_Def]] = {}
    other: set[str] = set()
    dynamic = False

    def bind_target(t: ast.AST) -> None:
        for n in ast.walk(t):
            if isinstance(n, ast.Name):
                other.add(n.id)

    def visit(stmts: list[ast.stmt], top: bool) -> None:
        nonlocal dynamic
        for s in stmts:
            if isinstance(s, (ast.FunctionDef, ast.AsyncFunctionDef)):
                if top:
                    defs.setdefault(s.name, []).append(s)
                else:
                    other.add(s.name)  # defined under a condition: its signature is not certain
                continue
            if isinstance(s, ast.ClassDef):
                other.add(s.name)
                continue
            if isinstance(s, (ast.Import, ast.ImportFrom)):
                for a in s.names:
                    if a.name == "*":
                        dynamic = True
                    other.add((a.asname or a.name).split(".")[0])
            elif isinstance(s, (ast.Assign, ast.AnnAssign, ast.AugAssign)):
                for t in s.targets if isinstance(s, ast.Assign) else [s.target]:
                    bind_target(t)
            elif isinstance(s, (ast.For, ast.AsyncFor)):
                bind_target(s.target)
            elif isinstance(s, (ast.With, ast.AsyncWith)):
                for item in s.items:
                    if item.optional_vars is not None:
                        bind_target(item.optional_vars)
            for n in ast.walk(s):
                if isinstance(n, NAMED_EXPR):
                    bind_target(n.target)
                elif isinstance(n, ast.Name) and n.id in DYNAMIC:
                    dynamic = True
            for field in ("body", "orelse", "finalbody"):
                block = getattr(s, field, None)
                if isinstance(block, list):
                    visit(block, False)
            for h in getattr(s, "handlers", None) or []:
                if h.name:
                    other.add(h.name)
                visit(h.body, False)
            for case in getattr(s, "cases", None) or []:
                visit(case.body, False)

    visit(tree.body, True)
    # Anywhere in the module (function and class bodies, decorators, defaults): a `global` that
    # can rebind a name, a name bound by a `match` pattern, and what rebinds names dynamically.
    for n in ast.walk(tree):
        if isinstance(n, ast.Global):
            other.update(n.names)
        elif isinstance(n, ast.Name) and n.id in DYNAMIC:
            dynamic = True
        elif isinstance(n, ast.Attribute) and (
            n.attr == "__dict__"
            or (n.attr == "modules" and isinstance(n.value, ast.Name) and n.value.id == "sys")
        ):
            dynamic = True
        else:
            for field in ("name", "rest"):  # MatchAs, MatchStar, MatchMapping (3.10+)
                if type(n).__name__ in ("MatchAs", "MatchStar", "MatchMapping"):
                    v = getattr(n, field, None)
                    if isinstance(v, str):
                        other.add(v)
    if "__getattr__" in defs or "__getattr__" in other:
        dynamic = True  # PEP 562: the module answers for names it does not bind
    return defs, other, dynamic


def describe(fn: _Def) -> str:
    a = fn.args
    parts = []
    pos = getattr(a, "posonlyargs", []) + a.args
    first_default = len(pos) - len(a.defaults)
    for i, p in enumerate(pos):
        parts.append(p.arg + ("=…" if i >= first_default else ""))
        if getattr(a, "posonlyargs", None) and i == len(a.posonlyargs) - 1:
            parts.append("/")
    if a.vararg:
        parts.append("*" + a.vararg.arg)
    elif a.kwonlyargs:
        parts.append("*")
    for k, d in zip(a.kwonlyargs, a.kw_defaults):
        parts.append(k.arg + ("=…" if d is not None else ""))
    if a.kwarg:
        parts.append("**" + a.kwarg.arg)
    return f"{fn.name}({', '.join(parts)})"


def check_call(fn: _Def, names: list[str], role: str) -> Optional[str]:
    """None if calling fn with len(names) positional arguments works, else why not."""
    a = fn.args
    pos = getattr(a, "posonlyargs", []) + a.args
    required = len(pos) - len(a.defaults)
    n = len(names)
    missing_kw = [
        k.arg for k, d in zip(a.kwonlyargs, a.kw_defaults) if d is None and k.arg != "out"
    ]
    if required <= n and (a.vararg or n <= len(pos)) and not missing_kw:
        return None
    # A required positional `out` after the op's arguments: pyop passes it by keyword when it
    # knows every output's shape (numpy mode), which only the call can tell.
    posonly = len(getattr(a, "posonlyargs", []))
    if [p.arg for p in pos[n:required]] == ["out"] and n >= posonly and not missing_kw:
        return "defer"
    if role == "gradient":
        call = f"{fn.name}(inputs, outputs, grads)"
    else:
        call = f"{fn.name}({', '.join(names)})" if names else f"{fn.name}()"
    if missing_kw:
        why = "keyword-only " + ", ".join(f"`{k}`" for k in missing_kw) + " without a default"
    elif n < required:
        why = f"at least {required} positional argument{'s' if required != 1 else ''}"
    else:
        why = f"at most {len(pos)} positional argument{'s' if len(pos) != 1 else ''}"
    what = "the gradient" if role == "gradient" else "the body"
    return (
        f"{what} `{describe(fn)}` takes {why}, but pyop calls it as `{call}` "
        f"({n} positional argument{'s' if n != 1 else ''})"
    )


def handle(filename: str, source: str, function: str, names: list[str], role: str) -> str:
    try:
        compile(source, filename, "exec", dont_inherit=True)
        tree = ast.parse(source, filename)
    except SyntaxError as e:
        line, msg = syntax_error(e, filename)
        return f"error\t{line}\t{escape(msg)}"
    except ValueError as e:  # e.g. a NUL byte
        return f"error\t0\t{escape(f'{filename} cannot be compiled: {e}')}"
    if role == "gradient":
        names = ["inputs", "outputs", "grads"]
    defs, other, dynamic = module_names(tree)
    what = "gradient" if role == "gradient" else "function"
    if function not in defs:
        if function in other or dynamic:
            return "defer\t" + escape(f"`{function}` is not a plain top-level `def`")
        found = sorted(defs)
        listing = ", ".join(f"`{f}`" for f in found) if found else "no top-level functions"
        return "error\t0\t" + escape(
            f"{filename} defines no {what} `{function}`; it defines {listing}"
        )
    fns = defs[function]
    fn = fns[-1]
    if len(fns) > 1 or function in other or fn.decorator_list or dynamic:
        return "defer\t" + escape(f"`{function}` is redefined, decorated, or may be rebound")
    why = check_call(fn, names, role)
    if why == "defer":
        return "defer\t" + escape("a positional `out`")
    if why:
        return f"error\t{fn.lineno}\t{escape(f'{filename}, line {fn.lineno}: {why}')}"
    return "ok"


def main() -> None:
    """Answers requests until stdin ends."""
    warnings.simplefilter("ignore")  # SyntaxWarnings are Python's to print at run time
    # UTF-8 and "\n" only, whatever the platform's defaults (`-I` ignores PYTHONUTF8): one line
    # is one request, and a "\r" in a source stays inside its field.
    sys.stdin = io.TextIOWrapper(sys.stdin.buffer, encoding="utf-8", newline="\n")
    sys.stdout = io.TextIOWrapper(sys.stdout.buffer, encoding="utf-8", newline="\n")

    for raw in sys.stdin:
        fields = [unescape(f) for f in raw.rstrip("\n").split("\t")]
        try:
            filename, source, function, names, role = fields
            answer = handle(filename, source, function, [n for n in names.split(",") if n], role)
        except Exception as e:  # never fail a build on the checker's own trouble
            answer = "defer\t" + escape(f"the build-time check failed: {e!r}")
        sys.stdout.write(answer + "\n")
        sys.stdout.flush()


if __name__ == "__main__":
    main()
