//! Registered gradients, and ops of any arity in candle's autograd.
//!
//! candle's custom ops take at most three inputs and give one output, and only `apply_op*` can
//! put a node with a user backward into the graph. An op call with tracked inputs therefore
//! becomes, after the body has run:
//!
//! ```text
//! x_i (tracked, float) ──flatten·to_dtype(F)──┐
//!                                              cat ─► packed_in ─[Node]─► packed_out ─narrow·reshape·to_dtype─► y_j
//! ```
//!
//! `Node`'s forward hands back the outputs the body already computed (no Python runs under
//! candle's storage locks); its backward unpacks the incoming gradient per output, calls the
//! registered gradient, and packs what it returns per input. `F` is f64 if any tracked value is
//! f64, else f32; each gradient comes back in its input's own dtype through the differentiable
//! casts. Integer inputs get no gradient and integer outputs are not tracked.

use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use candle_core::{CpuStorage, CustomOp1, DType, Layout, Shape, Tensor};
use pyo3::prelude::*;
use pyo3::types::{PyList, PyTuple};

use crate::arg::Arg;
use crate::bridge::outputs::OutputCheck;
use crate::bridge::prepare::Prepared;
use crate::bridge::with_gil;
use crate::error::{panic_message, Error, ErrorKind, Result, NO_OP};
use crate::op::{OpInner, PyOp};
use crate::spec::OutSpec;

/// A gradient written in Rust: given the op's arguments, outputs and the gradient arriving at each
/// output, return one entry per tensor input (tensors of a `&[Tensor]` argument counted one by
/// one, in order), `None` meaning no gradient. Each gradient must have its input's shape and dtype.
pub type RustGradient = fn(&GradientCall<'_>) -> Result<Vec<Option<Tensor>>>;

/// What a [`RustGradient`] is called with.
#[derive(Debug)]
pub struct GradientCall<'a> {
    /// The op's name.
    pub op: &'a str,
    /// All the op's arguments in declaration order, plain values included.
    pub args: &'a [Arg<'a>],
    /// The op's outputs.
    pub outputs: &'a [Tensor],
    /// The gradient arriving at each output (zeros for one that received none).
    pub grads: &'a [Tensor],
}

pub(crate) enum Gradient {
    Python(Py<PyAny>),
    Rust(RustGradient),
}

/// An owned argument, kept for the backward pass.
#[derive(Clone, Debug)]
enum Value {
    Tensor,
    Tensors(usize),
    F64(f64),
    I64(i64),
    Bool(bool),
    Str(String),
    F64s(Vec<f64>),
    I64s(Vec<i64>),
    None,
}

fn tracked(t: &Tensor) -> bool {
    t.dtype().is_float() && t.track_op()
}

