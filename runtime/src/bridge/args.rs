//! The Python positional arguments of a call, and the call itself (vectorcall: no tuple made).

use pyo3::prelude::*;
use pyo3::types::{PyBool, PyFloat, PyList, PyString, PyTuple};
use smallvec::SmallVec;

use super::prepare::{Passing, Prepared};
use super::view::numpy_view;
use crate::arg::Arg;
use crate::bridge::tensor::spare::Made;

/// How `&[Tensor]` arguments reach Python: a list for the body, a tuple for a gradient.
#[derive(Clone, Copy)]
pub(crate) enum Lists {
    AsLists,
    AsTuples,
}

/// A call's Python positional arguments, held on the stack for the usual few.
pub(crate) type Items<'py> = SmallVec<[Bound<'py, PyAny>; 4]>;

/// The Python positional arguments of a call: every argument in declaration order. The
/// `pyop.Tensor`s or views made for its tensors are added to `made` too. The arguments go to
/// [`call`], which lets go of them when the body returns (inside the call's time limit: a
/// `__del__` they trigger is Python of the call); `made` is to be dropped after the call's
/// outputs are read, so that an input the body handed back is let go too, and those nothing
/// else holds go back to the thread's spares (`tensor::spare`). (The caller's `made`, rather
/// than one returned with the arguments: ~50 bytes fewer moved through a `Result`.)
#[inline(always)]
pub(crate) fn python_args<'py>(
    py: Python<'py>,
    passing: Passing,
    args: &[Arg<'_>],
    prepared: &[Prepared],
    lists: Lists,
    made: &mut Made<'py>,
) -> PyResult<Items<'py>> {
    let mut next = prepared.iter();
    let mut tensor = |py: Python<'py>| -> PyResult<Bound<'py, PyAny>> {
        let p = next.next().expect("one prepared input per tensor");
        match passing {
            Passing::Views => numpy_view(py, p, made),
            Passing::Tensors | Passing::Dlpack => {
                Ok(made.input(py, p.tensor.clone(), p.shares_var)?.into_any())
            }
        }
    };
    let mut items = SmallVec::with_capacity(args.len());
    for arg in args {
        items.push(match arg {
            Arg::Tensor(_) => tensor(py)?,
            Arg::Tensors(ts) => {
                let items = ts
                    .iter()
                    .map(|_| tensor(py))
                    .collect::<PyResult<Vec<_>>>()?;
                match lists {
                    Lists::AsLists => PyList::new(py, items)?.into_any(),
                    Lists::AsTuples => PyTuple::new(py, items)?.into_any(),
                }
            }
            Arg::F64(v) => PyFloat::new(py, *v).into_any(),
            Arg::I64(v) => v.into_pyobject(py)?.into_any(),
            Arg::Bool(v) => PyBool::new(py, *v).to_owned().into_any(),
            Arg::Str(v) => PyString::new(py, v).into_any(),
            Arg::F64s(v) => PyList::new(py, v.iter())?.into_any(),
            Arg::I64s(v) => PyList::new(py, v.iter())?.into_any(),
            Arg::U64(v) => v.into_pyobject(py)?.into_any(),
            Arg::Usizes(v) => PyList::new(py, v.iter())?.into_any(),
            Arg::F32s(v) => PyList::new(py, v.iter().map(|&f| f64::from(f)))?.into_any(),
            Arg::None => py.None().into_bound(py),
        });
    }
    Ok(items)
}

/// [`python_args`] as one tuple (a gradient's `inputs`, `outputs` and `grads`), and the objects
/// made for it, to be dropped after the tuple and whatever the gradient returned (only then can
/// they go back to the thread's spares).
pub(crate) fn python_tuple<'py>(
    py: Python<'py>,
    passing: Passing,
    args: &[Arg<'_>],
    prepared: &[Prepared],
) -> PyResult<(Bound<'py, PyTuple>, Made<'py>)> {
    let mut made = Made::default();
    let items = python_args(py, passing, args, prepared, Lists::AsTuples, &mut made)?;
    Ok((PyTuple::new(py, items)?, made))
}

/// Calls `callable(*args, out=out)` (without `out` when it is `None`) by vectorcall, so that no
/// argument tuple or keyword dict is made, and lets go of the arguments as soon as it returns.
#[inline(always)]
pub(crate) fn call<'py>(
    callable: &Bound<'py, PyAny>,
    args: Items<'py>,
    out: Option<&Bound<'py, PyAny>>,
) -> PyResult<Bound<'py, PyAny>> {
    let py = callable.py();
    // A free slot before the arguments lets CPython call a bound method without a copy
    // (`PY_VECTORCALL_ARGUMENTS_OFFSET`); the usual few arguments sit in an array on the stack.
    let mut inline = [std::ptr::null_mut::<pyo3::ffi::PyObject>(); 6];
    let mut spilled = Vec::new();
    let needed = args.len() + 1 + usize::from(out.is_some());
    let ptrs: &mut [*mut pyo3::ffi::PyObject] = if needed <= inline.len() {
        &mut inline[..needed]
    } else {
        spilled.resize(needed, std::ptr::null_mut());
        &mut spilled
    };
    for (slot, arg) in ptrs[1..].iter_mut().zip(args.iter()) {
        *slot = arg.as_ptr();
    }
    static OUT: pyo3::sync::PyOnceLock<Py<PyTuple>> = pyo3::sync::PyOnceLock::new();
    let kwnames = match out {
        Some(out) => {
            ptrs[needed - 1] = out.as_ptr();
            Some(OUT.get_or_try_init(py, || PyTuple::new(py, ["out"]).map(Bound::unbind))?)
        }
        None => None,
    };
    let positional = args.len();
    // SAFETY: the GIL is held; `ptrs[1..]` are `positional` borrowed positional arguments
    // followed by one keyword value when `kwnames` (a tuple of that one name) is given, all kept
    // alive by `args`, `out` and `kwnames` for the length of the call; slot 0 is scratch space
    // CPython may write to, as the offset flag allows.
    let result = unsafe {
        pyo3::ffi::PyObject_Vectorcall(
            callable.as_ptr(),
            ptrs.as_mut_ptr().add(1),
            positional | pyo3::ffi::PY_VECTORCALL_ARGUMENTS_OFFSET,
            kwnames.map_or(std::ptr::null_mut(), |k| k.as_ptr()),
        )
    };
    drop(args);
    // SAFETY: the GIL is held; vectorcall returns a new reference or null with an exception set.
    unsafe { Bound::from_owned_ptr_or_err(py, result) }
}
