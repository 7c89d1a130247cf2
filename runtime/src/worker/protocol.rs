//! The one protocol between the program and a worker process: every message either way is a type
//! here (serde derive), and `worker.py` builds and reads exactly these fields.
//!
//! A frame the program sends is `{"q": <sequence>, "m": <Request>}`; a worker's reply is a 4-byte
//! header length, `{"q": <the request's sequence>, "m": <Reply>}`, then a pickle (empty unless
//! the reply is [`Reply::Pickled`]). Requests are tagged by `"op"`, replies by `"s"`. Both sides
//! are strict: the program decodes replies with `deny_unknown_fields` and then checks every place
//! and size against the arenas ([`Reply::check`]); `worker.py` checks each request's exact set of
//! fields. A message either side does not expect is a protocol error that ends the worker
//! (`WorkerLost` naming the field), never a default.
//!
//! Whether both sides agree is tested by round trips of every kind through the real worker
//! (`tests/worker_protocol_tests.rs`, `every_message_kind_round_trips_through_a_real_worker`) and
//! by the unit tests below, which hold the Rust side to the exact JSON `worker.py` writes.

use std::path::Path;

use serde::{Deserialize, Serialize};

/// A module's key in a worker: the op's own base (its name and a number unique in the program)
/// and the source's generation (hot reload makes a new one). A worker keeps one generation per
/// base; bases are compared whole, so no op's key is a prefix of another's.
#[derive(Clone, Debug, PartialEq, Eq, Hash, Serialize)]
pub(crate) struct ModuleKey {
    pub base: String,
    pub generation: u64,
}

/// How a worker finds a body's module.
#[derive(Debug, Serialize)]
#[serde(tag = "kind", rename_all = "snake_case")]
pub(crate) enum LoadSource<'a> {
    /// Inline code: run as a module named after the op, its lines given to `linecache`.
    Code {
        op_name: &'a str,
        text: &'a str,
        filename: &'a str,
        first_line: u32,
    },
    /// A file's text.
    File {
        op_name: &'a str,
        text: &'a str,
        filename: &'a str,
    },
    /// An importable module.
    Module { name: &'a str },
    /// An embedded package: its files by relative path, imported through the embedded importer.
    Package {
        name: &'a str,
        root: &'a str,
        module: &'a str,
        files: std::collections::BTreeMap<&'a str, &'a str>,
    },
}

/// A tensor in the input arena: its storage's bytes from `at`, read with these strides (bytes;
/// 0 for a broadcast dimension), so a broadcast or narrowed input crosses as the storage it views.
#[derive(Debug, Serialize)]
pub(crate) struct TensorRef {
    pub at: usize,
    pub dtype: &'static str,
    pub shape: Vec<usize>,
    pub strides: Vec<usize>,
}

/// A C-ordered `out` buffer in the input arena.
#[derive(Debug, Serialize)]
pub(crate) struct OutRef {
    pub at: usize,
    pub dtype: &'static str,
    pub shape: Vec<usize>,
}