/// Whether any float tensor argument is tracked by autograd.
pub(crate) fn any_tracked(args: &[Arg<'_>]) -> bool {
    let mut any = false;
    for a in args {
        a.for_each_tensor(|t| any |= tracked(t));
    }
    any
}

/// The prepared inputs, detached: the body's own ops must not enter the graph when a registered
/// gradient (or numpy mode) stands for them.
pub(crate) fn detach_prepared(prepared: Vec<Prepared>) -> Vec<Prepared> {
    prepared.into_iter().map(Prepared::detached).collect()
}

/// Puts the outputs of a call into the graph behind one node whose backward is the op's gradient.
pub(crate) fn attach(
    op: &Arc<OpInner>,
    args: &[Arg<'_>],
    prepared: Vec<Prepared>,
    outputs: Vec<Tensor>,
) -> Result<Vec<Tensor>> {
    let mut originals = Vec::new();
    for a in args {
        a.for_each_tensor(|t| originals.push(t.clone()));
    }
    let tracked_in: Vec<usize> = (0..originals.len())
        .filter(|&i| tracked(&originals[i]))
        .collect();
    let float_out: Vec<usize> = (0..outputs.len())
        .filter(|&j| outputs[j].dtype().is_float())
        .collect();
    if float_out.is_empty() {
        return Ok(outputs);
    }
    let wide = tracked_in
        .iter()
        .map(|&i| originals[i].dtype())
        .chain(float_out.iter().map(|&j| outputs[j].dtype()));
    let f = if wide.clone().any(|d| d == DType::F64) {
        DType::F64
    } else {
        DType::F32
    };

    let packed_in = pack(tracked_in.iter().map(|&i| &originals[i]), f)?;
    let packed_out = pack(float_out.iter().map(|&j| &outputs[j]), f)?.detach();
    let out_shape = packed_out.shape().clone();
    let slot = if packed_out.device().is_cpu() {
        Slot::Cpu(Mutex::new(Some(cpu_storage(&packed_out.flatten_all()?)?)))
    } else {
        Slot::Device(packed_out)
    };
    let values = args.iter().map(Value::from_arg).collect();
    let node = Node {
        op: PyOp { inner: op.clone() },
        values,
        prepared,
        outputs: outputs.clone(),
        tracked_in,
        float_out: float_out.clone(),
        dtype: f,
        in_shape: packed_in.shape().clone(),
        out_shape,
        slot,
    };
    let result = packed_in.apply_op1(node)?;
    let mut outputs = outputs;
    let mut offset = 0;
    for j in float_out {
        let tracked_y = unpack(&result, offset, &outputs[j])?;
        offset += outputs[j].elem_count();
        outputs[j] = tracked_y;
    }
    Ok(outputs)
}

/// Tensors as one, in dtype `f` (differentiably): a single tensor keeps its shape (no reshape
/// nodes in the common one-input, one-output case); several are flattened and concatenated.
fn pack<'a>(ts: impl ExactSizeIterator<Item = &'a Tensor>, f: DType) -> Result<Tensor> {
    if ts.len() == 1 {
        let t = ts.into_iter().next().expect("one");
        return Ok(if t.dtype() == f {
            t.clone()
        } else {
            t.to_dtype(f)?
        });
    }
    let flat: Vec<Tensor> = ts.map(|t| flat(t, f)).collect::<candle_core::Result<_>>()?;
    Ok(Tensor::cat(&flat, 0)?)
}

/// `t` flattened, in dtype `f`; no new tensor where it already is (the common one-input case).
fn flat(t: &Tensor, f: DType) -> candle_core::Result<Tensor> {
    let t = if t.rank() == 1 {
        t.clone()
    } else {
        t.flatten_all()?
    };
    if t.dtype() == f {
        Ok(t)
    } else {
        t.to_dtype(f)
    }
}

/// The part of the flat `packed` at `offset` with `like`'s size, shaped and typed like it.
fn unpack(packed: &Tensor, offset: usize, like: &Tensor) -> candle_core::Result<Tensor> {
    let n = like.elem_count();
    let t = if offset == 0 && n == packed.elem_count() {
        packed.clone()
    } else {
        packed.narrow(0, offset, n)?
    };
    let t = if t.dims() == like.dims() {
        t
    } else {
        t.reshape(like.shape())?
    };
    if t.dtype() == like.dtype() {
        Ok(t)
    } else {
        t.to_dtype(like.dtype())
    }
}

fn cpu_storage(t: &Tensor) -> Result<CpuStorage> {
    Ok(match t.dtype() {
        DType::F64 => CpuStorage::F64(t.to_vec1::<f64>()?),
        _ => CpuStorage::F32(t.to_vec1::<f32>()?),
    })
}

/// The outputs the node's forward hands candle: taken once from the CPU, or a device tensor.
enum Slot {
    Cpu(Mutex<Option<CpuStorage>>),
    #[cfg_attr(not(feature = "cuda"), allow(dead_code))]
    Device(Tensor),
}

struct Node {
    op: PyOp,
    values: Vec<Value>,
    prepared: Vec<Prepared>,
    outputs: Vec<Tensor>,
    tracked_in: Vec<usize>,
    float_out: Vec<usize>,
    dtype: DType,
    /// The shapes of the packed input and output.
    in_shape: Shape,
    out_shape: Shape,
    slot: Slot,
}

impl CustomOp1 for Node {
    fn name(&self) -> &'static str {
        "pyop"
    }

    fn cpu_fwd(&self, _: &CpuStorage, layout: &Layout) -> candle_core::Result<(CpuStorage, Shape)> {
        let Slot::Cpu(slot) = &self.slot else {
            candle_core::bail!("pyop: op `{}` computed on another device", self.op.name())
        };
        let storage = slot.lock().unwrap_or_else(|e| e.into_inner()).take();
        let Some(storage) = storage else {
            candle_core::bail!("pyop: op `{}` forward ran twice", self.op.name())
        };
        let _ = layout;
        Ok((storage, self.out_shape.clone()))
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        _: &candle_core::CudaStorage,
        _: &Layout,
    ) -> candle_core::Result<(candle_core::CudaStorage, Shape)> {
        use candle_core::backend::BackendStorage;
        let Slot::Device(t) = &self.slot else {
            candle_core::bail!("pyop: op `{}` computed on another device", self.op.name())
        };
        let (storage, layout) = t.storage_and_layout();
        match &*storage {
            candle_core::Storage::Cuda(s) => Ok((s.try_clone(layout)?, t.shape().clone())),
            _ => candle_core::bail!("pyop: op `{}` outputs are not on CUDA", self.op.name()),
        }
    }

    fn bwd(
        &self,
        _arg: &Tensor,
        _res: &Tensor,
        grad_res: &Tensor,
    ) -> candle_core::Result<Option<Tensor>> {
        Ok(self.backward(grad_res)?)
    }
}

