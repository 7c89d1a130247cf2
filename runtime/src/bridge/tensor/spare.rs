//! Spare `pyop.Tensor` objects, one store per thread: a call's input objects (tensor mode's
//! `pyop.Tensor`s, numpy mode's view bases) that came back with no other reference are kept,
//! emptied, and given the next call's input instead of being freed and made again. Making and
//! freeing one is about 400 instructions of a scalar call's ~3,000 (pyo3 makes every class
//! garbage-collected); refilling a spare is a reference-count read and a swap.
//!
//! Why no body can tell (see also `impl Sync for PyTensor`):
//! - An object is refilled or emptied only while the store holds its only reference (count
//!   one, read with the GIL held, no Python code run until the write is done). A body that kept
//!   the object (in a global, a closure, a list; a NumPy view of it, whose root holds the base)
//!   holds a reference, so that object is never touched again: it is let go, not kept.
//! - A kept spare holds an empty tensor (no element, no storage of anyone's): the input's
//!   storage is let go when the call ends, as when the object was freed.
//! - `pyop.Tensor` takes no weak references and has no `__dict__`, so nothing can follow the
//!   object without counting. A spare can still be found by `gc.get_objects()`; found, it is an
//!   empty tensor, and while the finder holds it the store's count check skips it.
//! - The same address for a new call's input is what CPython's allocator would often give too.
//!
//! Numpy mode keeps its whole input view (the array handed to the body, its hidden root, and the
//! `pyop.Tensor` under them: `view::numpy_view`) the same way, with NumPy 1.22 or later: given
//! back only when nothing can reach any part of it (`ndarray::view_parts`: counts of one along the
//! chain, no weak reference, no buffer handed out), its arrays made empty and its base emptied;
//! taken by the next input of the same rank and dtype, which gets its data, shape and strides
//! written in and NumPy's flags for them (`ViewParts::refill`). NumPy arrays are not tracked by
//! the garbage collector, so a kept view cannot be found; its base can, and one found and held
//! lets the view go when it is next taken.
//!
//! The store lives in a `thread_local!`; when the thread ends, its spares go to pyo3's deferred
//! reference pool (they are let go by the next thread that takes the GIL), so nothing touches
//! Python from a thread-local destructor. Built with that pool turned off
//! (`--cfg pyo3_disable_reference_pool`, where such a drop would abort), they are leaked instead.
//!
//! On a free-threaded CPython (`Py_GIL_DISABLED`) a reference count of one read by this thread
//! does not exclude another thread taking a reference at that moment: the store keeps nothing
//! there, and every input gets a new object, as before.

use std::cell::RefCell;

use candle_core::{DType, Device, Tensor};
use pyo3::prelude::*;
use smallvec::SmallVec;

use super::{Fields, PyTensor};
use crate::bridge::ndarray;
use crate::bridge::prepare::Prepared;

/// How many spares a thread keeps: enough for the inputs of the usual op, nested once.
const KEEP: usize = 8;

struct Store {
    spares: Vec<Py<PyTensor>>,
    /// Numpy mode's input views, each with its root and base (`ndarray::view_parts`), emptied.
    views: Vec<SpareView>,
    /// What an emptied spare holds (one per thread: cloning it touches no other thread's
    /// counter).
    empty: Option<Tensor>,
    /// NumPy's flags for the layout a view was last refilled with.
    flags: Option<ndarray::FlagsMemo>,
}

impl Drop for Store {
    fn drop(&mut self) {
        // Without pyo3's deferred reference pool, dropping a `Py` on a thread that is not
        // attached aborts the process: a thread's few spares are leaked instead.
        #[cfg(pyo3_disable_reference_pool)]
        {
            self.spares.drain(..).for_each(std::mem::forget);
            self.views.drain(..).for_each(|v| std::mem::forget(v.view));
        }
    }
}

/// A kept NumPy input view, with its rank and dtype object (which nothing can change while it is
/// kept: nothing else reaches the arrays).
struct SpareView {
    view: Py<PyAny>,
    kind: (usize, *mut numpy::npyffi::PyArray_Descr),
}

