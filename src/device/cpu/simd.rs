//! The vectorised inner loops of the CPU reductions, and the run-time choice between the
//! baseline and the AVX2 + FMA build of each kernel leaf function.

// The run-time choice and the cache hints are the collectives' too: one definition, below them.
pub(crate) use candle_collective::device::cpu::{has_avx2_fma, prefetch_l2};

/// Lanes of the reduction inner loops: partial sums of `LANES` consecutive values (or channels)
/// kept apart so that the compiler keeps them in vector registers (four AVX2 registers of f64)
/// without reassociating floating-point additions. Enough independent additions per step to
/// hide their latency.
pub(crate) const LANES: usize = 16;

/// The two contributions per value that a per-channel reduction sums, read from its inputs:
/// `u`, and the product `p·q` given as its two factors `(u, p, q)`, so that the AVX2 + FMA
/// build adds it with one fused multiply-add ([`madd`]).
///
/// A trait rather than closures so that the compiler inlines them into the vectorised loops
/// of [`row_sums`] and [`segment_sums`] (closures were left as calls).
pub(crate) trait Terms {
    /// `(values, constants)`: how many values the inputs hold (flat indices) and how many
    /// per-channel constants.
    fn len(&self) -> (usize, usize);

    /// `(u, p, q)` of the [`LANES`] consecutive values from flat index `i`, whose per-channel
    /// constants start at index `j` (channels-last: the channel of value `i`; a channels-first
    /// segment: 0, its constants repeated [`LANES`] times). Reads without bounds checks (the
    /// checks slowed the channels-last statistics pass; measured: docs/benchmarks.md, section
    /// "SyncBatchNorm on the CPU, world size 1, against PyTorch and candle-nn").
    ///
    /// # Safety
    /// `i + LANES ≤ self.len().0` and `j + LANES ≤ self.len().1`.
    unsafe fn lanes(&self, i: usize, j: usize) -> [[f64; LANES]; 3];

    /// `(u, p, q)` of the value at flat index `i`, with the per-channel constants at `j`.
    fn one(&self, i: usize, j: usize) -> [f64; 3];

    /// Asks for the cache lines of the inputs at flat index `i` ([`prefetch_l2`]); an index
    /// past the end is ignored.
    fn prefetch(&self, i: usize);
}

/// `p·q + acc`: one fused multiply-add (one rounding) when `FMA`, else a product and a sum (two
/// roundings; without the FMA instructions `f64::mul_add` would be a slow library call).
///
/// The fused form made the channels-last statistics pass faster than a product and a sum,
/// whose additions shared the adders with the subtractions and the plain sums (measured:
/// docs/benchmarks.md, section "SyncBatchNorm on the CPU, world size 1, against PyTorch and
/// candle-nn").
#[inline(always)]
pub(crate) fn madd<const FMA: bool>(p: f64, q: f64, acc: f64) -> f64 {
    if FMA {
        p.mul_add(q, acc)
    } else {
        p * q + acc
    }
}

/// `u + acc`, issued as the fused multiply-add `u·1 + acc` when `FMA` (the same value: the
/// product is exact and the sum rounded once), so that the sums of a reduction share the
/// multiply-add units with its products instead of queueing for the adders with the
/// subtractions and conversions. `one` must be 1 from [`opaque_one`]: with a literal 1 the
/// compiler turns the multiply-add back into an addition.
///
/// This made the channels-first statistics pass faster and left the channels-last one
/// unchanged within the noise (measured: docs/benchmarks.md, section "SyncBatchNorm on the
/// CPU, world size 1, against PyTorch and candle-nn").
#[inline(always)]
fn add<const FMA: bool>(u: f64, acc: f64, one: f64) -> f64 {
    if FMA {
        u.mul_add(one, acc)
    } else {
        u + acc
    }
}

/// 1, as a value the compiler cannot see (for [`add`]).
#[inline(always)]
fn opaque_one() -> f64 {
    std::hint::black_box(1.0)
}

