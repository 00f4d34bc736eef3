//! Deterministic parallel drivers of the CPU kernels on candle's worker pool: fixed work items
//! combined in a fixed order, so that results do not depend on the number of threads.

use std::mem::MaybeUninit;

use super::super::Geometry;

/// Elements per parallel work item (a few hundred KiB of input).
const BLOCK: usize = 1 << 15;

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
    if g.is_empty() {
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
    if g.is_empty() {
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
/// the threads candle's own CPU ops run on (`candle_core::utils::barrier_pool`), each thread
/// one contiguous run of indices; on the calling thread below [`MIN_POOL_VALUES`].
///
/// Why one run per thread: each thread then streams through one region of the tensors. Handing
/// out runs of about an eighth of a thread's share as threads free up (`execute_chunked`'s own
/// split) was slower on the 2-core EPYC development machine (2026-11-25, four alternating
/// criterion rounds): normalisation 280–302 µs against 238–244 µs and op backward 1.30–1.38
/// ms against 1.00–1.09 ms for 64x256x14x14 NHWC, forward 402–443 µs against 337–344 µs for
/// 8x32x112x112 NCHW; single indices from a shared cursor were slower still.
///
/// Why this pool: a second one beside it (rayon's, which this crate used before) competed with
/// candle's workers, which spin for a while after every candle op. Why not always: the pool
/// runs one job at a time, so thread ranks (`ThreadGroup`) would queue for it with their
/// small tensors, which they otherwise work on side by side.
///
/// A panic in `f` is caught in the pool and raised again here once every thread has stopped
/// (the rest of the panicking thread's run is skipped): a panic unwinding through the pool's
/// own lock would poison it for the rest of the process.
pub(crate) fn on_pool(items: usize, values: usize, f: impl Fn(usize) + Sync) {
    if values < MIN_POOL_VALUES {
        (0..items).for_each(f);
        return;
    }
    let panicked = std::sync::Mutex::new(None);
    let pool = candle_core::utils::barrier_pool();
    // One "item" of `execute_chunked` per thread (it splits `parts` items into chunks of one),
    // each standing for its share of the indices; nested in a pool job, `execute_chunked` runs
    // them all on the calling thread.
    let parts = pool.n_workers() + 1;
    pool.execute_chunked(parts, |range| {
        let range = range.start * items / parts..range.end * items / parts;
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
