//! A numpy-mode op's call run in a worker process (`crate::worker`): inputs written once into the
//! worker's shared memory, the request sent without the GIL, and the reply checked by the one
//! output check with the GIL held only for that.

use std::path::PathBuf;
use std::sync::{Arc, Mutex, OnceLock};
use std::time::Duration;

use candle_core::{DType, Tensor};
use pyo3::prelude::*;
use serde_json::{json, Value};

use super::OpInner;
use crate::arg::Arg;
use crate::body::source::{cannot_load, Source};
use crate::bridge::outputs::{outputs_from_python, OutputCheck};
use crate::bridge::prepare::{cpu_data_ptr, Prepared};
use crate::bridge::shared::{region, reply_value, result_not_sent, worker_exception};
use crate::bridge::with_gil;
use crate::error::{Error, ErrorKind, Result};
use crate::worker::{layout, Launch, Lease, WorkerPool, LOAD_TIMEOUT};
use crate::worker::{Failure, Reply, Request, StartError};

/// An op's pool and how its workers load its body.
pub(crate) struct Workers {
    pub pool: WorkerPool,
    /// Unique per op: module state in a worker is the op's own, as in the program.
    key: String,
    source: Mutex<Loaded>,
}

struct Loaded {
    /// The source workers load now (hot reload replaces it) and its message.
    source: Source,
    generation: u64,
    message: Arc<str>,
}

impl Workers {
    pub(crate) fn new(pool: WorkerPool, op: &str, source: &Source) -> Workers {
        static NEXT: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(1);
        let n = NEXT.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let key = format!("{op}#{n}");
        let message = load_message(op, &format!("{key}.0"), source);
        Workers {
            pool,
            key,
            source: Mutex::new(Loaded {
                source: source.clone(),
                generation: 0,
                message,
            }),
        }
    }

    /// The module key and load message for the source in use, after hot reload's `current`.
    fn load(&self, op: &str, current: Option<Source>) -> (String, Arc<str>) {
        let mut st = self.source.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(src) = current {
            if !same_text(&src, &st.source) {
                st.generation += 1;
                st.message = load_message(op, &format!("{}.{}", self.key, st.generation), &src);
                st.source = src;
            }
        }
        (
            format!("{}.{}", self.key, st.generation),
            st.message.clone(),
        )
    }
}

fn same_text(a: &Source, b: &Source) -> bool {
    match (a, b) {
        (Source::Package { files: x, .. }, Source::Package { files: y, .. }) => x == y,
        _ => a.text() == b.text(),
    }
}

fn load_message(op: &str, key: &str, source: &Source) -> Arc<str> {
    let msg = match source {
        Source::Code {
            code,
            filename,
            first_line,
        } => json!({"op": "load", "key": key, "kind": "code", "op_name": op, "text": code,
                    "filename": filename, "first_line": first_line}),
        Source::File { path, text } => json!({"op": "load", "key": key, "kind": "file",
                    "op_name": op, "text": text, "filename": path}),
        Source::Module(name) => json!({"op": "load", "key": key, "kind": "module", "name": name}),
        Source::Package {
            root,
            name,
            module,
            files,
        } => {
            let files: serde_json::Map<String, Value> = files
                .iter()
                .map(|(p, t)| (p.to_string(), Value::from(t.as_ref())))
                .collect();
            json!({"op": "load", "key": key, "kind": "package", "name": name, "root": root,
                   "module": module, "files": files})
        }
    };
    msg.to_string().into()
}

