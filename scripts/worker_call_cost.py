"""The Python a worker runs for one scalar call, without the program or a second process: the
worker's own functions (`worker.py`, loaded as the tests load it) read a call request from a
socket pair, run an identity body and write the reply, in a loop; the other end of the pair is
this process too. Prints the median over runs of the time per call.

    .venv/bin/python scripts/worker_call_cost.py [calls per run] [runs]

What it leaves out is the program's side and the wake-ups: `worker_ident_1` in
`cargo bench --bench summary` is the whole round trip.
"""

import os
import socket
import statistics
import sys
import time
import types
from pathlib import Path

import numpy

SRC = Path(__file__).resolve().parent.parent / "runtime" / "src"
# What a worker runs, in order, in one namespace (`worker/process.rs`); under another module
# name than `__pyop_worker__`, `worker.py` starts nothing.
TEXTS = [
    SRC / "worker/python/pickle_names.py",
    SRC / "worker/python/host.py",
    SRC / "worker/ray/python/relay.py",
    SRC / "worker/python/worker.py",
]


def main() -> None:
    calls = int(sys.argv[1]) if len(sys.argv) > 1 else 20_000
    runs = int(sys.argv[2]) if len(sys.argv) > 2 else 5
    w = types.ModuleType("pyop_worker_cost")
    for path in TEXTS:
        exec(compile(path.read_text(encoding="utf-8"), str(path), "exec"), w.__dict__)
    w._np = numpy
    for which in (0, 1):
        fd = os.memfd_create("pyop-cost-arena")
        os.ftruncate(fd, 1 << 20)
        w._install_arena(which, [fd], 1 << 20)
    program, worker = socket.socketpair()
    w._SOCK = worker
    body = types.ModuleType("body")
    exec("def ident(x):\n    return x", body.__dict__)
    w._modules[("ident#1", 0)] = body
    # The request the program sends for `ident` of a 1-element f32 tensor.
    call = (
        '{"op":"call","key":{"base":"ident#1","generation":0},"function":"ident",'
        '"args":[{"t":{"at":0,"dtype":"float32","shape":[1],"strides":[4]}}],"out":null,'
        '"spin":false}'
    )

    def frame(q: int) -> bytes:
        text = ('{"q":%d,"m":%s}' % (q, call)).encode()
        return len(text).to_bytes(4, "little") + text

    frames = [frame(q) for q in range(calls)]

    def run() -> float:
        t = time.perf_counter()
        for f in frames:
            program.sendall(f)
            w._seq, msg, _ = w._recv_frame()
            w._HANDLERS["call"](msg)
            program.recv(4096)
        return (time.perf_counter() - t) / calls

    # Once, outside the timing: each call is answered with its result in the arena, not an error.
    for q in (0, 1):
        program.sendall(frames[q])
        w._seq, msg, _ = w._recv_frame()
        w._HANDLERS["call"](msg)
        reply = program.recv(4096)
        want = b'{"q":%d,"m":{"s":"array","place":[0,0,4],"dtype":"<f4"' % q
        if want not in reply:
            sys.exit("unexpected reply: %r" % reply)
    run()
    per_call = statistics.median(run() for _ in range(runs))
    print("worker_call_python_us=%.1f" % (per_call * 1e6))


if __name__ == "__main__":
    main()
