//! A node's part in candle's graph (`CustomOp1`): its forward hands back what the body already
//! computed; its backward calls the op's gradient: a Rust gradient (panics caught, results
//! checked), or a Python one through the call core (in the program or in a worker), its results
//! checked like outputs.

use std::panic::{catch_unwind, AssertUnwindSafe};

use candle_core::{CpuStorage, CustomOp1, Layout, Shape, Tensor};
use pyo3::prelude::*;
use pyo3::types::{PyList, PyTuple};

use super::node::{Node, SavedArg};
use super::pack::{unpack, Slot};
use crate::arg::Arg;
use crate::bridge::args::python_tuple;
use crate::bridge::outputs::{OutputCheck, Role};
use crate::bridge::prepare::{Prepared, PreparedInputs};
use crate::error::{panic_message, Error, ErrorKind, Result};
use crate::op::gradient::{Gradient, GradientCall, RustGradient};
use crate::python::errors::python_error;
use crate::python::timeout::run_limited;
use crate::spec::OutSpec;

impl CustomOp1 for Node {
    fn name(&self) -> &'static str {
        "pyop"
    }

    fn cpu_fwd(&self, _: &CpuStorage, _: &Layout) -> candle_core::Result<(CpuStorage, Shape)> {
        let Slot::Cpu(slot) = &self.slot else {
            candle_core::bail!("pyop: op `{}` computed on another device", self.op.name())
        };
        let storage = slot.lock().unwrap_or_else(|e| e.into_inner()).take();
        let Some(storage) = storage else {
            candle_core::bail!("pyop: op `{}` forward ran twice", self.op.name())
        };
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
        super::record::note_gradient_run(&op.name);
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
        let grads = self.unpack_output_grads(grad_res)?;
        let input_grads = match gradient {
            Gradient::Rust(f) => self.rust_gradient(*f, &grads)?,
            Gradient::Python(f) => self.python_gradient(f, &grads)?,
        };
        self.pack_input_grads(&input_grads, grad_res.device())
    }

    /// The gradient arriving at each output, in the output's dtype; zeros for integer outputs.
    fn unpack_output_grads(&self, grad_res: &Tensor) -> Result<Vec<Tensor>> {
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
        Ok(grads)
    }

    /// The tracked inputs' gradients packed like `packed_in` (the one input's shape, or flat and
    /// concatenated); `None` when the gradient gave none.
    fn pack_input_grads(
        &self,
        input_grads: &[Option<Tensor>],
        device: &candle_core::Device,
    ) -> Result<Option<Tensor>> {
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
}

impl Node {
    pub(super) fn rust_gradient(
        &self,
        f: RustGradient,
        grads: &[Tensor],
    ) -> Result<Vec<Option<Tensor>>> {
        let op = &*self.op.inner;
        op.run_rust(|| {
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
            result.and_then(|g| self.check_rust(g))
        })
    }

