//! The one error type of pyop.
//!
//! Python exceptions keep the kind TensorFlow gives them (`ValueError` → invalid argument, …) so
//! a caller can match on [`ErrorKind`] without parsing messages; pyop's own failures have kinds of
//! their own. Every variant that comes from an op carries the op's name.

use std::fmt;

/// `Result` with [`Error`].
pub type Result<T, E = Error> = std::result::Result<T, E>;

/// What went wrong, coarsely: the value to `match` on.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum ErrorKind {
    // === Python exceptions, mapped as TensorFlow maps them ===
    /// `ValueError`, `TypeError`.
    InvalidArgument,
    /// `StopIteration`.
    OutOfRange,
    /// `MemoryError`.
    ResourceExhausted,
    /// `NotImplementedError`.
    Unimplemented,
    /// `KeyboardInterrupt`, `SystemExit`.
    Cancelled,
    /// Any other exception.
    Unknown,

    // === pyop's own failures ===
    /// A returned value does not match `tout` (count, dtype, shape or kind of value).
    OutputMismatch,
    /// Inputs on different devices, or a device the op cannot use.
    DeviceMismatch,
    /// The Python interpreter could not be started or set up.
    PythonUnavailable,
    /// A Python package the op needs cannot be imported: NumPy (numpy mode, workers), or Ray in
    /// the program's environment (a Ray pool's relays). The message names the install command.
    PackageUnavailable,
    /// The op's source did not compile, or its module failed to import.
    Source,
    /// The body (or gradient) named by the op does not exist or is not callable.
    MissingFunction,
    /// `backward()` reached an op that has no gradient.
    NoGradient,
    /// A gradient function returned values that do not match the op's inputs.
    GradientMismatch,
    /// The body ran past its time limit.
    Timeout,
    /// Rust code called by the executor panicked.
    Panic,
    /// `validate()` found problems in declared ops.
    Validation,
    /// An error from candle.
    Candle,
    /// A worker process died while running the call (a crash, `os._exit`, a kill from outside),
    /// or a Ray pool's actor or its node was lost during it; the pool replaces it.
    WorkerLost,
    /// A Ray pool's cluster cannot be used: it cannot be reached or joined (Ray's exception and
    /// traceback), an actor cannot be placed or fails as it starts, or its node runs another
    /// Python X.Y, NumPy or Ray than the program. The message names the fix.
    ClusterUnavailable,
}

/// An error from a pyop op, from [`validate`](crate::validate), or from candle.
///
/// Match on [`kind`](Error::kind) rather than on messages; [`op`](Error::op),
/// [`index`](Error::index), [`exception`](Error::exception), [`message`](Error::message),
/// [`traceback`](Error::traceback) and [`candle`](Error::candle) say where it came from and
/// what it was. The variants can be matched (with `..`: they may gain fields) but not built
/// outside pyop.
///
/// ```
/// use pyop::candle::{DType, Device, Tensor};
/// use pyop::{Arg, ErrorKind, OutSpec, PyOp};
///
/// let op = PyOp::builder("checked_log")
///     .code("import numpy as np\ndef checked_log(x):\n    if (x <= 0).any():\n        raise ValueError('log of a non-positive number')\n    return np.log(x)")
///     .numpy()
///     .tout([OutSpec::new(DType::F64)])
///     .build()?;
/// let x = Tensor::new(&[1f64, -1.], &Device::Cpu)?;
/// match op.call(&[Arg::from(&x)]) {
///     Err(e) if e.kind() == ErrorKind::InvalidArgument => {
///         assert_eq!(e.op(), Some("checked_log"));
///         assert!(e.to_string().contains("ValueError: log of a non-positive number"));
///         assert!(e.traceback().unwrap().contains("in checked_log"));
///     }
///     other => panic!("expected a ValueError, got {other:?}"),
/// }
/// # Ok::<(), pyop::Error>(())
/// ```
#[derive(thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// The body raised a Python exception.
    #[non_exhaustive]
    #[error("{}{exception}: {message}{}", op_prefix(op), fmt_traceback(traceback))]
    Python {
        /// The op it comes from; `None` for an error of no one op (`validate()`, set-up).
        op: Option<String>,
        /// What kind of failure, from the exception's builtin base (`ValueError` →
        /// `InvalidArgument`, …).
        kind: ErrorKind,
        /// The exception's type name, e.g. `ValueError`.
        exception: String,
        /// The exception's message (`str(e)`).
        message: String,
        /// The formatted Python traceback, empty if Python gave none.
        traceback: String,
    },

    /// A value the body (or gradient) returned does not match what was declared.
    #[non_exhaustive]
    #[error("{}{what}", op_prefix(op))]
    Mismatch {
        /// The op it comes from.
        op: Option<String>,
        /// What kind of failure (`OutputMismatch`, `GradientMismatch`).
        kind: ErrorKind,
        /// The output (or gradient) index, when the mismatch is about one value.
        index: Option<usize>,
        /// What did not match, in words.
        what: String,
    },

    /// A failure of pyop itself or of its environment, with a hint of what to do.
    #[non_exhaustive]
    #[error("{}{message}", op_prefix(op))]
    Op {
        /// The op it comes from; `None` for an error of no one op.
        op: Option<String>,
        /// What kind of failure.
        kind: ErrorKind,
        /// What went wrong and what to do.
        message: String,
    },

    /// An error from candle.
    #[non_exhaustive]
    #[error(transparent)]
    Candle(candle_core::Error),
}