/// Rows per sub-block of [`row_sums`]: at least [`MIN_SUB_ROWS`], else about 1 KiB of f32
/// input. Larger sub-blocks left the strided first reads of a tile to the hardware prefetcher,
/// which missed them on the benchmark's shapes (measured: docs/benchmarks.md, section
/// "SyncBatchNorm on the CPU, world size 1, against PyTorch and candle-nn").
const SUB_BLOCK: usize = 256;
/// The fewest rows a sub-block holds, so that a tile's sums are loaded and stored once per
/// several rows even for wide rows. 8 rather than 4: of 2, 4, 8 and 16 rows, 8 gave the
/// fastest channels-last statistics pass (measured: docs/benchmarks.md, section "SyncBatchNorm
/// on the CPU, world size 1, against PyTorch and candle-nn").
const MIN_SUB_ROWS: usize = 8;

/// The fewest channels (values per row) for which [`row_sums`] prefetches each tile's next
/// sub-block; narrower rows are read nearly in sequence, which the hardware follows.
const PREFETCH_MIN_C: usize = 256;

/// Adds per-channel sums over `rows` rows of `c = a.len()` values into `a` (`Σu`) and `b`
/// (`Σp·q`, [`madd`] with `FMA`), `[C]` each: `t.lanes(r·C + j, j)` for the tile of channels
/// `j..j + LANES` of row `r`, `t.one(r·C + j, j)` for each of the last `C % LANES` channels.
///
/// Channels go in tiles of [`LANES`] whose partial sums stay in vector registers over a
/// sub-block of a few rows ([`SUB_BLOCK`]), the tiles of a sub-block one after the other.
///
/// # Panics
/// When `t` holds fewer than `rows · C` values or fewer than `C` constants, or `b` is not `C`
/// long.
#[inline(always)]
pub(crate) fn row_sums<const FMA: bool>(rows: usize, a: &mut [f64], b: &mut [f64], t: &impl Terms) {
    let c = a.len();
    let (values, consts) = t.len();
    assert!(
        rows * c <= values && c <= consts && b.len() == c,
        "row_sums: {rows} rows of {c} over {values} values, {consts} constants, {} sums",
        b.len()
    );
    let full = c / LANES * LANES;
    let per = (SUB_BLOCK / c).max(MIN_SUB_ROWS);
    let one = opaque_one();
    for r0 in (0..rows).step_by(per) {
        let r1 = (r0 + per).min(rows);
        for j in (0..full).step_by(LANES) {
            // The lines this tile reads in the next sub-block: with wide rows they lie a row
            // apart, a pattern the hardware prefetchers follow poorly.
            if c >= PREFETCH_MIN_C {
                for r in r1..(r1 + per).min(rows) {
                    t.prefetch(r * c + j);
                }
            }
            let mut acc_a: [f64; LANES] = a[j..j + LANES].try_into().expect("LANES channels");
            let mut acc_b: [f64; LANES] = b[j..j + LANES].try_into().expect("LANES channels");
            for r in r0..r1 {
                // SAFETY: `r < rows` and `j + LANES ≤ C`, so `r·C + j + LANES ≤ rows·C`, which is
                // at most the values `t` holds, and `C` at most its constants (asserted above).
                let [u, p, q] = unsafe { t.lanes(r * c + j, j) };
                // Two loops: the compiler then adds whole vectors instead of pairing `a[i]`
                // with `b[i]`.
                for i in 0..LANES {
                    acc_a[i] = add::<FMA>(u[i], acc_a[i], one);
                }
                for i in 0..LANES {
                    acc_b[i] = madd::<FMA>(p[i], q[i], acc_b[i]);
                }
            }
            a[j..j + LANES].copy_from_slice(&acc_a);
            b[j..j + LANES].copy_from_slice(&acc_b);
        }
        for j in full..c {
            for r in r0..r1 {
                let [u, p, q] = t.one(r * c + j, j);
                a[j] += u;
                b[j] = madd::<FMA>(p, q, b[j]);
            }
        }
    }
}

