//! What an op declares: its mode and its outputs (`tout`).

use std::borrow::Cow;
use std::fmt;

use candle_core::DType;

/// How a body sees its tensor inputs.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum Mode {
    /// The `tf.py_function` analogue: inputs are `pyop.Tensor`s wrapping the candle tensors
    /// themselves; the body runs candle ops and autograd records them.
    Tensor,
    /// The `tf.numpy_function` analogue: inputs are read-only NumPy views of the candle storage.
    Numpy,
}

impl Mode {
    /// `"tensor"` or `"numpy"`.
    pub fn as_str(self) -> &'static str {
        match self {
            Mode::Tensor => "tensor",
            Mode::Numpy => "numpy",
        }
    }
}

impl fmt::Display for Mode {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// One declared output: a dtype and, optionally, a shape whose `None` entries match any size.
/// Made with [`OutSpec::new`], [`OutSpec::with_shape`], [`OutSpec::shaped`] or [`OutSpec::like`];
/// [`OutSpec::with_dtype_of`] makes its dtype a tensor argument's, so one declaration serves
/// every dtype (`tout = x.dtype`, `like(x)`).
#[derive(Clone, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub struct OutSpec {
    /// The output's dtype.
    pub dtype: DType,
    /// The output's shape, if declared (`None` entries match any size).
    pub shape: Option<Cow<'static, [Option<usize>]>>,
    /// The output has the shape of the argument at this index (`tout = f32[x]`).
    pub like: Option<usize>,
    /// The output has the dtype of the tensor argument at this index (`tout = x.dtype`), known
    /// at call time; `dtype` is then only a placeholder.
    pub dtype_of: Option<usize>,
}

impl OutSpec {
    /// An output of `dtype` with any shape.
    pub const fn new(dtype: DType) -> Self {
        Self {
            dtype,
            shape: None,
            like: None,
            dtype_of: None,
        }
    }

    /// An output of `dtype` with the shape of the tensor argument at `arg_index` (counting every
    /// argument passed to Python, in declaration order).
    pub const fn like(dtype: DType, arg_index: usize) -> Self {
        Self {
            dtype,
            shape: None,
            like: Some(arg_index),
            dtype_of: None,
        }
    }

    /// An output of `dtype` whose shape must match `shape` (`None` = any size).
    pub const fn with_shape(dtype: DType, shape: &'static [Option<usize>]) -> Self {
        Self {
            dtype,
            shape: Some(Cow::Borrowed(shape)),
            like: None,
            dtype_of: None,
        }
    }

    /// An output of `dtype` whose shape must match `shape`, built at run time.
    pub fn shaped(dtype: DType, shape: impl Into<Vec<Option<usize>>>) -> Self {
        Self {
            dtype,
            shape: Some(Cow::Owned(shape.into())),
            like: None,
            dtype_of: None,
        }
    }

    /// The same output with the dtype of the tensor argument at `arg_index` (counting every
    /// argument passed to Python), whatever it is on a call: `OutSpec::new(DType::F32)
    /// .with_dtype_of(0)` is `tout = x.dtype`, `OutSpec::like(DType::F32, 0).with_dtype_of(0)` is
    /// `like(x)`. The dtype given first is only a placeholder.
    pub fn with_dtype_of(self, arg_index: usize) -> Self {
        Self {
            dtype_of: Some(arg_index),
            ..self
        }
    }

    /// An output with the dtype and the shape of the tensor argument at `arg_index` (`tout =
    /// like(x)`).
    pub const fn same_as(arg_index: usize) -> Self {
        Self::__dtype_of(arg_index, Some(arg_index), None)
    }

    /// What `#[py_op]` writes for `tout = x.dtype…` in a `static`; not a public API.
    #[doc(hidden)]
    pub const fn __dtype_of(
        arg_index: usize,
        like: Option<usize>,
        shape: Option<&'static [Option<usize>]>,
    ) -> Self {
        Self {
            dtype: DType::F32,
            shape: match shape {
                Some(s) => Some(Cow::Borrowed(s)),
                None => None,
            },
            like,
            dtype_of: Some(arg_index),
        }
    }

