# The main loop of a pyop worker process (`runtime/src/worker/`). The parent starts
# `python -c <bootstrap>` (`proc.rs`), which reads `pickle_names.py`'s text, `host.py`'s,
# `ray/python/relay.py`'s (what a Ray pool's relay does) and then this file's from fd 3 and runs
# them, as one module named `__pyop_worker__`, under the file name `<pyop>` (its frames are left
# out of tracebacks, as in the program itself). `host.py` has what any process running bodies
# needs (loading them, their exceptions, their results pickled); this file, the socket, the
# shared memory and the main loop. Run under another module name (the tests in
# `runtime/python-tests/`), it defines its functions and starts nothing: no guardian, no socket,
# no main loop.
#
# The protocol is `runtime/src/worker/protocol.rs`: every message either way is a type there, and
# this file builds and reads exactly those fields (`_REQUESTS` lists what each request has; a
# request with other fields is a protocol error and the worker exits). Frames, both ways: a
# 4-byte little-endian length, then the frame. Parent -> worker: `{"q": seq, "m": request}` in
# JSON, possibly with a file descriptor (SCM_RIGHTS) attached to its first bytes. Worker ->
# parent: a 4-byte little-endian header length, `{"q": seq, "m": reply, "w": waited}` in JSON
# (`w`: how the worker waited for the request, `_wait_awake`), then a pickle
# (protocol 5, only for a "pickled" reply) whose large buffers live in shared memory, named by
# [arena, offset, length] with arena 0 the input arena and 1 the result arena. Every reply echoes
# its request's sequence number, so a reply can never be taken for another's.
#
# The arenas are memfds the parent creates and sends: inputs (and `out` buffers) are written by
# the parent into the input arena; results the body made are copied once into the result arena;
# a result that is an input (or a view of one) is named where it is, not copied, unless the body
# kept a view of its inputs (then it is copied, so the parent reads memory nothing can change).
# Inputs are views of a read-only mapping of the input arena; only `out` buffers are views of a
# writable one.

import os

# Whether this text runs as a worker (`proc.rs`'s bootstrap runs it as `__pyop_worker__`), not
# read by a test.
_IS_WORKER = __name__ == "__pyop_worker__"


# The guardian: a child that waits for the program's end (fd 4 is the read end of a pipe whose
# only write end the program holds) or its worker's (a pidfd of it), and then kills the worker's
# whole process group, with whatever processes its bodies started. The program kills the group
# itself whenever it ends a worker; the guardian covers the program's own end, however it comes
# (return from main, exit, a panic, a signal, SIGKILL), which a parent-death signal only covers
# for the worker itself, and a worker's end that the program cannot follow up (a forked worker
# whose zygote is gone). Being in the group, it keeps the group's id from being reused while it
# lives. A worker forked from the zygote starts its own (the zygote keeps fd 4 open for them).
def _start_guardian(sock_fd: int) -> None:
    worker = os.getpid()
    if os.fork() == 0:
        try:
            try:
                os.close(sock_fd)
            except OSError:
                pass  # closed already (the at-fork handler below closes the socket)
            try:
                watched = [4, os.pidfd_open(worker)]
            except (AttributeError, OSError):  # Python 3.8, Linux before 5.3
                watched = [4]
            import select

            while True:
                ready = select.select(watched, [], [])[0]
                if 4 not in ready or not os.read(4, 1):
                    break
        except BaseException:  # noqa: BLE001 - whatever happens, the group goes
            pass
        os.killpg(0, 9)
        os._exit(0)


if _IS_WORKER:
    _start_guardian(3)

import json
import json.encoder
import json.scanner
import mmap
import signal
import socket
import sys
import traceback
import types
import weakref
from array import array as _array_of
from os import sched_yield as _sched_yield
from select import select as _select
from time import perf_counter as _perf_counter
from time import thread_time as _thread_time
from typing import (
    TYPE_CHECKING,
    Any,
    Callable,
    Iterable,
    NoReturn,
    Optional,
    Sequence,
    Union,
    cast,
)

if TYPE_CHECKING:  # defined by host.py and relay.py, whose text runs before this file's
    import pickle

    import numpy
    import numpy as _np
    from host import (
        _PYOP,
        _clean,
        _exception_info,
        _ExcInfo,
        _Installer,
        _load_module,
        _Pickler,
        _PyopStub,
    )
    from numpy.typing import NDArray
    from relay import (
        _importer_text,  # noqa: F401 - set here (`init`)
        _join,
    )
    from typing_extensions import Buffer

# The socket, moved off fd 3 to a close-on-exec descriptor: a body that writes to fd 3, or a
# program it execs, cannot speak for the worker.
if _IS_WORKER:
    _SOCK = socket.socket(fileno=os.dup(3))
    os.close(3)
_ALIGN = 64
_MAX_PICKLE = (1 << 32) - (1 << 20)  # a frame's length is 4 bytes; room for the header
_seq = 0  # the sequence number of the request being served
_forked = False
_zygote_forking = False
_is_zygote = False