/// Whether a reference count of one, read with the GIL held, means no other thread can take a
/// reference before this one lets go of the GIL (not so without a GIL).
const KEEPS_SPARES: bool = !cfg!(Py_GIL_DISABLED);

thread_local! {
    static STORE: RefCell<Store> = const {
        RefCell::new(Store {
            spares: Vec::new(),
            views: Vec::new(),
            empty: None,
            flags: None,
        })
    };
}

/// The `pyop.Tensor` objects or NumPy views a call made for its inputs (one kind per call: its
/// mode's), given back to this thread's store when dropped (after everything else of the call
/// that referenced them is gone).
#[derive(Default)]
pub(crate) struct Made<'py> {
    made: SmallVec<[Bound<'py, PyAny>; 4]>,
    /// Whether `made` holds views (`view::numpy_view`), not `pyop.Tensor`s.
    views: bool,
}

impl<'py> Made<'py> {
    /// A `pyop.Tensor` for a call's input (tensor mode): a spare refilled, or a new object.
    pub(crate) fn input(
        &mut self,
        py: Python<'py>,
        tensor: Tensor,
        var_storage: bool,
    ) -> PyResult<Bound<'py, PyTensor>> {
        self.object(
            py,
            Fields {
                var_storage,
                ..Fields::new(tensor)
            },
        )
    }

    /// The base object of a NumPy view of `tensor` starting at address `data` (numpy mode's
    /// inputs): a spare refilled, or a new object.
    pub(crate) fn view_base(
        &mut self,
        py: Python<'py>,
        tensor: Tensor,
        data: usize,
    ) -> PyResult<Bound<'py, PyTensor>> {
        self.object(py, Fields::view_base(tensor, data, false))
    }

    #[inline(always)]
    fn object(&mut self, py: Python<'py>, fields: Fields) -> PyResult<Bound<'py, PyTensor>> {
        let object = fresh(py, fields)?;
        debug_assert!(!self.views, "one kind per call");
        self.made.push(object.clone().into_any());
        Ok(object)
    }

    /// The base object of a new NumPy input view (see [`Made::view_base`]), given back with the
    /// view ([`Made::keep_view`]), not on its own.
    pub(crate) fn fresh_view_base(
        &mut self,
        py: Python<'py>,
        tensor: Tensor,
        data: usize,
    ) -> PyResult<Bound<'py, PyTensor>> {
        fresh(py, Fields::view_base(tensor, data, false))
    }

    /// A new NumPy input view, its root and base (`view::numpy_view`), to be given back whole.
    pub(crate) fn keep_view(&mut self, view: Bound<'py, PyAny>) {
        debug_assert!(self.views || self.made.is_empty(), "one kind per call");
        self.views = true;
        self.made.push(view);
    }

    /// A spare NumPy input view of rank `nd` and dtype object `descr` from this thread's store,
    /// refilled with `p` (its base holding `p`'s tensor), or `None`.
    pub(crate) fn spare_view(
        &mut self,
        py: Python<'py>,
        nd: usize,
        descr: *mut numpy::npyffi::PyArray_Descr,
        p: &Prepared,
    ) -> Option<Bound<'py, PyAny>> {
        if !KEEPS_SPARES {
            return None;
        }
        let view = STORE
            .try_with(|store| {
                let mut store = store.try_borrow_mut().ok()?;
                let i = store.views.iter().rposition(|v| v.kind == (nd, descr))?;
                let view = store.views.swap_remove(i).view.into_bound(py);
                {
                    // SAFETY: the GIL is held; the view was kept (`give_back_view`) only where
                    // NumPy lays arrays out as `view_parts` reads them, and only once
                    // `view_parts` accepted it. The store's reference was its only one, now this
                    // function's. `None` where the base was found (`gc.get_objects()`) and is
                    // held: the view is let go.
                    let parts = unsafe { ndarray::kept_parts(py, &view, nd) }?;
                    // SAFETY: the base's only reference is the root's, reached only through
                    // this function's view; no Python code has run since it was counted.
                    let _emptied = unsafe {
                        replace(
                            &parts.base(),
                            Fields::view_base(p.tensor.clone(), p.data, false),
                        )
                    };
                    // SAFETY: as above; `p`'s tensor has the parts' rank and dtype (found by
                    // them), and the base holds it now.
                    unsafe { parts.refill(p, &mut store.flags) };
                }
                Some(view)
            })
            .ok()
            .flatten()?;
        self.keep_view(view.clone());
        Some(view)
    }
}