/// "op `name`: ", or nothing for an error that does not come from one op (`validate()`,
/// `gradcheck`, setting up the interpreter).
fn op_prefix(op: &Option<String>) -> String {
    match op {
        Some(op) => format!("op `{op}`: "),
        None => String::new(),
    }
}

/// What an error's op name can be made from: an op's name, or [`NO_OP`].
pub(crate) trait IntoOpName {
    fn into_op_name(self) -> Option<String>;
}

impl IntoOpName for &str {
    fn into_op_name(self) -> Option<String> {
        Some(self.to_owned())
    }
}

impl IntoOpName for &String {
    fn into_op_name(self) -> Option<String> {
        Some(self.clone())
    }
}

impl IntoOpName for Option<&str> {
    fn into_op_name(self) -> Option<String> {
        self.map(str::to_owned)
    }
}

/// For errors that do not come from one op.
pub(crate) const NO_OP: Option<&str> = None;

fn fmt_traceback(tb: &str) -> String {
    if tb.is_empty() {
        String::new()
    } else {
        format!("\n{}", tb.trim_end())
    }
}

// Debug prints what Display prints (as anyhow does), so `unwrap()` and candle's wrapping show a
// readable message with the traceback rather than a struct dump.
impl fmt::Debug for Error {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        fmt::Display::fmt(self, f)
    }
}

impl Error {
    /// The kind to match on.
    pub fn kind(&self) -> ErrorKind {
        match self {
            Error::Python { kind, .. } | Error::Mismatch { kind, .. } | Error::Op { kind, .. } => {
                *kind
            }
            Error::Candle(_) => ErrorKind::Candle,
        }
    }

    /// The op the error comes from, if it comes from one.
    pub fn op(&self) -> Option<&str> {
        match self {
            Error::Python { op, .. } | Error::Mismatch { op, .. } | Error::Op { op, .. } => {
                op.as_deref()
            }
            Error::Candle(_) => None,
        }
    }

    /// The output or gradient index a mismatch is about.
    pub fn index(&self) -> Option<usize> {
        match self {
            Error::Mismatch { index, .. } => *index,
            _ => None,
        }
    }

    /// The Python traceback, for errors raised in Python.
    pub fn traceback(&self) -> Option<&str> {
        match self {
            Error::Python { traceback, .. } => Some(traceback),
            _ => None,
        }
    }

    /// The Python exception's type name (`ValueError`), for errors raised in Python.
    pub fn exception(&self) -> Option<&str> {
        match self {
            Error::Python { exception, .. } => Some(exception),
            _ => None,
        }
    }