def _in_forked_child() -> None:
    # A body that forks (os.fork, multiprocessing): the child must not hold the parent's socket
    # open (the program would not see the worker die) nor answer for it. (Not the zygote's own
    # forks of workers, which set up their child themselves.)
    global _forked
    if _zygote_forking:
        return
    _forked = True
    try:
        _SOCK.close()
    except OSError:
        pass
    # The arenas are shared with the program: the child gets private copies in their place, as a
    # forked process in the program gets copy-on-write memory, so nothing it writes (an `out`
    # buffer it kept) reaches the program or a later call, and nothing the program writes next
    # reaches it.
    for arena in list(_all_arenas):
        arena.privatize()


if _IS_WORKER:
    os.register_at_fork(after_in_child=_in_forked_child)
# Every arena still mapped here (a kept view may hold an old one).
_all_arenas: "weakref.WeakSet[_Arena]" = weakref.WeakSet()


def _private_copy(m: mmap.mmap, size: int, readonly: bool) -> None:
    """Replaces the shared mapping `m` by a private anonymous one with the same bytes, at the same
    address (`MAP_FIXED`), so the Python objects viewing it stay valid."""
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)
    libc.mmap.restype = ctypes.c_void_p
    libc.mmap.argtypes = [
        ctypes.c_void_p,
        ctypes.c_size_t,
        ctypes.c_int,
        ctypes.c_int,
        ctypes.c_int,
        ctypes.c_long,
    ]
    addr = _address(m)
    saved = bytes(m)
    prot = mmap.PROT_READ | mmap.PROT_WRITE
    got = libc.mmap(addr, size, prot, mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | 0x10, -1, 0)
    if got != addr:  # 0x10: MAP_FIXED
        os._exit(73)
    ctypes.memmove(addr, saved, size)
    if readonly:
        libc.mprotect.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
        libc.mprotect(addr, size, mmap.PROT_READ)


def _exit_quietly() -> NoReturn:
    # The parent went away or closed the pool: nothing is left to serve.
    os._exit(0)


def _recv_exact(n: int) -> Union[bytes, bytearray]:
    # Mostly all at once (a frame the program sent whole); else in pieces.
    got = _SOCK.recv(n, socket.MSG_WAITALL)
    if len(got) == n:
        return got
    if not got:
        _exit_quietly()
    return got + _recv_rest(n - len(got))


def _recv_rest(n: int) -> bytearray:
    buf = bytearray(n)
    view = memoryview(buf)
    got = 0
    while got < n:
        k = _SOCK.recv_into(view[got:])
        if k == 0:
            _exit_quietly()
        got += k
    return buf


# How long a worker checks for its next request before it sleeps (seconds): three times the
# usual gap between its reply and the next request, so a loop of calls finds it awake, without
# the wake-up a sleep costs, at least 100 µs and at most 2 ms; 100 µs where calls come seldom
# (gaps over 2 ms). A check that found no request and spent more than half its time, and at least
# 200 µs (another thread's time slice, not the caller's few µs on this CPU), off its core (other
# processes were waiting for it: the machine is oversubscribed) turns checking off for 100 ms,
# so the worker never takes a core from one that works; and it checks only when the last call's
# request allows it (`spin`: false under `PYOP_WORKER_SPIN=0`; `pace.rs` is the program's side).
_gap = 100e-6  # a moving average of the gaps, each counted up to 4 ms
_spin_off_until = 0.0
_spin = False  # whether the last call's request allowed checking (`PYOP_WORKER_SPIN`)
# How this worker waited for the request it answers now, sent back with the reply (`w`, the
# pool's `WaitStats`): [0, µs] caught checking, [1, µs] checked that long, then slept and was
# woken, [2, 0] slept without checking.
_waited = [2, 0]


def _wait_awake() -> float:
    """Checks for the next request until it comes or the spin's time is up; returns when it
    began (to time the gap)."""
    global _spin_off_until, _waited
    start = _perf_counter()
    if not _spin or start < _spin_off_until:
        _waited = [2, 0]
        return start
    budget = 100e-6 if _gap > 2e-3 else min(max(3 * _gap, 100e-6), 2e-3)
    until = start + budget
    cpu = _thread_time()
    while True:
        if _select((_SOCK,), (), (), 0)[0]:
            _waited = [0, int((_perf_counter() - start) * 1e6)]
            return start
        if _perf_counter() >= until:
            break
        # The caller that will send the request may need this core first.
        _sched_yield()
    wall = _perf_counter() - start
    _waited = [1, int(wall * 1e6)]
    off = wall - (_thread_time() - cpu)
    if 2 * off > wall and off >= 200e-6:
        _spin_off_until = start + wall + 0.1
    return start


# Room for the descriptors a frame can carry (one; four, as a bound).
_FDS_ROOM = socket.CMSG_SPACE(4 * _array_of("i").itemsize)
# JSON read and written by the C scanner and encoder themselves (`json.loads` and `json.dumps`
# build them again on every call): the same text either way.
_scan_json = json.scanner.make_scanner(json.JSONDecoder())  # type: ignore[arg-type]


def _no_default(o: object) -> NoReturn:
    raise TypeError("a reply holds a %s" % type(o).__name__)