/// One argument as the worker decodes it: tensors by their place, tuples and lists of arguments,
/// plain values as JSON has them (non-finite floats spelt out, since JSON has none).
#[derive(Debug, Serialize)]
#[serde(untagged)]
pub(crate) enum WireArg<'a> {
    Tensor { t: TensorRef },
    Tuple { u: Vec<WireArg<'a>> },
    NonFinite { f: &'static str },
    List(Vec<WireArg<'a>>),
    Float(f64),
    Int(i64),
    UInt(u64),
    Bool(bool),
    Str(&'a str),
    None,
}

impl WireArg<'_> {
    /// A float exactly: finite as a JSON number, else its name.
    pub(crate) fn float(v: f64) -> WireArg<'static> {
        if v.is_finite() {
            WireArg::Float(v)
        } else {
            WireArg::NonFinite {
                f: if v.is_nan() {
                    "nan"
                } else if v > 0.0 {
                    "inf"
                } else {
                    "-inf"
                },
            }
        }
    }
}

/// Every message the program sends a worker.
#[derive(Debug, Serialize)]
#[serde(tag = "op", rename_all = "snake_case")]
pub(crate) enum Request<'a> {
    /// The second frame a worker gets (after its main loop's text): what it needs before it can
    /// import anything of the body's. Its `sys.path` came first, on its command line.
    Init {
        site_packages: Option<&'a Path>,
        importer: &'a str,
        version: [u32; 2],
        /// The program's `sys.argv`, which the worker's becomes.
        argv: &'a [String],
        /// Whether this process is the zygote (`zygote.rs`): it serves `spawn` and `reap`, and
        /// runs no body.
        zygote: bool,
    },
    /// To the zygote: fork a worker that serves the socket riding with the frame, in the
    /// program's directory `cwd` with the program's environment `env` now (the BLAS and OpenMP
    /// thread counts, `THREAD_VARS`, set as a worker's), its BLAS library's threads set to match.
    Spawn {
        env: &'a [(String, String)],
        cwd: &'a str,
    },
    /// To the zygote: wait for its child `pid` (which has exited or been killed) and say how it
    /// ended.
    Reap { pid: u32 },
    /// An arena (the descriptor rides with the frame): 0 inputs and `out` buffers, 1 results.
    /// Never answered.
    Arena { which: u8, size: usize },
    /// Load a body's module under `key` (dropping the other generations of its base).
    Load {
        key: &'a ModuleKey,
        #[serde(flatten)]
        source: LoadSource<'a>,
    },
    /// Run `function` of the module `key` on `args`, with `out` buffers when it takes them.
    Call {
        key: &'a ModuleKey,
        function: &'a str,
        args: Vec<WireArg<'a>>,
        out: Option<Vec<OutRef>>,
        /// Whether the worker may check for its next request for a while after replying
        /// (`worker.py`, `_wait_awake`, which judges from its own spins whether that takes a
        /// core from one that works): not under `PYOP_WORKER_SPIN=0` (`pace.rs`).
        spin: bool,
    },
    /// Drop every module of `base` (its op is gone). Never answered.
    Unload { base: &'a str },
    /// Which of `fns` the module `key` lacks (`validate()`).
    Ping {
        key: &'a ModuleKey,
        fns: &'a [&'a str],
    },
    /// To a worker that has just said `ready`: become the relay of a Ray actor (`ray/relay.py`):
    /// join the cluster at `address` (`None`: `RAY_ADDRESS`, else the cluster this machine
    /// runs) in `namespace`, start an actor of `actor`'s code with these resources and wait up
    /// to `timeout` seconds for it to say where it runs. Every later load, call, ping and unload
    /// is the actor's.
    Join {
        address: Option<&'a str>,
        namespace: &'a str,
        num_cpus: f64,
        resources: &'a [(String, f64)],
        actor: &'a str,
        timeout: f64,
    },
}

/// A frame: a request with its sequence number.
#[derive(Serialize)]
struct Envelope<'a> {
    q: u64,
    m: &'a Request<'a>,
}

/// The JSON text of a request, to be sent under sequence number `seq` by [`with_seq`].
pub(crate) fn encode(request: &Request<'_>) -> String {
    serde_json::to_string(request).expect("a request is plain data")
}

/// The frame of an encoded request (`encode`) under sequence number `seq`: a load message's text
/// is made once per source and sent to every worker.
pub(crate) fn with_seq(seq: u64, encoded: &str) -> Vec<u8> {
    format!("{{\"q\":{seq},\"m\":{encoded}}}").into_bytes()
}

/// A frame for `request` under sequence number `seq`.
pub(crate) fn frame(seq: u64, request: &Request<'_>) -> Vec<u8> {
    serde_json::to_vec(&Envelope { q: seq, m: request }).expect("a request is plain data")
}

/// When a worker's exception happened.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "snake_case")]
pub(crate) enum Phase {
    /// Importing NumPy at start.
    Start,
    /// Loading the body's module.
    Load,
    /// Running the body.
    Call,
    /// Sending its result back (it could not be pickled).
    Result,
    /// The worker's own machinery: it exits after saying so.
    Worker,
}

/// An exception raised in a worker, as the program rebuilds it.
#[derive(Clone, Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub(crate) struct ExcInfo {
    #[serde(rename = "type")]
    pub type_name: String,
    pub module: String,
    /// The builtin exception classes in its MRO, nearest first (they give its kind).
    pub bases: Vec<String>,
    pub message: String,
    pub traceback: String,
    pub phase: Phase,
    /// A `SyntaxError`'s own message and the lines that show where.
    pub syntax: Option<SyntaxInfo>,
    /// An `ImportError`'s `name`.
    pub name: Option<String>,
}

#[derive(Clone, Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub(crate) struct SyntaxInfo {
    pub msg: String,
    pub location: String,
}