    /// What went wrong, without the op's name or the traceback (the exception's message, what
    /// did not match, pyop's own message, or candle's).
    pub fn message(&self) -> std::borrow::Cow<'_, str> {
        match self {
            Error::Python { message, .. } | Error::Op { message, .. } => message.into(),
            Error::Mismatch { what, .. } => what.into(),
            Error::Candle(e) => e.to_string().into(),
        }
    }

    /// The candle error, for errors from candle.
    pub fn candle(&self) -> Option<&candle_core::Error> {
        match self {
            Error::Candle(e) => Some(e),
            _ => None,
        }
    }

    pub(crate) fn op_failure(
        op: impl IntoOpName,
        kind: ErrorKind,
        message: impl Into<String>,
    ) -> Self {
        Error::Op {
            op: op.into_op_name(),
            kind,
            message: message.into(),
        }
    }

    pub(crate) fn mismatch(
        op: impl IntoOpName,
        kind: ErrorKind,
        index: Option<usize>,
        what: impl Into<String>,
    ) -> Self {
        Error::Mismatch {
            op: op.into_op_name(),
            kind,
            index,
            what: what.into(),
        }
    }

    /// Adds `context` to the message (e.g. where the op was declared).
    pub(crate) fn append_context(mut self, context: &str) -> Self {
        match &mut self {
            Error::Python { message: m, .. }
            | Error::Mismatch { what: m, .. }
            | Error::Op { message: m, .. } => m.push_str(context),
            Error::Candle(_) => {}
        }
        self
    }

    /// The same Python error with another kind and its message rewritten by `message`: how a
    /// load failure becomes [`ErrorKind::Source`] and an interrupted body [`ErrorKind::Timeout`],
    /// keeping the traceback. Other errors are returned as they are.
    pub(crate) fn with_kind(self, kind: ErrorKind, message: impl FnOnce(String) -> String) -> Self {
        match self {
            Error::Python {
                op,
                exception,
                message: m,
                traceback,
                ..
            } => Error::Python {
                op,
                kind,
                exception,
                message: message(m),
                traceback,
            },
            e => e,
        }
    }

    /// Says which op a candle error on its call path came from (a bare `Error::Candle` would
    /// not), keeping candle's message.
    pub(crate) fn in_op(self, name: &str) -> Self {
        match self {
            Error::Candle(e) => Error::op_failure(name, ErrorKind::Candle, candle_message(&e)),
            e => e,
        }
    }

    /// This error as each caller of a batch gets it (`Batch`): the same kind, exception and
    /// message, which says the body ran on a batch of `calls` calls.
    pub(crate) fn of_batch(&self, op: &str, calls: usize) -> Self {
        let note = format!(" (the body ran on a batch of {calls} calls)");
        match self {
            Error::Python {
                op,
                kind,
                exception,
                message,
                traceback,
            } => Error::Python {
                op: op.clone(),
                kind: *kind,
                exception: exception.clone(),
                message: format!("{message}{note}"),
                traceback: traceback.clone(),
            },
            Error::Mismatch {
                op,
                kind,
                index,
                what,
            } => Error::Mismatch {
                op: op.clone(),
                kind: *kind,
                index: *index,
                what: format!("{what}{note}"),
            },
            Error::Op { op, kind, message } => Error::Op {
                op: op.clone(),
                kind: *kind,
                message: format!("{message}{note}"),
            },
            Error::Candle(e) => Error::op_failure(
                op,
                ErrorKind::Candle,
                format!("{}{note}", candle_message(e)),
            ),
        }
    }

    /// Names the op, if the error was made before the op was known.
    pub(crate) fn with_op_if_none(self, name: &str) -> Self {
        if self.op().is_none() && !matches!(self, Error::Candle(_)) {
            self.with_op(Some(name))
        } else {
            self
        }
    }

    /// Replaces the op name (`None`: an error of no one op).
    pub(crate) fn with_op(mut self, name: Option<&str>) -> Self {
        match &mut self {
            Error::Python { op, .. } | Error::Mismatch { op, .. } | Error::Op { op, .. } => {
                *op = name.map(str::to_owned)
            }
            Error::Candle(_) => {}
        }
        self
    }
}

/// candle's message without the Rust backtrace it carries when `RUST_BACKTRACE` is set: the
/// Python traceback says where the body was.
pub(crate) fn candle_message(e: &candle_core::Error) -> String {
    match e {
        candle_core::Error::WithBacktrace { inner, .. } => candle_message(inner),
        e => e.to_string(),
    }
}

