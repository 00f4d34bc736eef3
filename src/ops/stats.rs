//! Local batch statistics as shifted sums: `[n_r, Σ(x − K), Σ(x − K)²]` per channel, in f64.
//!
//! With a shift `K` close to the mean these sums are accurate and can be added across ranks
//! (one all-reduce of 3C values, whatever the world size); see [`super::batch_norm_gather_stats`].

use candle_core::backend::BackendStorage;
use candle_core::{bail, CpuStorage, CustomOp1, DType, Layout, Result, Shape, Tensor};

use super::cpu::{hsum2, reduce2, simd_fn, slice, Elem, Geometry, Real, LANES};
use super::{host_f64, OP};

simd_fn! {
    /// `(Σ(x − k), Σ(x − k)²)` of one channels-first segment.
    fn plane_stats<T: Elem>(x: &[T], k: f64) -> (f64, f64) {
        let (mut a, mut b) = ([0f64; LANES], [0f64; LANES]);
        let chunks = x.chunks_exact(LANES);
        let rem = chunks.remainder();
        for v in chunks {
            for i in 0..LANES {
                let d = v[i].load().to_f64() - k;
                a[i] += d;
                b[i] += d * d;
            }
        }
        for (i, v) in rem.iter().enumerate() {
            let d = v.load().to_f64() - k;
            a[i] += d;
            b[i] += d * d;
        }
        hsum2(a, b)
    }
}

simd_fn! {
    /// Adds the shifted sums of channels-last rows `x` (`rows × C`) into `a` and `b` (`[C]`).
    fn row_stats<T: Elem>(x: &[T], k: &[f64], a: &mut [f64], b: &mut [f64]) -> () {
        for row in x.chunks_exact(k.len()) {
            for (((v, k), a), b) in row.iter().zip(k).zip(a.iter_mut()).zip(b.iter_mut()) {
                let d = v.load().to_f64() - k;
                *a += d;
                *b += d * d;
            }
        }
    }
}

/// `(Σ(x − K), Σ(x − K)²)` of `m` values from their sums `a = Σ(x − s)`, `b = Σ(x − s)²` relative
/// to another shift `s`, with `d = s − K`.
#[inline]
fn to_shift(m: f64, d: f64, a: f64, b: f64) -> (f64, f64) {
    (a + m * d, b + 2.0 * d * a + m * d * d)
}

/// Shifted local sums of one contiguous input. Returns `[3·C]` f64: counts, Σ(x−K), Σ(x−K)².
fn stats_cpu(xs: &CpuStorage, xl: &Layout, g: &Geometry, shift: &[f64]) -> Result<Vec<f64>> {
    // Each work item accumulates relative to its own first value (first row for channels-last),
    // which is close to its data, and only then moves its sums to the common shift `K`. Summing
    // relative to a far `K` directly would let the rounding of the growing partial sums reach
    // ε·n·(mean − K)² instead of the ε·(mean − K)² of the final combination alone.
    fn run<T: Elem>(x: &[T], g: &Geometry, k: &[f64]) -> Vec<f64> {
        let c = g.c;
        let plane = |ch: usize, lo: usize, hi: usize| {
            let s = x[lo].load().to_f64();
            let (a, b) = plane_stats(&x[lo..hi], s);
            to_shift((hi - lo) as f64, s - k[ch], a, b)
        };
        let rows = |lo: usize, hi: usize, acc: &mut [f64]| {
            let s: Vec<f64> = x[lo * c..(lo + 1) * c]
                .iter()
                .map(|v| v.load().to_f64())
                .collect();
            let mut local = vec![0f64; 2 * c];
            let (a, b) = local.split_at_mut(c);
            row_stats(&x[lo * c..hi * c], &s, a, b);
            let m = (hi - lo) as f64;
            let (acc_a, acc_b) = acc.split_at_mut(c);
            for j in 0..c {
                let (da, db) = to_shift(m, s[j] - k[j], a[j], b[j]);
                acc_a[j] += da;
                acc_b[j] += db;
            }
        };
        reduce2(g, plane, rows)
    }
    if shift.len() != g.c {
        bail!(
            "{OP} stats: shift has {} values for {} channels",
            shift.len(),
            g.c
        )
    }
    let sums = match xs.dtype() {
        DType::F32 => run(slice::<f32>(OP, xs, xl)?, g, shift),
        DType::F64 => run(slice::<f64>(OP, xs, xl)?, g, shift),
        DType::F16 => run(slice::<half::f16>(OP, xs, xl)?, g, shift),
        DType::BF16 => run(slice::<half::bf16>(OP, xs, xl)?, g, shift),
        d => bail!("{OP} stats: unsupported dtype {d:?} (expected f32, f64, f16 or bf16)"),
    };
    let mut out = vec![g.count() as f64; g.c];
    out.extend(sums);
    Ok(out)
}

struct StatsOp {
    geometry: Geometry,
    shift: Vec<f64>,
}

impl CustomOp1 for StatsOp {
    fn name(&self) -> &'static str {
        "sync-batch-norm-stats"
    }

    fn cpu_fwd(&self, s: &CpuStorage, l: &Layout) -> Result<(CpuStorage, Shape)> {
        let out = stats_cpu(s, l, &self.geometry, &self.shift)?;
        Ok((CpuStorage::F64(out), Shape::from((3, self.geometry.c))))
    }
    // cuda_fwd: the `cuda` feature adds the kernels of `kernels/stats.cu` here.
}

/// Local shifted sums of `x` per channel, the input of the cross-rank all-reduce.
///
/// # Arguments
/// * `x` - `(N, C, *)`, or `(N, *, C)` with `channels_last`; rank 2 to 5; f32, f64, f16, bf16.
///   `N` may be 0 (an empty local batch gives zero sums).
/// * `shift` - `[C]`, the shift `K` (any float dtype, read as f64); must be identical on every
///   rank, ideally close to the channel means (e.g. the previous step's global mean).
///
/// Returns `[3, C]` f64: row 0 the local count `n_r` (values per channel), row 1 `Σ(x − K)`,
/// row 2 `Σ(x − K)²`. Sum it over ranks and pass it to [`super::batch_norm_gather_stats`].
pub fn batch_norm_stats(x: &Tensor, shift: &Tensor, channels_last: bool) -> Result<Tensor> {
    let geometry = Geometry::of(OP, x.dims(), channels_last)?;
    let shift = host_f64("shift", shift, geometry.c)?;
    x.contiguous()?
        .apply_op1_no_bwd(&StatsOp { geometry, shift })
}
