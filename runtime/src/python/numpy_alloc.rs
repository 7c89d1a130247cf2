//! NumPy's data allocator, pointed at the allocator candle frees into, so that a fresh array a
//! body returns can become a tensor without a copy.
//!
//! candle's CPU storage is a `Vec<T>`: it frees through Rust's global allocator with
//! `Layout::array::<T>(n)`. A NumPy array's buffer comes from NumPy's allocator (`malloc`), which
//! the global allocator may not be and which does not know that layout, so by default a returned
//! array is copied. NumPy (from 1.22) lets a program replace its data allocator per context
//! (`PyDataMem_SetHandler`, a context variable); pyop installs one in the context of each
//! thread that runs a numpy-mode body, in place of NumPy's default (see [`enter`]). Buffers from [`ADOPT_FROM`] bytes on come from Rust's global allocator,
//! with the alignment of the op's output dtype, and are recorded with their layout; smaller ones,
//! and every buffer NumPy allocated otherwise, go to NumPy's own default allocator (its cache of
//! small buffers included). [`take`] hands a recorded buffer over to a `Vec<T>` when its layout
//! is exactly the one that `Vec` frees with; the conversion layer does the rest (the array must
//! have no other reference; it is left as a read-only view of the tensor).
//!
//! Where NumPy is older than 1.22, or a program installed a data allocator of its own, nothing is
//! installed and returned arrays are copied as before.

use std::alloc::Layout;
use std::cell::Cell;
use std::collections::HashMap;
use std::ffi::{c_char, c_void, CStr};
use std::sync::{LazyLock, Mutex, OnceLock, PoisonError};

use pyo3::ffi;
use pyo3::prelude::*;
use pyo3::sync::PyOnceLock;

/// Buffers from this size on come from Rust's global allocator (and can be adopted); below it a
/// copy costs less than a lock and a hash lookup, and NumPy's small-buffer cache stays in use.
const ADOPT_FROM: usize = 64 << 10;

/// `PyDataMemAllocator` (numpy/ndarraytypes.h, NumPy ≥ 1.22).
#[repr(C)]
#[derive(Clone, Copy)]
struct Allocator {
    ctx: *mut c_void,
    malloc: unsafe extern "C" fn(*mut c_void, usize) -> *mut c_void,
    calloc: unsafe extern "C" fn(*mut c_void, usize, usize) -> *mut c_void,
    realloc: unsafe extern "C" fn(*mut c_void, *mut c_void, usize) -> *mut c_void,
    free: unsafe extern "C" fn(*mut c_void, *mut c_void, usize),
}

// SAFETY: the pointers are NumPy's default allocator functions and its context, which NumPy
// calls from any thread.
unsafe impl Send for Allocator {}
// SAFETY: as above; the struct is never written after it is copied.
unsafe impl Sync for Allocator {}

/// `PyDataMem_Handler`: a name, version 1, the allocator.
#[repr(C)]
struct Handler {
    name: [c_char; 127],
    version: u8,
    allocator: Allocator,
}

/// NumPy's default allocator, to which everything pyop does not allocate itself is passed.
static DEFAULT: OnceLock<Allocator> = OnceLock::new();

/// The buffers pyop's allocator made and NumPy has not freed, with their layouts.
static OWNED: LazyLock<Mutex<HashMap<usize, Layout>>> = LazyLock::new(Default::default);

thread_local! {
    /// The alignment of large buffers NumPy allocates on this thread: the op's output dtype's
    /// while a body runs (a `Vec<T>` frees with `align_of::<T>()`).
    static ALIGN: Cell<usize> = const { Cell::new(16) };
    /// Whether [`enter`] has found pyop's handler in force on this thread (installed it, or found
    /// it there): later calls ask no more.
    static INSTALLED: Cell<bool> = const { Cell::new(false) };
}

fn owned() -> std::sync::MutexGuard<'static, HashMap<usize, Layout>> {
    OWNED.lock().unwrap_or_else(PoisonError::into_inner)
}

fn default() -> &'static Allocator {
    DEFAULT.get().expect("set before the handler is installed")
}

/// A buffer of `size` bytes from the global allocator, recorded; null when it cannot be had.
fn ours(size: usize, zeroed: bool) -> *mut c_void {
    let Ok(layout) = Layout::from_size_align(size, ALIGN.with(Cell::get)) else {
        return std::ptr::null_mut();
    };
    // SAFETY: `size` is at least ADOPT_FROM, so the layout is not zero-sized.
    let ptr = unsafe {
        if zeroed {
            std::alloc::alloc_zeroed(layout)
        } else {
            std::alloc::alloc(layout)
        }
    };
    if !ptr.is_null() {
        crate::alloc::advise_huge_pages(ptr, size);
        owned().insert(ptr as usize, layout);
    }
    ptr.cast()
}