/// The message of a caught panic.
pub(crate) fn panic_message(panic: &(dyn std::any::Any + Send)) -> String {
    panic
        .downcast_ref::<&str>()
        .map(|s| (*s).to_owned())
        .or_else(|| panic.downcast_ref::<String>().cloned())
        .unwrap_or_else(|| "a panic with a non-string payload".to_owned())
}

/// Returns early with an [`Error::Op`].
macro_rules! bail {
    ($op:expr, $kind:ident, $($fmt:tt)+) => {
        return Err($crate::Error::op_failure($op, $crate::ErrorKind::$kind, format!($($fmt)+)))
    };
}
pub(crate) use bail;

/// A pyop error inside candle's `Error::Wrapped`, whose text is the error's own
/// (`WrappedContext`, the one candle variant that can be downcast, shows its payload's `Debug`
/// and adds a context line). A `Wrapped` holds only a `dyn Display`, which cannot be downcast, so
/// the conversion back asks the value itself: it formats the value while [`PROBE`] names the
/// value's address, and a `Carried` at that address hands its error over through [`PROBE`].
/// Nothing is cast and nothing is trusted by address: a user's value at any address only gets
/// formatted (into a sink that refuses every byte), and a `Carried` elsewhere that it forwards to
/// keeps its error (its own address is not the one asked for).
struct Carried(std::sync::Mutex<Option<Error>>);

/// What a conversion back asks: the address of the value being probed, and the error a `Carried`
/// at that address handed over.
struct Probe {
    at: std::cell::Cell<usize>,
    taken: std::cell::RefCell<Option<Error>>,
}

thread_local! {
    static PROBE: Probe = const {
        Probe { at: std::cell::Cell::new(0), taken: std::cell::RefCell::new(None) }
    };
}

impl Carried {
    fn error(&self) -> std::sync::MutexGuard<'_, Option<Error>> {
        self.0.lock().unwrap_or_else(|e| e.into_inner())
    }
}

impl fmt::Display for Carried {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let asked = PROBE
            .try_with(|p| p.at.get() == self as *const Carried as usize)
            .unwrap_or(false);
        if asked {
            // The value being converted back is this one: hand its error over, write nothing.
            let taken = self.error().take();
            let _ = PROBE.try_with(|p| {
                p.at.set(0);
                *p.taken.borrow_mut() = taken;
            });
            return Ok(());
        }
        match &*self.error() {
            Some(e) => fmt::Display::fmt(e, f),
            None => Ok(()),
        }
    }
}

/// A `fmt::Write` that takes nothing: a probed value's text is never needed, so formatting stops
/// at its first write.
struct Refuse;

impl fmt::Write for Refuse {
    fn write_str(&mut self, _: &str) -> fmt::Result {
        Err(fmt::Error)
    }
}

/// The pyop error `wrapped` carries, if it is a [`Carried`]; else `wrapped` back.
fn uncarry(
    wrapped: Box<dyn fmt::Display + Send + Sync>,
) -> std::result::Result<Error, Box<dyn fmt::Display + Send + Sync>> {
    let at = &*wrapped as *const (dyn fmt::Display + Send + Sync) as *const () as usize;
    /// Puts the outer probe back (a probe inside a probe: a user's `Display` converting another
    /// error), also when the probed `Display` panics (a caught panic must not leave this address
    /// asked for, or an error handed over, to a later probe on this thread).
    struct Restore<'a>(&'a Probe, usize);
    impl Drop for Restore<'_> {
        fn drop(&mut self) {
            self.0.at.set(self.1);
            self.0.taken.borrow_mut().take();
        }
    }
    let asked = PROBE.try_with(|p| {
        p.taken.borrow_mut().take();
        let restore = Restore(p, p.at.replace(at));
        let _ = fmt::write(&mut Refuse, format_args!("{wrapped}"));
        let taken = p.taken.borrow_mut().take();
        drop(restore);
        taken
    });
    match asked {
        Ok(Some(e)) => Ok(e),
        // Not a `Carried`, or this thread's storage is gone (a thread-local destructor): the
        // error stays candle's, with the same text.
        _ => Err(wrapped),
    }
}

