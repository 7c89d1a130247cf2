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
    /// Per input, the largest |analytic − numeric| over the entries `∂y_j[m]/∂x_i[k]` of the
    /// Jacobian (0 for integer inputs).
    pub max_abs_error: Vec<f64>,
}

/// Checks the gradient of `f` at `inputs` against central finite differences, like torch's
/// `gradcheck`.
///
/// `f` gets the inputs as tensors that autograd tracks (`Var`s of each input's dtype) and returns
/// any number of outputs. Every entry of the Jacobian, `∂y_j[m]/∂x_i[k]` for each float output
/// element and float input element, is compared: the analytic one from a backward pass per
/// output element, the numeric one from two calls of `f` per input element (so keep the inputs
/// small, as for torch's). Any float dtype works: an input narrower than f64 is checked with
/// [`GradCheck::for_dtype`]'s tolerances (f64 inputs give the tightest check). Integer inputs
/// and outputs are left out. An entry with |analytic − numeric| > `atol + rtol·|numeric|` is an
/// error of kind [`ErrorKind::GradientMismatch`] that gives both values, the output, input and
/// elements, the step and tolerances, and the ops whose gradient that backward pass ran (the
/// error's [`op`](crate::Error::op) where it is one). A probe that changes a float output's
/// shape (`x[x > 0]` near 0) is an error of kind [`ErrorKind::InvalidArgument`] naming the input
/// element, the value probed and both shapes.
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
    // The float outputs, flat, with their indices among all outputs and their shapes.
    let float_outputs = |xs: &[Tensor]| -> Result<FloatOutputs> {
        let (mut outs, mut shapes) = (Vec::new(), Vec::new());
        for (j, y) in f(xs)?.into_iter().enumerate() {
            if y.dtype().is_float() {
                shapes.push((j, y.dims().to_vec()));
                outs.push((j, y.flatten_all()?));
            }
        }
        Ok((outs, shapes))
    };
    let xs: Vec<Tensor> = vars.iter().map(|v| v.as_tensor().clone()).collect();
    let (ys, shapes) = float_outputs(&xs)?;
    if ys.is_empty() {
        return Err(Error::op_failure(
            NO_OP,
            ErrorKind::InvalidArgument,
            "the function has no float output",
        ));
    }
    // Analytic rows: one backward pass per output element gives ∂y_j[m]/∂x for every input.
    let mut rows = Vec::new();
    for (j, y) in &ys {
        for m in 0..y.elem_count() {
            let (grads, ran) = crate::op::autograd::gradients_run(|| {
                y.narrow(0, m, 1)?
                    .to_dtype(DType::F64)?
                    .sum_all()?
                    .backward()
            });
            let grads = grads?;
            let per_input = xs
                .iter()
                .map(|x| match grads.get(x) {
                    Some(g) => Ok(Some(g.to_dtype(DType::F64)?.flatten_all()?.to_vec1()?)),
                    None => Ok(None),
                })
                .collect::<candle_core::Result<Vec<Option<Vec<f64>>>>>()?;
            rows.push((*j, m, per_input, ran));
        }
    }
    // An output narrower than an input is compared at the output's precision.
    let out_dtypes: Vec<DType> = ys.iter().map(|(_, y)| y.dtype()).collect();
    let mut report = GradReport {
        max_abs_error: Vec::new(),
    };
    for (i, x) in xs.iter().enumerate() {
        if !x.dtype().is_float() {
            report.max_abs_error.push(0.0);
            continue;
        }
        let base: Vec<f64> = x.to_dtype(DType::F64)?.flatten_all()?.to_vec1()?;
        let narrowest = narrowest(x.dtype(), &out_dtypes);
        let tol = out_dtypes
            .iter()
            .fold(tol.for_dtype(x.dtype()), |t, d| t.for_dtype(*d));
        let mut worst: f64 = 0.0;
        for k in 0..base.len() {
            // Every output element at x_i[k] ± eps: a column of the numeric Jacobian, and the
            // value x_i[k] took in its own dtype (the step actually taken).
            let at = |delta: f64| -> Result<(f64, Vec<f64>)> {
                let mut v = base.clone();
                v[k] += delta;
                let mut probe: Vec<Tensor> = xs.iter().map(Tensor::detach).collect();
                probe[i] = Tensor::from_vec(v, x.shape(), x.device())?.to_dtype(x.dtype())?;
                let taken = probe[i]
                    .flatten_all()?
                    .get(k)?
                    .to_dtype(DType::F64)?
                    .to_scalar::<f64>()?;
                let (outs, probed) = float_outputs(&probe)?;
                // Another shape there would pair elements of different outputs (or run past
                // the end): not a gradient to compare.
                if let Some(what) = shape_change(&shapes, &probed) {
                    return Err(Error::mismatch(
                        NO_OP,
                        ErrorKind::InvalidArgument,
                        Some(i),
                        format!(
                            "input {i}[{k}] = {} probed at {taken} (step eps = {}): {what}; \
                             gradcheck needs outputs whose shapes do not depend on the inputs' \
                             values near the point (check at a point away from the threshold, \
                             or with a smaller step)",
                            base[k], tol.eps
                        ),
                    ));
                }
                let mut column = Vec::new();
                for (_, y) in outs {
                    column.extend(y.to_dtype(DType::F64)?.to_vec1::<f64>()?);
                }
                Ok((taken, column))
            };
            let ((up, plus), (down, minus)) = (at(tol.eps)?, at(-tol.eps)?);
            // In a narrow dtype a step can round away (f16 has 0.25 between 256 and 512).
            let step = up - down;
            if step == 0.0 {
                return Err(Error::mismatch(
                    NO_OP,
                    ErrorKind::InvalidArgument,
                    Some(i),
                    format!(
                        "input {i}[{k}] = {}: the step eps = {} rounds away in {}; give a larger \
                         step (GradCheck::eps) or check with f64 inputs",
                        base[k],
                        tol.eps,
                        x.dtype().as_str()
                    ),
                ));
            }
            for (r, (j, m, per_input, ran)) in rows.iter().enumerate() {
                let numeric = (plus[r] - minus[r]) / step;
                let analytic = per_input[i].as_ref().map_or(0.0, |g| g[k]);
                let err = (analytic - numeric).abs();
                worst = worst.max(err);
                if err > tol.atol + tol.rtol * numeric.abs() || err.is_nan() {
                    return Err(mismatch(
                        (i, k, *j, *m),
                        analytic,
                        numeric,
                        narrowest,
                        tol,
                        ran,
                    ));
                }
            }
        }
        report.max_abs_error.push(worst);
    }
    Ok(report)
}

