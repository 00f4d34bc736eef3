//! Rounding f32 values to a 16-bit wire dtype and back, for an all-reduce with a wire dtype
//! (`AllReduce::wire`) on the backends that have no 16-bit wire (thread ranks, MPI): bitwise
//! what `half`'s conversions give, in forms the CPU runs many lanes at a time.

use half::f16;

/// The dtype values are rounded to.
#[derive(Debug)]
pub(crate) enum Wire {
    None,
    F16,
    BF16,
}

impl Wire {
    /// The rounding to `wire` (`None` for a dtype other than f16 and bf16).
    pub(crate) fn to(wire: Option<candle_core::DType>) -> Self {
        match wire {
            Some(candle_core::DType::F16) => Wire::F16,
            Some(candle_core::DType::BF16) => Wire::BF16,
            _ => Wire::None,
        }
    }

    /// Rounds every value of `v` to the wire dtype (kept as f32, exactly representable).
    pub(crate) fn round(&self, v: &mut [f32]) {
        self.scale_round(v, None);
    }

    /// Multiplies every value of `v` by `scale` (if any), then rounds it to the wire dtype, in
    /// one pass over `v` (64 values at a time through a stack buffer): bitwise the product in
    /// f32 followed by [`Wire::round`].
    pub(crate) fn scale_round(&self, v: &mut [f32], scale: Option<f32>) {
        if let Wire::None = self {
            if let Some(k) = scale {
                v.iter_mut().for_each(|x| *x *= k);
            }
            return;
        }
        for part in v.chunks_mut(64) {
            let mut copy = [0f32; 64];
            let copy = &mut copy[..part.len()];
            match scale {
                Some(k) => copy.iter_mut().zip(&*part).for_each(|(c, x)| *c = x * k),
                None => copy.copy_from_slice(part),
            }
            self.round_from(copy, part);
        }
    }

    /// `x` rounded to the wire dtype (kept as f32), one value: bitwise what [`Wire::round`]
    /// gives for it.
    pub(crate) fn one(&self, x: f32) -> f32 {
        match self {
            Wire::None => x,
            Wire::F16 => round_f16(x),
            Wire::BF16 => round_bf16(x),
        }
    }

    /// `dst[i]` = `src[i]` rounded to the wire dtype (`dst` as long as `src`).
    pub(crate) fn round_from(&self, src: &[f32], dst: &mut [f32]) {
        match self {
            Wire::None => dst.copy_from_slice(src),
            Wire::F16 => round_f16_from(src, dst),
            Wire::BF16 => round_bf16_from(src, dst),
        }
    }
}

/// `x` rounded to bf16 (to nearest, ties to even; a NaN made quiet) and widened back: what
/// `bf16::from_f32(x).to_f32()` gives, in branch-free integer steps the compiler vectorises.
#[inline(always)]
fn round_bf16(x: f32) -> f32 {
    let b = x.to_bits();
    let nan = (b & 0x7FFF_FFFF) > 0x7F80_0000;
    // Adding 0x7FFF, plus 1 when the kept part is odd, carries into the kept part exactly when
    // the dropped part is above half of its last place, or exactly half with an odd last place.
    let rounded = b.wrapping_add(0x7FFF + ((b >> 16) & 1)) & 0xFFFF_0000;
    let quiet = (b | 0x0040_0000) & 0xFFFF_0000;
    // All ones for a NaN, zero otherwise: a select without a branch.
    let mask = 0u32.wrapping_sub(u32::from(nan));
    f32::from_bits((quiet & mask) | (rounded & !mask))
}

/// `dst[i]` = `src[i]` rounded to bf16: 8 lanes at a time with AVX2 (the crate's CPU kernels'
/// run-time choice, `CANDLE_DISTRIBUTED_NO_SIMD` included), 4 with the baseline SSE2.
fn round_bf16_from(src: &[f32], dst: &mut [f32]) {
    #[inline(always)]
    fn body(src: &[f32], dst: &mut [f32]) {
        dst.iter_mut()
            .zip(src)
            .for_each(|(d, x)| *d = round_bf16(*x));
    }
    #[cfg(target_arch = "x86_64")]
    {
        #[target_feature(enable = "avx2")]
        fn avx2(src: &[f32], dst: &mut [f32]) {
            body(src, dst);
        }
        if crate::device::cpu::has_avx2_fma() {
            // SAFETY: `avx2` only differs from `body` by being compiled for AVX2, which this CPU
            // supports (checked at run time just above).
            return unsafe { avx2(src, dst) };
        }
    }
    body(src, dst);
}

/// `x` rounded to f16 and widened back.
fn round_f16(x: f32) -> f32 {
    f16::from_f32(x).to_f32()
}

/// `dst[i]` = `src[i]` rounded to f16: 8 lanes per instruction pair on a CPU with F16C (the
/// conversions `half` itself uses there, so the bits are the same), else one value at a time.
fn round_f16_from(src: &[f32], dst: &mut [f32]) {
    #[cfg(target_arch = "x86_64")]
    if has_f16c() {
        // SAFETY: the CPU has AVX and F16C (checked at run time just above).
        return unsafe { f16c::round_from(src, dst) };
    }
    dst.iter_mut()
        .zip(src)
        .for_each(|(d, x)| *d = round_f16(*x));
}

/// Whether the CPU has AVX and F16C (checked once per process).
#[cfg(target_arch = "x86_64")]
pub(crate) fn has_f16c() -> bool {
    static HAS: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *HAS.get_or_init(|| {
        std::is_x86_feature_detected!("avx") && std::is_x86_feature_detected!("f16c")
    })
}