    /// The declared outputs with every `dtype_of` made concrete from this call's arguments
    /// (borrowed as they are when no output takes an argument's dtype).
    #[inline]
    pub(crate) fn resolve<'s>(
        tout: &'s [OutSpec],
        args: &[crate::arg::Arg<'_>],
    ) -> Result<Cow<'s, [OutSpec]>, String> {
        if tout.iter().all(|o| o.dtype_of.is_none()) {
            return Ok(Cow::Borrowed(tout));
        }
        Self::resolve_from(tout, args)
    }

    /// [`resolve`](Self::resolve) when an output takes an argument's dtype (out of line).
    fn resolve_from<'s>(
        tout: &'s [OutSpec],
        args: &[crate::arg::Arg<'_>],
    ) -> Result<Cow<'s, [OutSpec]>, String> {
        tout.iter()
            .enumerate()
            .map(|(out, o)| match o.dtype_of {
                None => Ok(o.clone()),
                Some(i) => match args.get(i) {
                    Some(crate::arg::Arg::Tensor(t)) => Ok(OutSpec {
                        dtype: t.dtype(),
                        dtype_of: None,
                        ..o.clone()
                    }),
                    _ => Err(format!(
                        "output {out} takes the dtype of argument {i}, which is not a tensor on \
                         this call"
                    )),
                },
            })
            .collect::<Result<Vec<_>, _>>()
            .map(Cow::Owned)
    }

    /// Whether `dims` matches the declared shape.
    pub fn shape_matches(&self, dims: &[usize]) -> bool {
        match &self.shape {
            None => true,
            Some(want) => {
                want.len() == dims.len()
                    && want
                        .iter()
                        .zip(dims)
                        .all(|(w, d)| w.is_none_or(|w| w == *d))
            }
        }
    }
}

impl OutSpec {
    /// Written as `#[py_op]` accepts it (`f32[_, 3]`, `f64[x]`, `x.dtype`, `like(x)`), argument
    /// `i` named `name(i)`.
    fn write_named(&self, f: &mut dyn fmt::Write, name: &dyn Fn(usize) -> String) -> fmt::Result {
        match (self.dtype_of, self.like) {
            (Some(i), Some(j)) if i == j && self.shape.is_none() => {
                return write!(f, "like({})", name(i))
            }
            (Some(i), _) => write!(f, "{}.dtype", name(i))?,
            (None, _) => f.write_str(self.dtype.as_str())?,
        }
        if let Some(i) = self.like {
            write!(f, "[{}]", name(i))?;
        }
        if let Some(shape) = &self.shape {
            f.write_str("[")?;
            for (i, d) in shape.iter().enumerate() {
                if i > 0 {
                    f.write_str(", ")?;
                }
                match d {
                    Some(n) => write!(f, "{n}")?,
                    None => f.write_str("_")?,
                }
            }
            f.write_str("]")?;
        }
        Ok(())
    }
}

/// As `#[py_op]` writes it, an argument named by its index (`args[0]`): `f64[args[0]]`,
/// `like(args[0])`.
impl fmt::Display for OutSpec {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        self.write_named(f, &|i| format!("args[{i}]"))
    }
}

/// As [`Display`](fmt::Display): the dtype of an output that takes an argument's is that
/// argument's, not the placeholder the struct holds.
impl fmt::Debug for OutSpec {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "OutSpec({self})")
    }
}

/// The declared outputs as `#[py_op]`'s `tout` writes them.
pub(crate) fn tout_to_string(tout: &[OutSpec]) -> String {
    tout_named(tout, &[])
}

/// The declared outputs as `#[py_op]`'s `tout` writes them, arguments by their names in
/// `params` (by index, `args[i]`, past its end).
pub(crate) fn tout_named(tout: &[OutSpec], params: &[&str]) -> String {
    let name = |i: usize| match params.get(i) {
        Some(p) => (*p).to_owned(),
        None => format!("args[{i}]"),
    };
    let one = |o: &OutSpec| {
        let mut s = String::new();
        let _ = o.write_named(&mut s, &name);
        s
    };
    match tout {
        [o] => one(o),
        many => {
            let parts: Vec<String> = many.iter().map(one).collect();
            format!("({})", parts.join(", "))
        }
    }
}

/// Dynamic micro-batching ([`OpBuilder::batch`](crate::OpBuilder::batch), `#[py_op(batch(max =
/// 64, wait_us = 200))]`): concurrent calls of the op from different threads are gathered along
/// axis 0 of their batched inputs, the body runs once on the stacked inputs, and each caller gets
/// its own rows of every output. The body must treat rows independently (a row's result depends
/// on that row alone), as a vectorised `predict` or a row-wise transform does.
///
/// ```
/// use std::time::Duration;
/// use pyop::Batch;
///
/// let batch = Batch::new(64).wait(Duration::from_micros(200));
/// assert_eq!(batch.max, 64);
/// // Only the first argument is stacked; the others must be the same for every call in a batch.
/// let some = Batch::new(8).inputs([0]);
/// assert_eq!(some.inputs.as_deref(), Some(&[0][..]));
/// ```
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub struct Batch {
    /// The most calls one body call serves (at least 1).
    pub max: usize,
    /// How long a call that found no company waits for more before its batch runs (zero: a batch
    /// is only what is already queued).
    pub wait: std::time::Duration,
    /// The arguments (by index, counting every argument) stacked along axis 0; `None`: every
    /// tensor argument. Arguments not stacked must be equal for every call of one batch (a
    /// tensor: the same tensor; a plain value: the same value).
    pub inputs: Option<Cow<'static, [usize]>>,
}

