"""Turns `cargo bench --bench summary` and peers.py output into the README's markdown table."""

import re
import sys
from typing import Optional

pyop = {}
fields = {}  # a case's other key=value fields (how a worker case waited, the load, the steal)
for line in open(sys.argv[1]):
    m = re.match(r"case=(\S+) median_us=([\d.]+)(.*)", line)
    if m:
        pyop[m.group(1)] = float(m.group(2))
        fields[m.group(1)] = dict(re.findall(r"(\w+)=(\S+)", m.group(3)))

peers = {}
for line in open(sys.argv[2]):
    m = re.match(r"\s*(\d+) f32\s+(\w+)\s+(.+?)\s+([\d.]+) us/call", line)
    if m:
        size, body, system, us = int(m.group(1)), m.group(2), m.group(3).strip(), float(m.group(4))
        peers[(size, body, system)] = us

systems = [
    "tf.numpy_function in tf.function",
    "tf.py_function in tf.function",
    "tf.py_function eager",
    "jax.pure_callback in jit",
]
sizes = sorted(
    {k[0] for k in peers}
    | {int(k.rsplit("_", 1)[1]) for k in pyop if k.rsplit("_", 1)[-1].isdigit()}
)


def fmt(us):
    if us is None:  # a case this run did not measure (`CASES=…`)
        return "—"
    return f"{us:,.2f} µs" if us < 1000 else f"{us / 1000:,.2f} ms"


print(
    "| size (f32) | body | pyop numpy | pyop tensor | plain Python / candle | "
    + " | ".join(systems)
    + " |"
)
print("|---|---|---|---|---|" + "---|" * len(systems))
for size in sizes:
    for body in ("ident", "plus1"):
        n, t = pyop.get(f"numpy_{body}_{size}"), pyop.get(f"tensor_{body}_{size}")
        if n is None:
            continue
        plain = (
            pyop.get(f"python_plus1_{size}")
            if body == "plus1"
            else peers.get((size, body, "plain python call"))
        )
        cells = []
        for s in systems:
            p = peers.get((size, body, s))
            cells.append("—" if p is None else f"{fmt(p)} (**{p / n:,.0f}×**)")
        plain_s = "—" if plain is None else fmt(plain)
        candle = pyop.get(f"candle_plus1_{size}") if body == "plus1" else None
        if candle is not None:
            plain_s += f" / {fmt(candle)}"
        print(
            f"| {size:,} | `{body}` | {fmt(n)} | {fmt(t)} | {plain_s} | " + " | ".join(cells) + " |"
        )
print()
print("Ratios are peer time ÷ pyop numpy-mode time (higher = pyop faster).")
for k in ("backward_pygrad", "pygrad_body", "threads1_call", "threads2_call"):
    if k in pyop:
        print(f"- `{k}`: {fmt(pyop[k])}")
if "threads1_call" in pyop and "threads2_call" in pyop:
    print(f"- 2-thread speed-up: {pyop['threads1_call'] / pyop['threads2_call']:.2f}×")

# The scalar call from the threads programs call from, against the floor of any embedding (bare
# pyo3: take the GIL, vectorcall a Python identity function, release it) measured in turns with
# it on the same thread.
floor = pyop.get("floor_attach_call_1")
if floor:
    print()
    print(
        "| called from | floor (bare pyo3) | pyop tensor `ident` | ÷ floor | pyop numpy `ident` | ÷ floor |"
    )
    print("|---|---|---|---|---|---|")
    places = [
        ("main thread", ""),
        ("spawned thread", "_spawned"),
        ("rayon pool thread", "_rayon"),
        ("tokio blocking-pool thread", "_tokio"),
    ]
    worst = {"tensor": 0.0, "numpy": 0.0}
    for label, suffix in places:
        f = pyop.get(f"floor_attach_call_1{suffix}")
        cells = [fmt(f) if f else "—"]
        for mode in ("tensor", "numpy"):
            t = pyop.get(f"{mode}_ident_1{suffix}")
            if t is None or not f:
                cells += ["—", "—"]
                continue
            worst[mode] = max(worst[mode], t / f)
            cells += [fmt(t), f"{t / f:.1f}×"]
        print(f"| {label} | " + " | ".join(cells) + " |")
    print()
    ok = lambda c: "met" if c else "**missed**"
    print(
        f"- tensor mode ≤ 2.0× the floor from every thread: worst {worst['tensor']:.1f}× "
        f"({ok(worst['tensor'] <= 2.0)}); numpy mode ≤ 3.0×: worst {worst['numpy']:.1f}× "
        f"({ok(worst['numpy'] <= 3.0)})"
    )
    spawned, main = pyop.get("tensor_ident_1_spawned"), pyop.get("tensor_ident_1")
    if spawned and main:
        print(
            f"- a spawned thread's call costs {spawned / main:.2f}× the main thread's (tensor mode)"
        )
