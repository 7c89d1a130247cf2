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
    /// A Python package the op needs (NumPy) cannot be imported.
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
}

/// An error from a pyop op, from [`validate`](crate::validate), or from candle.
///
/// Match on [`kind`](Error::kind) rather than on messages; [`op`](Error::op),
/// [`index`](Error::index) and [`traceback`](Error::traceback) say where it came from.
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
    #[error("{}{exception}: {message}{}", op_prefix(op), fmt_traceback(traceback))]
    Python {
        op: String,
        kind: ErrorKind,
        /// The exception's type name, e.g. `ValueError`.
        exception: String,
        message: String,
        /// The formatted Python traceback, empty if Python gave none.
        traceback: String,
    },

    /// A value the body (or gradient) returned does not match what was declared.
    #[error("{}{what}", op_prefix(op))]
    Mismatch {
        op: String,
        kind: ErrorKind,
        /// The output (or gradient) index, when the mismatch is about one value.
        index: Option<usize>,
        what: String,
    },

    /// A failure of pyop itself or of its environment, with a hint of what to do.
    #[error("{}{message}", op_prefix(op))]
    Op {
        op: String,
        kind: ErrorKind,
        message: String,
    },

    /// An error from candle.
    #[error(transparent)]
    Candle(candle_core::Error),
}

/// "op `name`: ", or nothing for an error that does not come from one op (`validate()`,
/// `gradcheck`, setting up the interpreter).
fn op_prefix(op: &str) -> String {
    if op.is_empty() {
        String::new()
    } else {
        format!("op `{op}`: ")
    }
}

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
                Some(op.as_str()).filter(|op| !op.is_empty())
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

    pub(crate) fn op_failure(op: &str, kind: ErrorKind, message: impl Into<String>) -> Self {
        Error::Op {
            op: op.to_owned(),
            kind,
            message: message.into(),
        }
    }

    pub(crate) fn mismatch(
        op: &str,
        kind: ErrorKind,
        index: Option<usize>,
        what: impl Into<String>,
    ) -> Self {
        Error::Mismatch {
            op: op.to_owned(),
            kind,
            index,
            what: what.into(),
        }
    }

    /// Adds where the op was declared to a load error of a `#[py_op]` op.
    pub(crate) fn at_declaration(mut self, decl: &crate::decl::OpDecl) -> Self {
        let at = format!(
            " (op declared as {} at {}:{})",
            decl.rust_path(),
            decl.file(),
            decl.line()
        );
        match &mut self {
            Error::Python { message: m, .. }
            | Error::Mismatch { what: m, .. }
            | Error::Op { message: m, .. } => m.push_str(&at),
            Error::Candle(_) => {}
        }
        self
    }

    /// Says which op a candle error on its call path came from (a bare `Error::Candle` would
    /// not), keeping candle's message.
    pub(crate) fn in_op(self, name: &str) -> Self {
        match self {
            Error::Candle(e) => {
                Error::op_failure(name, ErrorKind::Candle, crate::tensor::candle_message(&e))
            }
            e => e,
        }
    }

    /// Names the op, if the error was made before the op was known.
    pub(crate) fn with_op_if_empty(self, name: &str) -> Self {
        if self.op().is_none() && !matches!(self, Error::Candle(_)) {
            self.with_op(name)
        } else {
            self
        }
    }

    /// Replaces the op name of an error that was made before the op was known.
    pub(crate) fn with_op(mut self, name: &str) -> Self {
        match &mut self {
            Error::Python { op, .. } | Error::Mismatch { op, .. } | Error::Op { op, .. } => {
                name.clone_into(op)
            }
            Error::Candle(_) => {}
        }
        self
    }
}

/// Returns early with an [`Error::Op`].
macro_rules! bail {
    ($op:expr, $kind:ident, $($fmt:tt)+) => {
        return Err($crate::Error::op_failure($op, $crate::ErrorKind::$kind, format!($($fmt)+)))
    };
}
pub(crate) use bail;

const CANDLE_CONTEXT: &str = "pyop";

impl From<candle_core::Error> for Error {
    /// Unwraps a pyop error that travelled through candle (e.g. out of `backward()`), so its kind
    /// survives the round trip.
    fn from(err: candle_core::Error) -> Self {
        match err {
            candle_core::Error::WrappedContext { wrapped, context }
                if context == CANDLE_CONTEXT =>
            {
                match wrapped.downcast::<Error>() {
                    Ok(e) => *e,
                    Err(wrapped) => {
                        Error::Candle(candle_core::Error::WrappedContext { wrapped, context })
                    }
                }
            }
            candle_core::Error::WithBacktrace { inner, backtrace } => match Error::from(*inner) {
                // A plain candle error keeps its backtrace; a pyop error inside is unwrapped.
                Error::Candle(inner) => Error::Candle(candle_core::Error::WithBacktrace {
                    inner: Box::new(inner),
                    backtrace,
                }),
                e => e,
            },
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
    fn from(err: Error) -> Self {
        match err {
            Error::Candle(e) => e,
            e => candle_core::Error::WrappedContext {
                wrapped: Box::new(e),
                context: CANDLE_CONTEXT.to_owned(),
            },
        }
    }
}