impl Node {
    fn backward(&self, grad_res: &Tensor) -> Result<Option<Tensor>> {
        let op = &*self.op.inner;
        let Some(gradient) = &op.gradient else {
            return Err(Error::op_failure(
                &op.name,
                ErrorKind::NoGradient,
                format!(
                    "backward() reached this {} op, which has no gradient; declare one with \
                     `grad = \"python_function\"` or `grad = rust_fn` in #[py_op] (or \
                     OpBuilder::gradient), or detach its inputs",
                    op.mode
                ),
            ));
        };
        // The gradient arriving at each output, in the output's dtype; zeros for integer outputs.
        let mut grads = Vec::with_capacity(self.outputs.len());
        let mut offset = 0;
        for (j, y) in self.outputs.iter().enumerate() {
            if self.float_out.contains(&j) {
                grads.push(unpack(grad_res, offset, y)?);
                offset += y.elem_count();
            } else {
                grads.push(y.zeros_like()?);
            }
        }
        let input_grads = match gradient {
            Gradient::Rust(f) => self.rust_gradient(*f, &grads)?,
            Gradient::Python(f) => self.python_gradient(f, &grads)?,
        };
        // Pack the tracked inputs' gradients like `packed_in`.
        let device = grad_res.device();
        let mut parts = Vec::with_capacity(self.tracked_in.len());
        let mut any = false;
        for &i in &self.tracked_in {
            let x = &self.prepared[i].tensor;
            let g = match &input_grads[i] {
                Some(g) => {
                    any = true;
                    let g = g.to_device(device)?;
                    if g.dtype() == self.dtype {
                        g
                    } else {
                        g.to_dtype(self.dtype)?
                    }
                }
                None => Tensor::zeros(x.shape(), self.dtype, device)?,
            };
            parts.push(g);
        }
        if !any {
            return Ok(None);
        }
        // Shaped like `packed_in`: the one input's shape, or flat and concatenated.
        Ok(Some(match parts.len() {
            1 => {
                let g = parts.pop().expect("one");
                if g.shape() == &self.in_shape {
                    g
                } else {
                    g.reshape(self.in_shape.clone())?
                }
            }
            _ => {
                let flat: Vec<Tensor> = parts
                    .iter()
                    .map(|g| g.flatten_all())
                    .collect::<candle_core::Result<_>>()?;
                Tensor::cat(&flat, 0)?
            }
        }))
    }

    fn rust_gradient(&self, f: RustGradient, grads: &[Tensor]) -> Result<Vec<Option<Tensor>>> {
        let op = &*self.op.inner;
        let started = Instant::now();
        // `&[Tensor]` arguments need slices that live as long as the call.
        let lists: Vec<Vec<Tensor>> = self.tensor_lists();
        let args = self.args_with_lists(&lists);
        let call = GradientCall {
            op: &op.name,
            args: &args,
            outputs: &self.outputs,
            grads,
        };
        let result = catch_unwind(AssertUnwindSafe(|| f(&call))).unwrap_or_else(|panic| {
            Err(Error::op_failure(
                &op.name,
                ErrorKind::Panic,
                format!("the Rust gradient panicked: {}", panic_message(&*panic)),
            ))
        });
        let result = result.and_then(|g| self.check_rust(g));
        op.counters
            .record(result.is_ok(), started.elapsed(), Duration::ZERO);
        result
    }