contended = None
for line in open(sys.argv[1]):
    m = re.match(
        r"case=contended_ident_8threads median_us=([\d.]+) p99_us=([\d.]+) "
        r"p999_us=([\d.]+) calls_per_s=(\d+)",
        line,
    )
    if m:
        contended = [float(v) for v in m.groups()]
if contended:
    p50, p99, p999, rate = contended
    print(
        f"- 8 threads at once (`contended_ident_8threads`): median {fmt(p50)}, p99 {fmt(p99)} "
        f"({p99 / p50:,.0f}× the median; target ≤ 10×: {'met' if p99 <= 10 * p50 else '**missed**'}), "
        f"p999 {fmt(p999)}, {rate:,.0f} calls/s"
    )

# Awaited calls (the guide's "Async"): each against the way a tokio program calls without them.
awaited = [
    ("async_ident_1", "spawn_blocking_ident_1", 0.5, "in-program op awaited ÷ `spawn_blocking`"),
    ("async_worker_ident_1", "sync_worker_ident_1", 1.2, "worker op awaited ÷ blocked round trip"),
    (
        "async_worker_ident_1",
        "spawn_blocking_worker_ident_1",
        None,
        "worker op awaited ÷ `spawn_blocking`",
    ),
]
for got, base, target, label in awaited:
    if got in pyop and base in pyop:
        r = pyop[got] / pyop[base]
        verdict = (
            ""
            if target is None
            else f"; target ≤ {target}×: {'met' if r <= target else '**missed**'}"
        )
        print(f"- {label}: {fmt(pyop[got])} ÷ {fmt(pyop[base])} = {r:.2f}×{verdict}")

# Outputs at memory speed: the `out` path, a returned array (adopted without a copy), the copy
# path proper (the body kept a reference) and its slower forms, against the plain NumPy body, a
# bare copy into the same kind of memory, and TF.
print()
print(
    "| size (f32) | plain NumPy `x + 1` | `memcpy` | pyop `out` | pyop, returned | returned + kept (copy) | copy, reversed | copy, unaligned | tf.numpy_function |"
)
print("|---|---|---|---|---|---|---|---|---|")
for size in sizes:
    py_, mc = pyop.get(f"python_plus1_{size}"), pyop.get(f"memcpy_{size}")
    out, cp = pyop.get(f"numpy_plus1_{size}"), pyop.get(f"numpy_plus1copy_{size}")
    if None in (py_, mc, out, cp):
        continue
    tf = peers.get((size, "plus1", "tf.numpy_function in tf.function"))
    cells = [fmt(py_), fmt(mc), fmt(out), fmt(cp)]
    cells += [
        fmt(pyop[k]) if k in pyop else "—"
        for k in (
            f"numpy_plus1kept_{size}",
            f"numpy_plus1rev_{size}",
            f"numpy_plus1unaligned_{size}",
        )
    ]
    cells.append("—" if tf is None else fmt(tf))
    print(f"| {size:,} | " + " | ".join(cells) + " |")
