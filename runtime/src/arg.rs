//! The arguments of an op call, as the generated functions and `PyOp::call` pass them.

use candle_core::Tensor;

/// One argument of an op call, in declaration order. Plain values reach Python as `float`, `int`,
/// `bool`, `str`, lists of them, or `None`, without loss: `usize` and `u64` as `int` (Python's
/// are unbounded), `u32`/`i32` as `int`, `f32` widened to `float` exactly.
#[derive(Clone, Copy, Debug)]
#[non_exhaustive]
pub enum Arg<'a> {
    /// A tensor: a `pyop.Tensor` in tensor mode, a read-only NumPy view in numpy mode.
    Tensor(&'a Tensor),
    /// A list of tensors (`&[Tensor]`), each as a single tensor goes.
    Tensors(&'a [Tensor]),
    /// A `float` (`f64`, and `f32` widened exactly).
    F64(f64),
    /// An `int` (`i64`, `i32`, `u32`).
    I64(i64),
    /// A `bool`.
    Bool(bool),
    /// A `str`.
    Str(&'a str),
    /// A list of `float`s.
    F64s(&'a [f64]),
    /// A list of `int`s.
    I64s(&'a [i64]),
    /// An unsigned integer beyond `i64`'s range possibly (`usize`, `u64`).
    U64(u64),
    /// Sizes or dims (`&[usize]`), as a list of `int`.
    Usizes(&'a [usize]),
    /// `&[f32]`, as a list of `float` (widened exactly).
    F32s(&'a [f32]),
    /// An absent `Option<…>`.
    None,
}

impl<'a> From<&'a Tensor> for Arg<'a> {
    fn from(t: &'a Tensor) -> Self {
        Arg::Tensor(t)
    }
}

impl<'a> From<&'a [Tensor]> for Arg<'a> {
    fn from(t: &'a [Tensor]) -> Self {
        Arg::Tensors(t)
    }
}

impl From<f64> for Arg<'_> {
    fn from(v: f64) -> Self {
        Arg::F64(v)
    }
}

impl From<i64> for Arg<'_> {
    fn from(v: i64) -> Self {
        Arg::I64(v)
    }
}

impl From<i32> for Arg<'_> {
    fn from(v: i32) -> Self {
        Arg::I64(v.into())
    }
}

impl From<u32> for Arg<'_> {
    fn from(v: u32) -> Self {
        Arg::I64(v.into())
    }
}

impl From<u64> for Arg<'_> {
    fn from(v: u64) -> Self {
        Arg::U64(v)
    }
}

impl From<usize> for Arg<'_> {
    fn from(v: usize) -> Self {
        // usize is at most 64 bits on every target Rust supports.
        Arg::U64(v as u64)
    }
}

impl From<f32> for Arg<'_> {
    fn from(v: f32) -> Self {
        Arg::F64(v.into())
    }
}

impl<'a> From<&'a [f32]> for Arg<'a> {
    fn from(v: &'a [f32]) -> Self {
        Arg::F32s(v)
    }
}

impl<'a> From<&'a [usize]> for Arg<'a> {
    fn from(v: &'a [usize]) -> Self {
        Arg::Usizes(v)
    }
}

impl From<bool> for Arg<'_> {
    fn from(v: bool) -> Self {
        Arg::Bool(v)
    }
}

impl<'a> From<&'a str> for Arg<'a> {
    fn from(v: &'a str) -> Self {
        Arg::Str(v)
    }
}

impl<'a> From<&'a [f64]> for Arg<'a> {
    fn from(v: &'a [f64]) -> Self {
        Arg::F64s(v)
    }
}

impl<'a> From<&'a [i64]> for Arg<'a> {
    fn from(v: &'a [i64]) -> Self {
        Arg::I64s(v)
    }
}

impl<'a, T: Into<Arg<'a>>> From<Option<T>> for Arg<'a> {
    fn from(v: Option<T>) -> Self {
        v.map_or(Arg::None, Into::into)
    }
}