    fn tensor_lists(&self) -> Vec<Vec<Tensor>> {
        let mut next = 0;
        let mut lists = Vec::new();
        for v in &self.values {
            match v {
                Value::Tensor => next += 1,
                Value::Tensors(k) => {
                    lists.push(
                        self.prepared[next..next + k]
                            .iter()
                            .map(|p| p.tensor.clone())
                            .collect(),
                    );
                    next += k;
                }
                _ => {}
            }
        }
        lists
    }

    fn args_with_lists<'a>(&'a self, lists: &'a [Vec<Tensor>]) -> Vec<Arg<'a>> {
        let mut tensors = self.prepared.iter().map(|p| &p.tensor);
        let mut lists = lists.iter();
        self.values
            .iter()
            .map(|v| match v {
                Value::Tensors(k) => {
                    for _ in 0..*k {
                        tensors.next();
                    }
                    Arg::Tensors(lists.next().expect("one list per argument"))
                }
                Value::Tensor => Arg::Tensor(tensors.next().expect("one per tensor")),
                other => Value::as_plain(other),
            })
            .collect()
    }

    fn check_rust(&self, g: Vec<Option<Tensor>>) -> Result<Vec<Option<Tensor>>> {
        let op = &self.op.inner.name;
        if g.len() != self.prepared.len() {
            return Err(Error::mismatch(
                op,
                ErrorKind::GradientMismatch,
                None,
                format!(
                    "expected {} gradients (one per tensor input), got {}",
                    self.prepared.len(),
                    g.len()
                ),
            ));
        }
        for (i, (g, p)) in g.iter().zip(&self.prepared).enumerate() {
            if let Some(g) = g {
                let x = &p.tensor;
                if g.dims() != x.dims() || g.dtype() != x.dtype() {
                    return Err(Error::mismatch(
                        op,
                        ErrorKind::GradientMismatch,
                        Some(i),
                        format!(
                            "gradient {i}: expected {}{:?}, got {}{:?}",
                            x.dtype().as_str(),
                            x.dims(),
                            g.dtype().as_str(),
                            g.dims()
                        ),
                    ));
                }
            }
        }
        Ok(g)
    }

    fn python_gradient(&self, f: &Py<PyAny>, grads: &[Tensor]) -> Result<Vec<Option<Tensor>>> {
        let op = &*self.op.inner;
        let started = Instant::now();
        // Outputs and incoming gradients, prepared for Python in one go.
        let both: Vec<Arg<'_>> = self.outputs.iter().chain(grads).map(Arg::Tensor).collect();
        let mut out_prepared = crate::python::without_gil(|| {
            crate::bridge::prepare::prepare_inputs(&op.name, op.mode, &both)
        })?;
        let grad_prepared = out_prepared.split_off(self.outputs.len());
        let lists = self.tensor_lists();
        let args = self.args_with_lists(&lists);
        let device = self
            .prepared
            .first()
            .map(|p| p.tensor.device().clone())
            .unwrap_or(candle_core::Device::Cpu);
        let result = with_gil(&op.name, |py| {
            let _device = crate::bridge::tensor::device::DeviceScope::enter(&device);
            let inputs = crate::bridge::args::python_args(
                py,
                op.mode,
                &args,
                &self.prepared,
                crate::bridge::args::Lists::AsTuples,
            )
            .map_err(|e| crate::python::errors::python_error(py, &op.name, e))?;
            let outs: Vec<Arg<'_>> = self.outputs.iter().map(Arg::Tensor).collect();
            let outputs = crate::bridge::args::python_args(
                py,
                op.mode,
                &outs,
                &out_prepared,
                crate::bridge::args::Lists::AsTuples,
            )
            .map_err(|e| crate::python::errors::python_error(py, &op.name, e))?;
            let gs: Vec<Arg<'_>> = grads.iter().map(Arg::Tensor).collect();
            let grads = crate::bridge::args::python_args(
                py,
                op.mode,
                &gs,
                &grad_prepared,
                crate::bridge::args::Lists::AsTuples,
            )
            .map_err(|e| crate::python::errors::python_error(py, &op.name, e))?;
            let f = op.python_gradient_now(py, f);
            let returned = crate::python::timeout::run_limited(py, &op.name, op.timeout, || {
                f.call1((inputs, outputs, grads))
            })?;
            self.python_results(py, &args, &device, &returned)
        });
        let (result, waited) = match result {
            Ok((r, w)) => (Ok(r), w),
            Err(e) => (Err(e), Duration::ZERO),
        };
        op.counters.record(
            result.is_ok(),
            started.elapsed().saturating_sub(waited),
            waited,
        );
        result
    }

