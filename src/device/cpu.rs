//! Shared machinery of the CPU kernels: element types, the (N, C, S) geometry of an input, and
//! deterministic parallel drivers (fixed work items combined in a fixed order, so results do
//! not depend on the number of threads).

use std::mem::MaybeUninit;
use std::ops::{Add, Mul, Sub};

use candle_core::{bail, CpuStorage, Layout, Result, WithDType};
use half::{bf16, f16};

/// Elements per parallel work item (a few hundred KiB of input).
const BLOCK: usize = 1 << 15;

/// Arithmetic type of the element-wise passes: f32 for f32/f16/bf16, f64 for f64.
pub(crate) trait Real:
    Copy + Send + Sync + PartialOrd + Add<Output = Self> + Sub<Output = Self> + Mul<Output = Self>
{
    const ZERO: Self;
    fn to_f64(self) -> f64;
    fn from_f64(v: f64) -> Self;
}

impl Real for f32 {
    const ZERO: Self = 0.0;
    #[inline(always)]
    fn to_f64(self) -> f64 {
        self as f64
    }
    #[inline(always)]
    fn from_f64(v: f64) -> Self {
        v as f32
    }
}

impl Real for f64 {
    const ZERO: Self = 0.0;
    #[inline(always)]
    fn to_f64(self) -> f64 {
        self
    }
    #[inline(always)]
    fn from_f64(v: f64) -> Self {
        v
    }
}

/// A storage element type the kernels accept.
pub(crate) trait Elem: WithDType {
    type R: Real;
    fn load(self) -> Self::R;
    fn store(v: Self::R) -> Self;
}

impl Elem for f32 {
    type R = f32;
    #[inline(always)]
    fn load(self) -> f32 {
        self
    }
    #[inline(always)]
    fn store(v: f32) -> Self {
        v
    }
}

impl Elem for f64 {
    type R = f64;
    #[inline(always)]
    fn load(self) -> f64 {
        self
    }
    #[inline(always)]
    fn store(v: f64) -> Self {
        v
    }
}

impl Elem for f16 {
    type R = f32;
    #[inline(always)]
    fn load(self) -> f32 {
        self.to_f32()
    }
    #[inline(always)]
    fn store(v: f32) -> Self {
        f16::from_f32(v)
    }
}

impl Elem for bf16 {
    type R = f32;
    #[inline(always)]
    fn load(self) -> f32 {
        self.to_f32()
    }
    #[inline(always)]
    fn store(v: f32) -> Self {
        bf16::from_f32(v)
    }
}

/// Splits a per-channel f64 value into `hi + lo` in the arithmetic type, so that `x − hi − lo`
/// stays accurate in f32 when `|mean| ≫ std` (`x − hi` is exact near the mean).
#[inline]
pub(crate) fn split<R: Real>(v: f64) -> (R, R) {
    let hi = R::from_f64(v);
    (hi, R::from_f64(v - hi.to_f64()))
}

/// An input seen as `n` batch entries × `c` channels × `s` positions.
///
/// Channels-first `(N, C, *)`: planes of `s` contiguous values, plane `p` is channel `p % c`.
/// Channels-last `(N, *, C)`: rows of `c` contiguous channels, `n · s` rows.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Geometry {
    pub n: usize,
    pub c: usize,
    pub s: usize,
    pub layout: crate::Layout,
}

impl Geometry {
    /// Reads the geometry of a shape; rank 2 to 5.
    pub fn of(op: &str, dims: &[usize], layout: crate::Layout) -> Result<Self> {
        if !(2..=5).contains(&dims.len()) {
            let shape = layout.describe();
            bail!("{op}: expected an input of rank 2 to 5 {shape}, got shape {dims:?}")
        }
        let (c, s) = if layout.is_channels_last() {
            (
                dims[dims.len() - 1],
                dims[1..dims.len() - 1].iter().product(),
            )
        } else {
            (dims[1], dims[2..].iter().product())
        };
        Ok(Self {
            n: dims[0],
            c,
            s,
            layout,
        })
    }

    /// Values per channel on this rank (`N · S`).
    pub fn count(&self) -> usize {
        self.n * self.s
    }

    /// Total number of elements.
    pub fn len(&self) -> usize {
        self.n * self.c * self.s
    }

    /// True when the channels are the contiguous dimension (channels-last, or `S = 1`).
    pub fn rows(&self) -> bool {
        self.layout.is_channels_last() || self.s == 1
    }