_c_make_encoder = getattr(json.encoder, "c_make_encoder", None)  # not in typeshed
if _c_make_encoder is not None:
    _encode_json = _c_make_encoder(
        None, _no_default, json.encoder.encode_basestring_ascii, None, ":", ",", False, False, True
    )
else:  # an interpreter without the _json accelerator
    _encode_json = json.JSONEncoder(separators=(",", ":"), default=_no_default).iterencode


def _recv_frame() -> tuple[int, dict[str, Any], list[int]]:
    if _forked:
        os._exit(0)
    global _gap
    waited = _perf_counter() if _is_zygote else _wait_awake()
    try:
        # Close-on-exec from the start: a body's thread that execs meanwhile cannot inherit them.
        head, anc, _flags, _addr = _SOCK.recvmsg(4, _FDS_ROOM, socket.MSG_CMSG_CLOEXEC)
    except (ConnectionResetError, OSError):
        _exit_quietly()
    if not head:
        _exit_quietly()
    _gap += (min(_perf_counter() - waited, 4e-3) - _gap) / 4
    fds: list[int] = []
    for level, kind, data in anc:
        if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
            got = _array_of("i")
            got.frombytes(data[: len(data) - len(data) % got.itemsize])
            fds += got
    if len(head) < 4:
        head += _recv_exact(4 - len(head))
    n = int.from_bytes(head, "little")
    text = _recv_exact(n).decode()
    global _plan
    # The program's frames are `{"q":<digits>,"m":<request>}`: a call whose request reads as one
    # seen before (a loop calls an op again and again with its arguments laid out alike) is that
    # request as it was checked then, under this frame's number.
    m = text.find(',"m":', 5) if text.startswith('{"q":') and text.endswith("}") else -1
    if m > 5:
        seen = _SEEN.get(text[m + 5 : -1])
        q = text[5:m]
        # (Digits as JSON writes a number: no sign, no leading zero.)
        if seen is not None and q.isascii() and q.isdigit() and (q[0] != "0" or q == "0"):
            _plan = seen[1]
            return int(q), seen[0], fds
    _plan = None
    try:
        frame, end = _scan_json(text, 0)
    except (StopIteration, ValueError):
        frame, end = None, 0
    if end != len(text) or type(frame) is not dict or frame.keys() != {"q", "m"}:
        raise _ProtocolError("a frame is not {q, m} in JSON")
    if type(frame["m"]) is not dict:
        raise _ProtocolError("a frame is not {q, m}")
    msg = _checked(frame["m"])
    if m > 5 and msg["op"] == "call":
        _plan = _args_plan(msg["args"])
        if len(_SEEN) >= _SEEN_MAX:
            _SEEN.clear()
        _SEEN[text[m + 5 : -1]] = (msg, _plan)
    return frame["q"], msg, fds


# The call requests read so far (at most `_SEEN_MAX`), by their JSON text: each as `_checked` left
# it, with its arguments' plan (`_args_plan`). A request is the same function of its text every
# time, so one read from here is the one the scanner and `_checked` would make; no handler changes
# a request it is given.
_SEEN: "dict[str, tuple[dict[str, Any], Optional[_Plan]]]" = {}
_SEEN_MAX = 256
# The plan of the call request `_recv_frame` read last (`None` for any other request, or a call
# with an argument other than an array): what `_call` makes its input views of.
_plan: "Optional[_Plan]" = None


class _ProtocolError(Exception):
    """A request this worker does not understand: it says so and exits."""


# Every request and its exact fields (protocol.rs `Request`; a load's fields by its kind).
_REQUESTS = {
    "init": {"site_packages", "importer", "version", "argv", "zygote"},
    "spawn": {"env", "cwd"},
    "reap": {"pid"},
    "arena": {"which", "size"},
    "unload": {"base"},
    "call": {"key", "function", "args", "out", "spin"},
    "ping": {"key", "fns"},
    "join": {"address", "namespace", "num_cpus", "resources", "actor", "timeout"},
}
_LOADS = {
    "code": {"op_name", "text", "filename", "first_line"},
    "file": {"op_name", "text", "filename"},
    "module": {"name"},
    "package": {"name", "root", "module", "files"},
}


# The same with "op" (and a load's "key" and "kind"), as compared.
# (Keyed by what a request says its op and kind are: anything JSON holds.)
_FIELDS: "dict[object, set[str]]" = {op: fields | {"op"} for op, fields in _REQUESTS.items()}
_LOAD_FIELDS: "dict[object, set[str]]" = {
    kind: fields | {"op", "key", "kind"} for kind, fields in _LOADS.items()
}


def _checked(msg: dict[str, Any]) -> dict[str, Any]:
    op = msg.get("op")
    if op == "load":
        fields = _LOAD_FIELDS.get(msg.get("kind"))
    else:
        fields = _FIELDS.get(op)
    if fields is None or msg.keys() != fields:
        raise _ProtocolError("unexpected request %r with fields %s" % (op, sorted(msg)))
    if "key" in msg:
        key = msg["key"]
        if type(key) is not dict or key.keys() != {"base", "generation"}:
            raise _ProtocolError("a module key is not {base, generation}")
        msg["key"] = (key["base"], key["generation"])
    return msg


