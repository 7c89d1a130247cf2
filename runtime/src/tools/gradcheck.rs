//! [`gradcheck`]: an op's gradient against central finite differences, like torch's.

use candle_core::{DType, Tensor};

use crate::error::{Error, ErrorKind, Result, NO_OP};

/// Tolerances of [`gradcheck`]: `GradCheck::default()`, or changed with its setters,
/// `GradCheck::default().atol(1e-8)`.
#[derive(Clone, Copy, Debug)]
#[non_exhaustive]
pub struct GradCheck {
    /// Step of the central differences.
    pub eps: f64,
    /// Absolute tolerance.
    pub atol: f64,
    /// Relative tolerance (of the finite-difference value).
    pub rtol: f64,
}

impl Default for GradCheck {
    fn default() -> Self {
        Self {
            eps: 1e-6,
            atol: 1e-5,
            rtol: 1e-3,
        }
    }
}

impl GradCheck {
    /// The tolerances used for an input of `dtype`: these for f64; for narrower floats at
    /// least what finite differences in that precision can resolve (a smaller step is lost to
    /// rounding): f32 `eps` 1e-3, `atol` 1e-3, `rtol` 1e-2; f16 `eps` 1e-2, `atol`/`rtol` 5e-2;
    /// bf16 `eps` 5e-2, `atol`/`rtol` 1e-1.
    pub fn for_dtype(self, dtype: DType) -> Self {
        let (eps, atol, rtol) = match dtype {
            DType::F32 => (1e-3, 1e-3, 1e-2),
            DType::F16 => (1e-2, 5e-2, 5e-2),
            DType::BF16 => (5e-2, 1e-1, 1e-1),
            _ => return self,
        };
        Self {
            eps: self.eps.max(eps),
            atol: self.atol.max(atol),
            rtol: self.rtol.max(rtol),
        }
    }

    /// Sets the step of the central differences.
    pub fn eps(mut self, eps: f64) -> Self {
        self.eps = eps;
        self
    }

    /// Sets the absolute tolerance.
    pub fn atol(mut self, atol: f64) -> Self {
        self.atol = atol;
        self
    }

    /// Sets the relative tolerance.
    pub fn rtol(mut self, rtol: f64) -> Self {
        self.rtol = rtol;
        self
    }
}

/// What [`gradcheck`] found: the largest difference between the analytic and the numeric
/// gradient, per input.
#[derive(Clone, Debug, PartialEq)]
#[non_exhaustive]
pub struct GradReport {
    /// Per input, the largest |analytic − numeric| over its elements (0 for integer inputs).
    pub max_abs_error: Vec<f64>,
}