    /// Reads a Python gradient's return value: one entry per tensor argument (a sequence of
    /// entries for a `&[Tensor]` argument), or a bare value for an op with one tensor argument.
    fn python_results(
        &self,
        py: Python<'_>,
        args: &[Arg<'_>],
        device: &candle_core::Device,
        returned: &Bound<'_, PyAny>,
    ) -> Result<Vec<Option<Tensor>>> {
        let op = &self.op.inner.name;
        let mismatch = |index: Option<usize>, what: String| {
            Error::mismatch(op, ErrorKind::GradientMismatch, index, what)
        };
        let tensor_args: Vec<&Arg<'_>> = args
            .iter()
            .filter(|a| matches!(a, Arg::Tensor(_) | Arg::Tensors(_)))
            .collect();
        let entries: Vec<Bound<'_, PyAny>> = match (tensor_args.as_slice(), seq(returned)) {
            ([Arg::Tensor(_)], Some(items)) if items.len() == 1 => items,
            ([Arg::Tensor(_)], _) => vec![returned.clone()],
            // A single list argument: its tuple of entries, bare or as the only entry.
            ([Arg::Tensors(ts)], Some(items)) if items.len() == ts.len() && ts.len() != 1 => {
                vec![returned.clone()]
            }
            (_, Some(items)) if items.len() == tensor_args.len() => items,
            (_, Some(items)) => {
                return Err(mismatch(
                    None,
                    format!(
                        "expected {} gradients (one per tensor argument), got {}",
                        tensor_args.len(),
                        items.len()
                    ),
                ))
            }
            (_, None) => {
                return Err(mismatch(
                    None,
                    format!(
                        "expected a tuple of {} gradients, got {}",
                        tensor_args.len(),
                        crate::bridge::numbers::describe_value(returned)
                    ),
                ))
            }
        };
        let mut out = Vec::with_capacity(self.prepared.len());
        let mut flat_index = 0;
        for (arg, entry) in tensor_args.iter().zip(entries) {
            let items = match arg {
                Arg::Tensors(ts) if entry.is_none() => vec![entry; ts.len()],
                Arg::Tensors(ts) => match seq(&entry) {
                    Some(items) if items.len() == ts.len() => items,
                    _ => {
                        return Err(mismatch(
                            Some(flat_index),
                            format!(
                                "expected a tuple of {} gradients for a list argument, got {}",
                                ts.len(),
                                crate::bridge::numbers::describe_value(&entry)
                            ),
                        ))
                    }
                },
                _ => vec![entry],
            };
            for item in items {
                let x = &self.prepared[flat_index].tensor;
                if item.is_none() || !x.dtype().is_float() {
                    out.push(None);
                } else {
                    let spec = OutSpec::shaped(
                        x.dtype(),
                        x.dims().iter().map(|&d| Some(d)).collect::<Vec<_>>(),
                    );
                    let check = OutputCheck {
                        op,
                        tout: std::slice::from_ref(&spec),
                        device,
                        what: "gradient",
                        args: &[],
                    };
                    out.push(Some(crate::bridge::outputs::value_to_tensor(
                        py, &check, flat_index, &spec, &item,
                    )?));
                }
                flat_index += 1;
            }
        }
        Ok(out)
    }
}

