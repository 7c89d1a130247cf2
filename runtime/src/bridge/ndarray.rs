//! NumPy's array object as NumPy 1.22 and later lay it out, and the parts of a numpy-mode input
//! view (`view::numpy_view`: the array, its hidden root, the `pyop.Tensor` under them) read and
//! written through it, for the thread's spare views (`tensor::spare`): whether nothing but one
//! reference reaches them (`view_parts`), and the writes that refill and empty them.

use std::ffi::c_void;

use numpy::npyffi::{self, npy_intp, PY_ARRAY_API};
use pyo3::prelude::*;

use super::prepare::Prepared;
use super::tensor::PyTensor;

/// NumPy's array object as NumPy 1.22 and later lay it out: the fields rust-numpy declares (up
/// to `weakreflist`), then `_buffer_info` (NumPy 1.20: the formats and shapes the array handed
/// out through the buffer protocol, kept until it is freed; null until then) and `mem_handler`
/// (1.22).
#[repr(C)]
struct ArrayObject {
    array: npyffi::PyArrayObject,
    buffer_info: *mut c_void,
    mem_handler: *mut pyo3::ffi::PyObject,
}

/// Whether input views are kept and refilled (`spare`): with NumPy 1.22 or later, whose arrays
/// are laid out as [`ArrayObject`], and not on a CPython built with `--with-trace-refs`, whose
/// `sys.getobjects()` lists every object, untracked arrays too, so a kept view could be reached.
pub(crate) fn spare_views(py: Python<'_>) -> bool {
    use pyo3::sync::PyOnceLock;
    static LAYOUT: PyOnceLock<bool> = PyOnceLock::new();
    *LAYOUT.get_or_init(py, || {
        let lists_every_object = py
            .import("sys")
            .and_then(|sys| sys.hasattr("getobjects"))
            .unwrap_or(true);
        // SAFETY: a plain query of the loaded NumPy's C-API feature version (NumPy is loaded:
        // the caller makes arrays).
        let layout = unsafe { PY_ARRAY_API.PyArray_GetNDArrayCFeatureVersion(py) } >= 0x0f; // NPY_1_22_API_VERSION
        layout && !lists_every_object
    })
}

/// The type objects of NumPy's ndarray and of `pyop.Tensor`, looked up once (both live as long as
/// the process: a static type of NumPy's, pyo3's type object for the class): the pointer compares
/// of [`view_parts`] and [`unchanged_view`](crate::bridge::view::unchanged_view), a few loads
/// instead of two lookups each call.
pub(crate) fn types(
    py: Python<'_>,
) -> (*mut pyo3::ffi::PyTypeObject, *mut pyo3::ffi::PyTypeObject) {
    use pyo3::type_object::PyTypeInfo;
    let &(ndarray, tensor) = TYPES.get_or_init(py, || {
        // SAFETY: NumPy is loaded (the callers read arrays); its ndarray type object.
        let ndarray = unsafe { npyffi::get_type_object(py, npyffi::NpyTypes::PyArray_Type) };
        (ndarray as usize, PyTensor::type_object_raw(py) as usize)
    });
    (ndarray as *mut _, tensor as *mut _)
}

static TYPES: pyo3::sync::PyOnceLock<(usize, usize)> = pyo3::sync::PyOnceLock::new();

/// Whether [`types`] has been asked once already (so asking again loads nothing: NumPy's C API
/// is loaded the first time).
#[inline]
pub(crate) fn types_known(py: Python<'_>) -> bool {
    TYPES.get(py).is_some()
}

/// The parts of an input view as [`numpy_view`](crate::bridge::view::numpy_view) makes it: the array handed to the body, its
/// hidden root, and the `pyop.Tensor` under both.
pub(crate) struct ViewParts<'a, 'py> {
    py: Python<'py>,
    view: *mut ArrayObject,
    root: *mut ArrayObject,
    base: *mut pyo3::ffi::PyObject,
    /// The view they were read from, which keeps them alive.
    _view: std::marker::PhantomData<&'a Bound<'py, PyAny>>,
}