/// Checks the gradient of `f` at `inputs` against central finite differences, like torch's
/// `gradcheck`.
///
/// `f` gets the inputs as tensors that autograd tracks (`Var`s of each input's dtype) and returns
/// any number of outputs. Any float dtype works: an input narrower than f64 is checked with
/// [`GradCheck::for_dtype`]'s tolerances (f64 inputs give the tightest check). The loss is
/// `Σ_j Σ (y_j · w_j)` with fixed pseudo-random weights `w_j`, so every output element counts.
/// Integer inputs and outputs are left out. Returns an error of kind
/// [`ErrorKind::GradientMismatch`] naming the input and element where the two disagree.
///
/// ```
/// use pyop::candle::{Device, Tensor};
/// use pyop::{gradcheck, py_op, GradCheck};
///
/// // A numpy-mode op with its gradient in Python: d/dx sin(x) = cos(x).
/// #[py_op(code = r#"
/// import numpy as np
/// def sine(x):
///     return np.sin(x)
/// def sine_grad(inputs, outputs, grads):
///     return grads[0] * np.cos(inputs[0])
/// "#, numpy, tout = f64, grad = "sine_grad")]
/// fn sine(x: &Tensor) -> pyop::Result<Tensor>;
///
/// let x = Tensor::new(&[0.1f64, 0.7, 2.0], &Device::Cpu)?;
/// let report = gradcheck(|xs| Ok(vec![sine(&xs[0])?]), &[x], GradCheck::default())?;
/// assert!(report.max_abs_error[0] < 1e-8);
/// # Ok::<(), pyop::Error>(())
/// ```
pub fn gradcheck<F>(f: F, inputs: &[Tensor], tol: GradCheck) -> Result<GradReport>
where
    F: Fn(&[Tensor]) -> Result<Vec<Tensor>>,
{
    let vars: Vec<candle_core::Var> = inputs
        .iter()
        .map(candle_core::Var::from_tensor)
        .collect::<candle_core::Result<_>>()?;
    let as_tensors =
        |vs: &[candle_core::Var]| vs.iter().map(|v| v.as_tensor().clone()).collect::<Vec<_>>();
    let loss = |xs: &[Tensor]| -> Result<Tensor> {
        let ys = f(xs)?;
        let mut total: Option<Tensor> = None;
        for (j, y) in ys.iter().enumerate() {
            if !y.dtype().is_float() {
                continue;
            }
            let y = y.to_dtype(DType::F64)?;
            let w: Vec<f64> = (0..y.elem_count()).map(|k| weight(j, k)).collect();
            let w = Tensor::from_vec(w, y.shape(), y.device())?;
            let term = (y * w)?.sum_all()?;
            total = Some(match total {
                None => term,
                Some(t) => (t + term)?,
            });
        }
        total.ok_or_else(|| {
            Error::op_failure(
                NO_OP,
                ErrorKind::InvalidArgument,
                "the function has no float output",
            )
        })
    };
    let xs = as_tensors(&vars);
    let grads = loss(&xs)?.backward()?;
    let mut report = GradReport {
        max_abs_error: Vec::new(),
    };
    for (i, var) in vars.iter().enumerate() {
        let x = var.as_tensor();
        if !x.dtype().is_float() {
            report.max_abs_error.push(0.0);
            continue;
        }
        let analytic: Vec<f64> = match grads.get(x) {
            Some(g) => g.to_dtype(DType::F64)?.flatten_all()?.to_vec1()?,
            None => vec![0.0; x.elem_count()],
        };
        let base: Vec<f64> = x.to_dtype(DType::F64)?.flatten_all()?.to_vec1()?;
        let tol = tol.for_dtype(x.dtype());
        let mut worst: f64 = 0.0;
        for k in 0..base.len() {
            let at = |delta: f64| -> Result<f64> {
                let mut v = base.clone();
                v[k] += delta;
                let xi = Tensor::from_vec(v, x.shape(), x.device())?.to_dtype(x.dtype())?;
                let mut probe: Vec<Tensor> = vars.iter().map(|v| v.as_tensor().detach()).collect();
                probe[i] = xi;
                Ok(loss(&probe)?.to_scalar::<f64>()?)
            };
            let numeric = (at(tol.eps)? - at(-tol.eps)?) / (2.0 * tol.eps);
            let err = (analytic[k] - numeric).abs();
            worst = worst.max(err);
            if err > tol.atol + tol.rtol * numeric.abs() || err.is_nan() {
                return Err(Error::mismatch(
                    NO_OP,
                    ErrorKind::GradientMismatch,
                    Some(i),
                    format!(
                        "input {i}, element {k}: analytic gradient {} but finite differences give {numeric}{}",
                        analytic[k],
                        if x.dtype() == DType::F64 {
                            String::new()
                        } else {
                            format!(
                                " (in {}, with step eps = {} and atol = {}, rtol = {}: a smaller \
                                 step is lost to rounding in that dtype; check the gradient with \
                                 f64 inputs for a tight comparison)",
                                x.dtype().as_str(),
                                tol.eps,
                                tol.atol,
                                tol.rtol
                            )
                        }
                    ),
                ));
            }
        }
        report.max_abs_error.push(worst);
    }
    Ok(report)
}

/// Fixed weights in [0.5, 1.5), different per output and element.
fn weight(j: usize, k: usize) -> f64 {
    let mut h = (j as u64).wrapping_mul(0x9E37_79B9_7F4A_7C15)
        ^ (k as u64).wrapping_mul(0xC2B2_AE3D_27D4_EB4F);
    h ^= h >> 31;
    h = h.wrapping_mul(0x94D0_49BB_1331_11EB);
    h ^= h >> 29;
    0.5 + (h >> 11) as f64 / (1u64 << 53) as f64
}