impl<'a> Arg<'a> {
    /// The argument's tensors: one, a list's, or none.
    #[inline]
    pub(crate) fn tensors(&self) -> &'a [Tensor] {
        match *self {
            Arg::Tensor(t) => std::slice::from_ref(t),
            Arg::Tensors(ts) => ts,
            _ => &[],
        }
    }

    /// Calls `f` on every tensor of the argument.
    pub(crate) fn for_each_tensor(&self, f: impl FnMut(&'a Tensor)) {
        self.tensors().iter().for_each(f)
    }
}

/// An argument kept beyond the call's borrows: its plain values copied, a tensor as `T` and a
/// list of tensors as `L` (the tensors themselves for an awaited call's future; nothing, and
/// the count, for an autograd node, which keeps the tensors apart).
#[derive(Clone, Debug)]
pub(crate) enum Kept<T, L> {
    Tensor(T),
    Tensors(L),
    F64(f64),
    I64(i64),
    Bool(bool),
    Str(String),
    F64s(Vec<f64>),
    I64s(Vec<i64>),
    U64(u64),
    Usizes(Vec<usize>),
    F32s(Vec<f32>),
    None,
}

impl<T, L> Kept<T, L> {
    /// `arg` kept, its tensor or list as `tensor` or `tensors` keeps it.
    pub(crate) fn new(
        arg: &Arg<'_>,
        tensor: impl FnOnce(&Tensor) -> T,
        tensors: impl FnOnce(&[Tensor]) -> L,
    ) -> Self {
        match *arg {
            Arg::Tensor(t) => Kept::Tensor(tensor(t)),
            Arg::Tensors(ts) => Kept::Tensors(tensors(ts)),
            Arg::F64(v) => Kept::F64(v),
            Arg::I64(v) => Kept::I64(v),
            Arg::Bool(v) => Kept::Bool(v),
            Arg::Str(v) => Kept::Str(v.to_owned()),
            Arg::F64s(v) => Kept::F64s(v.to_vec()),
            Arg::I64s(v) => Kept::I64s(v.to_vec()),
            Arg::U64(v) => Kept::U64(v),
            Arg::Usizes(v) => Kept::Usizes(v.to_vec()),
            Arg::F32s(v) => Kept::F32s(v.to_vec()),
            Arg::None => Kept::None,
        }
    }

    /// The argument again when it is a plain value; `None` for a tensor or a list (its keeper
    /// gives those).
    pub(crate) fn plain(&self) -> Option<Arg<'_>> {
        Some(match self {
            Kept::Tensor(_) | Kept::Tensors(_) => return None,
            Kept::F64(v) => Arg::F64(*v),
            Kept::I64(v) => Arg::I64(*v),
            Kept::Bool(v) => Arg::Bool(*v),
            Kept::Str(v) => Arg::Str(v),
            Kept::F64s(v) => Arg::F64s(v),
            Kept::I64s(v) => Arg::I64s(v),
            Kept::U64(v) => Arg::U64(*v),
            Kept::Usizes(v) => Arg::Usizes(v),
            Kept::F32s(v) => Arg::F32s(v),
            Kept::None => Arg::None,
        })
    }
}

/// A call's arguments, owned: an awaited call's future, or a call queued for a batch, outlives
/// the caller's borrows.
pub(crate) struct OwnedArgs(smallvec::SmallVec<[Kept<Tensor, Vec<Tensor>>; 4]>);

impl OwnedArgs {
    pub(crate) fn new(args: &[Arg<'_>]) -> OwnedArgs {
        OwnedArgs(
            args.iter()
                .map(|a| Kept::new(a, Tensor::clone, <[Tensor]>::to_vec))
                .collect(),
        )
    }

    /// The arguments, borrowed from here.
    pub(crate) fn args(&self) -> smallvec::SmallVec<[Arg<'_>; 4]> {
        self.0
            .iter()
            .map(|k| match k {
                Kept::Tensor(t) => Arg::Tensor(t),
                Kept::Tensors(ts) => Arg::Tensors(ts),
                plain => plain.plain().expect("a plain value"),
            })
            .collect()
    }
}
