//! The f32 sum of a [`super::ThreadGroup`] all-reduce in one pass: for each 8 lanes of the
//! result, every rank's values are loaded, rounded to the wire dtype (if any), added in rank
//! order, scaled and rounded, and stored, without the strip path's round trips through
//! working buffers. Each rank's input is prefetched a little ahead of the sum, and large
//! results are written with non-temporal stores, which skip reading each output cache line
//! before it is overwritten.
//!
//! The arithmetic is the strip path's, operation for operation (IEEE additions and products in
//! the same order, no fused multiply-add), so the bits are the same whichever path or thread
//! computed a block. (One exception: where two ranks hold NaNs with different payloads at the
//! same element, which payload the sum keeps is the compiler's choice of operand order, in
//! either path. Every rank still gets the same bits: each element is computed once, for all.)

use std::mem::MaybeUninit;
use std::ops::Range;

use crate::round::Wire;

/// Results of at least this many bytes are written with non-temporal stores: they do not fit
/// the caches, so reading each line before overwriting it (what a plain store does) would only
/// add a fifth to the traffic of a four-rank sum. Smaller results stay in the cache for
/// whoever reads them next.
pub(super) const STREAM_BYTES: usize = 4 << 20;

/// `dst[j]` = element `range.start + j` of the result: `w(k · Σ_r w(ins[r][i]))`, summed in
/// rank order in f32, where `w` rounds to `wire` (nothing without one) and `k` is `scale`
/// (omitted without one). `dst` is as long as `range`; `stream` asks for non-temporal stores.
///
/// Returns `false`, writing nothing, when this CPU has no AVX2 and F16C (or the crate's SIMD
/// is turned off): the caller then takes the strip path.
pub(super) fn sum(
    ins: &[&[f32]],
    range: Range<usize>,
    dst: &mut [MaybeUninit<f32>],
    scale: Option<f32>,
    wire: &Wire,
    stream: bool,
) -> bool {
    assert_eq!(
        range.len(),
        dst.len(),
        "fused::sum: output of another length"
    );
    #[cfg(target_arch = "x86_64")]
    if crate::device::cpu::has_avx2_fma() && crate::round::has_f16c() {
        let run = match wire {
            Wire::None => x86::sum::<{ x86::NONE }>,
            Wire::F16 => x86::sum::<{ x86::F16 }>,
            Wire::BF16 => x86::sum::<{ x86::BF16 }>,
        };
        // SAFETY: the CPU has AVX2 and F16C (checked just above), all `run` is compiled for.
        unsafe { run(ins, range, dst, scale, wire, stream) };
        return true;
    }
    let _ = (ins, scale, wire, stream);
    false
}

/// Element `i` of the result, one value at a time: the lanes before the first 32-byte aligned
/// output address and after the last whole 8 lanes.
#[cfg_attr(not(target_arch = "x86_64"), allow(dead_code))]
fn one(ins: &[&[f32]], i: usize, scale: Option<f32>, wire: &Wire) -> f32 {
    let mut acc = wire.one(ins[0][i]);
    for x in &ins[1..] {
        acc += wire.one(x[i]);
    }
    if let Some(k) = scale {
        acc *= k;
    }
    wire.one(acc)
}

#[cfg(target_arch = "x86_64")]
mod x86 {
    use std::arch::x86_64::{
        __m256, __m256i, _mm256_add_epi32, _mm256_add_ps, _mm256_and_si256, _mm256_blendv_epi8,
        _mm256_castps_si256, _mm256_castsi256_ps, _mm256_cmp_ps, _mm256_cvtph_ps, _mm256_cvtps_ph,
        _mm256_loadu_ps, _mm256_movemask_ps, _mm256_mul_ps, _mm256_or_si256, _mm256_set1_epi32,
        _mm256_set1_ps, _mm256_srli_epi32, _mm256_storeu_ps, _mm256_stream_ps, _mm_sfence,
        _CMP_UNORD_Q, _MM_FROUND_TO_NEAREST_INT,
    };
    use std::mem::MaybeUninit;
    use std::ops::Range;

    use super::one;
    use crate::device::cpu::prefetch;
    use crate::round::Wire;

