//! Tensor kernels candle lacks: integer powers, NumPy's `matmul` rules for 1-d operands, the
//! sigmoid.

use candle_core::{Tensor, D};

use super::compute::CResult;

pub(super) fn powi(t: &Tensor, e: u64) -> CResult<Tensor> {
    if e == 0 {
        return t.ones_like();
    }
    let mut result: Option<Tensor> = None;
    let mut base = t.clone();
    let mut e = e;
    while e > 0 {
        if e & 1 == 1 {
            result = Some(match result {
                None => base.clone(),
                Some(r) => (r * &base)?,
            });
        }
        e >>= 1;
        if e > 0 {
            base = (&base * &base)?;
        }
    }
    Ok(result.expect("e > 0"))
}

pub(super) fn matmul(a: &Tensor, b: &Tensor) -> CResult<Tensor> {
    let (a1, b1) = (a.rank() == 1, b.rank() == 1);
    let a = if a1 { a.unsqueeze(0)? } else { a.clone() };
    let b = if b1 { b.unsqueeze(1)? } else { b.clone() };
    let mut r = if a.rank() == b.rank() {
        a.matmul(&b)?
    } else {
        a.broadcast_matmul(&b)?
    };
    if b1 {
        r = r.squeeze(D::Minus1)?;
    }
    if a1 {
        r = r.squeeze(if b1 {
            r.rank().saturating_sub(1)
        } else {
            r.rank() - 2
        })?;
    }
    Ok(r)
}

pub(super) fn sigmoid(t: &Tensor) -> CResult<Tensor> {
    (t.neg()?.exp()? + 1.0)?.recip()
}