/// `view`'s parts, if it is an input view as [`numpy_view`](crate::bridge::view::numpy_view) made it and nothing but the caller's
/// one reference can reach any part of it: the view an exact ndarray whose only reference is the
/// caller's, its base the root (an exact ndarray whose only reference is the view's), the root's
/// base an exact `pyop.Tensor` whose only reference is the root's; no weak reference to either
/// array (`weakreflist`), no buffer handed out by either (`_buffer_info`: NumPy keeps the
/// buffer's description, shape and all, until the array is freed), neither writable nor owning
/// its data (`__setstate__` gives an array data of its own), both of the same data, dtype and
/// rank. NumPy arrays are not tracked by the garbage collector, and a `pyop.Tensor` holds no
/// reference to an array, so nothing else leads to them.
///
/// # Safety
/// The GIL is held (`view` proves it) and the loaded NumPy lays arrays out as [`ArrayObject`]
/// ([`spare_views`]). The parts may be written, through [`ViewParts::refill`] and [`ViewParts::empty`], until the
/// caller lets go of `view` or runs Python code.
pub(crate) unsafe fn view_parts<'a, 'py>(
    py: Python<'py>,
    view: &'a Bound<'py, PyAny>,
) -> Option<ViewParts<'a, 'py>> {
    use pyo3::ffi::{Py_REFCNT, Py_TYPE};
    let (ndarray, tensor) = types(py);
    let sole = |obj: *mut pyo3::ffi::PyObject, ty: *mut pyo3::ffi::PyTypeObject| {
        // SAFETY: reading the type and count of a live object (non-null checked first).
        !obj.is_null() && unsafe { Py_TYPE(obj) == ty && Py_REFCNT(obj) == 1 }
    };
    let hidden = |a: &ArrayObject| {
        let f = &a.array.fields;
        let refused = npyffi::NPY_ARRAY_OWNDATA
            | npyffi::NPY_ARRAY_WRITEABLE
            | npyffi::NPY_ARRAY_WRITEBACKIFCOPY;
        f.weakreflist.is_null() && a.buffer_info.is_null() && f.flags & refused == 0
    };
    if !sole(view.as_ptr(), ndarray) {
        return None;
    }
    let view = view.as_ptr().cast::<ArrayObject>();
    // SAFETY: `view` is an exact ndarray laid out as `ArrayObject` (the contract), alive while
    // the caller holds it; so is its base, checked to be one, and the root's base while the root
    // is. Fields are only read here.
    unsafe {
        let root = (*view).array.fields.base;
        if !sole(root, ndarray) {
            return None;
        }
        let root = root.cast::<ArrayObject>();
        let base = (*root).array.fields.base;
        let (v, r) = (&*view, &*root);
        if !sole(base, tensor)
            || !hidden(v)
            || !hidden(r)
            || v.array.fields.data != r.array.fields.data
            || v.array.fields.descr != r.array.fields.descr
            || v.array.fields.nd != r.array.fields.nd
        {
            return None;
        }
        Some(ViewParts {
            py,
            view,
            root,
            base,
            _view: std::marker::PhantomData,
        })
    }
}

/// The parts of a view this thread's store kept (`tensor::spare`) for inputs of rank `nd`, if
/// nothing but the caller's one reference reaches any of them: [`view_parts`]' counts of one
/// along the chain, its rank and no weak reference on either array, and nothing more. Its other
/// conditions held when the view was kept and cannot have changed since: the store's reference
/// was the view's only one, NumPy arrays are not tracked by the garbage collector and the base
/// holds no reference to an array, so nothing reached either array (no new reference, weak
/// reference, buffer, flag or field). Only the base can have been found (`gc.get_objects()`) and
/// held, which its count shows. (A CPython whose `sys.getobjects()` reaches untracked objects
/// keeps no views: [`spare_views`]. The few loads for the links, ranks and weak references are
/// kept anyway, so that an array reached all the same is let go rather than written out of
/// bounds.)
///
/// # Safety
/// As for [`view_parts`], and `view` is a view [`view_parts`] accepted when the store kept it,
/// held since by the store alone (its reference now the caller's).
#[inline(always)]
pub(crate) unsafe fn kept_parts<'a, 'py>(
    py: Python<'py>,
    view: &'a Bound<'py, PyAny>,
    nd: usize,
) -> Option<ViewParts<'a, 'py>> {
    use pyo3::ffi::Py_REFCNT;
    let view = view.as_ptr().cast::<ArrayObject>();
    // SAFETY: the view is alive while the caller holds it; so is its base, checked non-null, and
    // the root's base while the root is. Fields and counts are only read.
    unsafe {
        let root = (*view).array.fields.base.cast::<ArrayObject>();
        if root.is_null() {
            return None;
        }
        let base = (*root).array.fields.base;
        let (v, r) = (&(*view).array.fields, &(*root).array.fields);
        let sole = !base.is_null()
            && Py_REFCNT(view.cast()) == 1
            && Py_REFCNT(root.cast()) == 1
            && Py_REFCNT(base) == 1
            && v.nd as usize == nd
            && r.nd as usize == nd
            && v.weakreflist.is_null()
            && r.weakreflist.is_null();
        sole.then_some(ViewParts {
            py,
            view,
            root,
            base,
            _view: std::marker::PhantomData,
        })
    }
}