/// How workers start: found once, with the GIL, from the embedded interpreter.
fn launch(op: &str) -> Result<&'static Launch> {
    static LAUNCH: OnceLock<Launch> = OnceLock::new();
    if let Some(l) = LAUNCH.get() {
        return Ok(l);
    }
    let found = with_gil(op, |py| {
        let env = crate::python::env::current(py);
        let python = std::env::var_os("PYOP_WORKER_PYTHON")
            .map(PathBuf::from)
            .or_else(|| env.and_then(|e| e.running.executable.clone()));
        let Some(python) = python else {
            return Err(Error::op_failure(
                op,
                ErrorKind::PythonUnavailable,
                "cannot start a worker: the embedded interpreter's own `python` executable was \
                 not found (set PYOP_WORKER_PYTHON to it)",
            ));
        };
        let sys_path: Vec<String> = py
            .import("sys")
            .and_then(|s| s.getattr("path"))
            .and_then(|p| p.extract())
            .map_err(|e| crate::python::errors::python_error(py, op, e))?;
        let version: (u32, u32) = py
            .import("sys")
            .and_then(|s| s.getattr("version_info"))
            .and_then(|v| Ok((v.get_item(0)?.extract()?, v.get_item(1)?.extract()?)))
            .map_err(|e| crate::python::errors::python_error(py, op, e))?;
        let (describe, pip) = match env {
            Some(e) => (e.describe(), e.pip_install("numpy")),
            None => (String::new(), "`pip install numpy`".to_owned()),
        };
        Ok(Launch {
            python,
            sys_path,
            site_packages: env.and_then(|e| e.site_packages.clone()),
            importer: crate::body::package::IMPORTER,
            version: [version.0, version.1],
            describe,
            pip_numpy: pip,
        })
    })?
    .0;
    Ok(LAUNCH.get_or_init(|| found))
}

/// NumPy's name for a dtype it holds.
fn numpy_name(dtype: DType) -> &'static str {
    match dtype {
        DType::U8 => "uint8",
        DType::U32 => "uint32",
        DType::I16 => "int16",
        DType::I32 => "int32",
        DType::I64 => "int64",
        DType::F16 => "float16",
        DType::F32 => "float32",
        _ => "float64",
    }
}

/// Inputs as bytes the worker gets: each prepared tensor made contiguous (a view is copied once
/// here), in order.
pub(crate) struct WireInputs {
    tensors: Vec<Tensor>,
}

impl WireInputs {
    pub(crate) fn new<'a>(prepared: impl IntoIterator<Item = &'a Prepared>) -> Result<WireInputs> {
        let tensors = prepared
            .into_iter()
            .map(|p| p.tensor.contiguous())
            .collect::<candle_core::Result<Vec<_>>>()?;
        Ok(WireInputs { tensors })
    }

    fn bytes(&self, i: usize) -> &[u8] {
        let t = &self.tensors[i];
        let len = t.elem_count() * t.dtype().size_in_bytes();
        if len == 0 {
            return &[];
        }
        // SAFETY: a contiguous CPU tensor of a NumPy dtype: `len` bytes from its first element
        // are its data, alive as long as `self.tensors`.
        unsafe { std::slice::from_raw_parts(cpu_data_ptr(t) as *const u8, len) }
    }
}

/// How `&[Tensor]` arguments reach the worker: a list for the body, a tuple for a gradient.
#[derive(Clone, Copy)]
pub(crate) enum Group {
    List,
    Tuple,
}

/// A call's arguments as worker.py decodes them, tensors named by their place in the arena.
struct ArgWriter<'a> {
    offsets: &'a [usize],
    inputs: &'a WireInputs,
    next: usize,
}

impl ArgWriter<'_> {
    fn tensor(&mut self) -> Value {
        let i = self.next;
        self.next += 1;
        let t = &self.inputs.tensors[i];
        json!({"t": [self.offsets[i], numpy_name(t.dtype()), t.dims()]})
    }

    fn args(&mut self, args: &[Arg<'_>], group: Group) -> Vec<Value> {
        args.iter()
            .map(|a| match a {
                Arg::Tensor(_) => self.tensor(),
                Arg::Tensors(ts) => {
                    let items: Vec<Value> = ts.iter().map(|_| self.tensor()).collect();
                    match group {
                        Group::List => Value::Array(items),
                        Group::Tuple => json!({"u": items}),
                    }
                }
                Arg::F64(v) => float(*v),
                Arg::I64(v) => json!(v),
                Arg::Bool(v) => json!(v),
                Arg::Str(v) => json!(v),
                Arg::F64s(v) => Value::Array(v.iter().map(|&f| float(f)).collect()),
                Arg::I64s(v) => json!(v),
                Arg::U64(v) => json!(v),
                Arg::Usizes(v) => json!(v),
                Arg::F32s(v) => Value::Array(v.iter().map(|&f| float(f64::from(f))).collect()),
                Arg::None => Value::Null,
            })
            .collect()
    }
}