/// A float output: its index among all outputs, and its shape.
type Shaped = (usize, Vec<usize>);

/// The float outputs, flat, with their indices among all outputs; and their shapes.
type FloatOutputs = (Vec<(usize, Tensor)>, Vec<Shaped>);

/// How the float outputs at a probe differ from those at the base point (`None`: the same
/// outputs, of the same shapes).
fn shape_change(base: &[Shaped], probed: &[Shaped]) -> Option<String> {
    let fmt = |s: &[usize]| format!("{s:?}");
    for (j, shape) in base {
        match probed.iter().find(|(p, _)| p == j) {
            Some((_, s)) if s == shape => {}
            Some((_, s)) => {
                return Some(format!(
                    "output {j} has shape {} there but {} at the point checked",
                    fmt(s),
                    fmt(shape)
                ))
            }
            None => {
                return Some(format!(
                    "output {j} (shape {} at the point checked) is no float output there",
                    fmt(shape)
                ))
            }
        }
    }
    probed
        .iter()
        .find(|(p, _)| !base.iter().any(|(j, _)| j == p))
        .map(|(j, s)| {
            format!(
                "output {j} is a float output of shape {} there but not at the point checked",
                fmt(s)
            )
        })
}

/// The narrowest of `input` and the float `outputs` (the one whose precision bounds the check).
fn narrowest(input: DType, outputs: &[DType]) -> DType {
    let rank = |d: DType| match d {
        DType::F64 => 0,
        DType::F32 => 1,
        DType::F16 => 2,
        _ => 3,
    };
    outputs
        .iter()
        .copied()
        .chain([input])
        .max_by_key(|d| rank(*d))
        .unwrap_or(input)
}

