//! Finding how workers start: the embedded interpreter's own `python` (or
//! `PYOP_WORKER_PYTHON`), its `sys.path` and version, found once, with the GIL.

use std::path::PathBuf;
use std::sync::OnceLock;

use pyo3::prelude::*;

use crate::bridge::with_gil;
use crate::error::{Error, ErrorKind, Result};
use crate::worker::exchange::Launch;

static LAUNCH: OnceLock<Launch> = OnceLock::new();

/// How workers start, if found already (an awaited call finds it on pyop's threads).
pub(crate) fn found() -> Option<&'static Launch> {
    LAUNCH.get()
}

/// How workers start: found once, with the GIL, from the embedded interpreter.
pub(crate) fn launch(op: &str) -> Result<&'static Launch> {
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
        let sys = py
            .import("sys")
            .map_err(|e| crate::python::errors::python_error(py, op, e))?;
        let sys_path: Vec<String> = sys
            .getattr("path")
            .and_then(|p| p.extract())
            .map_err(|e| crate::python::errors::python_error(py, op, e))?;
        let argv: Vec<String> = sys
            .getattr("argv")
            .and_then(|a| a.extract())
            .unwrap_or_else(|_| vec![String::new()]);
        let version: (u32, u32) = sys
            .getattr("version_info")
            .and_then(|v| Ok((v.get_item(0)?.extract()?, v.get_item(1)?.extract()?)))
            .map_err(|e| crate::python::errors::python_error(py, op, e))?;
        let (describe, pip, pip_ray) = match env {
            Some(e) => (e.describe(), e.pip_install("numpy"), e.pip_install("ray")),
            None => (
                String::new(),
                "`pip install numpy`".to_owned(),
                "`pip install ray`".to_owned(),
            ),
        };
        Ok(Launch {
            python,
            sys_path,
            argv,
            site_packages: env.and_then(|e| e.site_packages.clone()),
            importer: crate::body::package::IMPORTER,
            version: [version.0, version.1],
            describe,
            pip_numpy: pip,
            pip_ray,
        })
    })?;
    Ok(LAUNCH.get_or_init(|| found))
}
