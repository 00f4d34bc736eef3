//! Normalisation: `y = act((x − mean)·γ·invstd + β + z)`, with an optional residual `z` and an
//! optional fused ReLU.

use candle_core::backend::BackendStorage;
use candle_core::{bail, CpuStorage, CustomOp1, CustomOp2, DType, Layout, Result, Shape, Tensor};

use super::cpu::{elementwise, simd_fn, slice, split, Elem, Geometry, Real};
use super::{check_same_shape, host_f64, OP};

/// Per-channel coefficients of the normalisation, on the host.
#[derive(Debug, Clone)]
pub(crate) struct ApplyCoef {
    /// Mean to subtract (f64: split into hi + lo for f32 arithmetic).
    pub mean: Vec<f64>,
    /// `γ · invstd`.
    pub scale: Vec<f64>,
    /// `β`.
    pub shift: Vec<f64>,
}

impl ApplyCoef {
    /// Coefficients from mean, invstd and optional affine parameters (`None` = 1 and 0).
    pub fn new(
        mean: Vec<f64>,
        invstd: &[f64],
        weight: Option<&[f64]>,
        bias: Option<&[f64]>,
    ) -> Self {
        let scale = match weight {
            Some(w) => w.iter().zip(invstd).map(|(w, s)| w * s).collect(),
            None => invstd.to_vec(),
        };
        let shift = bias.map_or_else(|| vec![0.0; mean.len()], <[f64]>::to_vec);
        Self { mean, scale, shift }
    }
}

#[inline(always)]
fn act<R: Real, const RELU: bool>(v: R) -> R {
    if RELU && v < R::ZERO {
        R::ZERO
    } else {
        v
    }
}

/// `act(((x − h) − l)·s + b [+ z])` for one value.
#[inline(always)]
fn norm<T: Elem, const RELU: bool>(x: T, z: T::R, [h, l, s, b]: [T::R; 4]) -> T {
    T::store(act::<_, RELU>(((x.load() - h) - l) * s + b + z))
}

#[inline(always)]
fn plane_apply_act<T: Elem, const RELU: bool>(
    x: &[T],
    z: Option<&[T]>,
    o: &mut [T],
    coef: [T::R; 4],
) {
    match z {
        None => o
            .iter_mut()
            .zip(x)
            .for_each(|(o, x)| *o = norm::<T, RELU>(*x, T::R::ZERO, coef)),
        Some(z) => o
            .iter_mut()
            .zip(x)
            .zip(z)
            .for_each(|((o, x), z)| *o = norm::<T, RELU>(*x, z.load(), coef)),
    }
}

simd_fn! {
    /// One channels-first segment with its channel's `[mean hi, mean lo, γ·invstd, β]`.
    fn plane_apply<T: Elem>(x: &[T], z: Option<&[T]>, o: &mut [T], coef: [T::R; 4], relu: bool) -> () {
        if relu {
            plane_apply_act::<T, true>(x, z, o, coef)
        } else {
            plane_apply_act::<T, false>(x, z, o, coef)
        }
    }
}

#[inline(always)]
fn rows_apply_act<T: Elem, const RELU: bool>(
    x: &[T],
    z: Option<&[T]>,
    o: &mut [T],
    [h, l, s, b]: [&[T::R]; 4],
) {
    let c = h.len();
    let coef = h
        .iter()
        .zip(l)
        .zip(s)
        .zip(b)
        .map(|(((h, l), s), b)| [*h, *l, *s, *b]);
    for (r, (o, x)) in o.chunks_exact_mut(c).zip(x.chunks_exact(c)).enumerate() {
        match z {
            None => o
                .iter_mut()
                .zip(x)
                .zip(coef.clone())
                .for_each(|((o, x), k)| *o = norm::<T, RELU>(*x, T::R::ZERO, k)),
            Some(z) => {
                let z = &z[r * c..(r + 1) * c];
                o.iter_mut()
                    .zip(x)
                    .zip(z)
                    .zip(coef.clone())
                    .for_each(|(((o, x), z), k)| *o = norm::<T, RELU>(*x, z.load(), k))
            }
        }
    }
}

simd_fn! {
    /// Channels-last rows (`rows × C`) with per-channel `[mean hi, mean lo, γ·invstd, β]`.
    fn rows_apply<T: Elem>(x: &[T], z: Option<&[T]>, o: &mut [T], coef: [&[T::R]; 4], relu: bool) -> () {
        if relu {
            rows_apply_act::<T, true>(x, z, o, coef)
        } else {
            rows_apply_act::<T, false>(x, z, o, coef)
        }
    }
}