/// An array's shape and strides (in bytes), its own `nd` entries of each (none for rank 0, whose
/// pointers may be null).
///
/// # Safety
/// `f` points to a live array's fields; the slices are only read, and only while nothing writes
/// the array's shape and strides.
#[inline(always)]
pub(crate) unsafe fn dims_and_strides<'a>(
    f: *const npyffi::PyArrayObject_fields,
) -> (&'a [npy_intp], &'a [npy_intp]) {
    // SAFETY: per the contract; a live array's `dimensions` and `strides` hold `nd` entries each.
    unsafe {
        let nd = (*f).nd as usize;
        if nd == 0 {
            return (&[], &[]);
        }
        (
            std::slice::from_raw_parts((*f).dimensions, nd),
            std::slice::from_raw_parts((*f).strides, nd),
        )
    }
}

/// NumPy's contiguity and alignment flags for one layout, as `PyArray_UpdateFlags` last computed
/// them on this thread (`tensor::spare` keeps one): the flags are a function of the dtype, the
/// shape, the strides and the data address modulo the dtype's alignment (a power of two, at most
/// 64 here), so the same layout gets them again without asking NumPy (~90 instructions of a
/// numpy-mode scalar call).
#[derive(Clone, Copy)]
pub(crate) struct FlagsMemo {
    descr: *mut npyffi::PyArray_Descr,
    nd: usize,
    dims: [npy_intp; MEMO_RANK],
    strides: [npy_intp; MEMO_RANK],
    /// The data address modulo 64.
    offset: usize,
    flags: std::ffi::c_int,
}

/// The highest rank [`FlagsMemo`] remembers.
const MEMO_RANK: usize = 4;

