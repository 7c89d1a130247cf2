//! A call's arguments as the worker reads them (`protocol::WireArg`), and its tensors as the
//! bytes written into the worker's input arena: each input crosses as the part of its storage it
//! views, with its strides, so a broadcast input is one element in the arena and a narrowed or
//! transposed one is its span of storage, never a copy of its logical size.

use candle_core::{DType, Tensor};

use crate::arg::Arg;
use crate::bridge::prepare::Prepared;
use crate::error::{Error, ErrorKind, Result};
use crate::worker::protocol::{self, ModuleKey, OutRef, Request, TensorRef, WireArg};

/// NumPy's name for a dtype it holds.
pub(super) fn numpy_name(dtype: DType) -> &'static str {
    match dtype {
        DType::U8 => "uint8",
        DType::U32 => "uint32",
        DType::I16 => "int16",
        DType::I32 => "int32",
        DType::I64 => "int64",
        DType::F16 => "float16",
        DType::F32 => "float32",
        _ => "float64",
    }
}

/// One input as it crosses: the tensor (kept alive while its bytes are read), where its first
/// element is, and the bytes its view spans.
struct Input {
    tensor: Tensor,
    data: usize,
    span: usize,
    strides: Vec<usize>,
}

/// The inputs of a call, in order, as the storage spans the worker gets.
pub(crate) struct WireInputs {
    inputs: Vec<Input>,
}

impl WireInputs {
    /// The prepared host tensors' spans: bytes from the first element to one past the last,
    /// following the strides (0 for a broadcast dimension). Refused (`ResourceExhausted`) only if
    /// that overflows, which no real tensor's does.
    pub(crate) fn new<'a>(
        op: &str,
        prepared: impl IntoIterator<Item = &'a Prepared>,
    ) -> Result<WireInputs> {
        let inputs = prepared
            .into_iter()
            .map(|p| {
                let t = &p.tensor;
                let size = t.dtype().size_in_bytes();
                let stride = t.stride();
                let span = if t.elem_count() == 0 {
                    Some(0)
                } else {
                    t.dims()
                        .iter()
                        .zip(stride)
                        .try_fold(1usize, |n, (&d, &s)| n.checked_add((d - 1).checked_mul(s)?))
                        .and_then(|n| n.checked_mul(size))
                };
                let strides = stride.iter().map(|s| s.checked_mul(size)).collect();
                match (span, strides) {
                    (Some(span), Some(strides)) => Ok(Input {
                        tensor: t.clone(),
                        data: p.data,
                        span,
                        strides,
                    }),
                    _ => Err(Error::op_failure(
                        op,
                        ErrorKind::ResourceExhausted,
                        format!(
                            "input of shape {:?} spans more bytes than memory has",
                            t.dims()
                        ),
                    )),
                }
            })
            .collect::<Result<Vec<_>>>()?;
        Ok(WireInputs { inputs })
    }

    fn bytes(&self, i: usize) -> &[u8] {
        let input = &self.inputs[i];
        if input.span == 0 {
            return &[];
        }
        // SAFETY: a CPU tensor of a NumPy dtype whose first element is at `data`: every element
        // its layout reaches lies in `span` bytes from there, inside its storage, which
        // `input.tensor` keeps alive as long as `self`; prepared inputs are snapshots nothing
        // writes.
        unsafe { std::slice::from_raw_parts(input.data as *const u8, input.span) }
    }
}

/// How `&[Tensor]` arguments reach the worker: a list for the body, a tuple for a gradient.
#[derive(Clone, Copy)]
pub(crate) enum Group {
    List,
    Tuple,
}

/// A call's arguments, tensors named by their place in the arena.
struct ArgWriter<'a> {
    offsets: &'a [usize],
    inputs: &'a WireInputs,
    next: usize,
}