/// Applies the normalisation to a contiguous input. `z`: residual of the same shape and dtype.
pub(crate) fn apply_cpu(
    xs: &CpuStorage,
    xl: &Layout,
    z: Option<(&CpuStorage, &Layout)>,
    g: &Geometry,
    coef: &ApplyCoef,
    relu: bool,
) -> Result<CpuStorage> {
    fn run<T: Elem>(x: &[T], z: Option<&[T]>, g: &Geometry, k: &ApplyCoef, relu: bool) -> Vec<T> {
        let c = g.c;
        let (mh, ml): (Vec<T::R>, Vec<T::R>) = k.mean.iter().map(|&m| split::<T::R>(m)).unzip();
        let sc: Vec<T::R> = k.scale.iter().map(|&v| T::R::from_f64(v)).collect();
        let be: Vec<T::R> = k.shift.iter().map(|&v| T::R::from_f64(v)).collect();
        let mut out = vec![T::zero(); x.len()];
        let plane = |ch: usize, lo: usize, hi: usize, o: &mut [T], _: Option<&mut [T]>| {
            let coef = [mh[ch], ml[ch], sc[ch], be[ch]];
            plane_apply(&x[lo..hi], z.map(|z| &z[lo..hi]), o, coef, relu)
        };
        let rows = |lo: usize, hi: usize, o: &mut [T], _: Option<&mut [T]>| {
            let span = lo * c..hi * c;
            let coef = [&mh[..], &ml, &sc, &be];
            rows_apply(&x[span.clone()], z.map(|z| &z[span]), o, coef, relu)
        };
        elementwise(g, &mut out, None, plane, rows);
        out
    }
    macro_rules! go {
        ($t:ty, $v:ident) => {{
            let x = slice::<$t>(OP, xs, xl)?;
            let z = match z {
                Some((zs, zl)) => Some(slice::<$t>(OP, zs, zl)?),
                None => None,
            };
            CpuStorage::$v(run(x, z, g, coef, relu))
        }};
    }
    if let Some((zs, _)) = z {
        if zs.dtype() != xs.dtype() {
            bail!(
                "{OP}: residual dtype {:?} differs from input dtype {:?}",
                zs.dtype(),
                xs.dtype()
            )
        }
    }
    Ok(match xs.dtype() {
        DType::F32 => go!(f32, F32),
        DType::F64 => go!(f64, F64),
        DType::F16 => go!(half::f16, F16),
        DType::BF16 => go!(half::bf16, BF16),
        d => bail!("{OP} apply: unsupported dtype {d:?} (expected f32, f64, f16 or bf16)"),
    })
}

struct ApplyOp {
    geometry: Geometry,
    coef: ApplyCoef,
    relu: bool,
}

impl CustomOp1 for ApplyOp {
    fn name(&self) -> &'static str {
        "sync-batch-norm-apply"
    }

    fn cpu_fwd(&self, s: &CpuStorage, l: &Layout) -> Result<(CpuStorage, Shape)> {
        let out = apply_cpu(s, l, None, &self.geometry, &self.coef, self.relu)?;
        Ok((out, l.shape().clone()))
    }
    // cuda_fwd: the `cuda` feature adds the kernels of `kernels/apply.cu` here.
}

impl CustomOp2 for ApplyOp {
    fn name(&self) -> &'static str {
        "sync-batch-norm-apply-residual"
    }

    fn cpu_fwd(
        &self,
        s1: &CpuStorage,
        l1: &Layout,
        s2: &CpuStorage,
        l2: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        let out = apply_cpu(
            s1,
            l1,
            Some((s2, l2)),
            &self.geometry,
            &self.coef,
            self.relu,
        )?;
        Ok((out, l1.shape().clone()))
    }
}

/// Normalises `x` with given statistics: `y = act((x − mean)·weight·invstd + bias + residual)`.
///
/// # Arguments
/// * `x` - `(N, C, *)`, or `(N, *, C)` with `channels_last`; rank 2 to 5; f32, f64, f16, bf16.
/// * `mean`, `invstd` - `[C]` (any float dtype; read as f64).
/// * `weight`, `bias` - `[C]` or `None` (1 and 0).
/// * `residual` - same shape and dtype as `x`, added before the activation, or `None`.
/// * `relu` - apply ReLU to the result.
///
/// Returns a tensor of `x`'s shape and dtype. Not differentiable by itself: the
/// [`crate::SyncBatchNorm`] layer wraps this arithmetic in an op with a backward.
#[allow(clippy::too_many_arguments)]
pub fn batch_norm_elemt(
    x: &Tensor,
    mean: &Tensor,
    invstd: &Tensor,
    weight: Option<&Tensor>,
    bias: Option<&Tensor>,
    residual: Option<&Tensor>,
    relu: bool,
    channels_last: bool,
) -> Result<Tensor> {
    let geometry = Geometry::of(OP, x.dims(), channels_last)?;
    let c = geometry.c;
    let weight = weight.map(|w| host_f64("weight", w, c)).transpose()?;
    let bias = bias.map(|b| host_f64("bias", b, c)).transpose()?;
    let coef = ApplyCoef::new(
        host_f64("mean", mean, c)?,
        &host_f64("invstd", invstd, c)?,
        weight.as_deref(),
        bias.as_deref(),
    );
    let op = ApplyOp {
        geometry,
        coef,
        relu,
    };
    let x = x.contiguous()?;
    match residual {
        None => x.apply_op1_no_bwd(&op),
        Some(z) => {
            check_same_shape("residual", x.dims(), z)?;
            x.apply_op2_no_bwd(&z.contiguous()?, &op)
        }
    }
}
