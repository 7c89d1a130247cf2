//! Tensors made ready for Python, outside the GIL: on the CPU for NumPy views, snapshotted when a
//! concurrent `Var::set` could change them, with the address NumPy views start at.

use candle_core::{CpuStorage, DType, Device, Storage, Tensor};

use crate::arg::Arg;
use crate::error::{Error, ErrorKind, Result};
use crate::spec::{numpy_can_hold, Mode};

/// How a call's tensors reach Python.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Passing {
    /// `pyop.Tensor`s of the very tensors, tracked by autograd (tensor mode).
    Tensors,
    /// Read-only NumPy views of host copies (numpy mode).
    Views,
    /// `pyop.Tensor`s on the op's own device, for the body to take through DLPack (numpy mode
    /// with `dlpack`): no move to the host.
    Dlpack,
}

impl Passing {
    /// Why tensors of `dtype` cannot be passed this way (nor returned: numpy mode's outputs come
    /// back the way its inputs go), if they cannot.
    pub(crate) fn refuses(self, dtype: DType) -> Option<&'static str> {
        match self {
            Passing::Tensors => None,
            Passing::Views => (!numpy_can_hold(dtype)).then_some("NumPy cannot hold"),
            Passing::Dlpack => {
                (!crate::bridge::dlpack::can_carry(dtype)).then_some("DLPack cannot carry")
            }
        }
    }

    /// How an op of `mode` passes its tensors (`dlpack`: numpy mode's `dlpack` option).
    pub(crate) fn of(mode: Mode, dlpack: bool) -> Self {
        match (mode, dlpack) {
            (Mode::Tensor, _) => Passing::Tensors,
            (Mode::Numpy, false) => Passing::Views,
            (Mode::Numpy, true) => Passing::Dlpack,
        }
    }
}

/// A tensor made ready for Python outside the GIL: on the CPU (NumPy views), snapshotted if it is
/// a `Var` (so a concurrent `Var::set` is seen entirely or not at all), with its data pointer.
pub(crate) struct Prepared {
    pub tensor: Tensor,
    /// Address of the first element, for NumPy views (`Passing::Views` only).
    pub data: usize,
    /// Whether the tensor was tracked and not copied, so may share a `Var`'s storage (a view of
    /// one, in tensor mode), also once detached.
    pub shares_var: bool,
}

/// A call's prepared inputs, held inline for the usual few.
pub(crate) type PreparedInputs = smallvec::SmallVec<[Prepared; 4]>;

/// Prepares every tensor of `args`, in order, into `out` (empty). Runs without the GIL: it may
/// copy and lock.
#[inline(always)]
pub(crate) fn prepare_inputs(
    op: &str,
    passing: Passing,
    args: &[Arg<'_>],
    out: &mut PreparedInputs,
) -> Result<()> {
    debug_assert!(out.is_empty());
    for arg in args {
        match arg {
            Arg::Tensor(t) => prepare(op, passing, t, out)?,
            Arg::Tensors(ts) => {
                for t in *ts {
                    prepare(op, passing, t, out)?;
                }
            }
            _ => {}
        }
    }
    Ok(())
}

/// Prepares `t` onto the end of `out` (pushed there rather than returned: a `Result` of it is
/// `pyop::Error`'s 112 bytes, copied piecewise on the way).
#[inline(always)]
fn prepare(op: &str, passing: Passing, t: &Tensor, out: &mut PreparedInputs) -> Result<()> {
    if let Some(why) = passing.refuses(t.dtype()) {
        return Err(refused(op, t, out.len(), why));
    }
    // A Var's storage can be overwritten in place by `Var::set` while the body reads it; candle's
    // `copy` takes the storage's read lock, so the snapshot is all old or all new values. `copy`
    // is differentiable, so gradients still reach the Var. NumPy (or a DLPack consumer) reads
    // without any lock, so in numpy mode every tracked input is snapshotted too: it may be a view
    // of a Var (`narrow`, `t()`, `reshape`), which shares the Var's storage. A NumPy view of a
    // tensor on another device is of a host copy, which is the snapshot.
    let moved = passing == Passing::Views && !t.device().is_cpu();
    let snapshot = t.is_variable() || (passing != Passing::Tensors && t.track_op());
    let shares_var = t.track_op() && !snapshot && !moved;
    let t = if moved {
        t.to_device(&Device::Cpu)?
    } else if snapshot {
        t.copy()?
    } else {
        t.clone()
    };
    let data = match passing {
        Passing::Views => cpu_data_ptr(&t),
        Passing::Tensors | Passing::Dlpack => 0,
    };
    out.push(Prepared {
        tensor: t,
        data,
        shares_var,
    });
    Ok(())
}

#[cold]
fn refused(op: &str, t: &Tensor, index: usize, why: &str) -> Error {
    Error::mismatch(
        op,
        ErrorKind::InvalidArgument,
        Some(index),
        format!(
            "input {index} is {}, which {why}; convert it with `to_dtype` or use tensor mode",
            t.dtype().as_str()
        ),
    )
}

/// The address of a CPU tensor's first element (0 for a dtype NumPy cannot hold, which `prepare`
/// rejects before asking).
pub(crate) fn cpu_data_ptr(t: &Tensor) -> usize {
    let (storage, layout) = t.storage_and_layout();
    let Storage::Cpu(cpu) = &*storage else {
        unreachable!("a CPU tensor")
    };
    element_ptr(cpu, layout.start_offset())
}

/// The address of element `offset` of a CPU storage (0 for a dtype with no plain element type,
/// fp8, which neither NumPy nor DLPack export).
pub(crate) fn element_ptr(cpu: &CpuStorage, offset: usize) -> usize {
    macro_rules! at {
        ($v:expr) => {
            $v.as_ptr().wrapping_add(offset) as usize
        };
    }
    match cpu {
        CpuStorage::U8(v) => at!(v),
        CpuStorage::U32(v) => at!(v),
        CpuStorage::I16(v) => at!(v),
        CpuStorage::I32(v) => at!(v),
        CpuStorage::I64(v) => at!(v),
        CpuStorage::BF16(v) => at!(v),
        CpuStorage::F16(v) => at!(v),
        CpuStorage::F32(v) => at!(v),
        CpuStorage::F64(v) => at!(v),
        _ => 0,
    }
}

impl Prepared {
    /// The same input, cut from the autograd graph (its storage is shared).
    pub(crate) fn detached(self) -> Self {
        Prepared {
            tensor: self.tensor.detach(),
            data: self.data,
            shares_var: self.shares_var,
        }
    }
}