/// Where a buffer of a reply lies: `[arena, offset, length]`, arena 0 the input arena, 1 the
/// result arena.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Deserialize)]
pub(crate) struct Place(pub u8, pub u64, pub u64);

/// Every message a worker sends.
#[derive(Clone, Debug, Deserialize)]
#[serde(tag = "s", rename_all = "snake_case", deny_unknown_fields)]
pub(crate) enum Reply {
    /// Started: its interpreter and NumPy imported.
    Ready {
        pid: u32,
        python: String,
        numpy: String,
    },
    /// Another Python version than the program's: it did not start.
    WrongVersion { version: String },
    /// NumPy could not be imported: it did not start.
    NoNumpy { exc: ExcInfo },
    /// (A struct variant, so that an unexpected field is refused.)
    Loaded {},
    /// The module failed to load (the worker stays usable for other modules).
    LoadFailed { exc: ExcInfo },
    /// The result arena is too small for this call's results: the program sends one of at least
    /// `need` bytes, then the reply comes.
    Need { need: u64 },
    /// The result arena sent after a `need` is mapped (a struct variant, as `Loaded`).
    Mapped {},
    /// A plain C-ordered array, its bytes at `place`.
    Array {
        place: Place,
        dtype: String,
        shape: Vec<u64>,
        retained: bool,
    },
    /// Any other value: the frame's pickle, its large buffers at `bufs`.
    Pickled { bufs: Vec<Place>, retained: bool },
    /// The body wrote its `out` buffers (and returned them or `None`): where each now is (in
    /// place, or copied into the result arena when the body kept a view).
    Wrote { outs: Vec<Place>, retained: bool },
    /// The body (or the worker) raised.
    Raised { exc: ExcInfo, retained: bool },
    /// The answer to a ping.
    Pong { missing: Vec<String> },
    /// From the zygote: a worker forked, its process id (it says `ready` on its own socket).
    Spawned { pid: u32 },
    /// From the zygote: it could not fork a worker (it is not single-threaded any more, or
    /// `fork` failed): why.
    SpawnFailed { why: String },
    /// From the zygote: how its child ended, as `waitpid` gives it (a raw wait status).
    Reaped { status: i32 },
    /// A relay joined its cluster and started its actor: the versions the relay (the program's
    /// environment) runs, and where the actor runs with what.
    Joined { driver: Versions, actor: ActorPlace },
    /// A relay could not join or start its actor: at which step, and the exception.
    JoinFailed { stage: JoinStage, exc: ExcInfo },
    /// A relay's actor (or its node) is gone: Ray's error, as `Type: message`. The relay exits.
    Lost { why: String },
}

/// Python X.Y, NumPy and Ray versions, which each actor's must equal the program's.
#[derive(Clone, Debug, PartialEq, Eq, Deserialize)]
#[serde(deny_unknown_fields)]
pub(crate) struct Versions {
    pub python: String,
    pub numpy: String,
    pub ray: String,
}

/// Where a relay's actor runs: its process on its node, and its versions.
#[derive(Clone, Debug, PartialEq, Eq, Deserialize)]
#[serde(deny_unknown_fields)]
pub(crate) struct ActorPlace {
    pub pid: u32,
    pub node: String,
    pub ip: String,
    pub versions: Versions,
}

/// The step of a relay's join that failed.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "snake_case")]
pub(crate) enum JoinStage {
    /// `import ray`.
    Import,
    /// `ray.init`: joining the cluster.
    Connect,
    /// Asking Ray for the actor (its options refused).
    Submit,
    /// The actor was not placed and started within the time limit.
    Place,
    /// The actor failed as it started.
    Start,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct ReplyEnvelope {
    q: u64,
    m: Reply,
    /// How the worker waited for the request (`worker.py`'s `_wait_awake`); older relays'
    /// replies may lack it.
    #[serde(default)]
    w: Option<Waited>,
}

/// How one side waited for the other's message: it caught it checking (spinning) for it, it
/// checked for a while and then slept until the message woke it, or it slept without checking
/// (spinning was off, or the message was not due yet). In a reply's `w`: `[0, µs]`, `[1, µs]`,
/// `[2, 0]`, with the µs spent checking.
#[derive(Deserialize, Clone, Copy, Debug, PartialEq, Eq)]
#[serde(try_from = "(u8, u64)")]
pub(crate) enum Waited {
    Caught { checked: std::time::Duration },
    Missed { checked: std::time::Duration },
    Slept,
}

impl Waited {
    /// Its counter in a side's row of `WaitStats` (0 caught, 1 missed, 2 slept) and the time it
    /// spent checking.
    pub(crate) fn slot(self) -> (usize, std::time::Duration) {
        match self {
            Waited::Caught { checked } => (0, checked),
            Waited::Missed { checked } => (1, checked),
            Waited::Slept => (2, std::time::Duration::ZERO),
        }
    }
}

impl TryFrom<(u8, u64)> for Waited {
    type Error = String;