unsafe extern "C" fn pyop_malloc(_: *mut c_void, size: usize) -> *mut c_void {
    if size >= ADOPT_FROM {
        return ours(size, false);
    }
    let d = default();
    // SAFETY: NumPy's default allocator, called as NumPy would.
    unsafe { (d.malloc)(d.ctx, size) }
}

unsafe extern "C" fn pyop_calloc(_: *mut c_void, nelem: usize, elsize: usize) -> *mut c_void {
    match nelem.checked_mul(elsize) {
        None => std::ptr::null_mut(), // NumPy's default does not check the product
        Some(size) if size >= ADOPT_FROM => ours(size, true),
        Some(_) => {
            let d = default();
            // SAFETY: as in `pyop_malloc`.
            unsafe { (d.calloc)(d.ctx, nelem, elsize) }
        }
    }
}

unsafe extern "C" fn pyop_realloc(
    _: *mut c_void,
    ptr: *mut c_void,
    new_size: usize,
) -> *mut c_void {
    let found = owned().remove(&(ptr as usize));
    let Some(layout) = found else {
        let d = default();
        // SAFETY: `ptr` is null or came from the default allocator (every buffer of ours is
        // recorded until freed).
        return unsafe { (d.realloc)(d.ctx, ptr, new_size) };
    };
    let new_size = new_size.max(1);
    if Layout::from_size_align(new_size, layout.align()).is_err() {
        owned().insert(ptr as usize, layout);
        return std::ptr::null_mut();
    }
    // SAFETY: `ptr` came from the global allocator with `layout` (recorded); the new size is
    // non-zero and valid for the alignment (checked above).
    let new = unsafe { std::alloc::realloc(ptr.cast(), layout, new_size) };
    let mut table = owned();
    if new.is_null() {
        table.insert(ptr as usize, layout); // the old buffer is still valid, and still ours
    } else {
        // SAFETY: checked above.
        let layout = unsafe { Layout::from_size_align_unchecked(new_size, layout.align()) };
        table.insert(new as usize, layout);
    }
    new.cast()
}

unsafe extern "C" fn pyop_free(_: *mut c_void, ptr: *mut c_void, size: usize) {
    let found = owned().remove(&(ptr as usize));
    match found {
        // SAFETY: `ptr` came from the global allocator with `layout` and NumPy frees it once.
        Some(layout) => unsafe { std::alloc::dealloc(ptr.cast(), layout) },
        None => {
            let d = default();
            // SAFETY: `ptr` came from the default allocator (or is null).
            unsafe { (d.free)(d.ctx, ptr, size) }
        }
    }
}

/// The NumPy C-API functions this needs (slots 304 and 305 of its `_ARRAY_API` table).
struct Api {
    set_handler: unsafe extern "C" fn(*mut ffi::PyObject) -> *mut ffi::PyObject,
    get_handler: unsafe extern "C" fn() -> *mut ffi::PyObject,
    /// NumPy's default handler capsule, the only one pyop replaces.
    default: Py<PyAny>,
    /// pyop's handler capsule, alive for the rest of the process.
    ours: Py<PyAny>,
}

static API: PyOnceLock<Option<Api>> = PyOnceLock::new();

const CAPSULE: &CStr = c"mem_handler";