print()
for size in sizes:
    py_, mc = pyop.get(f"python_plus1_{size}"), pyop.get(f"memcpy_{size}")
    out, cp, kept = (pyop.get(f"numpy_plus1{k}_{size}") for k in ("", "copy", "kept"))
    if None in (py_, mc, out, cp, kept) or size < 1 << 20:
        continue
    tf = peers.get((size, "plus1", "tf.numpy_function in tf.function"))
    ok = lambda c: "met" if c else "**missed**"
    print(
        f"- {size:,}: `out` {out / py_:.2f}× the plain body (target ≤ 1.10: {ok(out <= 1.10 * py_)}); "
        f"returned {cp / py_:.2f}× (adopted, no copy); copied {fmt(kept)} vs plain + 1.25 × memcpy = "
        f"{fmt(py_ + 1.25 * mc)} ({ok(kept <= py_ + 1.25 * mc)}; pyop's own work on top of body and copy: "
        f"{(kept - py_ - mc) / mc * 100:+.0f} % of the copy)"
        + (
            ""
            if tf is None
            else f"; vs tf.numpy_function {fmt(tf)}: "
            f"{ok(out < tf and cp < tf)} (`out`, returned), {ok(kept < tf)} (copied)"
        )
    )


# Worker processes (numpy mode, `workers = N`): the round trip of a scalar call against a blocking
# ping-pong of two processes, the large identities against one memcpy, and a ~1 ms Python-bound
# body from 1 and 2 threads (and 2 threads beside 2 CPU-bound processes), in the program against
# 2 workers; then issue 32's targets, each a ratio of two cases of the same run.
def ratio_row(label, got, good):
    print(f"| {label} | {got} | {'met' if good else '**missed**'} |")


print()
print("| case | pyop in the program | pyop in workers | |")
print("|---|---|---|---|")
g = pyop.get
w1, n1, pp = g("worker_ident_1"), g("numpy_ident_1"), g("ipc_pingpong_blocking")
if w1 is not None:
    extra = (
        ""
        if pp is None
        else f"{w1 / pp:.2f}× a blocking ping-pong of two processes on a socket pair ({fmt(pp)})"
    )
    print(f"| scalar `ident` | {fmt(n1) if n1 else '—'} | {fmt(w1)} | {extra} |")
for size in sizes:
    w, mc, n = g(f"worker_ident_{size}"), g(f"memcpy_{size}"), g(f"numpy_ident_{size}")
    if w is None or mc is None or size < 1 << 20:
        continue
    print(
        f"| `ident`, {size:,} f32 | {fmt(n) if n else '—'} (no copy) | {fmt(w)} | {w / mc:.2f}× one memcpy ({fmt(mc)}), "
        f"{w / (2 * mc):.2f}× a memcpy of input and output |"
    )
p1, p2 = g("pyloop_inprocess_2threads"), g("pyloop_workers2_2threads")
alone, pair = g("pyloop_inner_python"), g("pyloop_inner_python_pair")
if p1 and p2:
    ceiling = (
        ""
        if not (alone and pair)
        else f"; two plain interpreters side by side: {2 * alone / pair:.2f}× one's"
    )
    print(
        f"| ~1 ms Python loop, 2 threads (time per call, by throughput) | {fmt(p1)} | {fmt(p2)} | "
        f"{p1 / p2:.2f}× the throughput{ceiling} |"
    )
q1, q2 = g("pyloop_inprocess_1thread"), g("pyloop_workers2_1thread")


# The same loop called in a forked child of a plain `python -c` over a socket pair, against the
# parent running it itself: the floor of the 1-thread ratio here, with nothing of pyop's.
def pair_ratio(case: str) -> Optional[float]:
    child = g(case)
    parent = fields.get(case, {}).get("inparent_us")
    return child / float(parent) if child and parent else None