    /// The wire of a monomorphised [`sum`]: none, f16, bf16.
    pub(super) const NONE: u8 = 0;
    pub(super) const F16: u8 = 1;
    pub(super) const BF16: u8 = 2;

    /// 8 values rounded to the wire `W` and widened back: F16C's conversion for f16 (the one
    /// `half` uses on such a CPU), for bf16 [`bf16_carry`] with a NaN (found by comparing it
    /// with itself) made quiet instead, the dropped half cleared once after the select.
    #[target_feature(enable = "avx2,f16c")]
    #[inline]
    fn round<const W: u8>(v: __m256) -> __m256 {
        match W {
            F16 => _mm256_cvtph_ps(_mm256_cvtps_ph::<_MM_FROUND_TO_NEAREST_INT>(v)),
            BF16 => {
                let b = _mm256_castps_si256(v);
                let nan = _mm256_castps_si256(_mm256_cmp_ps::<_CMP_UNORD_Q>(v, v));
                let quiet = _mm256_or_si256(b, _mm256_set1_epi32(0x0040_0000));
                _mm256_castsi256_ps(_mm256_and_si256(
                    _mm256_blendv_epi8(bf16_carry(b), quiet, nan),
                    _mm256_set1_epi32(KEPT),
                ))
            }
            _ => v,
        }
    }

    /// How far ahead of the sum each rank's input is prefetched, in values (1 KiB). The
    /// hardware prefetchers alone left the 16-bit wires' sums, which compute more per value,
    /// slower than the f32 sum; with this they came near its time, and the f32 sum's own time
    /// did not change (measured: docs/benchmarks.md, section "Gradient synchronisation on the
    /// CPU backends").
    const AHEAD: usize = 256;

    /// The bits kept by bf16: the upper half of an f32.
    const KEPT: i32 = 0xFFFF_0000u32 as i32;

    /// The integer steps of `round.rs`'s scalar bf16 rounding on 8 values' bits `b`: a carry
    /// into the kept half that rounds to nearest, ties to even (the dropped half is left as it
    /// comes out). Right for every value but a NaN, whose payload it may carry into an
    /// infinity or across the sign.
    #[target_feature(enable = "avx2")]
    #[inline]
    fn bf16_carry(b: __m256i) -> __m256i {
        let odd = _mm256_and_si256(_mm256_srli_epi32::<16>(b), _mm256_set1_epi32(1));
        _mm256_add_epi32(b, _mm256_add_epi32(_mm256_set1_epi32(0x7FFF), odd))
    }

    /// 8 values that are not NaN rounded to bf16 and widened back: [`round`] without the NaN
    /// test, select and quieting (5 integer operations instead of 8).
    #[target_feature(enable = "avx2")]
    #[inline]
    fn bf16_not_nan(v: __m256) -> __m256 {
        let b = bf16_carry(_mm256_castps_si256(v));
        _mm256_castsi256_ps(_mm256_and_si256(b, _mm256_set1_epi32(KEPT)))
    }

    /// 8 lanes at `ins[r][i..i + 8]`, rounded to `W`.
    #[target_feature(enable = "avx2,f16c")]
    #[inline]
    fn load<const W: u8>(x: &[f32], i: usize) -> __m256 {
        let lanes = &x[i..i + 8];
        // SAFETY: `lanes` holds 8 f32 (the slice above is bounds-checked); the load is
        // unaligned, so any f32 address is valid.
        round::<W>(unsafe { _mm256_loadu_ps(lanes.as_ptr()) })
    }

    /// The 8 result lanes from element `i`: the ranks' values rounded to `W`, added in rank
    /// order, multiplied by `k` (if any) and rounded.
    #[target_feature(enable = "avx2,f16c")]
    #[inline]
    fn lanes<const W: u8>(ins: &[&[f32]], i: usize, k: Option<__m256>) -> __m256 {
        let mut acc = load::<W>(ins[0], i);
        for x in &ins[1..] {
            acc = _mm256_add_ps(acc, load::<W>(x, i));
        }
        if let Some(k) = k {
            acc = _mm256_mul_ps(acc, k);
        }
        round::<W>(acc)
    }