impl From<candle_core::Error> for Error {
    /// Unwraps a pyop error that travelled through candle (e.g. out of `backward()`), so its kind
    /// survives the round trip.
    fn from(err: candle_core::Error) -> Self {
        match err {
            candle_core::Error::Wrapped(wrapped) => match uncarry(wrapped) {
                Ok(e) => e,
                Err(wrapped) => Error::Candle(candle_core::Error::Wrapped(wrapped)),
            },
            candle_core::Error::WithBacktrace { inner, backtrace } => match Error::from(*inner) {
                // A plain candle error keeps its backtrace; a pyop error inside is unwrapped.
                Error::Candle(inner) => Error::Candle(candle_core::Error::WithBacktrace {
                    inner: Box::new(inner),
                    backtrace,
                }),
                e => e,
            },
            candle_core::Error::WithPath { inner, path } => match Error::from(*inner) {
                Error::Candle(inner) => Error::Candle(candle_core::Error::WithPath {
                    inner: Box::new(inner),
                    path,
                }),
                e => e,
            },
            // candle's `Context` trait on a `Result<_, pyop::Error>`.
            candle_core::Error::WrappedContext { wrapped, context } => {
                match wrapped.downcast::<Error>() {
                    Ok(e) => *e,
                    Err(wrapped) => {
                        Error::Candle(candle_core::Error::WrappedContext { wrapped, context })
                    }
                }
            }
            candle_core::Error::Context { inner, context } => match Error::from(*inner) {
                Error::Candle(inner) => Error::Candle(candle_core::Error::Context {
                    inner: Box::new(inner),
                    context,
                }),
                e => e,
            },
            e => Error::Candle(e),
        }
    }
}