/// `(Σu, Σp·q)` of a channels-first segment of `len` values, summed as rows of [`LANES`] lanes
/// by [`row_sums`] (`t`'s constants repeated [`LANES`] times, one loop for both layouts), then
/// the lanes ([`lane_sum`]) and the last `len % LANES` values.
#[inline(always)]
pub(crate) fn segment_sums<const FMA: bool>(len: usize, t: &impl Terms) -> (f64, f64) {
    let (mut a, mut b) = ([0f64; LANES], [0f64; LANES]);
    row_sums::<FMA>(len / LANES, &mut a, &mut b, t);
    // Through memory: otherwise the compiler vectorises the two final sums together, pairing
    // `a[i]` with `b[i]` in two-lane vectors back into the loop, at a third of the speed.
    let (a, b) = (std::hint::black_box(a), std::hint::black_box(b));
    // The last values in scalars of their own: added into the lanes in memory, their scalar
    // stores held up the vector loads of `lane_sum` (about 30 % of the pass's samples with
    // planes of 196 values).
    let (mut ra, mut rb) = (0.0, 0.0);
    for j in len / LANES * LANES..len {
        let [u, p, q] = t.one(j, 0);
        ra += u;
        rb = madd::<FMA>(p, q, rb);
    }
    (lane_sum(a) + ra, lane_sum(b) + rb)
}

/// The sum of [`LANES`] partial sums, added pairwise in halves (lane `i` with lane
/// `i + LANES/2`, then again on the first half, …), which the compiler turns into a few whole
/// vector additions; a sequential sum was a chain of 15 dependent scalar additions per sum,
/// about a fifth of the samples of a channels-first statistics pass with planes of 196 values
/// (`perf record`, 64x256x14x14 NCHW).
#[inline(always)]
fn lane_sum(mut v: [f64; LANES]) -> f64 {
    let mut n = LANES;
    while n > 1 {
        n /= 2;
        for i in 0..n {
            v[i] += v[i + n];
        }
    }
    v[0]
}

/// Defines a kernel leaf function `$name<T: Elem>` compiled twice, for the baseline target and
/// for AVX2 + FMA (4 f64 / 8 f32 lanes instead of SSE2's 2 / 4), and picks one at run time. The
/// body is inlined into both twins, so each is optimised for its instruction set. Written with
/// `<T: Elem, const FMA: bool>`, the body also sees `FMA`: `true` in the AVX2 + FMA twin, so
/// that it can fuse multiply-adds there (see [`madd`]); the function itself stays `<T: Elem>`.
macro_rules! simd_fn {
    ($(#[$m:meta])* fn $name:ident<T: Elem>($($a:ident : $t:ty),* $(,)?) -> $r:ty $body:block) => {
        $crate::device::cpu::simd_fn! {
            @twins $(#[$m])* fn $name($($a: $t),*) -> $r;
            fn body<T: Elem>($($a: $t),*) -> $r $body;
            fast: body::<T>, base: body::<T>
        }
    };
    ($(#[$m:meta])* fn $name:ident<T: Elem, const $fma:ident: bool>($($a:ident : $t:ty),* $(,)?) -> $r:ty $body:block) => {
        $crate::device::cpu::simd_fn! {
            @twins $(#[$m])* fn $name($($a: $t),*) -> $r;
            fn body<T: Elem, const $fma: bool>($($a: $t),*) -> $r $body;
            fast: body::<T, true>, base: body::<T, false>
        }
    };
    (@twins $(#[$m:meta])* fn $name:ident($($a:ident : $t:ty),*) -> $r:ty;
     $inner:item; fast: $fast:expr, base: $base:expr) => {
        $(#[$m])*
        #[allow(clippy::too_many_arguments)]
        fn $name<T: Elem>($($a: $t),*) -> $r {
            #[inline(always)]
            #[allow(clippy::too_many_arguments)]
            $inner
            #[cfg(target_arch = "x86_64")]
            {
                #[target_feature(enable = "avx2,fma")]
                #[allow(clippy::too_many_arguments)]
                fn fast<T: Elem>($($a: $t),*) -> $r {
                    $fast($($a),*)
                }
                if $crate::device::cpu::has_avx2_fma() {
                    // SAFETY: `fast` only differs from the baseline by being compiled for AVX2
                    // and FMA, which this CPU supports (checked at run time just above).
                    return unsafe { fast($($a),*) };
                }
            }
            $base($($a),*)
        }
    };
}
pub(crate) use simd_fn;
