//! Local batch statistics as shifted sums: `[n_r, Σ(x − K), Σ(x − K)²]` per channel, in f64.
//!
//! With a shift `K` close to the mean these sums are accurate and can be added across ranks
//! (one all-reduce of 3C values, whatever the world size); see [`super::batch_norm_gather_stats`].

use candle_core::backend::BackendStorage;
use candle_core::{bail, CpuStorage, CustomOp2, Layout, Result, Shape, Tensor};

use super::{per_channel_f64, OP};
use crate::device::cpu::{
    self, prefetch_l2, reduce2, row_sums, segment_sums, simd_fn, slice, Elem, Real, Terms, LANES,
};
use crate::device::Geometry;

/// `(x − k, (x − k)²)` of the values of `x`, with per-channel shifts `k` (the square as its
/// two factors, see [`Terms`]).
struct Shifted<'a, T> {
    x: &'a [T],
    k: &'a [f64],
}

impl<T: Elem> Terms for Shifted<'_, T> {
    fn len(&self) -> (usize, usize) {
        (self.x.len(), self.k.len())
    }

    #[inline(always)]
    unsafe fn lanes(&self, i: usize, j: usize) -> [[f64; LANES]; 3] {
        // SAFETY: `i + LANES ≤ x.len()` and `j + LANES ≤ k.len()` (the caller's contract), and
        // an array of `T` has the alignment of `T`.
        let (v, k) = unsafe {
            (
                &*self.x.as_ptr().add(i).cast::<[T; LANES]>(),
                &*self.k.as_ptr().add(j).cast::<[f64; LANES]>(),
            )
        };
        let d: [f64; LANES] = std::array::from_fn(|l| v[l].load().to_f64() - k[l]);
        [d; 3]
    }

    #[inline(always)]
    fn one(&self, i: usize, j: usize) -> [f64; 3] {
        [self.x[i].load().to_f64() - self.k[j]; 3]
    }

    /// Into the level-2 cache: this was faster than the level-1 hint and than no prefetch with
    /// `x` coming from memory, and a little slower than no prefetch with `x` staying in the L3
    /// between calls, where the level-1 hint was as fast or slower (measured:
    /// docs/benchmarks.md, section "SyncBatchNorm on the CPU, world size 1, against PyTorch
    /// and candle-nn").
    #[inline(always)]
    fn prefetch(&self, i: usize) {
        prefetch_l2(self.x.get(i));
    }
}

simd_fn! {
    /// `(Σ(x − k), Σ(x − k)²)` of one channels-first segment.
    fn plane_stats<T: Elem, const FMA: bool>(x: &[T], k: f64) -> (f64, f64) {
        segment_sums::<FMA>(x.len(), &Shifted { x, k: &[k; LANES] })
    }
}

simd_fn! {
    /// Adds the shifted sums of channels-last rows `x` (`rows × C`) into `a` and `b` (`[C]`).
    fn row_stats<T: Elem, const FMA: bool>(x: &[T], k: &[f64], a: &mut [f64], b: &mut [f64]) -> () {
        row_sums::<FMA>(x.len() / k.len(), a, b, &Shifted { x, k })
    }
}

/// `(Σ(x − K), Σ(x − K)²)` of `m` values from their sums `a = Σ(x − s)`, `b = Σ(x − s)²` relative
/// to another shift `s`, with `d = s − K`.
#[inline]
fn to_shift(m: f64, d: f64, a: f64, b: f64) -> (f64, f64) {
    (a + m * d, b + 2.0 * d * a + m * d * d)
}

thread_local! {
    /// The per-item shifts of [`stats_cpu`]'s channels-last items (`C` values and room to start
    /// them on a cache line), kept by each thread between items.
    static SHIFTS: std::cell::Cell<Vec<f64>> = const { std::cell::Cell::new(Vec::new()) };
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
            // The shifts from a cache-line boundary, so that the tiles' 32-byte loads do not
            // straddle lines (the sums in `acc` start on one too when C is a multiple of 4), in
            // a buffer each thread keeps: the items are small and many. 64x256x14x14 NHWC:
            // 244–250 µs against 255–261 µs with every line straddled (six alternating
            // criterion runs, 2-core EPYC, 2026-11-25).
            let mut buf = SHIFTS.take();
            buf.resize(c + 8, 0.0);
            let line = (64 - buf.as_ptr() as usize % 64) % 64 / 8;
            let s = &mut buf[line..line + c];
            let first = &x[lo * c..(lo + 1) * c];
            s.iter_mut()
                .zip(first)
                .for_each(|(s, v)| *s = v.load().to_f64());
            let (a, b) = acc.split_at_mut(c);
            row_stats(&x[lo * c..hi * c], s, a, b);
            let m = (hi - lo) as f64;
            for ((a, b), (s, k)) in a.iter_mut().zip(b.iter_mut()).zip(s.iter().zip(k)) {
                (*a, *b) = to_shift(m, s - k, *a, *b);
            }
            SHIFTS.set(buf);
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
    fn go<T: Elem>(xs: &CpuStorage, xl: &Layout, g: &Geometry, k: &[f64]) -> Result<Vec<f64>> {
        Ok(run(slice::<T>(OP, xs, xl)?, g, k))
    }
    let sums = cpu::dispatch!(format!("{OP} stats"), xs.dtype(), go(xs, xl, g, shift))?;
    let mut out = vec![g.count() as f64; g.c];
    out.extend(sums);
    Ok(out)
}