impl<'py> ViewParts<'_, 'py> {
    /// The `pyop.Tensor` under the arrays.
    pub(crate) fn base(&self) -> Borrowed<'_, 'py, PyTensor> {
        // SAFETY: the root's base, checked to be an exact `pyop.Tensor`, alive while the view is,
        // which `self` borrows (see `view_parts`).
        unsafe { Borrowed::from_ptr(self.py, self.base).cast_unchecked::<PyTensor>() }
    }

    /// The rank and dtype object of both arrays.
    pub(crate) fn kind(&self) -> (usize, *mut npyffi::PyArray_Descr) {
        // SAFETY: the arrays are alive while the view is, which `self` borrows.
        let f = unsafe { &(*self.view).array.fields };
        (f.nd as usize, f.descr)
    }

    /// Points both arrays at `p`'s memory, with its shape and strides, flags as NumPy gives a new
    /// read-only array over it (contiguity and alignment, computed by NumPy itself). The base is
    /// the caller's to refill.
    ///
    /// # Safety
    /// As for [`view_parts`], which gave these parts, with no Python code run since; `p`'s
    /// tensor has the parts' rank and dtype ([`Self::kind`]), and the base holds it before the
    /// view is handed out.
    pub(crate) unsafe fn refill(&self, p: &Prepared, memo: &mut Option<FlagsMemo>) {
        let t = &p.tensor;
        let size = t.dtype().size_in_bytes() as npy_intp;
        for a in [self.root, self.view] {
            // SAFETY: no one else can reach the arrays (the contract); `dimensions` and
            // `strides` hold `nd` entries each, and `nd` is the tensor's rank.
            unsafe {
                let f = &mut (*a).array.fields;
                f.data = p.data as *mut _;
                for (i, (&d, &s)) in t.dims().iter().zip(t.stride()).enumerate() {
                    *f.dimensions.add(i) = d as npy_intp;
                    *f.strides.add(i) = s as npy_intp * size;
                }
            }
        }
        // Written through the raw pointers only (NumPy writes the root's flags too).
        let root = self.root;
        // SAFETY: as above (the arrays are the caller's alone, of the tensor's rank); read only
        // (by NumPy too) while the slices live.
        let (descr, (dims, strides)) = unsafe {
            let f = &raw const (*root).array.fields;
            ((*f).descr, dims_and_strides(f))
        };
        let offset = p.data % 64;
        let flags = match memo {
            // The memo's flags are the ones NumPy computed for this very dtype, shape, strides
            // and data offset.
            Some(m) if m.is_of(descr, dims, strides, offset) => m.flags,
            _ => {
                // SAFETY: as above; `UpdateFlags` reads the root's data, shape, strides and
                // dtype, which are its own, and sets the contiguity and alignment flags from
                // them.
                let flags = unsafe {
                    (*root).array.fields.flags = 0;
                    PY_ARRAY_API.PyArray_UpdateFlags(
                        self.py,
                        root.cast(),
                        npyffi::NPY_ARRAY_C_CONTIGUOUS
                            | npyffi::NPY_ARRAY_F_CONTIGUOUS
                            | npyffi::NPY_ARRAY_ALIGNED,
                    );
                    (*root).array.fields.flags
                };
                *memo = FlagsMemo::of(descr, dims, strides, offset, flags);
                flags
            }
        };
        // The view has the same data and layout, so the same flags.
        // SAFETY: as above.
        unsafe {
            (*root).array.fields.flags = flags;
            (*self.view).array.fields.flags = flags;
        }
    }

    /// Makes both arrays empty (every dimension 0) over no one's memory, for a view kept as a
    /// spare after its data is let go. The base is the caller's to empty.
    ///
    /// # Safety
    /// As for [`view_parts`], which gave these parts, with no Python code run since.
    pub(crate) unsafe fn empty(&self) {
        static NOWHERE: [u64; 2] = [0; 2];
        for a in [self.root, self.view] {
            // SAFETY: as in `refill`.
            unsafe {
                let f = &mut (*a).array.fields;
                f.data = NOWHERE.as_ptr() as *mut _;
                for i in 0..f.nd as usize {
                    *f.dimensions.add(i) = 0;
                }
            }
        }
    }
}

impl FlagsMemo {
    /// The memo of `flags` for this layout, if its rank is one kept.
    fn of(
        descr: *mut npyffi::PyArray_Descr,
        dims: &[npy_intp],
        strides: &[npy_intp],
        offset: usize,
        flags: std::ffi::c_int,
    ) -> Option<Self> {
        let nd = dims.len();
        (nd <= MEMO_RANK).then(|| {
            let mut memo = FlagsMemo {
                descr,
                nd,
                dims: [0; MEMO_RANK],
                strides: [0; MEMO_RANK],
                offset,
                flags,
            };
            memo.dims[..nd].copy_from_slice(dims);
            memo.strides[..nd].copy_from_slice(strides);
            memo
        })
    }

    /// Whether this is the memo of that dtype and layout, data at the same offset modulo 64.
    #[inline(always)]
    fn is_of(
        &self,
        descr: *mut npyffi::PyArray_Descr,
        dims: &[npy_intp],
        strides: &[npy_intp],
        offset: usize,
    ) -> bool {
        // An element loop: the slices' `==` is a `memcmp` call for a handful of entries.
        self.descr == descr
            && self.nd == dims.len()
            && self.offset == offset
            && dims
                .iter()
                .zip(strides)
                .zip(self.dims.iter().zip(&self.strides))
                .all(|(a, b)| a == b)
    }
}