    pub(super) fn tensor_lists(&self) -> Vec<Vec<Tensor>> {
        let mut next = 0;
        let mut lists = Vec::new();
        for v in &self.values {
            match v {
                SavedArg::Tensor(()) => next += 1,
                SavedArg::Tensors(k) => {
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

    pub(super) fn args_with_lists<'a>(&'a self, lists: &'a [Vec<Tensor>]) -> Vec<Arg<'a>> {
        let mut tensors = self.prepared.iter().map(|p| &p.tensor);
        let mut lists = lists.iter();
        self.values
            .iter()
            .map(|v| match v {
                SavedArg::Tensors(k) => {
                    for _ in 0..*k {
                        tensors.next();
                    }
                    Arg::Tensors(lists.next().expect("one list per argument"))
                }
                SavedArg::Tensor(()) => Arg::Tensor(tensors.next().expect("one per tensor")),
                plain => plain.plain().expect("a plain value"),
            })
            .collect()
    }

    pub(super) fn check_rust(&self, g: Vec<Option<Tensor>>) -> Result<Vec<Option<Tensor>>> {
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

    pub(super) fn python_gradient(
        &self,
        f: &Py<PyAny>,
        grads: &[Tensor],
    ) -> Result<Vec<Option<Tensor>>> {
        let op = &*self.op.inner;
        // Outputs and incoming gradients, prepared for Python in one go.
        let both: Vec<Arg<'_>> = self.outputs.iter().chain(grads).map(Arg::Tensor).collect();
        let mut out_prepared = PreparedInputs::new();
        crate::python::without_gil(|| {
            crate::bridge::prepare::prepare_inputs(&op.name, op.passing(), &both, &mut out_prepared)
        })?;
        let grad_prepared: PreparedInputs = out_prepared.drain(self.outputs.len()..).collect();
        let lists = self.tensor_lists();
        let args = self.args_with_lists(&lists);
        let device = self
            .prepared
            .first()
            .map(|p| p.tensor.device().clone())
            .unwrap_or(candle_core::Device::Cpu);
        if let (Some(workers), Some(name)) = (&op.workers, &op.gradient_name) {
            // The registered Python gradient runs in a worker too, with the same arguments.
            let outs: Vec<Arg<'_>> = self.outputs.iter().map(Arg::Tensor).collect();
            let gs: Vec<Arg<'_>> = grads.iter().map(Arg::Tensor).collect();
            return crate::op::worker_call::gradient_in_worker(
                op,
                workers,
                name,
                [&self.prepared, &out_prepared, &grad_prepared],
                [&args, &outs, &gs],
                &device,
                |py, returned| self.python_results(py, &args, &device, returned),
            );
        }
        op.run_python(&device, |py| {
            // The limit covers the gradient and the check of what it returned.
            let _deadline = crate::python::timeout::Deadline::enter(op.timeout);
            // Dropped last, after the tuples and what the gradient returned, so that the objects
            // nothing else holds go back to the thread's spares.
            let mut made = smallvec::SmallVec::<[_; 3]>::new();
            let mut tuples = |a: &[Arg<'_>], p: &[Prepared]| {
                let (tuple, objects) = python_tuple(py, op.passing(), a, p)
                    .map_err(|e| python_error(py, &op.name, e))?;
                made.push(objects);
                Ok::<_, crate::error::Error>(tuple)
            };
            let inputs = tuples(&args, &self.prepared)?;
            let outs: Vec<Arg<'_>> = self.outputs.iter().map(Arg::Tensor).collect();
            let outputs = tuples(&outs, &out_prepared)?;
            let gs: Vec<Arg<'_>> = grads.iter().map(Arg::Tensor).collect();
            let grads = tuples(&gs, &grad_prepared)?;
            let f = op.python_gradient_now(py, f);
            let returned = run_limited(py, &op.name, op.timeout, || {
                f.call1((inputs, outputs, grads))
            })?;
            self.python_results(py, &args, &device, &returned)
        })
    }

    pub(super) fn python_results(
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
        let entries = gradient_entries(returned, &tensor_args, &mismatch)?;
        let mut out = Vec::with_capacity(self.prepared.len());
        let mut flat_index = 0;
        for (arg, entry) in tensor_args.iter().zip(entries) {
            let items = match arg {
                Arg::Tensors(ts) if entry.is_none() => vec![entry; ts.len()],
                Arg::Tensors(ts) => match seq(&entry) {
                    Some(items) if items.len() == ts.len() => items,
                    // A list of one tensor: its gradient may come bare, as `(g,)` for the op.
                    None if ts.len() == 1 => vec![entry],
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
                        role: Role::Gradient,
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

/// One entry per tensor argument of what a Python gradient returned: a tuple or list of them,
/// or a bare value when the op has one tensor argument.
fn gradient_entries<'py>(
    returned: &Bound<'py, PyAny>,
    tensor_args: &[&Arg<'_>],
    mismatch: &dyn Fn(Option<usize>, String) -> Error,
) -> Result<Vec<Bound<'py, PyAny>>> {
    Ok(match (tensor_args, seq(returned)) {
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
    })
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
