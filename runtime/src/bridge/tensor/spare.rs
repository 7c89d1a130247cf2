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

/// How many spares a thread keeps: enough for the inputs of the usual op, nested once.
const KEEP: usize = 8;

struct Store {
    spares: Vec<Py<PyTensor>>,
    /// What an emptied spare holds (one per thread: cloning it touches no other thread's
    /// counter).
    empty: Option<Tensor>,
}

impl Drop for Store {
    fn drop(&mut self) {
        // Without pyo3's deferred reference pool, dropping a `Py` on a thread that is not
        // attached aborts the process: a thread's few spares are leaked instead.
        #[cfg(pyo3_disable_reference_pool)]
        for spare in self.spares.drain(..) {
            std::mem::forget(spare);
        }
    }
}

/// Whether a reference count of one, read with the GIL held, means no other thread can take a
/// reference before this one lets go of the GIL (not so without a GIL).
const KEEPS_SPARES: bool = !cfg!(Py_GIL_DISABLED);

thread_local! {
    static STORE: RefCell<Store> = const {
        RefCell::new(Store {
            spares: Vec::new(),
            empty: None,
        })
    };
}

/// The `pyop.Tensor` objects a call made for its inputs, given back to this thread's store when
/// dropped (after everything else of the call that referenced them is gone).
#[derive(Default)]
pub(crate) struct Made<'py>(SmallVec<[Bound<'py, PyTensor>; 4]>);

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
        writable: bool,
    ) -> PyResult<Bound<'py, PyTensor>> {
        self.object(
            py,
            Fields {
                view_data: data,
                writable,
                ..Fields::new(tensor)
            },
        )
    }

    fn object(&mut self, py: Python<'py>, fields: Fields) -> PyResult<Bound<'py, PyTensor>> {
        let object = match take(py) {
            Some(spare) => {
                // SAFETY: `take` hands out a spare only with the store's reference its only one,
                // now this function's; no Python code has run since it was counted.
                let _emptied = unsafe { replace(&spare, fields) };
                spare
            }
            None => Bound::new(py, PyTensor::of(fields))?,
        };
        self.0.push(object.clone());
        Ok(object)
    }
}

impl Drop for Made<'_> {
    fn drop(&mut self) {
        for object in self.0.drain(..) {
            give_back(object);
        }
    }
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
        let empty = match &store.empty {
            Some(empty) => empty.clone(),
            None => match Tensor::zeros(0, DType::U8, &Device::Cpu) {
                Ok(empty) => store.empty.insert(empty).clone(),
                Err(_) => return,
            },
        };
        // SAFETY: the reference count read above is one, `object`'s own, and no Python code
        // has run since; `object` is this function's.
        let input = unsafe { replace(&object, Fields::new(empty)) };
        store.spares.push(object.unbind());
        // The input's tensor (and its storage) is let go here, as if the object had been freed.
        drop(input);
    });
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