struct StatsOp {
    geometry: Geometry,
}

impl CustomOp2 for StatsOp {
    fn name(&self) -> &'static str {
        "sync-batch-norm-stats"
    }

    fn cpu_fwd(
        &self,
        xs: &CpuStorage,
        xl: &Layout,
        ks: &CpuStorage,
        kl: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        let shift = slice::<f64>(OP, ks, kl)?;
        let out = stats_cpu(xs, xl, &self.geometry, shift)?;
        Ok((CpuStorage::F64(out), Shape::from((3, self.geometry.c))))
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        xs: &candle_core::CudaStorage,
        xl: &Layout,
        ks: &candle_core::CudaStorage,
        kl: &Layout,
    ) -> Result<(candle_core::CudaStorage, Shape)> {
        let out = stats_cuda(xs, xl, ks, kl, &self.geometry)?;
        Ok((out, Shape::from((3, self.geometry.c))))
    }
}

/// `bn_stats_{nchw,nhwc}_<dtype>` of `kernels/stats.cu`: `[3, C]` f64 on the input's device.
#[cfg(feature = "cuda")]
fn stats_cuda(
    xs: &candle_core::CudaStorage,
    xl: &Layout,
    ks: &candle_core::CudaStorage,
    kl: &Layout,
    g: &Geometry,
) -> Result<candle_core::CudaStorage> {
    use crate::device::cuda::{dispatch, view, Buffers};
    use crate::kernels::args::{KernelGeometry, Scratch, Stats};
    use crate::kernels::{launch, with_scratch, Module};
    use candle_core::cuda_backend::CudaDType;
    use candle_core::CudaStorage;

    fn run<T: CudaDType>(
        xs: &CudaStorage,
        xl: &Layout,
        ks: &CudaStorage,
        kl: &Layout,
        g: &Geometry,
    ) -> Result<CudaStorage> {
        let dev = &xs.device;
        let x = view::<T>(OP, xs, xl, "input")?;
        let shift = view::<f64>(OP, ks, kl, "shift")?;
        // SAFETY: the kernel writes all 3·C values (zeros for an empty batch).
        let mut out = unsafe { dev.alloc::<f64>(3 * g.c)? };
        let e = g.contiguous_channels_as_rows();
        if let Some(r) = e.reduction() {
            let stream = dev.cuda_stream();
            with_scratch(dev, r.counters, r.work_len, |scratch| {
                let mut b = Buffers::on(&stream);
                let call = Stats {
                    x: b.read(&x),
                    shift: b.read(&shift),
                    out: b.write(&mut out),
                    scratch: Scratch {
                        work: b.write(&mut scratch.work),
                        counters: b.write(&mut scratch.counters),
                    },
                }
                .call(OP, xs.dtype(), &e)?;
                launch(dev, Module::Stats, call, b)
            })?;
        }
        Ok(CudaStorage::wrap_cuda_slice(out, dev.clone()))
    }
    dispatch!(format!("{OP} stats"), xs.dtype(), run(xs, xl, ks, kl, g))
}

/// Local shifted sums of `x` per channel, the input of the cross-rank all-reduce.
///
/// # Arguments
/// * `x` - `(N, C, *)`, or `(N, *, C)` with `ChannelLayout::ChannelsLast`; rank 2 to 5; f32, f64, f16, bf16.
///   `N` may be 0 (an empty local batch gives zero sums).
/// * `shift` - `[C]` on `x`'s device, the shift `K` (any float dtype, used as f64); must be
///   identical on every rank, ideally close to the channel means (e.g. the previous step's
///   global mean).
///
/// Returns `[3, C]` f64 on `x`'s device: row 0 the local count `n_r` (values per channel), row 1
/// `Σ(x − K)`, row 2 `Σ(x − K)²`. Sum it over ranks and pass it to
/// [`super::batch_norm_gather_stats`]. Nothing is read back to the host.
///
/// # Errors
///
/// When `x` is not of rank 2 to 5 or its dtype is not f32, f64, f16 or bf16; when `shift` is not
/// of shape `[C]` in a float dtype or not on `x`'s device; on a GPU, when a CUDA allocation or kernel launch
/// fails.
pub fn batch_norm_stats(
    x: &Tensor,
    shift: &Tensor,
    layout: crate::layout::ChannelLayout,
) -> Result<Tensor> {
    crate::device::check_supported(OP, x.device())?;
    let geometry = Geometry::of(OP, x.dims(), layout)?;
    let shift = per_channel_f64("shift", shift, &[geometry.c])?;
    x.contiguous()?
        .apply_op2_no_bwd(&shift, &StatsOp { geometry })
}