    /// The input as the kernels see it: rows of channels when [`Self::rows`], else planes.
    #[cfg(feature = "cuda")]
    pub fn extent(&self) -> super::args::Extent {
        super::args::Extent {
            n: self.n,
            c: self.c,
            hw: self.s,
            channels_last: self.rows(),
        }
    }
}

/// The contiguous data of a CPU storage as a slice of `T`.
pub(crate) fn slice<'a, T: WithDType>(op: &str, s: &'a CpuStorage, l: &Layout) -> Result<&'a [T]> {
    let data = s.as_slice::<T>()?;
    match l.contiguous_offsets() {
        Some((a, b)) => Ok(&data[a..b]),
        None => bail!(
            "{op}: expected a contiguous tensor, got strides {:?}",
            l.stride()
        ),
    }
}

/// Calls `$run::<T>(args…)` with the storage type `T` of `$dtype` (f32, f64, f16 or bf16);
/// another dtype is an error naming the caller `$op` (evaluated only then). The CPU twin of
/// `cuda::dispatch!`.
macro_rules! dispatch {
    ($op:expr, $dtype:expr, $run:ident($($arg:expr),* $(,)?)) => {
        match $dtype {
            candle_core::DType::F32 => $run::<f32>($($arg),*),
            candle_core::DType::F64 => $run::<f64>($($arg),*),
            candle_core::DType::F16 => $run::<half::f16>($($arg),*),
            candle_core::DType::BF16 => $run::<half::bf16>($($arg),*),
            d => candle_core::bail!(
                "{}: unsupported dtype {d:?} (expected f32, f64, f16 or bf16)",
                $op
            ),
        }
    };
}
pub(crate) use dispatch;

/// Per-channel two-accumulator reduction: returns `[acc0[c]..., acc1[c]...]` (2C values).
///
/// `plane(ch, lo, hi)` sums the channels-first segment `lo..hi` of channel `ch`;
/// `rows(lo, hi, acc)` adds rows `lo..hi` of a channels-last input into `acc` (`[2, C]`).
pub(crate) fn reduce2<P, Q>(g: &Geometry, plane: P, rows: Q) -> Vec<f64>
where
    P: Fn(usize, usize, usize) -> (f64, f64) + Sync,
    Q: Fn(usize, usize, &mut [f64]) + Sync,
{
    let c = g.c;
    let mut out = vec![0f64; 2 * c];
    if g.len() == 0 {
        return out;
    }
    if g.rows() {
        let nrows = g.n * g.s;
        let per = (BLOCK / c).max(1);
        let items = nrows.div_ceil(per);
        let parts: Vec<Vec<f64>> = map_indexed(items, g.len(), |i| {
            let mut acc = vec![0f64; 2 * c];
            rows(i * per, ((i + 1) * per).min(nrows), &mut acc);
            acc
        });
        for p in parts {
            out.iter_mut().zip(p).for_each(|(o, v)| *o += v);
        }
    } else {
        let s = g.s;
        let segs = s.div_ceil(BLOCK);
        let items = g.n * c * segs;
        let parts: Vec<(f64, f64)> = map_indexed(items, g.len(), |i| {
            let (p, seg) = (i / segs, i % segs);
            let lo = p * s + seg * BLOCK;
            plane(p % c, lo, (lo + BLOCK).min((p + 1) * s))
        });
        for (i, (a, b)) in parts.into_iter().enumerate() {
            let ch = (i / segs) % c;
            out[ch] += a;
            out[c + ch] += b;
        }
    }
    out
}