fn seq<'py>(v: &Bound<'py, PyAny>) -> Option<Vec<Bound<'py, PyAny>>> {
    if let Ok(t) = v.cast::<PyTuple>() {
        Some(t.iter().collect())
    } else if let Ok(l) = v.cast::<PyList>() {
        Some(l.iter().collect())
    } else {
        None
    }
}

impl Value {
    fn from_arg(a: &Arg<'_>) -> Value {
        match a {
            Arg::Tensor(_) => Value::Tensor,
            Arg::Tensors(ts) => Value::Tensors(ts.len()),
            Arg::F64(x) => Value::F64(*x),
            Arg::I64(x) => Value::I64(*x),
            Arg::Bool(x) => Value::Bool(*x),
            Arg::Str(s) => Value::Str((*s).to_owned()),
            Arg::F64s(v) => Value::F64s(v.to_vec()),
            Arg::I64s(v) => Value::I64s(v.to_vec()),
            Arg::None => Value::None,
        }
    }

    fn as_plain(&self) -> Arg<'_> {
        match self {
            Value::F64(x) => Arg::F64(*x),
            Value::I64(x) => Arg::I64(*x),
            Value::Bool(x) => Arg::Bool(*x),
            Value::Str(s) => Arg::Str(s),
            Value::F64s(v) => Arg::F64s(v),
            Value::I64s(v) => Arg::I64s(v),
            Value::None => Arg::None,
            Value::Tensor | Value::Tensors(_) => unreachable!("tensors are handled by the caller"),
        }
    }
}

// ---------------------------------------------------------------------------------------------
// Checking gradients against finite differences
// ---------------------------------------------------------------------------------------------

/// Tolerances of [`gradcheck`]: `GradCheck::default()`, or changed with its setters,
/// `GradCheck::default().atol(1e-8)`.
#[derive(Clone, Copy, Debug)]
#[non_exhaustive]
pub struct GradCheck {
    /// Step of the central differences.
    pub eps: f64,
    /// Absolute tolerance.
    pub atol: f64,
    /// Relative tolerance (of the finite-difference value).
    pub rtol: f64,
}

impl Default for GradCheck {
    fn default() -> Self {
        Self {
            eps: 1e-6,
            atol: 1e-5,
            rtol: 1e-3,
        }
    }
}

impl GradCheck {
    /// Sets the step of the central differences.
    pub fn eps(mut self, eps: f64) -> Self {
        self.eps = eps;
        self
    }

    /// Sets the absolute tolerance.
    pub fn atol(mut self, atol: f64) -> Self {
        self.atol = atol;
        self
    }

    /// Sets the relative tolerance.
    pub fn rtol(mut self, rtol: f64) -> Self {
        self.rtol = rtol;
        self
    }
}

/// What [`gradcheck`] found: the largest difference between the analytic and the numeric
/// gradient, per input.
#[derive(Clone, Debug, PartialEq)]
#[non_exhaustive]
pub struct GradReport {
    /// Per input, the largest |analytic − numeric| over its elements (0 for integer inputs).
    pub max_abs_error: Vec<f64>,
}