# Where the scheduler puts the two; then pinned to one CPU (no CPU woken from idle) and to two
# (every message wakes the other's CPU).
pair_floor = pair_ratio("pingpong_python_pyloop")
pinned = [
    f"{where}: {r:.2f}×"
    for where, r in (
        ("both on one CPU", pair_ratio("pingpong_python_pyloop_samecpu")),
        ("on two", pair_ratio("pingpong_python_pyloop_twocpus")),
    )
    if r is not None
]
if q1 and q2:
    floor = (
        ""
        if pair_floor is None
        else f"; plain Python calling the loop in a child process: {pair_floor:.2f}× its own time"
        + (f" ({', '.join(pinned)})" if pinned else "")
    )
    print(
        f"| the same, 1 thread | {fmt(q1)} | {fmt(q2)} | {q2 / q1:.2f}× the program's time{floor} |"
    )
b1, b2 = g("pyloop_inprocess_2threads_busy"), g("pyloop_workers2_2threads_busy")
if b1 and b2:
    print(f"| the same, 2 threads, busy | {fmt(b1)} | {fmt(b2)} | {b1 / b2:.2f}× the throughput |")
i1, i2 = g("pyloop_inner_inprocess"), g("pyloop_inner_worker")
if i1 and i2:
    plain = "" if not alone else f"a plain `python -c`: {fmt(alone)}"
    if alone and pair:
        plain += f"; two at once: {fmt(pair)} each"
    print(f"| the loop alone, timed inside the body | {fmt(i1)} | {fmt(i2)} | {plain} |")
ws, ns = g("worker_start"), g("python_numpy_start")
if ws:
    vs = "" if not ns else f'{ws / ns:.2f}× a plain `python -c "import numpy"` ({fmt(ns)})'
    print(f"| starting a worker (interpreter + NumPy) | — | {fmt(ws)} | {vs} |")
if "matmul256_workers2_2threads" in pyop:
    print(
        f"| 256×256 f64 `x @ x` (NumPy's BLAS), 2 threads | — | "
        f"{fmt(pyop['matmul256_workers2_2threads'])} | the cores shared among the workers' BLAS threads |"
    )
print()
print()
print("| target (issue 46) | measured | |")
print("|---|---|---|")
if p1 and p2:
    ratio_row(
        "Python-bound body from 2 threads: workers ≥ 1.7× the program's throughput",
        f"{p1 / p2:.2f}×",
        p1 / p2 >= 1.7,
    )
if q1 and q2:
    ratio_row(
        "the same from 1 thread: within 1.15× of the program's time",
        f"{q2 / q1:.2f}×"
        + ("" if pair_floor is None else f" (plain Python pair: {pair_floor:.2f}×)"),
        q2 / q1 <= 1.15,
    )
if b1 and b2:
    ratio_row("the same, busy: workers ≥ 1.0× the program", f"{b1 / b2:.2f}×", b1 / b2 >= 1.0)
if w1 and pp:
    ratio_row("`worker_ident_1` ≤ 0.6× `ipc_pingpong_blocking`", f"{w1 / pp:.2f}×", w1 / pp <= 0.6)
if ws and ns:
    ratio_row("`worker_start` ≤ 0.5× `python_numpy_start`", f"{ws / ns:.2f}×", ws / ns <= 0.5)

# How the worker cases' calls were waited for, per call (`PoolStats::waits`), and the machine.
waited = [c for c in pyop if "caller_caught" in fields.get(c, {})]
if waited:
    print()
    print(
        "| worker case | caller: caught / missed / slept, µs checking | "
        "worker: caught / missed / slept, µs checking | crowded | load, steal |"
    )
    print("|---|---|---|---|---|")

    def side(f, who):
        return (
            f"{f[who + '_caught']} / {f[who + '_missed']} / {f[who + '_slept']}, "
            f"{f[who + '_check_us']}"
        )

    for c in waited:
        f = fields[c]
        iters = f" ({f['iters']} iterations)" if "iters" in f else ""
        print(
            f"| `{c}`{iters} | {side(f, 'caller')} | {side(f, 'worker')} | {f['crowded']} | "
            f"{f.get('load1', '?')}, {f.get('steal_pct', '?')} % |"
        )