impl Drop for Made<'_> {
    #[inline(always)]
    fn drop(&mut self) {
        for object in self.made.drain(..) {
            if self.views {
                give_back_view(object);
            } else if let Ok(object) = object.cast_into::<PyTensor>() {
                give_back(object);
            }
        }
    }
}

/// A `pyop.Tensor` holding `fields`: a spare refilled, or a new object.
#[inline(always)]
fn fresh(py: Python<'_>, fields: Fields) -> PyResult<Bound<'_, PyTensor>> {
    Ok(match take(py) {
        Some(spare) => {
            // SAFETY: `take` hands out a spare only with the store's reference its only one, now
            // this function's; no Python code has run since it was counted.
            let _emptied = unsafe { replace(&spare, fields) };
            spare
        }
        None => Bound::new(py, PyTensor::of(fields))?,
    })
}

/// A spare from this thread's store whose only reference is the store's, now the caller's.
fn take(py: Python<'_>) -> Option<Bound<'_, PyTensor>> {
    if !KEEPS_SPARES {
        return None;
    }
    STORE
        .try_with(|store| {
            let mut store = store.try_borrow_mut().ok()?;
            while let Some(spare) = store.spares.pop() {
                if refs(spare.bind(py)) == 1 {
                    return Some(spare.into_bound(py));
                }
                // Found and held by someone (`gc.get_objects()`): theirs now.
            }
            None
        })
        .ok()
        .flatten()
}

/// Keeps `object` in this thread's store, emptied, if nothing else references it; else lets it
/// go.
#[inline(always)]
fn give_back(object: Bound<'_, PyTensor>) {
    if !KEEPS_SPARES || refs(&object) != 1 {
        return;
    }
    let _ = STORE.try_with(|store| {
        let Ok(mut store) = store.try_borrow_mut() else {
            return;
        };
        if store.spares.len() >= KEEP {
            return;
        }
        let Some(empty) = empty_tensor(&mut store) else {
            return;
        };
        // SAFETY: the reference count read above is one, `object`'s own, and no Python code
        // has run since; `object` is this function's.
        let input = unsafe { replace(&object, Fields::new(empty)) };
        store.spares.push(object.unbind());
        // The input's tensor (and its storage) is let go here, as if the object had been freed.
        drop(input);
    });
}

/// Keeps a NumPy input view (with its root and base) in this thread's store, emptied, if nothing
/// else can reach any part of it (`ndarray::view_parts`); else lets it go.
fn give_back_view(view: Bound<'_, PyAny>) {
    if !KEEPS_SPARES {
        return;
    }
    let py = view.py();
    // SAFETY: the GIL is held; the view was made by `view::numpy_view`, only where NumPy lays
    // arrays out as `view_parts` reads them.
    let Some(parts) = (unsafe { ndarray::view_parts(py, &view) }) else {
        return;
    };
    let kind = parts.kind();
    let evicted = STORE.try_with(|store| {
        let mut store = store.try_borrow_mut().ok()?;
        let empty = empty_tensor(&mut store)?;
        // Full: the view kept longest goes (its rank or dtype may be one this thread no longer
        // sees), let go below, outside the store.
        let evicted = (store.views.len() >= KEEP).then(|| store.views.remove(0));
        // SAFETY: the parts were counted above with no Python code run since; the base's only
        // reference is the root's, reached only through `view`, this function's.
        let input = unsafe {
            parts.empty();
            replace(&parts.base(), Fields::new(empty))
        };
        // (A second reference for the store: `view`, which the parts borrow, goes below.)
        store.views.push(SpareView {
            view: view.clone().unbind(),
            kind,
        });
        // The input's tensor (and its storage) is let go here, as if the view had been freed.
        drop(input);
        evicted
    });
    drop(evicted);
}

/// How many spare `pyop.Tensor`s and spare views this thread's store holds now (for tests: a
/// count of empty `pyop.Tensor`s through `gc` sees every thread's, which other threads change).
pub(crate) fn on_this_thread() -> (usize, usize) {
    STORE
        .try_with(|s| {
            s.try_borrow()
                .map_or((0, 0), |s| (s.spares.len(), s.views.len()))
        })
        .unwrap_or((0, 0))
}

/// This thread's empty tensor, made once.
fn empty_tensor(store: &mut Store) -> Option<Tensor> {
    match &store.empty {
        Some(empty) => Some(empty.clone()),
        None => Tensor::zeros(0, DType::U8, &Device::Cpu)
            .ok()
            .map(|empty| store.empty.insert(empty).clone()),
    }
}

fn refs(object: &Bound<'_, PyTensor>) -> isize {
    // SAFETY: reading the reference count of a live object, with the GIL held.
    unsafe { pyo3::ffi::Py_REFCNT(object.as_ptr()) }
}

/// Replaces `object`'s fields, giving back the old ones.
///
/// # Safety
/// The GIL is held (`object` proves it), `object` is the only reference to the object (its
/// reference count is one), and no Python code has run since that was read.
unsafe fn replace(object: &Bound<'_, PyTensor>, fields: Fields) -> Fields {
    // SAFETY: per the contract, no other reference exists, so no `&Fields` borrowed from one;
    // this function's own borrow of `object` reads nothing of the fields while writing them.
    unsafe { std::mem::replace(&mut *object.get().fields.get(), fields) }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn with_py<R>(f: impl for<'py> FnOnce(Python<'py>) -> R) -> R {
        crate::python::attach(f)
    }

    #[test]
    fn an_unreferenced_input_object_is_kept_emptied_and_refilled_for_the_next_call() {
        with_py(|py| {
            let a = Tensor::new(&[1f32, 2.], &Device::Cpu).unwrap();
            let b = Tensor::new(&[3f64], &Device::Cpu).unwrap();
            let first = {
                let mut made = Made::default();
                let x = made.input(py, a.clone(), true).unwrap();
                x.as_ptr() as usize
            };
            let spare = STORE.with(|s| s.borrow().spares.last().map(|o| o.as_ptr() as usize));
            assert_eq!(spare, Some(first));
            // Emptied: the input's storage is the caller's alone again.
            STORE.with(|s| {
                let store = s.borrow();
                let kept = store.spares.last().unwrap().get();
                assert_eq!(kept.tensor().elem_count(), 0);
                assert!(!kept.may_be_written());
            });
            let mut made = Made::default();
            let y = made.input(py, b.clone(), false).unwrap();
            assert_eq!(y.as_ptr() as usize, first);
            assert_eq!(y.get().tensor().to_vec1::<f64>().unwrap(), [3.]);
            assert!(!y.get().may_be_written());
        });
    }

    #[test]
    fn an_input_object_someone_kept_is_never_refilled() {
        with_py(|py| {
            let a = Tensor::new(&[1f32, 2.], &Device::Cpu).unwrap();
            let kept = {
                let mut made = Made::default();
                made.input(py, a.clone(), false).unwrap()
            };
            let mut made = Made::default();
            let y = made
                .input(py, Tensor::new(&[9f32], &Device::Cpu).unwrap(), false)
                .unwrap();
            assert!(!y.is(&kept));
            assert_eq!(kept.get().tensor().to_vec1::<f32>().unwrap(), [1., 2.]);
        });
    }

    /// An input view of `t` as numpy mode makes it, with `made`.
    fn view_of<'py>(py: Python<'py>, made: &mut Made<'py>, t: &Tensor) -> Bound<'py, PyAny> {
        crate::python::env::init(py).unwrap();
        crate::python::numpy::ensure_numpy(py, None).unwrap();
        let p = Prepared {
            tensor: t.clone(),
            data: crate::bridge::prepare::cpu_data_ptr(t),
            shares_var: false,
        };
        crate::bridge::view::numpy_view(py, &p, made).unwrap()
    }

    fn kept_views() -> Vec<usize> {
        STORE.with(|s| {
            let store = s.borrow();
            store
                .views
                .iter()
                .map(|v| v.view.as_ptr() as usize)
                .collect()
        })
    }

    /// Runs `code` with `x` bound, giving back the value of its last line's expression `r`.
    fn run<'py>(py: Python<'py>, code: &str, x: &Bound<'py, PyAny>) -> Bound<'py, PyAny> {
        let locals = pyo3::types::PyDict::new(py);
        locals.set_item("x", x).unwrap();
        let code = std::ffi::CString::new(code).unwrap();
        py.run(&code, None, Some(&locals)).unwrap();
        locals.get_item("r").unwrap().unwrap()
    }

    #[test]
    fn a_view_nothing_else_reaches_is_kept_emptied_and_refilled_with_numpys_flags() {
        with_py(|py| {
            let a = Tensor::arange(0f64, 6., &Device::Cpu)
                .unwrap()
                .reshape((2, 3))
                .unwrap();
            let first = {
                let mut made = Made::default();
                let x = view_of(py, &mut made, &a);
                x.as_ptr() as usize
            };
            assert_eq!(kept_views().last(), Some(&first));
            // Emptied: no dimension, nobody's memory, an empty base.
            let shape = STORE.with(|s| {
                let store = s.borrow();
                let v = store.views.last().unwrap().view.bind(py);
                let base = v.getattr("base").unwrap().getattr("base").unwrap();
                assert_eq!(
                    base.cast::<PyTensor>().unwrap().get().tensor().elem_count(),
                    0
                );
                v.getattr("shape")
                    .unwrap()
                    .extract::<(usize, usize)>()
                    .unwrap()
            });
            assert_eq!(shape, (0, 0));
            // Refilled with a transposed tensor of another shape: its values, shape, strides and
            // NumPy's flags for that layout (those of a new array over it), base and root too.
            let b = Tensor::arange(10f64, 22., &Device::Cpu)
                .unwrap()
                .reshape((3, 4))
                .unwrap()
                .t()
                .unwrap();
            let mut made = Made::default();
            let y = view_of(py, &mut made, &b);
            assert_eq!(y.as_ptr() as usize, first);
            let got = run(
                py,
                "import numpy as np\n\
                 def flags(a):\n\
                 \x20   return [a.flags[k] for k in ('C', 'F', 'A', 'W', 'O')]\n\
                 r = (x.tolist(), x.strides, flags(x), flags(x.base), flags(x.view()),\n\
                 \x20    flags(np.lib.stride_tricks.as_strided(x)))",
                &y,
            );
            type Flags = Vec<bool>;
            type Got = (Vec<Vec<f64>>, (isize, isize), Flags, Flags, Flags, Flags);
            let (values, strides, flags, root, viewed, strided): Got = got.extract().unwrap();
            assert_eq!(values, b.to_vec2::<f64>().unwrap());
            assert_eq!(strides, (8, 32));
            assert_eq!(flags, [false, true, true, false, false]);
            assert_eq!((&root, &viewed), (&flags, &flags));
            assert_eq!(strided[..3], flags[..3]);
            let base = y.getattr("base").unwrap().getattr("base").unwrap();
            let base = base.cast::<PyTensor>().unwrap().get();
            assert_eq!(
                base.tensor().to_vec2::<f64>().unwrap(),
                b.to_vec2::<f64>().unwrap()
            );
            assert_eq!(
                base.view_data(),
                Some(crate::bridge::prepare::cpu_data_ptr(&b))
            );
        });
    }

    #[test]
    fn a_view_with_a_weak_reference_or_a_buffer_handed_out_is_let_go() {
        // Each line but the first leaves the view or its root reachable, or NumPy holding a
        // buffer description of one (at the field the store reads: a check of NumPy's layout on
        // this version).
        for (code, weak) in [
            ("r = x.sum()", false),
            ("import weakref; r = weakref.ref(x)", true),
            ("import weakref; r = weakref.ref(x.base)", true),
            ("memoryview(x).release(); r = None", false),
            ("memoryview(x.base).release(); r = None", false),
            ("r = x.base", false),
            ("r = x.base.base", false),
        ] {
            with_py(|py| {
                let a = Tensor::arange(0f32, 4., &Device::Cpu).unwrap();
                let (held, x) = {
                    let mut made = Made::default();
                    let x = view_of(py, &mut made, &a);
                    (run(py, code, &x).unbind(), x.as_ptr() as usize)
                };
                let kept = kept_views().contains(&x);
                assert_eq!(kept, code.starts_with("r = x.sum"), "{code}");
                if weak {
                    // The view or root went: the weak reference is dead.
                    assert!(held.bind(py).call0().unwrap().is_none(), "{code}");
                }
            });
        }
    }

    #[test]
    fn a_full_store_lets_its_oldest_view_go_for_a_new_one() {
        with_py(|py| {
            let rank2 = Tensor::zeros((2, 2), DType::F32, &Device::Cpu).unwrap();
            // KEEP views of rank 2 given back together fill the store.
            {
                let mut made = Made::default();
                for _ in 0..KEEP {
                    view_of(py, &mut made, &rank2);
                }
            }
            let kept = kept_views();
            assert_eq!(kept.len(), KEEP);
            let rank1 = Tensor::zeros(3, DType::F32, &Device::Cpu).unwrap();
            let x = {
                let mut made = Made::default();
                let x = view_of(py, &mut made, &rank1);
                x.as_ptr() as usize
            };
            assert_eq!(kept_views(), [&kept[1..], &[x]].concat());
        });
    }

    #[test]
    fn a_spare_view_whose_base_someone_holds_again_is_let_go() {
        with_py(|py| {
            let a = Tensor::arange(0f32, 4., &Device::Cpu).unwrap();
            drop(view_of(py, &mut Made::default(), &a));
            // Its base held again (as `gc.get_objects()` would hand it to a body).
            let found = STORE.with(|s| {
                let store = s.borrow();
                let v = store.views.last().unwrap().view.bind(py);
                v.getattr("base").unwrap().getattr("base").unwrap().unbind()
            });
            let spares = kept_views().len();
            let mut made = Made::default();
            let y = view_of(py, &mut made, &a);
            // A new view over another base; the spare was let go (not put back).
            let base = y.getattr("base").unwrap().getattr("base").unwrap();
            assert!(!base.is(found.bind(py)));
            assert_eq!(kept_views().len(), spares - 1);
            let found = found.bind(py).cast::<PyTensor>().unwrap().get();
            assert_eq!(found.tensor().elem_count(), 0);
        });
    }

    /// What `kept_parts` still reads, should a kept view be reached all the same (on a CPython
    /// whose `sys.getobjects()` lists untracked objects, where no view is kept): a view reshaped
    /// to another rank (possible while it is empty) or weakly referenced is let go when taken,
    /// not written into. (Told by what the next input's view is, not by its address, which
    /// CPython may give the next new array.)
    #[test]
    fn a_spare_view_reached_while_kept_is_let_go() {
        for (code, reshaped) in [
            ("x.shape = (0,)\nr = 0", true),
            ("import weakref\nr = weakref.ref(x)", false),
        ] {
            with_py(|py| {
                let a = Tensor::zeros((2, 2), DType::F32, &Device::Cpu).unwrap();
                drop(view_of(py, &mut Made::default(), &a));
                let held = STORE.with(|s| {
                    let store = s.borrow();
                    run(py, code, store.views.last().unwrap().view.bind(py)).unbind()
                });
                let mut made = Made::default();
                let y = view_of(py, &mut made, &a);
                // Taken, the reshaped view would still say rank 1 (only its dims are written).
                let shape = y.getattr("shape").unwrap();
                assert_eq!(shape.extract::<Vec<usize>>().unwrap(), [2, 2], "{code}");
                if !reshaped {
                    // Let go: its weak reference is dead, not a reference to the input's view.
                    assert!(held.bind(py).call0().unwrap().is_none(), "{code}");
                }
            });
        }
    }

    #[test]
    fn a_spare_someone_holds_again_is_skipped() {
        with_py(|py| {
            let a = Tensor::new(&[1f32], &Device::Cpu).unwrap();
            drop(Made::default().input(py, a.clone(), false).unwrap());
            // A spare held again (as `gc.get_objects()` would hand it to a body).
            let found = STORE.with(|s| s.borrow().spares.last().unwrap().clone_ref(py));
            let mut made = Made::default();
            let y = made.input(py, a.clone(), false).unwrap();
            assert!(!y.is(found.bind(py)));
            assert_eq!(found.get().tensor().elem_count(), 0);
        });
    }
}