/// Element-wise driver writing one or two outputs of the input's length.
///
/// `plane(ch, lo, hi, o1, o2)` fills the outputs for channels-first positions `lo..hi` of
/// channel `ch`; `rows(lo, hi, o1, o2)` fills channels-last rows `lo..hi`. The output slices
/// given to the closures start at `lo` (`lo · C` for rows). Every position of the outputs is
/// handed to exactly one closure call, which must write all of its slices (the outputs may
/// come uninitialised from [`written`]).
pub(crate) fn elementwise<T, P, Q>(
    g: &Geometry,
    out1: &mut [MaybeUninit<T>],
    out2: Option<&mut [MaybeUninit<T>]>,
    plane: P,
    rows: Q,
) where
    T: Send,
    P: Fn(usize, usize, usize, &mut [MaybeUninit<T>], Option<&mut [MaybeUninit<T>]>) + Sync,
    Q: Fn(usize, usize, &mut [MaybeUninit<T>], Option<&mut [MaybeUninit<T>]>) + Sync,
{
    let c = g.c;
    if g.len() == 0 {
        return;
    }
    let (block, row_mode) = if g.rows() {
        ((BLOCK / c).max(1) * c, true)
    } else {
        (BLOCK, false)
    };
    let body = |i: usize, o1: &mut [MaybeUninit<T>], mut o2: Option<&mut [MaybeUninit<T>]>| {
        let start = i * block;
        if row_mode {
            rows(start / c, (start + o1.len()) / c, o1, o2);
            return;
        }
        let end = start + o1.len();
        let mut lo = start;
        while lo < end {
            let p = lo / g.s;
            let hi = end.min((p + 1) * g.s);
            let (a, b) = (lo - start, hi - start);
            plane(
                p % c,
                lo,
                hi,
                &mut o1[a..b],
                o2.as_deref_mut().map(|o| &mut o[a..b]),
            );
            lo = hi;
        }
    };
    let len = out1.len();
    assert!(
        out2.as_ref().is_none_or(|o| o.len() == len),
        "outputs of one length"
    );
    let (o1, o2) = (Disjoint::new(out1), out2.map(Disjoint::new));
    on_pool(len.div_ceil(block), len, |i| {
        let (lo, hi) = (i * block, len.min((i + 1) * block));
        // SAFETY: the pool hands every block index to one call only, so the ranges
        // `lo..hi` taken here never overlap, and they lie within the outputs' common length.
        let (a, b) = unsafe { (o1.range(lo, hi), o2.as_ref().map(|o| o.range(lo, hi))) };
        body(i, a, b)
    });
}

/// Values (elements of the input) below which a kernel runs on the calling thread (see
/// [`on_pool`]).
const MIN_POOL_VALUES: usize = 1 << 20;

/// Runs `f(i)` for every `i < items` of a job over `values` values: on candle's CPU worker pool,
/// the threads candle's own CPU ops run on (`candle_core::utils::barrier_pool`), indices handed
/// out in chunks as threads free up; on the calling thread below [`MIN_POOL_VALUES`].
///
/// Why this pool: a second one beside it (rayon's, which this crate used before) competed with
/// candle's workers, which spin for a while after every candle op. Why not always: the pool
/// runs one job at a time, so thread ranks (`ThreadGroup`) would queue for it with their
/// small tensors, which they otherwise work on side by side.
///
/// A panic in `f` is caught in the pool and raised again here, once every index has run: a
/// panic unwinding through the pool's own lock would poison it for the rest of the process.
pub(crate) fn on_pool(items: usize, values: usize, f: impl Fn(usize) + Sync) {
    if values < MIN_POOL_VALUES {
        (0..items).for_each(f);
        return;
    }
    let panicked = std::sync::Mutex::new(None);
    candle_core::utils::barrier_pool().execute_chunked(items, |range| {
        let run = std::panic::AssertUnwindSafe(|| range.for_each(&f));
        if let Err(payload) = std::panic::catch_unwind(run) {
            let mut first = panicked.lock().unwrap_or_else(|e| e.into_inner());
            first.get_or_insert(payload);
        }
    });
    let payload = panicked.into_inner().unwrap_or_else(|e| e.into_inner());
    if let Some(payload) = payload {
        std::panic::resume_unwind(payload);
    }
}

/// `[f(0), f(1), …]` for `items` indices of a job over `values` values, run as [`on_pool`]
/// runs them and returned in index order whatever thread computed each, so that the
/// reductions' partial sums combine in a fixed order.
pub(crate) fn map_indexed<R: Send>(
    items: usize,
    values: usize,
    f: impl Fn(usize) -> R + Sync,
) -> Vec<R> {
    let mut out: Vec<R> = Vec::with_capacity(items);
    let slots = Disjoint::new(&mut out.spare_capacity_mut()[..items]);
    on_pool(items, values, |i| {
        // SAFETY: every index is handed to one call only, so no two calls touch one slot.
        let slot = unsafe { slots.range(i, i + 1) };
        slot[0].write(f(i));
    });
    // SAFETY: `on_pool` returned, so every one of the `items` slots was written (a panic in
    // `f` propagates out of `on_pool` before this line, leaking what was written).
    unsafe { out.set_len(items) };
    out
}

/// Runs `f(i, chunk)` on the pool ([`on_pool`]) for every chunk `i` of `chunk` elements of
/// `out` (the last may be shorter).
pub(crate) fn chunks_on_pool<T: Send>(
    out: &mut [T],
    chunk: usize,
    f: impl Fn(usize, &mut [T]) + Sync,
) {
    let (len, chunk) = (out.len(), chunk.max(1));
    let out = Disjoint::new(out);
    on_pool(len.div_ceil(chunk), len, |i| {
        let (lo, hi) = (i * chunk, len.min((i + 1) * chunk));
        // SAFETY: every chunk index is handed to one call only: the ranges never overlap.
        f(i, unsafe { out.range(lo, hi) })
    });
}

