//! A worker op's call when its pool is a Ray pool (`bridge::ray`): the same arguments as in the
//! program (NumPy views, which Ray copies into its object store), the same output check on what
//! comes back, the same errors for what the body raised.

use std::time::Duration;

use candle_core::Device;
use pyo3::prelude::*;
use pyo3::types::PyList;

use super::encode::numpy_name;
use super::errors::{missing_functions, worker_error};
use super::load::Workers;
use super::out_shapes;
use crate::arg::Arg;
use crate::bridge::args::{python_args, python_tuple, Lists};
use crate::bridge::outputs::{outputs_from_python, OutputCheck, Outputs, Role};
use crate::bridge::prepare::{Passing, Prepared};
use crate::bridge::ray::{self, RayReply};
use crate::error::Result;
use crate::op::OpInner;
use crate::python::errors::python_error;

/// What actors need from the layers above the bridge: the embedded-package importer's code.
fn ready() {
    ray::set_importer(crate::body::package::IMPORTER);
}

impl OpInner {
    /// The body's part of a forward call run on a Ray actor.
    #[allow(clippy::too_many_arguments)]
    pub(super) fn run_in_ray(
        &self,
        workers: &Workers,
        args: &[Arg<'_>],
        prepared: &[Prepared],
        device: &Device,
        timeout: Option<Duration>,
        span: &tracing::Span,
    ) -> Result<Outputs> {
        ready();
        let tout = self.failed_before_python(self.resolved_tout(args))?;
        let (reloaded, accepts_out) = self.worker_body_now();
        let outs = if accepts_out {
            out_shapes(&tout, args)
        } else {
            None
        };
        let load = workers.load(&self.name, reloaded);
        let bytes_in = prepared
            .iter()
            .map(|p| p.tensor.elem_count() * p.tensor.dtype().size_in_bytes())
            .sum::<usize>() as u64;
        let started = std::time::Instant::now();
        let result = self.run_python(device, |py| {
            crate::python::numpy::ensure_numpy(py, Some(&self.name))?;
            let py_err = |e: PyErr| python_error(py, &self.name, e);
            let items =
                python_args(py, Passing::Views, args, prepared, Lists::AsLists).map_err(py_err)?;
            let list = PyList::new(py, items).map_err(py_err)?;
            let out_list = match &outs {
                None => None,
                Some(outs) => Some(
                    PyList::new(
                        py,
                        outs.iter().map(|(d, dims)| (numpy_name(*d), dims.clone())),
                    )
                    .map_err(py_err)?,
                ),
            };
            let (reply, actor, node) = ray::call(
                py,
                &workers.pool,
                &self.name,
                &load,
                &self.function,
                list,
                out_list,
                timeout,
                bytes_in,
            )?;
            span.record("worker", actor);
            span.record("node", node.as_str());
            let check = OutputCheck {
                op: &self.name,
                tout: &tout,
                device,
                role: Role::Output,
                args,
            };
            match reply {
                RayReply::Value(value) => match outs {
                    None => outputs_from_python(py, &check, value),
                    Some(_) => Err(crate::bridge::out::returned_instead_of_out(&check, &value)),
                },
                RayReply::Wrote(value) => outputs_from_python(py, &check, value),
                RayReply::Raised { exc, actor } => Err(worker_error(
                    py,
                    &self.name,
                    &self.body_named(),
                    actor,
                    &exc,
                )),
            }
        });
        self.counters.record_worker(started.elapsed());
        result
    }

    /// A registered Python gradient run on a Ray actor, with the same arguments as in the
    /// program; returns what `check` makes of its value.
    pub(super) fn gradient_in_ray<T>(
        &self,
        workers: &Workers,
        function: &str,
        prepared: [&[Prepared]; 3],
        groups: [&[Arg<'_>]; 3],
        device: &Device,
        check: impl FnOnce(Python<'_>, &Bound<'_, PyAny>) -> Result<T>,
    ) -> Result<T> {
        ready();
        let load = workers.load(&self.name, self.worker_body_now().0);
        let bytes_in = prepared
            .iter()
            .flat_map(|p| p.iter())
            .map(|p| p.tensor.elem_count() * p.tensor.dtype().size_in_bytes())
            .sum::<usize>() as u64;
        self.run_python(device, |py| {
            let py_err = |e: PyErr| python_error(py, &self.name, e);
            let tuples = groups
                .iter()
                .zip(prepared)
                .map(|(a, p)| python_tuple(py, Passing::Views, a, p))
                .collect::<PyResult<Vec<_>>>()
                .map_err(py_err)?;
            let list = PyList::new(py, tuples).map_err(py_err)?;
            let (reply, _, _) = ray::call(
                py,
                &workers.pool,
                &self.name,
                &load,
                function,
                list,
                None,
                self.timeout,
                bytes_in,
            )?;
            match reply {
                RayReply::Value(value) | RayReply::Wrote(value) => check(py, &value),
                RayReply::Raised { exc, actor } => Err(worker_error(
                    py,
                    &self.name,
                    &self.body_named(),
                    actor,
                    &exc,
                )),
            }
        })
    }

    /// Starts the pool's actors now (`PyOp::start_workers`).
    pub(super) fn start_actors(&self, workers: &Workers) -> Result<()> {
        ready();
        crate::bridge::with_gil(&self.name, |py| ray::fill(py, &workers.pool, &self.name))
            .map(|_| ())
    }

    /// Checks that an actor starts and loads the body, with its functions (`validate()`).
    pub(super) fn check_ray(&self, workers: &Workers, functions: &[&str]) -> Result<()> {
        ready();
        let op = self.name.as_str();
        let load = workers.load(op, None);
        let missing = crate::bridge::with_gil(op, |py| {
            match ray::check(py, &workers.pool, op, &load, functions)? {
                Ok(missing) => Ok(missing),
                Err((exc, actor)) => Err(worker_error(py, op, &self.body_named(), actor, &exc)),
            }
        })?
        .0;
        if !missing.is_empty() {
            return Err(missing_functions(
                op,
                &self.body_named(),
                "on a Ray actor",
                &missing,
            ));
        }
        Ok(())
    }
}
