# The build-time check of #[py_op] bodies, run by the interpreter pyo3 builds against (one
# process per rustc run, started on the first check). It compiles the source without running it
# and reads the named functions' signatures from its syntax tree.
#
# Protocol, one request per line on stdin, fields separated by tabs, each field escaped (`\\`,
# `\n`, `\t`): filename, source, function, positional argument names (comma-separated), role
# ("body", "gradient", or "" for a syntax check only). One answer per line on stdout:
#   ok
#   error <TAB> python line (0: none) <TAB> message
#   defer <TAB> reason   (what only running the source can tell; validate() checks it)
import ast
import sys
import warnings

warnings.simplefilter("ignore")  # SyntaxWarnings are Python's to print at run time


def unescape(s):
    out, i = [], 0
    while i < len(s):
        c = s[i]
        if c == "\\" and i + 1 < len(s):
            out.append({"n": "\n", "t": "\t", "\\": "\\"}.get(s[i + 1], s[i + 1]))
            i += 2
        else:
            out.append(c)
            i += 1
    return "".join(out)


def escape(s):
    return s.replace("\\", "\\\\").replace("\n", "\\n").replace("\t", "\\t")


def syntax_error(e, filename):
    line = e.lineno or 0
    msg = f"Python syntax error in {filename}, line {line}: {e.msg}"
    text = (e.text or "").rstrip("\n")
    if text:
        stripped = text.lstrip()
        indent = len(text) - len(stripped)
        msg += "\n    " + stripped
        if e.offset and e.offset - indent > 0:
            msg += "\n    " + " " * (e.offset - 1 - indent) + "^"
    return line, msg


NAMED_EXPR = getattr(ast, "NamedExpr", ())  # Python 3.8+
DYNAMIC = {"globals", "exec", "eval", "setattr", "vars", "__import__", "locals"}


def module_names(tree):
    """Names bound at module level: (functions defined directly, other bindings, dynamic?)."""
    defs, other, dynamic = {}, set(), False

    def bind_target(t):
        for n in ast.walk(t):
            if isinstance(n, ast.Name):
                other.add(n.id)

    def visit(stmts, top):
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
                for t in getattr(s, "targets", None) or [s.target]:
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
    return defs, other, dynamic


def describe(fn):
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


def check_call(fn, names, role):
    """None if calling fn with len(names) positional arguments works, else why not."""
    a = fn.args
    pos = getattr(a, "posonlyargs", []) + a.args
    required = len(pos) - len(a.defaults)
    n = len(names)
    missing_kw = [k.arg for k, d in zip(a.kwonlyargs, a.kw_defaults) if d is None and k.arg != "out"]
    if required <= n and (a.vararg or n <= len(pos)) and not missing_kw:
        return None
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
    return (f"{what} `{describe(fn)}` takes {why}, but pyop calls it as `{call}` "
            f"({n} positional argument{'s' if n != 1 else ''})")


def handle(filename, source, function, names, role):
    try:
        compile(source, filename, "exec", dont_inherit=True)
        tree = ast.parse(source, filename)
    except SyntaxError as e:
        line, msg = syntax_error(e, filename)
        return f"error\t{line}\t{escape(msg)}"
    except ValueError as e:  # e.g. a NUL byte
        return f"error\t0\t{escape(f'{filename} cannot be compiled: {e}')}"
    if not role:
        return "ok"
    if role == "gradient":
        names = ["inputs", "outputs", "grads"]
    defs, other, dynamic = module_names(tree)
    what = "gradient" if role == "gradient" else "function"
    if function not in defs:
        if function in other or dynamic:
            return "defer\t" + escape(f"`{function}` is not a plain top-level `def`")
        found = sorted(defs)
        listing = ", ".join(f"`{f}`" for f in found) if found else "no top-level functions"
        return (f"error\t0\t" + escape(
            f"{filename} defines no {what} `{function}`; it defines {listing}"))
    fns = defs[function]
    fn = fns[-1]
    if len(fns) > 1 or function in other or fn.decorator_list:
        return "defer\t" + escape(f"`{function}` is redefined or decorated")
    why = check_call(fn, names, role)
    if why:
        return f"error\t{fn.lineno}\t{escape(f'{filename}, line {fn.lineno}: {why}')}"
    return "ok"


for raw in sys.stdin:
    fields = [unescape(f) for f in raw.rstrip("\n").split("\t")]
    try:
        filename, source, function, names, role = fields
        answer = handle(filename, source, function, [n for n in names.split(",") if n], role)
    except Exception as e:  # never fail a build on the checker's own trouble
        answer = "defer\t" + escape(f"the build-time check failed: {e!r}")
    sys.stdout.write(answer + "\n")
    sys.stdout.flush()