/// A slice that several threads write through, each in ranges no other thread touches.
struct Disjoint<'a, T> {
    ptr: *mut T,
    len: usize,
    /// The exclusive borrow of the slice, for as long as ranges of it can be taken.
    _slice: std::marker::PhantomData<&'a mut [T]>,
}

// SAFETY: the slice is only reached through `range`, whose callers guarantee that concurrent
// ranges are disjoint; the values move between threads, hence `T: Send`.
unsafe impl<T: Send> Sync for Disjoint<'_, T> {}

impl<'a, T> Disjoint<'a, T> {
    fn new(s: &'a mut [T]) -> Self {
        Self {
            ptr: s.as_mut_ptr(),
            len: s.len(),
            _slice: std::marker::PhantomData,
        }
    }

    /// Elements `lo..hi`.
    ///
    /// # Safety
    /// No other live reference may overlap `lo..hi`: no two threads ask for overlapping ranges.
    #[allow(clippy::mut_from_ref)]
    unsafe fn range(&self, lo: usize, hi: usize) -> &mut [T] {
        assert!(
            lo <= hi && hi <= self.len,
            "range {lo}..{hi} of {}",
            self.len
        );
        // SAFETY: in bounds (asserted), borrowed exclusively for `'a` (the marker), and
        // exclusive among the callers by their contract.
        unsafe { std::slice::from_raw_parts_mut(self.ptr.add(lo), hi - lo) }
    }
}

/// A vector of `len` values written by `fill`, which gets them uninitialised and must write
/// every one (the element-wise kernels through [`elementwise`]). Zero-filling a fresh output
/// first, as `vec![0; len]` does, was a whole extra pass over it: the normalisation took 2.2×
/// the time of the kernel alone (2-core Xeon, 2026-11-23).
pub(crate) fn written<T>(len: usize, fill: impl FnOnce(&mut [MaybeUninit<T>])) -> Vec<T> {
    let mut out = Vec::with_capacity(len);
    fill(&mut out.spare_capacity_mut()[..len]);
    // SAFETY: the capacity is at least `len`, and `fill` wrote all `len` values (its contract:
    // the kernels' closures write every position of the slices `elementwise` hands them,
    // zipping each with inputs of the same length).
    unsafe { out.set_len(len) };
    out
}

/// Lanes of the reduction inner loops: partial sums of `LANES` consecutive values (or channels)
/// kept apart so that the compiler keeps them in vector registers (four AVX2 registers of f64)
/// without reassociating floating-point additions. Enough independent additions per step to
/// hide their latency.
pub(crate) const LANES: usize = 16;

/// The two contributions per value that a per-channel reduction sums, read from its inputs.
///
/// A trait rather than closures so that the compiler inlines them into the vectorised loops
/// of [`row_sums`] and [`segment_sums`] (closures were left as calls).
pub(crate) trait Terms {
    /// Contributions of the [`LANES`] consecutive values from flat index `i`, whose per-channel
    /// constants start at index `j` (channels-last: the channel of value `i`; a channels-first
    /// segment: 0, its constants repeated [`LANES`] times).
    fn lanes(&self, i: usize, j: usize) -> ([f64; LANES], [f64; LANES]);

    /// Contribution of the value at flat index `i`, with the per-channel constants at `j`.
    fn one(&self, i: usize, j: usize) -> (f64, f64);
}

/// Rows per sub-block of [`row_sums`]: at least [`MIN_SUB_ROWS`], else about 1 KiB of f32
/// input. Measured on the benchmark's shapes (2-core Xeon, 2026-11-23): larger sub-blocks left
/// the strided first reads of a tile to the hardware prefetcher, which missed them.
const SUB_BLOCK: usize = 256;
/// The fewest rows a sub-block holds, so that a tile's sums are loaded and stored once per
/// several rows even for wide rows.
const MIN_SUB_ROWS: usize = 4;