impl<'a> ArgWriter<'a> {
    fn tensor(&mut self) -> WireArg<'a> {
        let i = self.next;
        self.next += 1;
        let input = &self.inputs.inputs[i];
        WireArg::Tensor {
            t: TensorRef {
                at: self.offsets[i],
                dtype: numpy_name(input.tensor.dtype()),
                shape: input.tensor.dims().to_vec(),
                strides: input.strides.clone(),
            },
        }
    }

    fn args(&mut self, args: &'a [Arg<'a>], group: Group) -> Vec<WireArg<'a>> {
        args.iter()
            .map(|a| match a {
                Arg::Tensor(_) => self.tensor(),
                Arg::Tensors(ts) => {
                    let items: Vec<WireArg<'a>> = ts.iter().map(|_| self.tensor()).collect();
                    match group {
                        Group::List => WireArg::List(items),
                        Group::Tuple => WireArg::Tuple { u: items },
                    }
                }
                Arg::F64(v) => WireArg::float(*v),
                Arg::I64(v) => WireArg::Int(*v),
                Arg::Bool(v) => WireArg::Bool(*v),
                Arg::Str(v) => WireArg::Str(v),
                Arg::F64s(v) => WireArg::List(v.iter().map(|&f| WireArg::float(f)).collect()),
                Arg::I64s(v) => WireArg::List(v.iter().map(|&n| WireArg::Int(n)).collect()),
                Arg::U64(v) => WireArg::UInt(*v),
                Arg::Usizes(v) => {
                    WireArg::List(v.iter().map(|&n| WireArg::UInt(n as u64)).collect())
                }
                Arg::F32s(v) => {
                    WireArg::List(v.iter().map(|&f| WireArg::float(f64::from(f))).collect())
                }
                Arg::None => WireArg::None,
            })
            .collect()
    }
}

/// A call encoded: its request's JSON, the inputs' bytes at their offsets, the input arena's
/// size, and the `out` buffers' sizes.
pub(crate) struct Encoded<'a> {
    pub call: String,
    pub inputs: Vec<(usize, &'a [u8])>,
    pub arena_len: usize,
    pub out_sizes: Option<Vec<usize>>,
}

/// The request for `function` of module `key` on argument `groups` (the body's arguments, or a
/// gradient's three tuples), with `out` buffers of these dtypes and shapes.
pub(crate) fn call<'a>(
    op: &str,
    key: &ModuleKey,
    function: &str,
    inputs: &'a WireInputs,
    groups: &'a [(&'a [Arg<'a>], Group)],
    outs: Option<&[(DType, Vec<usize>)]>,
) -> Result<Encoded<'a>> {
    let too_large = || {
        Error::op_failure(
            op,
            ErrorKind::ResourceExhausted,
            "the call's inputs and `out` buffers span more bytes than memory has",
        )
    };
    let n_in = inputs.inputs.len();
    let out_sizes = outs
        .map(|outs| {
            outs.iter()
                .map(|(d, dims)| {
                    dims.iter()
                        .try_fold(d.size_in_bytes(), |n, &k| n.checked_mul(k))
                })
                .collect::<Option<Vec<usize>>>()
        })
        .map(|s| s.ok_or_else(too_large))
        .transpose()?;
    let sizes = (0..n_in)
        .map(|i| inputs.inputs[i].span)
        .chain(out_sizes.iter().flatten().copied());
    let (offsets, arena_len) = protocol::layout(sizes).ok_or_else(too_large)?;
    // One arena holds them all: refused before it is made if this machine cannot have it.
    if arena_len as u64 > protocol::need_cap() {
        return Err(too_large());
    }
    let mut writer = ArgWriter {
        offsets: &offsets,
        inputs,
        next: 0,
    };
    let args = match groups {
        [(args, group)] => writer.args(args, *group),
        _ => groups
            .iter()
            .map(|(args, group)| WireArg::Tuple {
                u: writer.args(args, *group),
            })
            .collect(),
    };
    let out = outs.map(|outs| {
        outs.iter()
            .enumerate()
            .map(|(i, (d, dims))| OutRef {
                at: offsets[n_in + i],
                dtype: numpy_name(*d),
                shape: dims.clone(),
            })
            .collect()
    });
    // Whether the worker may spin for its next request: unless `PYOP_WORKER_SPIN=0`. Whether
    // that takes a CPU from others is the worker's to judge, from its own spins, as a caller
    // judges its own: a caller's spin before a reply and a worker's after it meet different
    // CPUs: with 2 threads through 2 workers on 2 CPUs, callers found theirs crowded by the
    // other worker's body, and workers told so slept through 82-85% of requests; told only the
    // policy, they caught 56-60% of them (`cargo bench --bench summary`'s waits).
    #[cfg(target_os = "linux")]
    let spin = crate::worker::pace::spinning_wanted();
    #[cfg(not(target_os = "linux"))]
    let spin = false;
    let call = protocol::encode(&Request::Call {
        key,
        function,
        args,
        out,
        spin,
    });
    let inputs = (0..n_in).map(|i| (offsets[i], inputs.bytes(i))).collect();
    Ok(Encoded {
        call,
        inputs,
        arena_len,
        out_sizes,
    })
}