/// The error for the Jacobian entry `∂y_j[m]/∂x_i[k]` whose two values disagree, in gradient
/// units, naming the ops whose gradient ran for it (the error's op when there is one).
fn mismatch(
    (i, k, j, m): (usize, usize, usize, usize),
    analytic: f64,
    numeric: f64,
    dtype: DType,
    tol: GradCheck,
    ran: &[String],
) -> Error {
    let ops = match ran {
        [] => String::from("no op's registered gradient ran for it"),
        [one] => format!("the gradient of op `{one}` ran for it"),
        many => format!(
            "the gradients of ops {} ran for it",
            many.iter()
                .map(|o| format!("`{o}`"))
                .collect::<Vec<_>>()
                .join(", ")
        ),
    };
    let precision = if dtype == DType::F64 {
        String::new()
    } else {
        format!(
            "; in {} (the narrowest of the input and the outputs): a smaller step is lost to \
             rounding in that dtype, compare in f64 for a tight check",
            dtype.as_str()
        )
    };
    let what = format!(
        "d(output {j}[{m}])/d(input {i}[{k}]): analytic gradient {analytic} but finite differences \
         give {numeric} (central differences with step eps = {}; |difference| {} > atol = {} + \
         rtol = {} × |finite difference|; {ops}{precision})",
        tol.eps,
        (analytic - numeric).abs(),
        tol.atol,
        tol.rtol,
    );
    let op = match ran {
        [one] => Some(one.as_str()),
        _ => None,
    };
    Error::mismatch(op, ErrorKind::GradientMismatch, Some(i), what)
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::Device;

    #[test]
    fn tolerances_are_set_and_widened_per_dtype() {
        let t = GradCheck::default().eps(0.5).atol(0.25).rtol(0.125);
        assert_eq!((t.eps, t.atol, t.rtol), (0.5, 0.25, 0.125));
        let d = GradCheck::default();
        let f = |t: GradCheck| (t.eps, t.atol, t.rtol);
        assert_eq!(f(d.for_dtype(DType::F64)), f(d));
        assert_eq!(f(d.for_dtype(DType::F32)), (1e-3, 1e-3, 1e-2));
        assert_eq!(f(d.for_dtype(DType::F16)), (1e-2, 5e-2, 5e-2));
        assert_eq!(f(d.for_dtype(DType::BF16)), (5e-2, 1e-1, 1e-1));
        assert_eq!(narrowest(DType::F64, &[]), DType::F64);
        assert_eq!(narrowest(DType::F64, &[DType::F32, DType::F64]), DType::F32);
        assert_eq!(narrowest(DType::F32, &[DType::F16]), DType::F16);
        assert_eq!(narrowest(DType::F16, &[DType::BF16]), DType::BF16);
        assert_eq!(narrowest(DType::BF16, &[DType::F64]), DType::BF16);
    }

    /// The elements of `x` above 0 (an output whose length depends on the input's values).
    fn positive(x: &Tensor) -> Result<Tensor> {
        let keep: Vec<u32> = (x.to_vec1::<f64>()?.iter().enumerate())
            .filter(|(_, v)| **v > 0.0)
            .map(|(i, _)| i as u32)
            .collect();
        Ok(x.index_select(&Tensor::new(keep.as_slice(), x.device())?, 0)?)
    }

    /// A probe that changes an output's shape is named as such, with the input element and both
    /// shapes (third audit, finding 11: the last element shrinking the output panicked with an
    /// index out of bounds, the first one was blamed on the gradient).
    #[test]
    fn a_probe_changing_an_outputs_shape_is_an_invalid_argument() {
        for (values, k) in [([1.0f64, 2.0, 1e-7], 2), ([1e-7, 1.0, 2.0], 0)] {
            let x = Tensor::new(&values, &Device::Cpu).unwrap();
            let err = gradcheck(|xs| Ok(vec![positive(&xs[0])?]), &[x], GradCheck::default())
                .unwrap_err();
            assert_eq!(err.kind(), ErrorKind::InvalidArgument, "{err}");
            let msg = err.to_string();
            assert!(
                msg.contains(&format!("input 0[{k}] = 0.0000001 probed at -0.0000009")),
                "{msg}"
            );
            assert!(
                msg.contains("output 0 has shape [2] there but [3] at the point checked"),
                "{msg}"
            );
        }
        // The same function away from 0 checks.
        let x = Tensor::new(&[1.0f64, 2.0, 0.5], &Device::Cpu).unwrap();
        gradcheck(|xs| Ok(vec![positive(&xs[0])?]), &[x], GradCheck::default()).unwrap();
        // Outputs that stop or start being float outputs.
        let (a, b) = (vec![2usize], vec![3usize]);
        assert_eq!(shape_change(&[(0, a.clone())], &[(0, a.clone())]), None);
        assert_eq!(
            shape_change(&[(0, a.clone())], &[(1, a.clone())]).unwrap(),
            "output 0 (shape [2] at the point checked) is no float output there"
        );
        assert_eq!(
            shape_change(&[(0, a.clone())], &[(0, a), (1, b)]).unwrap(),
            "output 1 is a float output of shape [3] there but not at the point checked"
        );
    }

    /// A large gradient is compared relative to its size: 10^6·x² at 1 has a derivative of
    /// 2·10^6, whose finite difference is off by more than `atol` from rounding alone.
    #[test]
    fn large_gradients_pass_by_the_relative_tolerance() {
        let x = Tensor::new(&[1.0f64, -0.5], &Device::Cpu).unwrap();
        let report = gradcheck(
            |xs| Ok(vec![(xs[0].sqr()? * 1e6)?]),
            &[x],
            GradCheck::default(),
        )
        .unwrap();
        assert!(report.max_abs_error[0] > 1e-5, "{report:?}");
    }
}