/// Adds per-channel sums over `rows` rows of `c = a.len()` values into `a` and `b` (`[C]`
/// each): `t.lanes(r·C + j, j)` for the tile of channels `j..j + LANES` of row `r`,
/// `t.one(r·C + j, j)` for each of the last `C % LANES` channels.
///
/// Channels go in tiles of [`LANES`] whose partial sums stay in vector registers over a
/// sub-block of a few rows ([`SUB_BLOCK`]), the tiles of a sub-block one after the other.
#[inline(always)]
pub(crate) fn row_sums(rows: usize, a: &mut [f64], b: &mut [f64], t: &impl Terms) {
    let c = a.len();
    let full = c / LANES * LANES;
    let per = (SUB_BLOCK / c).max(MIN_SUB_ROWS);
    for r0 in (0..rows).step_by(per) {
        let r1 = (r0 + per).min(rows);
        for j in (0..full).step_by(LANES) {
            let mut acc_a: [f64; LANES] = a[j..j + LANES].try_into().expect("LANES channels");
            let mut acc_b: [f64; LANES] = b[j..j + LANES].try_into().expect("LANES channels");
            for r in r0..r1 {
                let (u, v) = t.lanes(r * c + j, j);
                // Two loops: the compiler then adds whole vectors instead of pairing `a[i]`
                // with `b[i]`.
                for i in 0..LANES {
                    acc_a[i] += u[i];
                }
                for i in 0..LANES {
                    acc_b[i] += v[i];
                }
            }
            a[j..j + LANES].copy_from_slice(&acc_a);
            b[j..j + LANES].copy_from_slice(&acc_b);
        }
        for j in full..c {
            for r in r0..r1 {
                let (u, v) = t.one(r * c + j, j);
                a[j] += u;
                b[j] += v;
            }
        }
    }
}

/// `(Σu, Σv)` of a channels-first segment of `len` values, summed as rows of [`LANES`] lanes
/// by [`row_sums`] (`t`'s constants repeated [`LANES`] times), the last `len % LANES` values
/// into the first lanes (one loop for both layouts).
#[inline(always)]
pub(crate) fn segment_sums(len: usize, t: &impl Terms) -> (f64, f64) {
    let (mut a, mut b) = ([0f64; LANES], [0f64; LANES]);
    row_sums(len / LANES, &mut a, &mut b, t);
    // Through memory: otherwise the compiler vectorises the two final sums together, pairing
    // `a[i]` with `b[i]` in two-lane vectors back into the loop, at a third of the speed.
    let (mut a, mut b) = (std::hint::black_box(a), std::hint::black_box(b));
    let full = len / LANES * LANES;
    for (i, j) in (full..len).enumerate() {
        let (u, v) = t.one(j, 0);
        a[i] += u;
        b[i] += v;
    }
    (a.iter().sum(), b.iter().sum())
}

/// Set to a non-empty value other than `0` to run the baseline (SSE2) kernels even on a CPU
/// with AVX2 (read once per process; the test suite runs both ways).
pub const NO_SIMD_ENV: &str = "CANDLE_DISTRIBUTED_NO_SIMD";

/// True when the CPU has AVX2 and FMA and [`NO_SIMD_ENV`] does not forbid them.
#[cfg(target_arch = "x86_64")]
#[inline]
pub(crate) fn has_avx2_fma() -> bool {
    static ENABLED: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *ENABLED.get_or_init(|| {
        let off = std::env::var(NO_SIMD_ENV).is_ok_and(|v| !v.is_empty() && v != "0");
        !off && std::is_x86_feature_detected!("avx2") && std::is_x86_feature_detected!("fma")
    })
}

/// Defines a kernel leaf function `$name<T: Elem>` compiled twice, for the baseline target and
/// for AVX2 + FMA (4 f64 / 8 f32 lanes instead of SSE2's 2 / 4), and picks one at run time. The
/// body is inlined into both twins, so each is optimised for its instruction set.
macro_rules! simd_fn {
    ($(#[$m:meta])* fn $name:ident<T: Elem>($($a:ident : $t:ty),* $(,)?) -> $r:ty $body:block) => {
        $(#[$m])*
        #[allow(clippy::too_many_arguments)]
        fn $name<T: Elem>($($a: $t),*) -> $r {
            #[inline(always)]
            #[allow(clippy::too_many_arguments)]
            fn body<T: Elem>($($a: $t),*) -> $r $body
            #[cfg(target_arch = "x86_64")]
            {
                #[target_feature(enable = "avx2,fma")]
                #[allow(clippy::too_many_arguments)]
                fn fast<T: Elem>($($a: $t),*) -> $r {
                    body($($a),*)
                }
                if $crate::device::cpu::has_avx2_fma() {
                    // SAFETY: `fast` only differs from `body` by being compiled for AVX2 and FMA,
                    // which this CPU supports (checked at run time just above).
                    return unsafe { fast($($a),*) };
                }
            }
            body($($a),*)
        }
    };
}
pub(crate) use simd_fn;