impl From<Error> for candle_core::Error {
    /// A pyop error as candle's `Error::Wrapped`: its text unchanged, and the error itself back
    /// (kind, op, traceback) when converted to [`Error`] again.
    fn from(err: Error) -> Self {
        match err {
            Error::Candle(e) => e,
            e => candle_core::Error::Wrapped(Box::new(Carried(std::sync::Mutex::new(Some(e))))),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::{Error, ErrorKind};

    /// Through candle and back: the text unchanged (no context line), the error itself back.
    #[test]
    fn a_pyop_error_crosses_candle_whole() {
        let e = Error::mismatch("op_a", ErrorKind::OutputMismatch, Some(1), "wrong");
        let text = e.to_string();
        let c = candle_core::Error::from(e);
        assert_eq!(c.to_string(), text);
        let back = Error::from(c);
        assert_eq!(back.kind(), ErrorKind::OutputMismatch);
        assert_eq!((back.op(), back.index()), (Some("op_a"), Some(1)));
        // With candle's context and backtrace around it, too.
        let e = Error::op_failure("op_b", ErrorKind::Timeout, "late");
        let c = candle_core::Error::from(e).bt();
        assert_eq!(Error::from(c).kind(), ErrorKind::Timeout);
        // A candle error that is not one stays candle's, and dropping a carried one forgets it.
        let plain = Error::from(candle_core::Error::Wrapped(Box::new("not pyop")));
        assert_eq!(plain.kind(), ErrorKind::Candle);
        assert_eq!(plain.to_string(), "not pyop");
        // Kinds survive candle's path and context wrappers too.
        let with_path =
            candle_core::Error::from(Error::op_failure("op_d", ErrorKind::Timeout, "late"))
                .with_path("/x");
        assert_eq!(Error::from(with_path).kind(), ErrorKind::Timeout);
        let wrapped = candle_core::Error::WrappedContext {
            wrapped: Box::new(Error::op_failure("op_e", ErrorKind::Source, "s")),
            context: "loading".into(),
        };
        assert_eq!(Error::from(wrapped).kind(), ErrorKind::Source);
    }

    /// The third audit's finding 1: a carried error moved out of its box (`Arc::from` frees the
    /// box without dropping the value) and a user's value allocated at the freed address. The
    /// user's value must stay the user's: its `Drop` runs, and it converts as a candle error.
    #[test]
    fn a_value_at_a_freed_carried_address_stays_the_users() {
        use std::fmt;
        use std::sync::atomic::{AtomicUsize, Ordering};
        use std::sync::Arc;

        static USER_DROPS: AtomicUsize = AtomicUsize::new(0);
        // The layout of a `Carried`, so that the allocator gives it the freed box's memory.
        struct UserWrapper(#[allow(dead_code)] std::sync::Mutex<Option<Error>>);
        impl fmt::Display for UserWrapper {
            fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str("a user's own wrapper")
            }
        }
        impl Drop for UserWrapper {
            fn drop(&mut self) {
                USER_DROPS.fetch_add(1, Ordering::SeqCst);
            }
        }

        let mut recycled = 0;
        for _ in 0..64 {
            let e = Error::op_failure("op_a", ErrorKind::Source, "inner");
            let candle_core::Error::Wrapped(boxed) = candle_core::Error::from(e) else {
                panic!("a pyop error crosses candle as `Wrapped`");
            };
            let old = &*boxed as *const _ as *const () as usize;
            // The value moves into the Arc; the box's memory is freed without its `Drop`.
            let moved: Arc<dyn fmt::Display + Send + Sync> = Arc::from(boxed);
            let fake: Box<dyn fmt::Display + Send + Sync> = Box::new(UserWrapper(
                std::sync::Mutex::new(Some(Error::op_failure("op_b", ErrorKind::Timeout, "other"))),
            ));
            recycled += usize::from(&*fake as *const _ as *const () as usize == old);
            let drops = USER_DROPS.load(Ordering::SeqCst);
            let back = Error::from(candle_core::Error::Wrapped(fake));
            assert_eq!(back.kind(), ErrorKind::Candle);
            assert_eq!(back.to_string(), "a user's own wrapper");
            drop(back);
            assert_eq!(USER_DROPS.load(Ordering::SeqCst), drops + 1);
            // The moved error still shows its text (it is never recovered from the Arc).
            assert!(moved.to_string().contains("inner"), "{moved}");
        }
        // The allocator reused the address at least once, or the test proved nothing.
        assert!(recycled > 0, "no freed address was reused");
    }

    /// A user's value that shows a carried error by forwarding to it is not that error: the
    /// carried one keeps its error and its text.
    #[test]
    fn a_forwarding_value_is_not_the_carried_error() {
        use std::fmt;
        use std::sync::Arc;

        struct Forward(Arc<dyn fmt::Display + Send + Sync>);
        impl fmt::Display for Forward {
            fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                self.0.fmt(f)
            }
        }
        let candle_core::Error::Wrapped(boxed) =
            candle_core::Error::from(Error::op_failure("op_f", ErrorKind::Source, "kept"))
        else {
            panic!("a pyop error crosses candle as `Wrapped`");
        };
        let shared: Arc<dyn fmt::Display + Send + Sync> = Arc::from(boxed);
        let back = Error::from(candle_core::Error::Wrapped(Box::new(Forward(
            shared.clone(),
        ))));
        assert_eq!(back.kind(), ErrorKind::Candle);
        assert!(back.to_string().contains("kept"), "{back}");
        assert!(shared.to_string().contains("kept"), "{shared}");
    }

    /// A user's `Display` that panics while probed (the panic caught) leaves no probe behind: a
    /// carried error made later at the same address still shows its text, and converts back.
    #[test]
    fn a_panicking_probe_leaves_nothing_behind() {
        use std::fmt;

        // The layout of a `Carried`, so that the allocator gives the next one its memory.
        struct Panics(#[allow(dead_code)] std::sync::Mutex<Option<Error>>);
        impl fmt::Display for Panics {
            fn fmt(&self, _: &mut fmt::Formatter<'_>) -> fmt::Result {
                panic!("a user's Display panicked")
            }
        }
        let mut reused = 0;
        for _ in 0..16 {
            let boxed: Box<dyn fmt::Display + Send + Sync> =
                Box::new(Panics(std::sync::Mutex::new(None)));
            let at = &*boxed as *const _ as *const () as usize;
            let caught = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
                Error::from(candle_core::Error::Wrapped(boxed))
            }));
            assert!(caught.is_err());
            let c = candle_core::Error::from(Error::op_failure("op_p", ErrorKind::Source, "shown"));
            if let candle_core::Error::Wrapped(w) = &c {
                reused += usize::from(&**w as *const _ as *const () as usize == at);
            }
            assert!(c.to_string().contains("shown"), "{c}");
            assert_eq!(Error::from(c).kind(), ErrorKind::Source);
        }
        assert!(reused > 0, "no freed address was reused");
    }
}