def _send(header: dict[str, Any], payload: bytes = b"") -> None:
    if _forked:
        os._exit(0)
    h = "".join(_encode_json({"q": _seq, "m": header, "w": _waited}, 0)).encode()
    body = len(h).to_bytes(4, "little") + h + payload
    _SOCK.sendall(len(body).to_bytes(4, "little") + body)


# An `array` reply as `_send` writes it, without a dict to build and walk.
_ARRAY_REPLY = (
    '{"q":%d,"m":{"s":"array","place":[%d,%d,%d],"dtype":"%s","shape":[%s],"retained":%s},'
    '"w":[%d,%d]}'
)


def _send_array(place: list[int], dtype: str, shape: list[int], retained: bool) -> None:
    """`_send({"s": "array", ...})`: the same text (a dtype's `str` of a plain number kind, such
    as `<f4`, needs no escaping in JSON)."""
    if _forked:
        os._exit(0)
    h = (
        _ARRAY_REPLY
        % (
            _seq,
            place[0],
            place[1],
            place[2],
            dtype,
            ",".join(map(str, shape)),
            "true" if retained else "false",
            _waited[0],
            _waited[1],
        )
    ).encode()
    n = len(h)
    _SOCK.sendall((n + 4).to_bytes(4, "little") + n.to_bytes(4, "little") + h)


