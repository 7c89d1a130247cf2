//! The node candle's graph holds for an op: its forward hands back what the body already
//! computed; its backward calls the op's gradient.

use candle_core::{CpuStorage, CustomOp1, DType, Layout, Shape, Tensor};

use super::pack::{unpack, Slot};
use crate::bridge::prepare::PreparedInputs;
use crate::error::{Error, ErrorKind, Result};
use crate::op::gradient::Gradient;
use crate::op::PyOp;

pub(super) struct Node {
    pub(super) op: PyOp,
    pub(super) values: Vec<SavedArg>,
    pub(super) prepared: PreparedInputs,
    pub(super) outputs: Vec<Tensor>,
    pub(super) tracked_in: Vec<usize>,
    pub(super) float_out: Vec<usize>,
    pub(super) dtype: DType,
    /// The shapes of the packed input and output.
    pub(super) in_shape: Shape,
    pub(super) out_shape: Shape,
    pub(super) slot: Slot,
}

impl CustomOp1 for Node {
    fn name(&self) -> &'static str {
        "pyop"
    }

    fn cpu_fwd(&self, _: &CpuStorage, _: &Layout) -> candle_core::Result<(CpuStorage, Shape)> {
        let Slot::Cpu(slot) = &self.slot else {
            candle_core::bail!("pyop: op `{}` computed on another device", self.op.name())
        };
        let storage = slot.lock().unwrap_or_else(|e| e.into_inner()).take();
        let Some(storage) = storage else {
            candle_core::bail!("pyop: op `{}` forward ran twice", self.op.name())
        };
        Ok((storage, self.out_shape.clone()))
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        _: &candle_core::CudaStorage,
        _: &Layout,
    ) -> candle_core::Result<(candle_core::CudaStorage, Shape)> {
        use candle_core::backend::BackendStorage;
        let Slot::Device(t) = &self.slot else {
            candle_core::bail!("pyop: op `{}` computed on another device", self.op.name())
        };
        let (storage, layout) = t.storage_and_layout();
        match &*storage {
            candle_core::Storage::Cuda(s) => Ok((s.try_clone(layout)?, t.shape().clone())),
            _ => candle_core::bail!("pyop: op `{}` outputs are not on CUDA", self.op.name()),
        }
    }

    fn bwd(
        &self,
        _arg: &Tensor,
        _res: &Tensor,
        grad_res: &Tensor,
    ) -> candle_core::Result<Option<Tensor>> {
        Ok(self.backward(grad_res)?)
    }
}

impl Node {
    fn backward(&self, grad_res: &Tensor) -> Result<Option<Tensor>> {
        let op = &*self.op.inner;
        super::record::note_gradient_run(&op.name);
        let Some(gradient) = &op.gradient else {
            return Err(Error::op_failure(
                &op.name,
                ErrorKind::NoGradient,
                format!(
                    "backward() reached this {} op, which has no gradient; declare one with \
                     `grad = \"python_function\"` or `grad = rust_fn` in #[py_op] (or \
                     OpBuilder::gradient), or detach its inputs",
                    op.mode
                ),
            ));
        };
        let grads = self.unpack_output_grads(grad_res)?;
        let input_grads = match gradient {
            Gradient::Rust(f) => self.rust_gradient(*f, &grads)?,
            Gradient::Python(f) => self.python_gradient(f, &grads)?,
        };
        self.pack_input_grads(&input_grads, grad_res.device())
    }

    /// The gradient arriving at each output, in the output's dtype; zeros for integer outputs.
    fn unpack_output_grads(&self, grad_res: &Tensor) -> Result<Vec<Tensor>> {
        let mut grads = Vec::with_capacity(self.outputs.len());
        let mut offset = 0;
        for (j, y) in self.outputs.iter().enumerate() {
            if self.float_out.contains(&j) {
                grads.push(unpack(grad_res, offset, y)?);
                offset += y.elem_count();
            } else {
                grads.push(y.zeros_like()?);
            }
        }
        Ok(grads)
    }

    /// The tracked inputs' gradients packed like `packed_in` (the one input's shape, or flat and
    /// concatenated); `None` when the gradient gave none.
    fn pack_input_grads(
        &self,
        input_grads: &[Option<Tensor>],
        device: &candle_core::Device,
    ) -> Result<Option<Tensor>> {
        let mut parts = Vec::with_capacity(self.tracked_in.len());
        let mut any = false;
        for &i in &self.tracked_in {
            let x = &self.prepared[i].tensor;
            let g = match &input_grads[i] {
                Some(g) => {
                    any = true;
                    let g = g.to_device(device)?;
                    if g.dtype() == self.dtype {
                        g
                    } else {
                        g.to_dtype(self.dtype)?
                    }
                }
                None => Tensor::zeros(x.shape(), self.dtype, device)?,
            };
            parts.push(g);
        }
        if !any {
            return Ok(None);
        }
        Ok(Some(match parts.len() {
            1 => {
                let g = parts.pop().expect("one");
                if g.shape() == &self.in_shape {
                    g
                } else {
                    g.reshape(self.in_shape.clone())?
                }
            }
            _ => {
                let flat: Vec<Tensor> = parts
                    .iter()
                    .map(|g| g.flatten_all())
                    .collect::<candle_core::Result<_>>()?;
                Tensor::cat(&flat, 0)?
            }
        }))
    }
}

/// What a node keeps of an argument, to pass it to the gradient again: its plain values, and
/// for a tensor or a list only their place (the node keeps the tensors apart, prepared).
pub(super) type SavedArg = crate::arg::Kept<(), usize>;