/// A float exactly (JSON has no NaN or infinities: those are spelled out).
fn float(v: f64) -> Value {
    if v.is_finite() {
        json!(v)
    } else {
        json!({"f": if v.is_nan() { "nan" } else if v > 0.0 { "inf" } else { "-inf" }})
    }
}

/// What one worker call is about: the function and its arguments (already written as JSON
/// groups), the inputs, and the `out` buffers to hand it.
pub(crate) struct WorkerCall<'a> {
    pub function: &'a str,
    pub inputs: &'a WireInputs,
    /// Argument groups: the body's arguments, or a gradient's (inputs, outputs, grads) tuples.
    pub groups: &'a [(&'a [Arg<'a>], Group)],
    /// For a body that takes `out` and whose outputs' shapes are all known.
    pub outs: Option<&'a [(DType, Vec<usize>)]>,
    pub timeout: Option<Duration>,
    /// The source hot reload found (`worker_body_now`), if it is on.
    pub reloaded: Option<Source>,
}

/// A reply, and the worker it came from. It holds the worker until it is dropped: the
/// worker's next call would overwrite the shared memory the reply's values are read from.
pub(crate) struct Answer {
    pub reply: Reply,
    pub worker: u64,
    _lease: Lease,
}

impl OpInner {
    /// Runs one call in a worker of the op's pool, without the GIL, and returns its reply.
    /// With hot reload on, the source workers load now (the program's check, which takes the
    /// GIL, may have found a new one) and whether the body takes `out`; without it, neither
    /// costs anything.
    pub(crate) fn worker_body_now(&self) -> (Option<Source>, bool) {
        let Some(r) = &self.reload else {
            return (None, self.accepts_out);
        };
        let accepts_out =
            with_gil(&self.name, |py| Ok(self.body_now(py).1)).map_or(self.accepts_out, |(a, _)| a);
        (Some(r.source()), accepts_out)
    }

    /// The body's source as errors name it.
    fn body_named(&self) -> String {
        self.source
            .as_ref()
            .map_or_else(|| "the body".to_owned(), Source::describe)
    }

    /// A worker of the op's pool for one call, started if none is idle (without the GIL).
    fn lease(&self, workers: &Workers, launch: &Launch) -> Result<Lease> {
        let lease = workers
            .pool
            .checkout(launch)
            .map_err(|e| start_error(&self.name, launch, e))?;
        lease.count_call();
        Ok(lease)
    }

    pub(crate) fn call_in_worker(&self, workers: &Workers, call: WorkerCall<'_>) -> Result<Answer> {
        let op = self.name.as_str();
        let launch = launch(op)?;
        let (key, load) = workers.load(op, call.reloaded);
        let n_in = call.inputs.tensors.len();
        let sizes = (0..n_in).map(|i| call.inputs.bytes(i).len()).chain(
            call.outs
                .into_iter()
                .flatten()
                .map(|(d, dims)| d.size_in_bytes() * dims.iter().product::<usize>()),
        );
        let (offsets, arena_len) = layout(sizes);
        let mut writer = ArgWriter {
            offsets: &offsets,
            inputs: call.inputs,
            next: 0,
        };
        let mut args: Vec<Value> = Vec::new();
        for (group_args, group) in call.groups {
            let encoded = writer.args(group_args, *group);
            if call.groups.len() == 1 {
                args = encoded;
            } else {
                args.push(json!({"u": encoded}));
            }
        }
        let outs = call.outs.map(|outs| {
            outs.iter()
                .enumerate()
                .map(|(i, (d, dims))| json!([offsets[n_in + i], numpy_name(*d), dims]))
                .collect::<Vec<_>>()
        });
        let request = json!({"op": "call", "key": key, "fn": call.function, "args": args,
                             "out": outs});
        let inputs = (0..n_in)
            .map(|i| (offsets[i], call.inputs.bytes(i)))
            .collect();
        crate::python::without_gil(|| {
            let mut lease = self.lease(workers, launch)?;
            let worker = lease.worker();
            let (id, pid) = (worker.id, worker.pid);
            let _span = tracing::trace_span!("pyop.worker", op, worker = id, pid).entered();
            let result = worker.call(Request {
                call: request,
                inputs,
                arena_len,
                load: Some((key, load)),
                timeout: call.timeout,
            });
            match result {
                Ok(reply) => Ok(Answer {
                    reply,
                    worker: id,
                    _lease: lease,
                }),
                Err(f) => Err(lost_call(op, lease, f, call.timeout)),
            }
        })
    }