#[cfg(target_arch = "x86_64")]
mod f16c {
    use std::arch::x86_64::{
        _mm256_cvtph_ps, _mm256_cvtps_ph, _mm256_loadu_ps, _mm256_storeu_ps,
        _MM_FROUND_TO_NEAREST_INT,
    };

    /// `dst[i]` = `src[i]` rounded to f16 (to nearest, ties to even) and widened back.
    #[target_feature(enable = "avx,f16c")]
    pub(super) fn round_from(src: &[f32], dst: &mut [f32]) {
        assert_eq!(
            src.len(),
            dst.len(),
            "round_from: slices of different lengths"
        );
        let whole = src.len() / 8 * 8;
        for i in (0..whole).step_by(8) {
            // SAFETY: `i + 8 <= whole <= len` for both slices; the loads and stores are
            // unaligned, so any f32 address is valid.
            unsafe {
                let v = _mm256_loadu_ps(src.as_ptr().add(i));
                let h = _mm256_cvtps_ph::<_MM_FROUND_TO_NEAREST_INT>(v);
                _mm256_storeu_ps(dst.as_mut_ptr().add(i), _mm256_cvtph_ps(h));
            }
        }
        for i in whole..src.len() {
            dst[i] = super::round_f16(src[i]);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use half::bf16;

    /// Rounding through the wire matches `half`'s scalar conversions for f16 as well, on edge
    /// values (ties, overflow, subnormals, NaN, infinities) and a sweep of bit patterns, in
    /// slices whose length is not a multiple of the 8 lanes.
    #[test]
    fn f16_rounding_is_halfs() {
        let edges = [
            0x3F80_1000u32, // tie at 1.0 (f16 keeps 10 mantissa bits): stays
            0x3F80_3000,    // tie, odd: rounds up
            0x477F_F000,    // 65520: rounds to infinity
            0x477F_E000,    // 65504, the largest f16
            0x3380_0000,    // 2^-24, the smallest f16 subnormal
            0x3300_0000,    // 2^-25: a tie with zero, rounds to zero
            0x7F80_0000,
            0xFF80_0000,
            0x7FC0_0000,
            0x8000_0000,
        ];
        let mut src: Vec<f32> = edges
            .into_iter()
            .chain((0..=u32::MAX).step_by(4099))
            .map(f32::from_bits)
            .collect();
        // A tail of 5 values beyond the last whole group of 8 lanes.
        src.truncate(src.len() / 8 * 8 - 3);
        let mut dst = vec![0f32; src.len()];
        Wire::F16.round_from(&src, &mut dst);
        let mut in_place = src.clone();
        Wire::F16.round(&mut in_place);
        for ((x, got), got2) in src.iter().zip(&dst).zip(&in_place) {
            let want = f16::from_f32(*x).to_f32().to_bits();
            assert_eq!(got.to_bits(), want, "input {:#010x}", x.to_bits());
            assert_eq!(got2.to_bits(), want, "input {:#010x}", x.to_bits());
        }
    }

    /// The vectorisable bf16 rounding is `half`'s, bit for bit: ties both ways, the largest
    /// finite values (rounding to infinity), infinities, NaNs, subnormals, signed zeros, and a
    /// sweep over one bit pattern in 251.
    #[test]
    fn bf16_rounding_is_halfs() {
        let edges = [
            0x3F80_8000u32, // tie, even kept part: stays
            0x3F81_8000,    // tie, odd kept part: rounds up
            0x3F80_8001,    // above half
            0x3F80_7FFF,    // below half
            0x7F7F_FFFF,    // largest finite: rounds to infinity
            0x7F80_0000,    // infinity
            0xFF80_0000,    // minus infinity
            0x7FC0_0000,    // quiet NaN
            0x7F80_0001,    // signalling NaN, payload only in the dropped bits
            0xFFA0_0001,    // negative NaN
            0x0000_8000,    // subnormal tie
            0x0001_8000,    // subnormal tie, odd
            0x8000_0000,    // minus zero
            0x0000_0000,
        ];
        let sweep = (0..=u32::MAX).step_by(251);
        for b in edges.into_iter().chain(sweep) {
            let x = f32::from_bits(b);
            let want = bf16::from_f32(x).to_f32().to_bits();
            assert_eq!(round_bf16(x).to_bits(), want, "input {b:#010x}");
        }
    }

    /// The one-pass scaling and rounding is the product in f32 and then `half`'s rounding, bit
    /// for bit, for each wire and with and without a scale: values spread over the exponent
    /// range (products that overflow, round to ties, or turn subnormal), NaNs and infinities,
    /// over a length that leaves a partial last group of 64.
    #[test]
    fn scaling_and_rounding_in_one_pass_is_the_two_steps() {
        let src: Vec<f32> = (0..=u32::MAX)
            .step_by(65521)
            .map(f32::from_bits)
            .chain([f32::NAN, f32::INFINITY, -0.0, 65520.0, 3.0e38])
            .collect();
        assert_ne!(src.len() % 64, 0);
        for wire in [Wire::None, Wire::F16, Wire::BF16] {
            for scale in [None, Some(0.25f32), Some(1.0 / 3.0), Some(3.0)] {
                let mut got = src.clone();
                wire.scale_round(&mut got, scale);
                for (x, g) in src.iter().zip(&got) {
                    let p = scale.map_or(*x, |k| x * k);
                    let want = wire.one(p);
                    assert_eq!(
                        g.to_bits(),
                        want.to_bits(),
                        "{wire:?}, scale {scale:?}, input {:#010x}",
                        x.to_bits()
                    );
                }
            }
        }
    }
}