class _Arena:
    """A memfd mapped shared: read-write (`map`), and for the input arena read-only too (`ro`),
    the mapping every input view is made of, so no body can write its inputs."""

    def __init__(self, fd: int, size: int, readonly_too: bool) -> None:
        self.map = mmap.mmap(fd, size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        self.ro = mmap.mmap(fd, size, mmap.MAP_SHARED, mmap.PROT_READ) if readonly_too else None
        os.close(fd)
        self.size = size
        self.view = memoryview(self.map)
        # The read-only mapping as uint8, made by the first call's `_Views`.
        self.ro_array: Optional[NDArray[numpy.uint8]] = None
        # The mappings' addresses, to tell whether a result's buffer lies inside one.
        self.addrs = [_address(m) for m in (self.map, self.ro) if m is not None]
        _all_arenas.add(self)

    def privatize(self) -> None:
        for m, readonly in ((self.map, False), (self.ro, True)):
            if m is not None and not m.closed:
                _private_copy(m, self.size, readonly)

    def offset_of(self, addr: int, n: int) -> Optional[int]:
        for a in self.addrs:
            if a <= addr and addr + n <= a + self.size:
                return addr - a
        return None


def _address(m: mmap.mmap) -> int:
    addr: int = _np.frombuffer(m, dtype=_np.uint8, count=1).__array_interface__["data"][0]
    return addr


# The input arena (0) and the result arena (1), once the parent has sent them.
_arenas: "list[Optional[_Arena]]" = [None, None]
_modules: "dict[tuple[str, int], types.ModuleType]" = {}  # key -> module
# (`_np`, NumPy once imported, is host.py's global: one namespace.)


def _map_or_exit(which: int, fds: list[int], size: int) -> None:
    # Never answered (the parent sends it between calls, or after a "need"); a worker that cannot
    # map its memory cannot serve: it exits (status 71), and the parent replaces it.
    if which not in (0, 1) or type(size) is not int:
        raise _ProtocolError("an arena message names arena %r of size %r" % (which, size))
    try:
        _install_arena(which, fds, size)
    except BaseException:  # noqa: BLE001
        os._exit(71)


def _install_arena(which: int, fds: list[int], size: int) -> None:
    # The old mapping is not closed: an array a body kept may still view it; it goes when the
    # last such array does.
    if len(fds) != 1:
        raise _ProtocolError("an arena came with %d descriptors" % len(fds))
    _arenas[which] = _Arena(fds[0], size, which == 0)


# --- loading bodies (host.py has the loading itself) -----------------------------------------


def _load(msg: dict[str, Any]) -> None:
    """Loads a body's module and says whether it loaded (before any call's time limit runs)."""
    key = msg["key"]
    # An earlier generation of the same op's module (hot reload) is not needed again; another
    # op's module is never touched (bases are compared whole).
    for old in [k for k in _modules if k[0] == key[0]]:
        del _modules[old]
    try:
        module = _load_module(msg, _install_package)
    except BaseException as e:  # noqa: BLE001 - reported to the parent
        _send({"s": "load_failed", "exc": _exception_info(e, "load")})
        return
    _modules[key] = module
    _send({"s": "loaded"})


# --- arguments --------------------------------------------------------------------------------


_TENSOR = {"at", "dtype", "shape", "strides"}
# An input view made ready: offset, dtype, shape, strides.
_Plan = tuple[tuple[int, "numpy.dtype[Any]", tuple[int, ...], tuple[int, ...]], ...]


def _args_plan(args: Any) -> "Optional[_Plan]":
    """Where each input view of a call lies, when every argument is an array (`{"t": ...}`), as
    `_Views.input` takes it; `None` for any other arguments (`_decode` reads them, and says what
    is wrong with them)."""
    if type(args) is not list:
        return None
    plan = []
    for v in args:
        t = v.get("t") if type(v) is dict and len(v) == 1 else None
        if type(t) is not dict or t.keys() != _TENSOR:
            return None
        at, dtype, shape, strides = t["at"], t["dtype"], t["shape"], t["strides"]
        if type(at) is not int or type(shape) is not list or type(strides) is not list:
            return None
        if type(dtype) is not str:
            return None
        dt = _DTYPES.get(dtype)
        if dt is None:
            try:
                dt = _DTYPES[dtype] = _np.dtype(dtype)
            except Exception:  # noqa: BLE001 - `_decode` says what is wrong with it
                return None
        plan.append((at, dt, tuple(shape), tuple(strides)))
    return tuple(plan)


def _decode(v: Any, views: "_Views") -> Any:
    if type(v) is dict:
        if len(v) == 1:
            t = v.get("t")
            if type(t) is dict and t.keys() == _TENSOR:
                return views.input(t["at"], t["dtype"], t["shape"], t["strides"])
            if "u" in v:
                return tuple(_decode(x, views) for x in v["u"])
            if v.get("f") in ("nan", "inf", "-inf"):
                return float(v["f"])
        raise _ProtocolError("unknown argument encoding " + repr(v)[:200])
    if type(v) is list:
        return [_decode(x, views) for x in v]
    return v


class _Views:
    """The per-call arrays over the input arena that every input view (read-only, over the
    read-only mapping) and `out` view (over the writable one) is a view of, so that whether the
    body kept one is known: every view NumPy derives from them (slices, reshapes, memoryviews of
    them) holds one of these arrays. What lies under them (the memoryview each array is made of,
    and the mapping) is watched too, so a body that keeps `x.base.base` is seen as well."""

    def __init__(self) -> None:
        # (Sent by the parent before the first call.)
        self.arena = cast("_Arena", _arenas[0])
        # Made once per arena: a kept view makes the program send a fresh arena for the next
        # call, so what is counted at the start of a call is this arena's references of its own.
        # (No local name holds what is counted.)
        if self.arena.ro_array is None:
            # (The input arena is mapped read-only too.)
            self.arena.ro_array = _np.frombuffer(cast(mmap.mmap, self.arena.ro), dtype=_np.uint8)
        self.ro = self.arena.ro_array
        self.watched: list[list[Any]] = [[self.ro, 0], [self.ro.base, 0], [self.arena.ro, 0]]
        self._count(self.watched)
        self.rw: Optional[NDArray[numpy.uint8]] = None
        self.inputs: list[tuple[NDArray[Any], int]] = []  # (view, offset) of each input

    @staticmethod
    def _count(watched: list[list[Any]]) -> None:
        # Counted with the same references as `retained` counts them (the list's, getrefcount's
        # argument), once no local name or temporary holds one.
        for w in watched:
            w[1] = sys.getrefcount(w[0])

    def input(self, off: int, dtype: str, shape: list[int], strides: list[int]) -> "NDArray[Any]":
        dt = _DTYPES.get(dtype)
        if dt is None:
            dt = _DTYPES[dtype] = _np.dtype(dtype)
        return self.view(off, dt, shape, strides)

    def view(
        self, off: int, dt: "numpy.dtype[Any]", shape: Sequence[int], strides: Sequence[int]
    ) -> "NDArray[Any]":
        # (Positional: NumPy parses keywords slower than it makes the view.)
        view: NDArray[Any] = _np.ndarray(shape, dt, self.ro, off, strides)
        self.inputs.append((view, off))
        return view

    def out(self, off: int, dtype: str, shape: list[int]) -> "NDArray[Any]":
        if self.rw is None:
            self.rw = _np.frombuffer(self.arena.map, dtype=_np.uint8)
            more: list[list[Any]] = [[self.rw, 0], [self.rw.base, 0], [self.arena.map, 0]]
            self._count(more)
            self.watched += more
        dt = _np.dtype(dtype)
        return cast(
            "NDArray[Any]", self.rw[off : off + _count(shape) * dt.itemsize].view(dt).reshape(shape)
        )

    def retained(self) -> bool:
        # This object's own references to the inputs go first (the result is encoded by now).
        self.inputs.clear()
        # A weak reference to an array or a mapping is a way back to it too.
        for w in self.watched:
            if sys.getrefcount(w[0]) > w[1] or weakref.getweakrefcount(w[0]):
                return True
        return False


_DTYPES: "dict[str, numpy.dtype[Any]]" = {}  # NumPy dtypes by the names the program sends
_DTYPE_NAMES: "dict[numpy.dtype[Any], str]" = {}  # and the names the program reads, by dtype


# --- results (host.py pickles them) -----------------------------------------------------------

# A buffer of a result: a view of its bytes.
_Bytes = Union[memoryview, "NDArray[numpy.uint8]"]
# Where each buffer of a reply lies, [arena, offset, length] (protocol.rs, `Place`).
_Places = list[list[int]]
# What is copied into the result arena: (offset, bytes).
_Copies = list[tuple[int, _Bytes]]


def _place(n: int, addr: int, placed: _Places, to_copy: _Copies, raw: _Bytes, need: int) -> int:
    """Names a buffer where it lies in the input arena, or makes room for it in the result
    arena; returns the result arena's bytes needed so far."""
    if n == 0:
        # Nothing to copy, nowhere to read: an empty array needs no arena.
        placed.append([0, 0, 0])
        return need
    inp = _arenas[0]
    off = inp.offset_of(addr, n) if inp is not None else None
    if off is not None:
        placed.append([0, off, n])
        return need
    return _room(n, placed, to_copy, raw, need)


def _room(n: int, placed: _Places, to_copy: _Copies, raw: _Bytes, need: int) -> int:
    off = (need + _ALIGN - 1) // _ALIGN * _ALIGN
    placed.append([1, off, n])
    to_copy.append((off, raw))
    return off + n


def _encode(
    value: object, views: "_Views"
) -> tuple[Optional[bytes], _Places, _Copies, int, Optional[tuple[str, list[int]]]]:
    """Pickles `value` with its large buffers out of band: each is named where it lies in the
    input arena, or copied into the result arena. A plain C-contiguous array of numbers, the
    common result, is sent without a pickle: its dtype, shape and buffer."""
    if type(value) is _np.ndarray and value.dtype.kind in "biufc" and value.flags.c_contiguous:
        placed: _Places = []
        to_copy: _Copies = []
        n = value.nbytes
        for view, off in views.inputs:
            # An input returned as it came: where it lies (its base checked too: `__setstate__`
            # gives the same object other memory).
            if value is view and n and value.base is views.ro:
                placed.append([0, off, n])
                need = 0
                break
        else:
            raw: _Bytes = value.reshape(-1).view(_np.uint8)
            if n and value.flags.owndata:  # memory NumPy allocated: in no arena
                need = _room(n, placed, to_copy, raw, 0)
            else:
                addr = value.__array_interface__["data"][0]
                need = _place(n, addr, placed, to_copy, raw, 0)
        dt = value.dtype
        name = _DTYPE_NAMES.get(dt)
        if name is None:
            name = _DTYPE_NAMES[dt] = dt.str
        return None, placed, to_copy, need, (name, list(value.shape))
    import io

    buffers: list[pickle.PickleBuffer] = []
    f = io.BytesIO()
    _Pickler(f, protocol=5, buffer_callback=buffers.append).dump(value)
    payload = f.getvalue()
    placed = []
    to_copy = []
    need = 0
    for pb in buffers:
        raw = pb.raw()
        n = raw.nbytes
        addr = _np.frombuffer(raw, dtype=_np.uint8).__array_interface__["data"][0] if n else 0
        need = _place(n, addr, placed, to_copy, raw, need)
    return payload, placed, to_copy, need, None


def _call(msg: dict[str, Any]) -> None:
    global _spin
    _spin = msg["spin"] is True
    module = _modules[msg["key"]]
    views = _Views()
    result, err, returned_out = _run(module, msg, views)
    if err is not None:
        # The traceback (and with it the body's frames) is gone by now.
        _send({"s": "raised", "exc": err, "retained": views.retained()})
        return
    try:
        payload, placed, to_copy, need, arr = _encode(result, views)
    except BaseException as e:  # noqa: BLE001 - a result that cannot be pickled
        err = _exception_info(e, "result")
    del result
    # Whether the body kept an input or `out` view (in module state, a closure, a thread): the
    # parent then gives the next call a fresh input arena, so what the body kept never changes
    # under it, and this call's results and `out` buffers are copied into the result arena, so
    # that the parent reads memory no view the body kept can write.
    retained = views.retained()
    if err is not None:
        _send({"s": "raised", "exc": err, "retained": retained})
        return
    inp = cast("_Arena", _arenas[0])  # (sent before the first call)
    if retained:
        for p in placed:
            if p[0] == 0 and p[2] > 0:
                _, off, n = p
                p.clear()
                need = _room(n, [], to_copy, inp.view[off : off + n], need)
                p.extend([1, to_copy[-1][0], n])
    # Where the parent reads each `out` buffer: in place, or its copy in the result arena.
    outs: Optional[_Places] = None
    if returned_out:
        outs = []
        for o in msg["out"]:
            n = _count(o["shape"]) * _np.dtype(o["dtype"]).itemsize
            if n == 0:
                outs.append([0, 0, 0])
            elif retained:
                need = _room(n, outs, to_copy, inp.view[o["at"] : o["at"] + n], need)
            else:
                outs.append([0, o["at"], n])
    res = cast("_Arena", _result_arena(need))  # (None only when nothing is copied)
    for off, raw in to_copy:
        # (An array is a buffer; NumPy's stubs say so for Python 3.12 and later only.)
        res.view[off : off + raw.nbytes] = cast("Buffer", raw)
    del to_copy
    if returned_out:
        _send({"s": "wrote", "outs": outs, "retained": retained})
    elif arr is not None:
        _send_array(placed[0], arr[0], arr[1], retained)
    else:
        pickled = cast(bytes, payload)  # (None only for an array, sent above)
        if len(pickled) > _MAX_PICKLE:
            _send(_too_large(len(pickled), retained))
        else:
            _send({"s": "pickled", "bufs": placed, "retained": retained}, pickled)


def _too_large(n: int, retained: bool) -> dict[str, Any]:
    """The reply for a result that pickles to `n` bytes, more than a frame carries."""
    return {
        "s": "raised",
        "retained": retained,
        "exc": {
            "type": "OverflowError",
            "module": "builtins",
            "bases": ["OverflowError", "ArithmeticError", "Exception", "BaseException"],
            "message": "the result pickles to %d bytes, more than a reply can carry (4 GiB); "
            "return it as an array" % n,
            "traceback": "",
            "phase": "result",
            "syntax": None,
            "name": None,
        },
    }


def _result_arena(need: int) -> "Optional[_Arena]":
    """The result arena, with room for `need` bytes: a larger one asked for (`need`) when it
    has not."""
    res = _arenas[1]
    if need and need > (res.size if res is not None else 0):
        _send({"s": "need", "need": need})
        _, nxt, nfds = _recv_frame()
        if nxt["op"] != "arena" or nxt["which"] != 1:
            raise _ProtocolError("a need was answered with %r" % nxt["op"])
        _map_or_exit(1, nfds, nxt["size"])
        _send({"s": "mapped"})
        res = _arenas[1]
    return res


def _run(
    module: types.ModuleType, msg: dict[str, Any], views: "_Views"
) -> "tuple[object, Optional[_ExcInfo], bool]":
    """Calls the body; returns (result, exception info or None, whether it returned `out`)."""
    plan = _plan
    if plan is not None:
        args = [views.view(*p) for p in plan]
    else:
        args = _decode(msg["args"], views)  # a protocol error is the worker's, not the body's
    try:
        kwargs = {}
        outs = msg["out"]
        if outs is not None:
            arrays = [views.out(o["at"], o["dtype"], o["shape"]) for o in outs]
            kwargs["out"] = arrays[0] if len(arrays) == 1 else tuple(arrays)
        f = getattr(module, msg["function"])
        result = f(*args, **kwargs)
    except BaseException as e:  # noqa: BLE001 - every exception goes back to the parent
        return None, _exception_info(e, "call"), False
    if outs is not None and (result is None or result is kwargs["out"]):
        return None, None, True
    return result, None, False


def _count(shape: Iterable[int]) -> int:
    count = 1
    for d in shape:
        count *= d
    return count


def _ping(msg: dict[str, Any]) -> None:
    module = _modules.get(msg["key"])
    missing = [name for name in msg["fns"] if not callable(getattr(module, name, None))]
    _send({"s": "pong", "missing": missing})


def _unload(msg: dict[str, Any]) -> None:
    # Never answered: the op is gone in the program, its modules go here.
    for old in [k for k in _modules if k[0] == msg["base"]]:
        del _modules[old]
    import gc

    gc.collect()


# What serves each request after `init` (an arena is mapped by the loop itself). A relay's join
# (relay.py) puts its own in place: from then on the actor serves them, and a second join is
# unexpected.
_HANDLERS: "dict[str, Callable[[dict[str, Any]], None]]" = {
    "call": _call,
    "load": _load,
    "ping": _ping,
    "unload": _unload,
    "join": _join,
}


def _main() -> None:
    global _np, _seq
    # Ctrl-C in a terminal is the program's to handle; the worker is in its own process group,
    # but a body's own signal handling should not see it either.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    _seq, init, _ = _recv_frame()
    if init["op"] != "init":
        raise _ProtocolError("the first request is not init")
    if list(sys.version_info[:2]) != init["version"]:
        # Another Python than the program's: its path would import the wrong standard library.
        _send({"s": "wrong_version", "version": sys.version.split()[0]})
        return
    sys.argv[:] = init["argv"]
    if init["site_packages"]:
        # As the program does: its environment's .pth files (editable installs, import hooks).
        import site

        site.addsitedir(init["site_packages"])
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.reconfigure(line_buffering=True)  # type: ignore[union-attr]
        except Exception:  # noqa: BLE001 - a replaced stream
            pass
    ns: dict[str, Any] = {}
    exec(compile(init["importer"], _PYOP, "exec"), ns)
    global _install_package, _importer_text
    _install_package = ns["_install_package"]
    _importer_text = init["importer"]  # for a relay's actor (relay.py)
    try:
        import numpy
    except BaseException as e:  # noqa: BLE001
        _send({"s": "no_numpy", "exc": _exception_info(e, "start")})
        return
    _np = numpy
    sys.modules["pyop"] = _PyopStub("pyop")
    if init["zygote"]:
        _zygote()
    os.close(4)
    _serve()


# --- the zygote (zygote.rs) -------------------------------------------------------------------
# A process that has started the interpreter and imported NumPy, with its BLAS and OpenMP thread
# pools at one thread (the program starts it with every THREAD_VARS at 1), so it stays
# single-threaded; it forks each worker, which sets its own thread counts. It runs no body.


def _zygote() -> None:
    global _seq, _is_zygote
    _is_zygote = True
    _send(
        {
            "s": "ready",
            "pid": os.getpid(),
            "python": sys.version.split()[0],
            "numpy": _np.__version__,
        }
    )
    while True:
        _seq, msg, fds = _recv_frame()
        op = msg["op"]
        if op == "spawn":
            if len(fds) != 1:
                raise _ProtocolError("a spawn came with %d descriptors" % len(fds))
            try:
                pid = _spawn(fds[0], msg["env"], msg["cwd"])
            except OSError as e:
                _send({"s": "spawn_failed", "why": _clean(e)})
            else:
                _send({"s": "spawned", "pid": pid})
            finally:
                os.close(fds[0])
        elif op == "reap":
            # Only children of this zygote, which the program has seen end or has killed.
            _, status = os.waitpid(msg["pid"], 0)
            _send({"s": "reaped", "status": status})
        else:
            raise _ProtocolError("the zygote got %r" % op)


def _spawn(fd: int, env: dict[str, str], cwd: str) -> int:
    global _zygote_forking
    threads = len(os.listdir("/proc/self/task"))
    if threads != 1:
        # Forking a process with threads copies locks they may hold: never done.
        raise OSError("the zygote has %d threads" % threads)
    _zygote_forking = True
    try:
        pid = os.fork()
    finally:
        _zygote_forking = False
    if pid:
        # Both sides set the group, so it exists whichever runs first.
        try:
            os.setpgid(pid, pid)
        except OSError:
            pass
        return pid
    # No parent-death signal: a worker outlives its zygote (its guardian ends it with the
    # program), so the zygote's end fails no call.
    try:
        os.setpgid(0, 0)
        _become_worker(fd, env, cwd)
    except BaseException:  # noqa: BLE001 - a child that cannot set up never serves
        try:
            traceback.print_exc()
        finally:
            os._exit(72)
    os._exit(0)


def _become_worker(fd: int, env: dict[str, str], cwd: str) -> None:
    global _SOCK, _seq, _is_zygote
    # A worker now: it checks for its next request after each reply (the zygote does not).
    _is_zygote = False
    _SOCK.close()
    os.set_inheritable(fd, False)
    _SOCK = socket.socket(fileno=os.dup(fd))
    os.close(fd)
    _start_guardian(_SOCK.fileno())
    os.close(4)
    # The program's environment and directory now, as a worker it started itself would have.
    os.chdir(cwd)
    os.environ.clear()
    os.environ.update(env)
    _blas_threads(dict(env))
    # NumPy's legacy global generator, if something imported it in the zygote, was seeded
    # there: each worker gets its own stream (Python's `random` reseeds itself at fork).
    if "numpy.random" in sys.modules:
        sys.modules["numpy.random"].seed()
    _seq = 0
    _serve()


def _blas_threads(env: dict[str, str]) -> None:
    """Sets the thread count of every BLAS library loaded (OpenBLAS, as NumPy's wheels ship it or
    as a system `libblas.so.3`, MKL, BLIS, FlexiBLAS) to what `env` says, as its variables would
    have at load time: found by the setter each exports, whatever the file is called."""
    import ctypes

    def count(*names: str) -> Optional[int]:
        for n in names:
            try:
                return int(env[n].split(",")[0])
            except (KeyError, ValueError):
                pass
        return None

    openblas = count("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS")
    setters = [
        ("openblas_set_num_threads", openblas),
        ("scipy_openblas_set_num_threads64_", openblas),
        ("scipy_openblas_set_num_threads_64_", openblas),
        ("openblas_set_num_threads64_", openblas),
        ("MKL_Set_Num_Threads", count("MKL_NUM_THREADS", "OMP_NUM_THREADS")),
        ("bli_thread_set_num_threads", count("BLIS_NUM_THREADS", "OMP_NUM_THREADS")),
        ("flexiblas_set_num_threads", count("OMP_NUM_THREADS")),
    ]
    seen = set()
    with open("/proc/self/maps") as maps:
        for line in maps:
            parts = line.split(None, 5)
            path = parts[5].strip() if len(parts) == 6 else ""
            if path.endswith(" (deleted)"):
                path = path[: -len(" (deleted)")]
            if not path.startswith("/") or ".so" not in path or path in seen:
                continue
            seen.add(path)
            try:
                lib = ctypes.CDLL(path, mode=os.RTLD_NOLOAD | os.RTLD_LAZY)
            except OSError:
                continue  # (replaced on disk since it was loaded, say)
            for name, n in setters:
                f = getattr(lib, name, None) if n is not None else None
                if f is not None:
                    f(n)
                    break


def _serve() -> None:
    global _seq
    _send(
        {
            "s": "ready",
            "pid": os.getpid(),
            "python": sys.version.split()[0],
            "numpy": _np.__version__,
        }
    )
    while True:
        try:
            _seq, msg, fds = _recv_frame()
            op = msg["op"]
            if op != "arena":
                for fd in fds:  # only an arena comes with one
                    os.close(fd)
            if op == "arena":
                _map_or_exit(msg["which"], fds, msg["size"])
                continue
            handler = _HANDLERS.get(op)
            if handler is None:
                raise _ProtocolError("unexpected request " + op)
            handler(msg)
        except BaseException as e:  # noqa: BLE001 - a failure of the worker itself
            # Said, then the worker exits: its state is not to be trusted with another call.
            try:
                _send({"s": "raised", "exc": _exception_info(e, "worker"), "retained": False})
            finally:
                os._exit(70)


# The embedded-package importer's `_install_package`, from `init` (`_main`).
_install_package: "_Installer"
if _IS_WORKER:
    _main()
