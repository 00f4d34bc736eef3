//! A bucket's averages put back as gradients; the buffer itself is packed by
//! [`crate::ops::pack`].

use candle_core::{DType, Result, Tensor};

/// Puts a bucket's averages (`avg`: the gradients of `vars` laid end to end, then one flag per
/// variable) into `grads`, leaving out the variables no rank has a gradient for (their flag is
/// 0 after the average; read back only when this rank missed one, `missing_here`).
pub(super) fn unpack(
    vars: &[&candle_core::Var],
    avg: &Tensor,
    missing_here: bool,
    grads: &mut candle_core::backprop::GradStore,
) -> Result<()> {
    let total: usize = vars.iter().map(|v| v.elem_count()).sum();
    let somewhere = if missing_here {
        let f = avg.narrow(0, total, vars.len())?;
        Some(f.to_dtype(DType::F32)?.to_vec1::<f32>()?)
    } else {
        None
    };
    let mut at = 0;
    for (i, v) in vars.iter().enumerate() {
        let n = v.elem_count();
        // A variable no rank has a gradient for stays without one, as in one process (an
        // optimizer then leaves it alone, weight decay included).
        if somewhere.as_ref().is_none_or(|f| f[i] != 0.0) {
            grads.insert(v.as_tensor(), avg.narrow(0, at, n)?.reshape(v.shape())?);
        }
        at += n;
    }
    Ok(())
}