    fn try_from((kind, us): (u8, u64)) -> Result<Waited, String> {
        let checked = std::time::Duration::from_micros(us);
        match kind {
            0 => Ok(Waited::Caught { checked }),
            1 => Ok(Waited::Missed { checked }),
            2 => Ok(Waited::Slept),
            other => Err(format!("no way of waiting is numbered {other}")),
        }
    }
}

/// A reply frame, decoded.
#[derive(Debug)]
pub(crate) struct Decoded {
    /// The sequence number of the request it answers.
    pub q: u64,
    pub reply: Reply,
    /// Its pickle (for a `pickled` reply; else empty).
    pub payload: Vec<u8>,
    pub waited: Option<Waited>,
}

/// A worker broke the protocol: the field at fault and what was wrong with it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct ProtocolError {
    pub field: &'static str,
    pub why: String,
}

impl std::fmt::Display for ProtocolError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "sent a reply whose `{}` {}", self.field, self.why)
    }
}

fn bad(field: &'static str, why: impl Into<String>) -> ProtocolError {
    ProtocolError {
        field,
        why: why.into(),
    }
}

/// A reply frame split into its sequence number, its message, its pickle and how the worker
/// waited.
pub(crate) fn decode(frame: Vec<u8>) -> Result<Decoded, ProtocolError> {
    let hlen = frame
        .get(..4)
        .map(|b| u32::from_le_bytes(b.try_into().expect("4 bytes")) as usize)
        .ok_or_else(|| bad("header", "is missing"))?;
    let end = hlen
        .checked_add(4)
        .filter(|&e| e <= frame.len())
        .ok_or_else(|| bad("header", format!("length {hlen} runs past its frame")))?;
    let envelope: ReplyEnvelope = serde_json::from_slice(&frame[4..end])
        .map_err(|e| bad("header", format!("is not a reply ({e})")))?;
    // The pickle moves to the front of the frame's own buffer: no second allocation.
    let mut payload = frame;
    payload.drain(..end);
    if !payload.is_empty() && !matches!(envelope.m, Reply::Pickled { .. }) {
        return Err(bad("payload", "comes with a reply that has none"));
    }
    Ok(Decoded {
        q: envelope.q,
        reply: envelope.m,
        payload,
        waited: envelope.w,
    })
}

/// The most bytes a `need` may ask for: the machine's memory (a worker cannot have made results
/// larger than that), so a forged or corrupt `need` cannot size an arena.
pub(crate) fn need_cap() -> u64 {
    crate::alloc::machine_memory()
}

/// A checked [`Place`]: inside its arena.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Region {
    /// 0: the input arena, 1: the result arena.
    pub arena: u8,
    pub offset: usize,
    pub len: usize,
}

impl Place {
    /// The region this place names, checked (with checked arithmetic) to lie inside its arena
    /// (`lens`: the input and result arenas' sizes, 0 for one the worker has none of). An empty
    /// buffer names no memory.
    pub(crate) fn check(
        self,
        field: &'static str,
        lens: [usize; 2],
    ) -> Result<Region, ProtocolError> {
        let Place(arena, offset, len) = self;
        if len == 0 {
            return Ok(Region {
                arena,
                offset: 0,
                len: 0,
            });
        }
        let size = *lens
            .get(usize::from(arena))
            .ok_or_else(|| bad(field, format!("names arena {arena}, which does not exist")))?;
        let (Ok(offset), Ok(len)) = (usize::try_from(offset), usize::try_from(len)) else {
            return Err(bad(field, "names a place past any arena"));
        };
        match offset.checked_add(len) {
            Some(end) if end <= size => Ok(Region { arena, offset, len }),
            _ => Err(bad(
                field,
                format!("names bytes {offset}+{len}, outside its arena of {size}"),
            )),
        }
    }
}