impl Batch {
    /// Batches of at most `max` calls, formed without waiting, every tensor argument stacked.
    pub const fn new(max: usize) -> Self {
        Self {
            max,
            wait: std::time::Duration::ZERO,
            inputs: None,
        }
    }

    /// A call that found no company waits at most `wait` for more.
    pub const fn wait(mut self, wait: std::time::Duration) -> Self {
        self.wait = wait;
        self
    }

    /// Only the arguments at these indices are stacked.
    pub fn inputs(mut self, inputs: impl Into<Vec<usize>>) -> Self {
        self.inputs = Some(Cow::Owned(inputs.into()));
        self
    }

    /// What `#[py_op(batch(...))]` writes in a `static`; not a public API.
    #[doc(hidden)]
    pub const fn __declared(max: usize, wait_us: u64, inputs: Option<&'static [usize]>) -> Self {
        Self {
            max,
            wait: std::time::Duration::from_micros(wait_us),
            inputs: match inputs {
                Some(i) => Some(Cow::Borrowed(i)),
                None => None,
            },
        }
    }
}

/// Evaluates `$body` with `$T` the Rust element type of `$dtype`, for the dtypes NumPy can hold
/// (see [`numpy_can_hold`]); `$other` for the rest. The one place that maps the two.
macro_rules! with_numpy_element {
    ($dtype:expr, $T:ident => $body:expr, $other:pat => $fallback:expr) => {
        match $dtype {
            candle_core::DType::U8 => {
                type $T = u8;
                $body
            }
            candle_core::DType::U32 => {
                type $T = u32;
                $body
            }
            candle_core::DType::I16 => {
                type $T = i16;
                $body
            }
            candle_core::DType::I32 => {
                type $T = i32;
                $body
            }
            candle_core::DType::I64 => {
                type $T = i64;
                $body
            }
            candle_core::DType::F16 => {
                type $T = half::f16;
                $body
            }
            candle_core::DType::F32 => {
                type $T = f32;
                $body
            }
            candle_core::DType::F64 => {
                type $T = f64;
                $body
            }
            $other => $fallback,
        }
    };
}
pub(crate) use with_numpy_element;

/// Evaluates `$body` with `$T` the Rust element type of `$dtype`, for every dtype with a plain
/// element type (NumPy's and bf16); `$other` for fp8.
macro_rules! with_plain_element {
    ($dtype:expr, $T:ident => $body:expr, $other:pat => $fallback:expr) => {
        match $dtype {
            candle_core::DType::BF16 => {
                type $T = half::bf16;
                $body
            }
            d => $crate::spec::with_numpy_element!(d, $T => $body, $other => $fallback),
        }
    };
}
pub(crate) use with_plain_element;

/// Whether NumPy has a dtype of the same name (bf16 and the f8/f4/f6 types it has not).
pub fn numpy_can_hold(dtype: DType) -> bool {
    with_numpy_element!(dtype, _T => true, _ => false)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tout_is_written_as_the_macro_accepts_it() {
        assert_eq!(tout_to_string(&[OutSpec::new(DType::F32)]), "f32");
        assert_eq!(tout_to_string(&[]), "()");
        let two = [
            OutSpec::new(DType::F32),
            OutSpec::with_shape(DType::I64, &[None, Some(2)]),
        ];
        assert_eq!(tout_to_string(&two), "(f32, i64[_, 2])");
        assert_eq!(OutSpec::shaped(DType::F64, vec![]).to_string(), "f64[]");
        assert_eq!(OutSpec::like(DType::F32, 1).to_string(), "f32[args[1]]");
        // The manifest names the parameters; `like(x)` and `x.dtype` read as declared.
        let like = [
            OutSpec::same_as(0),
            OutSpec::new(DType::F32).with_dtype_of(1),
            OutSpec::like(DType::F64, 1),
        ];
        assert_eq!(tout_named(&like, &["x", "y"]), "(like(x), y.dtype, f64[y])");
        assert_eq!(tout_to_string(&like[..1]), "like(args[0])");
        // Debug shows no placeholder dtype.
        assert_eq!(format!("{:?}", like[0]), "OutSpec(like(args[0]))");
    }

    #[test]
    fn shapes_match_with_wildcards() {
        let s = OutSpec::with_shape(DType::F32, &[None, Some(3)]);
        assert!(s.shape_matches(&[7, 3]));
        assert!(!s.shape_matches(&[7, 4]));
        assert!(!s.shape_matches(&[3]));
        assert!(OutSpec::new(DType::F32).shape_matches(&[1, 2, 3]));
        assert!(OutSpec::shaped(DType::F32, vec![]).shape_matches(&[]));
    }

    #[test]
    fn numpy_holds_what_it_has_names_for() {
        assert!(numpy_can_hold(DType::F16));
        assert!(!numpy_can_hold(DType::BF16));
        assert!(!numpy_can_hold(DType::F8E4M3));
    }
}