/// Reads NumPy's API table and default handler, and makes pyop's; `None` where NumPy cannot take
/// one (older than 1.22) or a handler other than NumPy's default is in place.
fn load(py: Python<'_>) -> PyResult<Option<Api>> {
    use numpy::npyffi::PY_ARRAY_API;
    // SAFETY: a plain query of the loaded NumPy's C-API feature version.
    let feature = unsafe { PY_ARRAY_API.PyArray_GetNDArrayCFeatureVersion(py) };
    if feature < 0x0f {
        return Ok(None); // NPY_1_22_API_VERSION
    }
    let module = py
        .import("numpy._core._multiarray_umath")
        .or_else(|_| py.import("numpy.core._multiarray_umath"))?;
    let table = module.getattr("_ARRAY_API")?;
    // SAFETY: `_ARRAY_API` is NumPy's capsule of its function table, which outlives the
    // process's use of NumPy; slots 304/305 exist from feature version 0x0f on (checked above).
    let (set_handler, get_handler) = unsafe {
        let name = ffi::PyCapsule_GetName(table.as_ptr());
        let api = ffi::PyCapsule_GetPointer(table.as_ptr(), name) as *const *const c_void;
        if api.is_null() {
            return Err(PyErr::fetch(py));
        }
        (
            std::mem::transmute::<
                *const c_void,
                unsafe extern "C" fn(*mut ffi::PyObject) -> *mut ffi::PyObject,
            >(*api.add(304)),
            std::mem::transmute::<*const c_void, unsafe extern "C" fn() -> *mut ffi::PyObject>(
                *api.add(305),
            ),
        )
    };
    // SAFETY: GetHandler returns a new reference to the current handler capsule (or null with an
    // exception set); its pointer is a `PyDataMem_Handler`.
    let current = unsafe { Bound::from_owned_ptr_or_err(py, get_handler())? };
    // SAFETY: as above.
    let handler =
        unsafe { ffi::PyCapsule_GetPointer(current.as_ptr(), CAPSULE.as_ptr()) }.cast::<Handler>();
    if handler.is_null() {
        return Err(PyErr::fetch(py));
    }
    // SAFETY: a valid handler; its name is NUL-terminated within 127 bytes.
    let (name, allocator) = unsafe {
        (
            CStr::from_ptr((*handler).name.as_ptr()).to_bytes(),
            (*handler).allocator,
        )
    };
    if name != b"default_allocator" {
        return Ok(None); // someone else's handler: leave it alone
    }
    DEFAULT.get_or_init(|| allocator);
    let mut name = [0 as c_char; 127];
    for (d, s) in name.iter_mut().zip(b"pyop_allocator") {
        *d = *s as c_char;
    }
    let ours: &'static Handler = Box::leak(Box::new(Handler {
        name,
        version: 1,
        allocator: Allocator {
            ctx: std::ptr::null_mut(),
            malloc: pyop_malloc,
            calloc: pyop_calloc,
            realloc: pyop_realloc,
            free: pyop_free,
        },
    }));
    // SAFETY: a capsule over a leaked, never-freed handler, without a destructor.
    let capsule = unsafe {
        Bound::from_owned_ptr_or_err(
            py,
            ffi::PyCapsule_New(
                (ours as *const Handler).cast_mut().cast(),
                CAPSULE.as_ptr(),
                None,
            ),
        )?
    };
    Ok(Some(Api {
        set_handler,
        get_handler,
        default: current.unbind(),
        ours: capsule.unbind(),
    }))
}

/// Before a numpy-mode body runs on this thread: NumPy's large buffers get `align` (the
/// alignment of the op's output dtype, until the guard drops) and come from pyop's allocator.
///
/// The allocator stays installed in this thread's context after the body (restoring NumPy's
/// default would cost two context-variable sets, 0.2 µs, on every call): NumPy code outside
/// bodies on this thread then gets its large buffers from Rust's global allocator, which is the
/// C `malloc` NumPy uses unless the program sets a `#[global_allocator]`. A handler the program
/// installed itself is never replaced (the body's arrays are then copied). Costs one
/// context-variable lookup per call until pyop's handler is found in force on the thread.
/// Nothing is done before NumPy is loaded: a body that never imports it (a `dlpack` body using torch) does not load it, nor touch one that cannot load.
pub(crate) fn enter(py: Python<'_>, align: usize) -> AlignGuard {
    let guard = AlignGuard(ALIGN.with(|a| a.replace(align)));
    // Once in force on this thread, the handler is not asked for again: if something swapped it
    // back since (a body's own context), large results are copied instead of adopted, never
    // mistaken for pyop's (adoption needs the buffer in pyop's own table).
    if INSTALLED.with(Cell::get) {
        return guard;
    }
    if !matches!(super::numpy::numpy_if_loaded(py), Ok(Some(_))) {
        return guard;
    }
    let Some(api) = API.get_or_init(py, || load(py).ok().flatten()) else {
        return guard;
    };
    // SAFETY: GetHandler returns a new reference (or null with an exception set); SetHandler
    // takes a valid handler capsule and returns a new reference to the previous one.
    unsafe {
        let current = (api.get_handler)();
        if current.is_null() {
            ffi::PyErr_Clear();
            return guard;
        }
        let is_default = current == api.default.as_ptr();
        let is_ours = current == api.ours.as_ptr();
        ffi::Py_DECREF(current);
        if is_default {
            let old = (api.set_handler)(api.ours.as_ptr());
            if old.is_null() {
                ffi::PyErr_Clear();
            } else {
                ffi::Py_DECREF(old);
                INSTALLED.with(|i| i.set(true));
            }
        } else if is_ours {
            INSTALLED.with(|i| i.set(true));
        }
    }
    guard
}

/// Restores the alignment in force before [`enter`], so a body that called another op goes on
/// with its own.
pub(crate) struct AlignGuard(usize);

impl Drop for AlignGuard {
    fn drop(&mut self) {
        ALIGN.with(|a| a.set(self.0));
    }
}

/// Takes the buffer at `ptr` out of NumPy's hands if pyop's allocator made it with exactly
/// `layout`: the caller then owns it (and must make sure NumPy never frees it).
pub(crate) fn take(ptr: usize, layout: Layout) -> bool {
    let mut table = owned();
    match table.get(&ptr) {
        Some(l) if *l == layout => {
            table.remove(&ptr);
            true
        }
        _ => false,
    }
}