/// A plain dtype string as NumPy writes it (`<f4`, `|u1`, `<c16`): its element size.
pub(crate) fn itemsize(dtype: &str) -> Option<u64> {
    let b = dtype.as_bytes();
    if b.len() < 3 || b.len() > 4 || !b"<>|=".contains(&b[0]) || !b"biufc".contains(&b[1]) {
        return None;
    }
    dtype[2..].parse().ok().filter(|&n: &u64| n > 0)
}

/// A reply's places and sizes, checked before anything is sized or read by them.
pub(crate) struct Checked {
    /// Bytes the worker copied into the result arena for this reply.
    pub copied_out: u64,
}

impl Reply {
    /// Checks every place and size the reply names against the arenas (`lens`), with checked
    /// arithmetic: each place inside its arena, an array's shape and dtype adding up to exactly
    /// its bytes, `need` under [`need_cap`]. `outs` is the `out` buffers' sizes the call sent.
    pub(crate) fn check(
        &self,
        lens: [usize; 2],
        outs: Option<&[usize]>,
    ) -> Result<Checked, ProtocolError> {
        let mut copied_out = 0u64;
        let mut count = |r: &Region| {
            if r.arena == 1 {
                copied_out = copied_out.saturating_add(r.len as u64);
            }
        };
        match self {
            Reply::Need { need } if *need == 0 || *need > need_cap() => {
                return Err(bad(
                    "need",
                    format!("asks for {need} bytes (0 or more than this machine has)"),
                ));
            }
            Reply::Array {
                place,
                dtype,
                shape,
                ..
            } => {
                let r = place.check("place", lens)?;
                count(&r);
                let size = itemsize(dtype)
                    .ok_or_else(|| bad("dtype", format!("{dtype:?} is not a plain dtype")))?;
                let bytes = shape
                    .iter()
                    .try_fold(size, |n, &d| n.checked_mul(d))
                    .ok_or_else(|| bad("shape", format!("{shape:?} overflows")))?;
                if bytes != r.len as u64 {
                    return Err(bad(
                        "shape",
                        format!(
                            "{shape:?} of {dtype} is {bytes} bytes, but its place holds {}",
                            r.len
                        ),
                    ));
                }
            }
            Reply::Raised { exc, .. } if exc.phase == Phase::Start => {
                return Err(bad(
                    "exc",
                    "says the worker failed to start, after its start",
                ));
            }
            Reply::Pickled { bufs, .. } => {
                for p in bufs {
                    count(&p.check("bufs", lens)?);
                }
            }
            Reply::Wrote { outs: places, .. } => {
                let Some(sizes) = outs else {
                    return Err(bad("outs", "answers a call that gave no `out` buffers"));
                };
                if places.len() != sizes.len() {
                    return Err(bad(
                        "outs",
                        format!("names {} buffers for {}", places.len(), sizes.len()),
                    ));
                }
                for (p, &n) in places.iter().zip(sizes) {
                    let r = p.check("outs", lens)?;
                    if r.len != n {
                        return Err(bad(
                            "outs",
                            format!("names {} bytes for a buffer of {n}", r.len),
                        ));
                    }
                    count(&r);
                }
            }
            _ => {}
        }
        Ok(Checked { copied_out })
    }

    /// The message's tag, for errors.
    pub(crate) fn kind(&self) -> &'static str {
        match self {
            Reply::Ready { .. } => "ready",
            Reply::WrongVersion { .. } => "wrong_version",
            Reply::NoNumpy { .. } => "no_numpy",
            Reply::Loaded {} => "loaded",
            Reply::LoadFailed { .. } => "load_failed",
            Reply::Need { .. } => "need",
            Reply::Mapped {} => "mapped",
            Reply::Array { .. } => "array",
            Reply::Pickled { .. } => "pickled",
            Reply::Wrote { .. } => "wrote",
            Reply::Raised { .. } => "raised",
            Reply::Pong { .. } => "pong",
            Reply::Spawned { .. } => "spawned",
            Reply::SpawnFailed { .. } => "spawn_failed",
            Reply::Reaped { .. } => "reaped",
            Reply::Joined { .. } => "joined",
            Reply::JoinFailed { .. } => "join_failed",
            Reply::Lost { .. } => "lost",
        }
    }
}