    /// [`lanes`] for the bf16 wire with the cheaper rounding of values that are not NaN
    /// ([`bf16_not_nan`]), or `None` when a NaN may have been among them: when the plain sum of
    /// the ranks' values (which is NaN if any of them is) or the scaled sum of their roundings
    /// is NaN. The plain sum costs one addition per rank, the NaN handling it replaces three
    /// operations per rank and for the result.
    #[target_feature(enable = "avx2")]
    #[inline]
    fn lanes_bf16(ins: &[&[f32]], i: usize, k: Option<__m256>) -> Option<__m256> {
        let x = &ins[0][i..i + 8];
        // SAFETY: `x` holds 8 f32 (bounds-checked just above); the load is unaligned.
        let mut raw = unsafe { _mm256_loadu_ps(x.as_ptr()) };
        let mut acc = bf16_not_nan(raw);
        for x in &ins[1..] {
            let x = &x[i..i + 8];
            // SAFETY: as above.
            let v = unsafe { _mm256_loadu_ps(x.as_ptr()) };
            raw = _mm256_add_ps(raw, v);
            acc = _mm256_add_ps(acc, bf16_not_nan(v));
        }
        if let Some(k) = k {
            acc = _mm256_mul_ps(acc, k);
        }
        let nan = _mm256_movemask_ps(_mm256_cmp_ps::<_CMP_UNORD_Q>(acc, raw));
        (nan == 0).then(|| bf16_not_nan(acc))
    }