    /// A forward call's outputs from its worker's answer, with the GIL held: the one output check
    /// on the values the worker returned, or the `out` buffers it wrote.
    pub(crate) fn worker_outputs(
        &self,
        py: pyo3::Python<'_>,
        answer: &Answer,
        check: &OutputCheck<'_>,
        outs: Option<&[(DType, Vec<usize>)]>,
    ) -> Result<crate::bridge::outputs::Outputs> {
        let reply = &answer.reply;
        let Some(outs) = outs.filter(|_| reply.header["out"] == true) else {
            let value = self.worker_value(py, answer)?;
            return match outs {
                None => outputs_from_python(py, check, value),
                Some(_) => Err(crate::bridge::out::returned_instead_of_out(check, &value)),
            };
        };
        // Where each output's bytes are: its `out` buffer in the input arena, or, when the body
        // kept a view of its buffers, the copy the worker made in the result arena.
        let places = reply.header["outs"].as_array();
        let Some(places) = places.filter(|p| p.len() == outs.len()) else {
            return Err(check.error(None, "a worker named the wrong outputs".into()));
        };
        outs.iter()
            .zip(places)
            .map(|((dtype, dims), at)| {
                let len = dtype.size_in_bytes() * dims.iter().product::<usize>();
                let Some((map, offset, _)) = region(reply, at).filter(|r| r.2 == len) else {
                    return Err(check.error(None, "a worker named memory outside its arena".into()));
                };
                let (dtype, dims) = (*dtype, dims.clone());
                let data = map.as_ptr() as usize + offset;
                let t = crate::python::copy_detached(py, len, move || {
                    // SAFETY: `offset..offset + len` lies inside a mapping `reply` keeps alive
                    // (`region`); the worker has finished writing it (it replied), and no view
                    // the body kept can reach it (the worker copied it into the result arena if
                    // one could).
                    unsafe { crate::alloc::tensor_from_bytes(dtype, data as *const u8, dims) }
                })?;
                Ok(t.to_device(check.device)?)
            })
            .collect()
    }

    /// The value a worker's reply carries, or the error it reports.
    pub(crate) fn worker_value<'py>(
        &self,
        py: pyo3::Python<'py>,
        answer: &Answer,
    ) -> Result<pyo3::Bound<'py, pyo3::PyAny>> {
        let header = &answer.reply.header;
        let op = self.name.as_str();
        if header["s"] == "err" {
            return Err(self.worker_error(py, answer.worker, &header["exc"]));
        }
        reply_value(py, &answer.reply).map_err(|e| {
            Error::mismatch(
                op,
                ErrorKind::OutputMismatch,
                None,
                format!(
                    "the body's result could not be read from its worker: {}",
                    crate::python::describe(py, &e)
                ),
            )
        })
    }

    /// The error a worker's reply reports (`exc`), by the phase it failed in.
    fn worker_error(&self, py: pyo3::Python<'_>, worker: u64, exc: &Value) -> Error {
        let op = self.name.as_str();
        match exc["phase"].as_str() {
            Some("load") => cannot_load(
                worker_exception(py, op, exc),
                &format!("{} in a worker", self.body_named()),
            ),
            Some("result") => result_not_sent(op, exc),
            // The worker's own machinery failed (it exits after saying so, and is replaced).
            Some("worker") => Error::op_failure(
                op,
                ErrorKind::WorkerLost,
                format!(
                    "worker {worker} failed in its own code ({}: {}) and exited; the next call \
                     starts a new worker",
                    exc["type"].as_str().unwrap_or("Exception"),
                    exc["message"].as_str().unwrap_or_default()
                ),
            ),
            _ => worker_exception(py, op, exc),
        }
    }

    /// Checks that a worker starts and loads the body, with its functions (for `validate()`).
    pub(crate) fn check_worker(&self, workers: &Workers, functions: &[&str]) -> Result<()> {
        let op = self.name.as_str();
        let launch = launch(op)?;
        let (key, load) = workers.load(op, None);
        crate::python::without_gil(|| {
            let mut lease = self.lease(workers, launch)?;
            let worker = lease.worker().id;
            let ping = json!({"op": "ping", "key": key, "fns": functions});
            match lease.worker().ask(Some((key, load)), ping, LOAD_TIMEOUT) {
                Ok(header) => Ok((worker, header)),
                Err(f) => Err(lost_call(op, lease, f, Some(LOAD_TIMEOUT))),
            }
        })
        .and_then(|(worker, header)| {
            if header["s"] == "err" {
                let exc = &header["exc"];
                return Err(with_gil(op, |py| Ok(self.worker_error(py, worker, exc)))?.0);
            }
            let missing: Vec<&str> = header["missing"]
                .as_array()
                .into_iter()
                .flatten()
                .filter_map(Value::as_str)
                .collect();
            if !missing.is_empty() {
                return Err(Error::op_failure(
                    op,
                    ErrorKind::MissingFunction,
                    format!(
                        "in a worker, {} defines no callable {}",
                        self.body_named(),
                        missing
                            .iter()
                            .map(|m| format!("`{m}`"))
                            .collect::<Vec<_>>()
                            .join(", ")
                    ),
                ));
            }
            Ok(())
        })
    }
}