/// Where each of `sizes` goes in an arena, 64-byte aligned, and the bytes needed in all; `None`
/// if that overflows.
pub(crate) fn layout(sizes: impl IntoIterator<Item = usize>) -> Option<(Vec<usize>, usize)> {
    let mut end = 0usize;
    let mut offsets = Vec::new();
    for n in sizes {
        let at = end.checked_next_multiple_of(64)?;
        end = at.checked_add(n)?;
        offsets.push(at);
    }
    Some((offsets, end))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn frame_of(header: &str, payload: &[u8]) -> Vec<u8> {
        let mut f = (header.len() as u32).to_le_bytes().to_vec();
        f.extend_from_slice(header.as_bytes());
        f.extend_from_slice(payload);
        f
    }

    fn reply(header: &str) -> Result<Reply, ProtocolError> {
        decode(frame_of(header, b"")).map(|d| d.reply)
    }

    const EXC: &str = r#"{"type":"ValueError","module":"builtins","bases":["ValueError","Exception","BaseException"],"message":"m","traceback":"","phase":"call","syntax":null,"name":null}"#;

    #[test]
    fn every_reply_kind_decodes_as_worker_py_writes_it() {
        let cases = [
            r#"{"q":1,"m":{"s":"ready","pid":7,"python":"3.11.7","numpy":"2.4.6"}}"#.to_owned(),
            r#"{"q":1,"m":{"s":"wrong_version","version":"3.12.1"}}"#.to_owned(),
            format!(r#"{{"q":1,"m":{{"s":"no_numpy","exc":{EXC}}}}}"#),
            r#"{"q":1,"m":{"s":"loaded"}}"#.to_owned(),
            format!(r#"{{"q":1,"m":{{"s":"load_failed","exc":{EXC}}}}}"#),
            r#"{"q":1,"m":{"s":"need","need":4096}}"#.to_owned(),
            r#"{"q":1,"m":{"s":"mapped"}}"#.to_owned(),
            r#"{"q":1,"m":{"s":"array","place":[0,0,8],"dtype":"<f4","shape":[2],"retained":false}}"#.to_owned(),
            r#"{"q":1,"m":{"s":"pickled","bufs":[[1,64,8]],"retained":true}}"#.to_owned(),
            r#"{"q":1,"m":{"s":"wrote","outs":[[0,0,8]],"retained":false}}"#.to_owned(),
            format!(r#"{{"q":1,"m":{{"s":"raised","exc":{EXC},"retained":false}}}}"#),
            r#"{"q":1,"m":{"s":"pong","missing":["g"]}}"#.to_owned(),
            r#"{"q":1,"m":{"s":"joined","driver":{"python":"3.11","numpy":"2.4.6","ray":"2.60.0"},"actor":{"pid":9,"node":"ab","ip":"10.0.0.7","versions":{"python":"3.11","numpy":"2.4.6","ray":"2.60.0"}}}}"#.to_owned(),
            format!(r#"{{"q":1,"m":{{"s":"join_failed","stage":"connect","exc":{EXC}}}}}"#),
            r#"{"q":1,"m":{"s":"lost","why":"ActorDiedError: gone"}}"#.to_owned(),
        ];
        let kinds: Vec<&str> = cases
            .iter()
            .map(|c| reply(c).unwrap_or_else(|e| panic!("{c}: {e}")).kind())
            .collect();
        assert_eq!(
            kinds,
            [
                "ready",
                "wrong_version",
                "no_numpy",
                "loaded",
                "load_failed",
                "need",
                "mapped",
                "array",
                "pickled",
                "wrote",
                "raised",
                "pong",
                "joined",
                "join_failed",
                "lost"
            ]
        );
    }

    #[test]
    fn how_the_worker_waited_comes_with_its_reply() {
        let waited = |w: &str| {
            decode(frame_of(
                &format!(r#"{{"q":4,"m":{{"s":"loaded"}}{w}}}"#),
                b"",
            ))
            .unwrap()
            .waited
        };
        let us = std::time::Duration::from_micros;
        assert_eq!(
            waited(r#","w":[0,17]"#),
            Some(Waited::Caught { checked: us(17) })
        );
        assert_eq!(
            waited(r#","w":[1,2000]"#),
            Some(Waited::Missed { checked: us(2000) })
        );
        assert_eq!(waited(r#","w":[2,0]"#), Some(Waited::Slept));
        assert_eq!(waited(""), None);
        // Counted where the wire puts them.
        for (kind, us) in [(0u8, 5u64), (1, 7), (2, 0)] {
            let w = Waited::try_from((kind, us)).unwrap();
            assert_eq!(
                w.slot(),
                (usize::from(kind), std::time::Duration::from_micros(us))
            );
        }
    }

    #[test]
    fn an_unexpected_or_missing_field_is_an_error_naming_the_header() {
        for bad in [
            r#"{"q":1,"m":{"s":"loaded","extra":1}}"#,
            r#"{"q":1,"m":{"s":"need"}}"#,
            r#"{"q":1,"m":{"s":"need","need":-1}}"#,
            r#"{"q":1,"m":{"s":"ok"}}"#,
            r#"{"q":1,"m":{"s":"array","place":[0,0],"dtype":"<f4","shape":[2],"retained":false}}"#,
            r#"{"q":1,"m":{"s":"pong","missing":[]},"x":0}"#,
            r#"{"m":{"s":"loaded"}}"#,
            r#"{"q":1,"m":{"s":"raised","exc":{"type":"E"},"retained":false}}"#,
            // A Ray actor's place without its versions, or a NumPy version missing on one side:
            // an error, never a default.
            r#"{"q":1,"m":{"s":"joined","driver":{"python":"3.11","numpy":"2.4.6","ray":"2.60.0"},"actor":{"pid":9,"node":"ab","ip":"10.0.0.7"}}}"#,
            r#"{"q":1,"m":{"s":"joined","driver":{"python":"3.11","ray":"2.60.0"},"actor":{"pid":9,"node":"ab","ip":"10.0.0.7","versions":{"python":"3.11","numpy":"2.4.6","ray":"2.60.0"}}}}"#,
            r#"{"q":1,"m":{"s":"join_failed","stage":"elsewhere","exc":{"type":"E"}}}"#,
            r#"{"q":1,"m":{"s":"lost"}}"#,
            // How the worker waited: a kind it does not have, a negative time, a missing one.
            r#"{"q":1,"m":{"s":"loaded"},"w":[3,0]}"#,
            r#"{"q":1,"m":{"s":"loaded"},"w":[0,-1]}"#,
            r#"{"q":1,"m":{"s":"loaded"},"w":[1]}"#,
        ] {
            let e = reply(bad).err().unwrap_or_else(|| panic!("accepted {bad}"));
            assert_eq!(e.field, "header", "{bad}: {e}");
        }
        // A pickle after a reply that has none.
        let e = decode(frame_of(r#"{"q":1,"m":{"s":"loaded"}}"#, b"x"))
            .err()
            .unwrap();
        assert_eq!(e.field, "payload");
        // A header length past the frame.
        assert_eq!(
            decode(vec![255, 255, 255, 255, b'{']).err().unwrap().field,
            "header"
        );
    }

    #[test]
    fn sizes_and_places_are_checked_with_a_cap() {
        let lens = [1 << 20, 64];
        let need = |n: u64| Reply::Need { need: n }.check(lens, None);
        assert!(need(4096).is_ok());
        assert!(need(need_cap()).is_ok(), "up to the machine's memory");
        assert_eq!(need(need_cap() + 1).err().unwrap().field, "need");
        assert_eq!(need(u64::MAX).err().unwrap().field, "need");
        assert_eq!(need(0).err().unwrap().field, "need");
        let pickled = |bufs: Vec<Place>| {
            Reply::Pickled {
                bufs,
                retained: false,
            }
            .check(lens, None)
        };
        assert_eq!(pickled(vec![Place(1, 0, 64)]).unwrap().copied_out, 64);
        let e = pickled(vec![Place(1, 1, 64)]).err().unwrap();
        assert_eq!(
            e.to_string(),
            "sent a reply whose `bufs` names bytes 1+64, outside its arena of 64"
        );
        assert_eq!(pickled(vec![Place(0, 0, 64)]).unwrap().copied_out, 0);
        for p in [
            Place(1, 1, 64),
            Place(2, 0, 1),
            Place(0, u64::MAX, 2),
            Place(1, 1 << 63, 1 << 63),
        ] {
            assert_eq!(pickled(vec![p]).err().unwrap().field, "bufs", "{p:?}");
        }
        assert!(
            pickled(vec![Place(2, 0, 0)]).is_ok(),
            "an empty buffer names nothing"
        );
        let array = |dtype: &str, shape: Vec<u64>, len: u64| {
            Reply::Array {
                place: Place(0, 0, len),
                dtype: dtype.into(),
                shape,
                retained: false,
            }
            .check(lens, None)
        };
        assert!(array("<f4", vec![2, 3], 24).is_ok());
        assert_eq!(array("<f4", vec![2, 3], 20).err().unwrap().field, "shape");
        assert_eq!(
            array("<f4", vec![1 << 62, 4], 0).err().unwrap().field,
            "shape"
        );
        assert!(array("<c16", vec![2], 32).is_ok());
        assert!(array("|u1", vec![3], 3).is_ok());
        for bad in ["O", "<f", "<f0", "xf4", "<x4", "<f4x", "<f123", "<V8"] {
            assert_eq!(
                array(bad, vec![1], 8).err().unwrap().field,
                "dtype",
                "{bad}"
            );
        }
        assert_eq!(array("<V8", vec![1], 8).err().unwrap().field, "dtype");
        let wrote = |outs: Vec<Place>, sizes: Option<&[usize]>| {
            Reply::Wrote {
                outs,
                retained: false,
            }
            .check(lens, sizes)
        };
        let raised = |phase: &str| {
            let json = EXC.replace("\"call\"", &format!("\"{phase}\""));
            let header = format!(r#"{{"q":1,"m":{{"s":"raised","exc":{json},"retained":false}}}}"#);
            reply(&header).unwrap().check(lens, None)
        };
        assert!(raised("call").is_ok());
        assert!(raised("worker").is_ok());
        assert_eq!(
            raised("start").err().unwrap().field,
            "exc",
            "only a start says so"
        );
        assert!(wrote(vec![Place(0, 0, 8)], Some(&[8])).is_ok());
        assert_eq!(
            wrote(vec![Place(0, 0, 8)], Some(&[4])).err().unwrap().field,
            "outs"
        );
        assert_eq!(
            wrote(vec![Place(0, 0, 8)], None).err().unwrap().field,
            "outs"
        );
        assert_eq!(wrote(vec![], Some(&[8])).err().unwrap().field, "outs");
    }

    #[test]
    fn requests_are_the_json_worker_py_reads() {
        let key = ModuleKey {
            base: "a#1.0#2".into(),
            generation: 3,
        };
        let call = Request::Call {
            key: &key,
            function: "f",
            args: vec![
                WireArg::Tensor {
                    t: TensorRef {
                        at: 64,
                        dtype: "float32",
                        shape: vec![4],
                        strides: vec![0],
                    },
                },
                WireArg::Tuple {
                    u: vec![WireArg::Int(-1), WireArg::UInt(u64::MAX)],
                },
                WireArg::float(f64::NAN),
                WireArg::float(f64::INFINITY),
                WireArg::float(f64::NEG_INFINITY),
                WireArg::List(vec![WireArg::Bool(true), WireArg::Str("s")]),
                WireArg::Float(0.5),
                WireArg::None,
            ],
            out: None,
            spin: true,
        };
        assert_eq!(
            String::from_utf8(frame(9, &call)).unwrap(),
            r#"{"q":9,"m":{"op":"call","key":{"base":"a#1.0#2","generation":3},"function":"f","args":[{"t":{"at":64,"dtype":"float32","shape":[4],"strides":[0]}},{"u":[-1,18446744073709551615]},{"f":"nan"},{"f":"inf"},{"f":"-inf"},[true,"s"],0.5,null],"out":null,"spin":true}}"#
        );
        let load = Request::Load {
            key: &key,
            source: LoadSource::Module { name: "numpy" },
        };
        assert_eq!(
            String::from_utf8(with_seq(2, &encode(&load))).unwrap(),
            r#"{"q":2,"m":{"op":"load","key":{"base":"a#1.0#2","generation":3},"kind":"module","name":"numpy"}}"#
        );
        let resources = [("extra".to_owned(), 1.0)];
        let join = Request::Join {
            address: Some("10.0.0.5:6379"),
            namespace: "pyop",
            num_cpus: 0.5,
            resources: &resources,
            actor: "class PyopActor: ...",
            timeout: 60.0,
        };
        assert_eq!(
            String::from_utf8(frame(1, &join)).unwrap(),
            r#"{"q":1,"m":{"op":"join","address":"10.0.0.5:6379","namespace":"pyop","num_cpus":0.5,"resources":[["extra",1.0]],"actor":"class PyopActor: ...","timeout":60.0}}"#
        );
    }

    #[test]
    fn layouts_align_and_refuse_overflow() {
        assert_eq!(layout([3, 0, 65]), Some((vec![0, 64, 64], 129)));
        assert_eq!(layout([usize::MAX - 10, 1]), None);
    }
}