/// Checks the gradient of `f` at `inputs` against central finite differences, like torch's
/// `gradcheck`.
///
/// `f` gets the inputs as tensors that autograd tracks (`Var`s of each input's dtype; use f64
/// inputs for tight tolerances) and returns any number of outputs. The loss is
/// `Σ_j Σ (y_j · w_j)` with fixed pseudo-random weights `w_j`, so every output element counts.
/// Integer inputs and outputs are left out. Returns an error of kind
/// [`ErrorKind::GradientMismatch`] naming the input and element where the two disagree.
///
/// ```
/// use pyop::candle::{Device, Tensor};
/// use pyop::{gradcheck, py_op, GradCheck};
///
/// // A numpy-mode op with its gradient in Python: d/dx sin(x) = cos(x).
/// #[py_op(code = r#"
/// import numpy as np
/// def sine(x):
///     return np.sin(x)
/// def sine_grad(inputs, outputs, grads):
///     return grads[0] * np.cos(inputs[0])
/// "#, numpy, tout = f64, grad = "sine_grad")]
/// fn sine(x: &Tensor) -> pyop::Result<Tensor>;
///
/// let x = Tensor::new(&[0.1f64, 0.7, 2.0], &Device::Cpu)?;
/// let report = gradcheck(|xs| Ok(vec![sine(&xs[0])?]), &[x], GradCheck::default())?;
/// assert!(report.max_abs_error[0] < 1e-8);
/// # Ok::<(), pyop::Error>(())
/// ```
pub fn gradcheck<F>(f: F, inputs: &[Tensor], tol: GradCheck) -> Result<GradReport>
where
    F: Fn(&[Tensor]) -> Result<Vec<Tensor>>,
{
    let vars: Vec<candle_core::Var> = inputs
        .iter()
        .map(candle_core::Var::from_tensor)
        .collect::<candle_core::Result<_>>()?;
    let as_tensors =
        |vs: &[candle_core::Var]| vs.iter().map(|v| v.as_tensor().clone()).collect::<Vec<_>>();
    let loss = |xs: &[Tensor]| -> Result<Tensor> {
        let ys = f(xs)?;
        let mut total: Option<Tensor> = None;
        for (j, y) in ys.iter().enumerate() {
            if !y.dtype().is_float() {
                continue;
            }
            let y = y.to_dtype(DType::F64)?;
            let w: Vec<f64> = (0..y.elem_count()).map(|k| weight(j, k)).collect();
            let w = Tensor::from_vec(w, y.shape(), y.device())?;
            let term = (y * w)?.sum_all()?;
            total = Some(match total {
                None => term,
                Some(t) => (t + term)?,
            });
        }
        total.ok_or_else(|| {
            Error::op_failure(
                NO_OP,
                ErrorKind::InvalidArgument,
                "the function has no float output",
            )
        })
    };
    let xs = as_tensors(&vars);
    let grads = loss(&xs)?.backward()?;
    let mut report = GradReport {
        max_abs_error: Vec::new(),
    };
    for (i, var) in vars.iter().enumerate() {
        let x = var.as_tensor();
        if !x.dtype().is_float() {
            report.max_abs_error.push(0.0);
            continue;
        }
        let analytic: Vec<f64> = match grads.get(x) {
            Some(g) => g.to_dtype(DType::F64)?.flatten_all()?.to_vec1()?,
            None => vec![0.0; x.elem_count()],
        };
        let base: Vec<f64> = x.to_dtype(DType::F64)?.flatten_all()?.to_vec1()?;
        let mut worst: f64 = 0.0;
        for k in 0..base.len() {
            let at = |delta: f64| -> Result<f64> {
                let mut v = base.clone();
                v[k] += delta;
                let xi = Tensor::from_vec(v, x.shape(), x.device())?.to_dtype(x.dtype())?;
                let mut probe: Vec<Tensor> = vars.iter().map(|v| v.as_tensor().detach()).collect();
                probe[i] = xi;
                Ok(loss(&probe)?.to_scalar::<f64>()?)
            };
            let numeric = (at(tol.eps)? - at(-tol.eps)?) / (2.0 * tol.eps);
            let err = (analytic[k] - numeric).abs();
            worst = worst.max(err);
            if err > tol.atol + tol.rtol * numeric.abs() || err.is_nan() {
                return Err(Error::mismatch(
                    NO_OP,
                    ErrorKind::GradientMismatch,
                    Some(i),
                    format!(
                        "input {i}, element {k}: analytic gradient {} but finite differences give {numeric}{}",
                        analytic[k],
                        if x.dtype() == DType::F64 {
                            ""
                        } else {
                            " (finite differences in a type narrower than f64 are too coarse for \
                             the default eps: check the gradient with f64 inputs)"
                        }
                    ),
                ));
            }
        }
        report.max_abs_error.push(worst);
    }
    Ok(report)
}

/// Fixed weights in [0.5, 1.5), different per output and element.
fn weight(j: usize, k: usize) -> f64 {
    let mut h = (j as u64).wrapping_mul(0x9E37_79B9_7F4A_7C15)
        ^ (k as u64).wrapping_mul(0xC2B2_AE3D_27D4_EB4F);
    h ^= h >> 31;
    h = h.wrapping_mul(0x94D0_49BB_1331_11EB);
    h ^= h >> 29;
    0.5 + (h >> 11) as f64 / (1u64 << 53) as f64
}