    /// [`super::sum`] for the wire `W`, 8 lanes at a time between a scalar head (up to the
    /// first 32-byte aligned output address) and a scalar tail.
    #[target_feature(enable = "avx2,f16c")]
    pub(super) fn sum<const W: u8>(
        ins: &[&[f32]],
        range: Range<usize>,
        dst: &mut [MaybeUninit<f32>],
        scale: Option<f32>,
        wire: &Wire,
        stream: bool,
    ) {
        let n = dst.len();
        let head = dst.as_ptr().align_offset(32).min(n);
        let body = head + (n - head) / 8 * 8;
        for (j, d) in dst[..head].iter_mut().enumerate() {
            d.write(one(ins, range.start + j, scale, wire));
        }
        let k = scale.map(|s| _mm256_set1_ps(s));
        for j in (head..body).step_by(8) {
            let i = range.start + j;
            // One prefetch per 64-byte line of each rank's input: every other step.
            if (j - head).is_multiple_of(16) {
                for x in ins {
                    prefetch(x.get(i + AHEAD));
                }
            }
            let v = match W {
                BF16 => lanes_bf16(ins, i, k).unwrap_or_else(|| lanes::<W>(ins, i, k)),
                _ => lanes::<W>(ins, i, k),
            };
            let out = &mut dst[j..j + 8];
            let p = out.as_mut_ptr().cast::<f32>();
            if stream {
                // SAFETY: `out` holds 8 f32 (bounds-checked above), and `p` is 32-byte aligned:
                // `head` brought the first address there and every step is 8 lanes.
                unsafe { _mm256_stream_ps(p, v) };
            } else {
                // SAFETY: as above; the store is unaligned, any f32 address is valid.
                unsafe { _mm256_storeu_ps(p, v) };
            }
        }
        for (j, d) in dst.iter_mut().enumerate().skip(body) {
            d.write(one(ins, range.start + j, scale, wire));
        }
        if stream {
            // Non-temporal stores are weakly ordered: this fence makes them visible before the
            // block's completion is counted (and the result handed to the other ranks).
            _mm_sfence();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// One rank, so that the sum is the rounding alone: the vector rounding against `half`'s
    /// on edge values (ties both ways, NaNs with their payload in the dropped bits only,
    /// infinities, the largest finite values, subnormals, signed zeros) and a sweep over one
    /// bit pattern in 65537, for both wires, plain and streamed.
    #[test]
    fn the_vector_rounding_is_halfs_on_edge_values() {
        let edges = [
            0x3F80_8000u32, // bf16 tie, even kept part: stays
            0x3F81_8000,    // bf16 tie, odd kept part: rounds up
            0x3F80_1000,    // f16 tie at 1.0: stays
            0x3F80_3000,    // f16 tie, odd: rounds up
            0x7F80_0001,    // signalling NaN, payload only in the dropped bits
            0xFF80_0001,
            0x7FFF_FFFF, // NaN, every payload bit set
            0x7FC0_0000,
            0x7F80_0000,
            0xFF80_0000,
            0x7F7F_FFFF, // the largest finite f32: bf16 rounds it to infinity
            0x477F_F000, // 65520: f16 rounds it to infinity
            0x0000_0001, // the smallest subnormal
            0x0040_8000, // a subnormal bf16 tie
            0x8000_0000,
            0x0000_0000,
        ];
        let values: Vec<f32> = edges
            .into_iter()
            .chain((0..=u32::MAX).step_by(65537))
            .map(f32::from_bits)
            .collect();
        for (wire, want) in [
            (
                Wire::BF16,
                (|x: f32| half::bf16::from_f32(x).to_f32()) as fn(f32) -> f32,
            ),
            (Wire::F16, |x: f32| half::f16::from_f32(x).to_f32()),
        ] {
            for stream in [false, true] {
                let mut dst = vec![MaybeUninit::<f32>::uninit(); values.len()];
                if !sum(&[&values], 0..values.len(), &mut dst, None, &wire, stream) {
                    eprintln!("no AVX2 and F16C here: the strip path covers this CPU");
                    return;
                }
                for (x, d) in values.iter().zip(&dst) {
                    // SAFETY: `sum` wrote every element of `dst`.
                    let got = unsafe { d.assume_init() };
                    assert_eq!(
                        got.to_bits(),
                        want(*x).to_bits(),
                        "input {:#010x}, stream {stream}",
                        x.to_bits()
                    );
                }
            }
        }
    }

    /// Every wire, sum and average, non-temporal or plain stores, and outputs starting at each
    /// of the 8 alignments with lengths that leave tails: bitwise the scalar rank-order sum.
    /// (Skipped on a CPU without AVX2 and F16C, where `sum` declines and the strip path runs.)
    #[test]
    fn the_one_pass_sum_is_the_scalar_one_bit_for_bit() {
        let len = 1000;
        // Seeded values of both signs over 2^-27 ..= 2^22 (f16's subnormals, its overflow,
        // bf16's dropped bits), NaNs and infinities among them.
        let mut state = 0x9E37_79B9_7F4A_7C15u64;
        let mut next = || {
            state ^= state << 13;
            state ^= state >> 7;
            state ^= state << 17;
            let b = (state >> 32) as u32;
            f32::from_bits((b & 0x807F_FFFF) | ((100 + (b >> 8) % 50) << 23))
        };
        let mut ranks: Vec<Vec<f32>> = (0..3).map(|_| (0..len).map(|_| next()).collect()).collect();
        ranks[1][17] = f32::NAN;
        ranks[2][40] = f32::INFINITY;
        ranks[0][41] = f32::NEG_INFINITY;
        // NaNs whose payload lies in bf16's dropped half: rounding them by the carry alone
        // would make an infinity and a negative zero.
        ranks[0][60] = f32::from_bits(0x7F80_0001);
        ranks[1][70] = f32::from_bits(0xFFFF_FFFF);
        // Finite values that bf16 rounds to infinities of both signs: a NaN sum of roundings
        // from a finite plain sum.
        ranks[0][80] = f32::MAX;
        ranks[2][80] = -f32::MAX;
        let ins: Vec<&[f32]> = ranks.iter().map(Vec::as_slice).collect();
        for wire in [Wire::None, Wire::F16, Wire::BF16] {
            for scale in [None, Some(1.0 / 3.0)] {
                for stream in [false, true] {
                    for shift in 0..8 {
                        let range = 5..len - 11;
                        let mut buf = vec![MaybeUninit::<f32>::uninit(); range.len() + 8];
                        let dst = &mut buf[shift..shift + range.len()];
                        if !sum(&ins, range.clone(), dst, scale, &wire, stream) {
                            eprintln!("no AVX2 and F16C here: the strip path covers this CPU");
                            return;
                        }
                        for (j, d) in dst.iter().enumerate() {
                            // SAFETY: `sum` wrote every element of `dst`.
                            let got = unsafe { d.assume_init() };
                            let want = one(&ins, range.start + j, scale, &wire);
                            assert_eq!(
                                got.to_bits(),
                                want.to_bits(),
                                "element {j}, shift {shift}, scale {scale:?}, stream {stream}"
                            );
                        }
                    }
                }
            }
        }
    }
}