impl super::PyOp {
    /// Starts the workers of the op's pool now, side by side, rather than on the first calls
    /// that need them (each costs an interpreter start and NumPy's import, about 70 ms). A no-op
    /// for an op that runs in the program.
    pub fn start_workers(&self) -> Result<()> {
        let op = &*self.inner;
        let Some(workers) = &op.workers else {
            return Ok(());
        };
        let launch = launch(&op.name)?;
        crate::python::without_gil(|| workers.pool.fill(launch))
            .map_err(|e| start_error(&op.name, launch, e))
    }
}

/// The error of a request its worker never answered (`timeout`: the call's limit), the worker
/// given up: killed if it timed out, reaped if it died.
fn lost_call(op: &str, mut lease: Lease, failure: Failure, timeout: Option<Duration>) -> Error {
    let (id, pid) = (lease.worker().id, lease.worker().pid);
    lease.discard(matches!(failure, Failure::TimedOut { .. }));
    match failure {
        Failure::TimedOut { loading: false } => Error::op_failure(
            op,
            ErrorKind::Timeout,
            format!(
                "the body ran past its time limit of {:?} in worker {id} (pid {pid}), which was \
                 killed; the next call starts a new worker",
                timeout.unwrap_or_default()
            ),
        ),
        Failure::TimedOut { loading: true } => Error::op_failure(
            op,
            ErrorKind::Timeout,
            format!(
                "loading the body in worker {id} (pid {pid}) took over {} s; the worker was \
                 killed, and the next call starts a new one",
                LOAD_TIMEOUT.as_secs()
            ),
        ),
        Failure::Lost { how, loading } => {
            let doing = if loading {
                "loading the body"
            } else {
                "running the body"
            };
            Error::op_failure(
                op,
                ErrorKind::WorkerLost,
                format!(
                    "worker {id} (pid {pid}) {how} while {doing}; this call failed, and the next \
                     call starts a new worker"
                ),
            )
        }
    }
}

fn start_error(op: &str, launch: &Launch, e: StartError) -> Error {
    match e {
        StartError::NoNumpy(why) => Error::op_failure(
            op,
            ErrorKind::PackageUnavailable,
            format!(
                "a worker cannot import NumPy ({why}): workers run {} with {}; install it with {}",
                launch.python.display(),
                launch.describe,
                launch.pip_numpy
            ),
        ),
        StartError::Failed(why) => Error::op_failure(
            op,
            ErrorKind::PythonUnavailable,
            format!("cannot start a worker: {why}"),
        ),
    }
}

/// Shapes of `out` buffers for a worker call (the same rule as in the program: every output's
/// shape known before the call).
pub(crate) fn out_shapes(
    tout: &[crate::spec::OutSpec],
    args: &[Arg<'_>],
) -> Option<Vec<(DType, Vec<usize>)>> {
    if tout.is_empty() {
        return None;
    }
    tout.iter()
        .map(|o| crate::bridge::outputs::known_shape(o, args).map(|s| (o.dtype, s)))
        .collect()
}
