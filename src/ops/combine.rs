//! Turns all-reduced shifted sums into the global mean, variance and inverse std.

use candle_core::{bail, Device, Result, Tensor};

use super::{host_f64, OP};

/// Global statistics of one layer's batch, on the host.
#[derive(Debug, Clone)]
pub(crate) struct HostStats {
    /// Values per channel over all ranks.
    pub count: f64,
    /// Global mean per channel.
    pub mean: Vec<f64>,
    /// Global sum of squared deviations per channel.
    pub m2: Vec<f64>,
}

impl HostStats {
    /// Biased variance `M2 / n`.
    pub fn var(&self) -> Vec<f64> {
        self.m2.iter().map(|m| m / self.count).collect()
    }

    /// `1 / sqrt(M2 / n + eps)`.
    pub fn invstd(&self, eps: f64) -> Vec<f64> {
        self.m2
            .iter()
            .map(|m| 1.0 / (m / self.count + eps).sqrt())
            .collect()
    }
}

/// Combines `[n, A, B]` (`3·C` values, already summed over ranks) with the shift `K`:
/// `mean = K + A/n`, `M2 = B − A²/n` (clamped at 0).
pub(crate) fn combine_host(sums: &[f64], shift: &[f64]) -> HostStats {
    let c = shift.len();
    let count = if c == 0 { 0.0 } else { sums[0] };
    let (a, b) = (&sums[c..2 * c], &sums[2 * c..3 * c]);
    let mut mean = Vec::with_capacity(c);
    let mut m2 = Vec::with_capacity(c);
    for j in 0..c {
        let d = if count > 0.0 { a[j] / count } else { 0.0 };
        let m = (b[j] - a[j] * d).max(0.0);
        mean.push(shift[j] + d);
        m2.push(m);
    }
    HostStats { count, mean, m2 }
}

/// Global batch statistics, each `[C]` f64 on the device of the sums.
#[derive(Debug, Clone)]
pub struct BatchStats {
    /// Values per channel over all ranks (`n`, identical for every channel).
    pub count: Tensor,
    /// Global mean.
    pub mean: Tensor,
    /// Biased variance `M2 / n` (what normalises the batch).
    pub var: Tensor,
    /// Unbiased variance `M2 / (n − 1)` (what running statistics track).
    pub var_unbiased: Tensor,
    /// `1 / sqrt(var + eps)`.
    pub invstd: Tensor,
}

/// Global statistics from the shifted sums of [`super::batch_norm_stats`] summed over ranks.
///
/// # Arguments
/// * `sums` - `[3, C]` f64: `[Σ n_r, Σ A_r, Σ B_r]` (the all-reduced output of `batch_norm_stats`).
/// * `shift` - `[C]`, the same shift `K` every rank passed to `batch_norm_stats`.
/// * `eps` - added to the biased variance before the inverse square root.
///
/// Errors when a channel has fewer than 2 values in total (as PyTorch does in training).
pub fn batch_norm_gather_stats(sums: &Tensor, shift: &Tensor, eps: f64) -> Result<BatchStats> {
    let c = shift.elem_count();
    if sums.dims() != [3, c] {
        bail!(
            "{OP} gather_stats: expected sums of shape [3, {c}], got {:?}",
            sums.dims()
        )
    }
    let host = combine_host(
        &sums
            .flatten_all()?
            .to_dtype(candle_core::DType::F64)?
            .to_vec1()?,
        &host_f64("shift", shift, c)?,
    );
    if host.count <= 1.0 {
        bail!(
            "{OP}: expected more than 1 value per channel when training, got {} in the global batch",
            host.count
        )
    }
    let dev = sums.device();
    let vec = |v: Vec<f64>, d: &Device| Tensor::from_vec(v, c, d);
    Ok(BatchStats {
        count: vec(vec![host.count; c], dev)?,
        mean: vec(host.mean.clone(), dev)?,
        var: vec(host.var(), dev)?,
        var_unbiased: vec(
            host.m2.iter().map(|m| m / (host.count - 1.0)).collect(),
            dev,
        )?,
        invstd: vec(host.invstd(eps), dev)?,
    })
}
