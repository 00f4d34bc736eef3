//! Deterministic parallel drivers of the CPU kernels on candle's worker pool: fixed work items
//! combined in a fixed order, so that results do not depend on the number of threads.

use std::mem::MaybeUninit;
use std::ops::Range;
use std::sync::atomic::{AtomicUsize, Ordering::Relaxed};

use super::super::Geometry;

/// Elements per parallel work item (a few hundred KiB of input).
const BLOCK: usize = 1 << 15;

/// The fewest channels-last rows in a work item of [`reduce2`], up to [`MAX_ROW_ITEM`] values:
/// each item also pays for `C`-long work of its own (its shifts, zeroed sums and their move to
/// the common shift, the combination), which wide rows left at 1/128 of a [`BLOCK`]-sized
/// item. With the single buffer of [`reduce2`], 512-row items made the channels-last
/// statistics of C = 256 faster than 128-row ones (measured: docs/benchmarks.md, section
/// "SyncBatchNorm on the CPU, world size 1, against PyTorch and candle-nn").
const MIN_ITEM_ROWS: usize = 512;

/// The most values in a work item of channels-last rows of [`reduce2`].
const MAX_ROW_ITEM: usize = 4 * BLOCK;

/// Per-channel two-accumulator reduction: returns `[acc0[c]..., acc1[c]...]` (2C values).
///
/// `plane(ch, lo, hi)` sums the channels-first segment `lo..hi` of channel `ch`;
/// `rows(lo, hi, acc)` adds rows `lo..hi` of a channels-last input into `acc` (`[2, C]`,
/// zeros, starting on a 64-byte boundary when `C` is a multiple of 4).
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
        let per = (BLOCK / c).max(MIN_ITEM_ROWS.min(MAX_ROW_ITEM / c)).max(1);
        let items = nrows.div_ceil(per);
        // Every item's sums in one buffer (no allocation per item), zeroed by the item itself
        // on the pool, from a cache-line boundary so that the kernels' 32-byte loads and
        // stores of the sums do not straddle lines.
        let slot = 2 * c;
        let mut parts: Vec<f64> = Vec::with_capacity(items * slot + 8);
        let line = (64 - parts.as_ptr() as usize % 64) % 64 / 8;
        let slots = Disjoint::new(&mut parts.spare_capacity_mut()[line..line + items * slot]);
        on_pool(items, g.len(), |i| {
            // SAFETY: every item index is handed to one call only, so the slots never overlap.
            let acc = unsafe { slots.range(i * slot, (i + 1) * slot) };
            acc.fill(MaybeUninit::new(0.0));
            // SAFETY: every value of the slot was just written.
            let acc = unsafe { &mut *(acc as *mut [MaybeUninit<f64>] as *mut [f64]) };
            rows(i * per, ((i + 1) * per).min(nrows), acc);
        });
        parts.spare_capacity_mut()[..line].fill(MaybeUninit::new(0.0));
        // SAFETY: the first `line` values were just written, and the items' slots, which cover
        // `line..line + items·slot`, were written by their items (`on_pool` returned).
        unsafe { parts.set_len(line + items * slot) };
        for p in parts[line..].chunks_exact(slot) {
            out.iter_mut().zip(p).for_each(|(o, v)| *o += v);
        }
    } else {
        let s = g.s;
        let segs = s.div_ceil(BLOCK);
        let units = g.n * c * segs;
        // Planes shorter than a block go several to a work item (`BLOCK / S` of them), so that
        // the pool's cost per item is not paid per plane of a few hundred values; each
        // segment's sums still get a slot of their own and combine in segment order.
        let group = (BLOCK / s.min(BLOCK)).max(1);
        let items = units.div_ceil(group);
        let mut parts: Vec<(f64, f64)> = Vec::with_capacity(units);
        let slots = Disjoint::new(&mut parts.spare_capacity_mut()[..units]);
        on_pool(items, g.len(), |i| {
            let (lo, hi) = (i * group, ((i + 1) * group).min(units));
            // SAFETY: every item index is handed to one call only, so the ranges of segments
            // never overlap.
            let slots = unsafe { slots.range(lo, hi) };
            let mut at = Segment::of(lo, segs, c);
            for slot in slots {
                let start = at.plane * s + at.seg * BLOCK;
                slot.write(plane(at.ch, start, (start + BLOCK).min((at.plane + 1) * s)));
                at.advance(segs, c);
            }
        });
        // SAFETY: `on_pool` returned, so every item wrote the slots of its segments, and the
        // items' ranges cover `0..units`.
        unsafe { parts.set_len(units) };
        for (p, segments) in parts.chunks_exact(segs).enumerate() {
            let ch = p % c;
            for &(a, b) in segments {
                out[ch] += a;
                out[c + ch] += b;
            }
        }
    }
    out
}

/// A segment of a channels-first reduction: the `seg`-th block of `plane` (sample·C + channel),
/// whose channel is `ch`.
struct Segment {
    plane: usize,
    seg: usize,
    ch: usize,
}

impl Segment {
    /// The `u`-th segment, with `segs` segments per plane and `c` channels.
    fn of(u: usize, segs: usize, c: usize) -> Self {
        let plane = u / segs;
        Self {
            plane,
            seg: u % segs,
            ch: plane % c,
        }
    }

    /// Moves to the next segment without dividing.
    fn advance(&mut self, segs: usize, c: usize) {
        self.seg += 1;
        if self.seg == segs {
            self.seg = 0;
            self.plane += 1;
            self.ch = if self.ch + 1 == c { 0 } else { self.ch + 1 };
        }
    }
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
/// [`on_pool`]): a few tens of microseconds of work, against the pool's few microseconds to
/// start a job. 2²⁰ before: the main job's model, whose batch norms see 2¹⁷–2¹⁹ values, then
/// ran them on one of two threads, and they took longer in `benches/step_breakdown.rs`; thread
/// ranks that queue for the pool trained as fast with either (measured: docs/benchmarks.md,
/// section "The convolution on the CPU: im2col + gemm, and the cores shared among the ranks").
const MIN_POOL_VALUES: usize = 1 << 16;

/// Runs `f(i)` for every `i < items` of a job over `values` values: on candle's CPU worker pool,
/// the threads candle's own CPU ops run on (`candle_core::utils::barrier_pool`), each thread
/// taking runs of consecutive indices that shrink as the job nears its end ([`grab`]); on the
/// calling thread below [`MIN_POOL_VALUES`].
///
/// Why shrinking runs: each thread streams through a few long regions of the tensors, as with
/// one run per thread, while whichever thread is ahead takes over the last short runs instead of
/// spinning at the end of the job (a profile of one run per thread had put part of the forward
/// in that wait); the forward and the op backward were faster than with one run per thread,
/// which had itself beaten runs of about an eighth of a thread's share handed out in turn
/// (`execute_chunked`'s own split) and single indices from a shared cursor (measured:
/// docs/benchmarks.md, section "SyncBatchNorm on the CPU, world size 1, against PyTorch and
/// candle-nn").
///
/// Why this pool: a second one beside it (rayon's, which this crate used before) competed with
/// candle's workers, which spin for a while after every candle op. Why not always: the pool
/// runs one job at a time, so thread ranks (`ThreadGroup`) would queue for it with their
/// small tensors, which they otherwise work on side by side.
///
/// A panic in `f` is caught in the pool and raised again here once every thread has stopped
/// (the rest of the panicking thread's current run is skipped, the other threads go on): a
/// panic unwinding through the pool's own lock would poison it for the rest of the process.
pub(crate) fn on_pool(items: usize, values: usize, f: impl Fn(usize) + Sync) {
    if values < MIN_POOL_VALUES || IN_JOB.get() {
        (0..items).for_each(f);
        return;
    }
    let panicked = std::sync::Mutex::new(None);
    let pool = candle_core::utils::barrier_pool();
    let threads = pool_threads();
    let next = AtomicUsize::new(0);
    let _job = JobFlag::set();
    // One "item" of `execute_chunked` per thread (it splits `threads` items into chunks of
    // one), each taking runs until none is left; called from one of the pool's workers,
    // `execute_chunked` calls this once, on that thread, which then takes every run.
    pool.execute_chunked(threads, |_| {
        let run = std::panic::AssertUnwindSafe(|| {
            while let Some(run) = grab(&next, items, threads) {
                run.for_each(&f);
            }
        });
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

/// Threads a pool job runs on: candle's workers and the calling thread.
pub(crate) fn pool_threads() -> usize {
    candle_core::utils::barrier_pool().n_workers() + 1
}

thread_local! {
    /// Whether this thread is running a pool job of [`on_pool`]: the pool's own workers run a
    /// job started inside one inline, but the thread that started a job works on it too, and
    /// a second job started there would wait for the pool's lock, which that thread holds.
    static IN_JOB: std::cell::Cell<bool> = const { std::cell::Cell::new(false) };
}

/// Marks this thread as running a pool job ([`IN_JOB`]) until dropped.
struct JobFlag;

impl JobFlag {
    fn set() -> Self {
        IN_JOB.set(true);
        JobFlag
    }
}

impl Drop for JobFlag {
    fn drop(&mut self) {
        IN_JOB.set(false);
    }
}

/// Takes the next run of indices below `items` from the shared position `next`: a
/// `1 / (2 · threads)` share of those left, at least one; `None` once none is left. With two
/// threads the first run is a quarter of the job, the next a quarter of the rest, and so on
/// down to single indices.
fn grab(next: &AtomicUsize, items: usize, threads: usize) -> Option<Range<usize>> {
    let mut at = next.load(Relaxed);
    loop {
        if at >= items {
            return None;
        }
        let take = ((items - at) / (2 * threads)).max(1);
        match next.compare_exchange_weak(at, at + take, Relaxed, Relaxed) {
            Ok(_) => return Some(at..at + take),
            Err(now) => at = now,
        }
    }
}

/// Runs `f(i, chunk)` on the pool ([`on_pool`]) for every chunk `i` of `chunk` elements of
/// `out` (the last may be shorter).
pub(crate) fn chunks_on_pool<T: Send>(
    out: &mut [T],
    chunk: usize,
    f: impl Fn(usize, &mut [T]) + Sync,
) {
    let len = out.len();
    chunks_on_pool_for(out, chunk, len, f)
}

/// [`chunks_on_pool`] for a job whose work is not its output's length: `work` (in values, or
/// multiply-adds) decides whether it goes to the pool.
pub(crate) fn chunks_on_pool_for<T: Send>(
    out: &mut [T],
    chunk: usize,
    work: usize,
    f: impl Fn(usize, &mut [T]) + Sync,
) {
    let (len, chunk) = (out.len(), chunk.max(1));
    let out = Disjoint::new(out);
    on_pool(len.div_ceil(chunk), work, |i| {
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
/// first, as `vec![0; len]` does, was a whole extra pass over it (measured: docs/benchmarks.md,
/// section "SyncBatchNorm on the CPU, world size 1, against PyTorch and candle-nn").
pub(crate) fn written<T>(len: usize, fill: impl FnOnce(&mut [MaybeUninit<T>])) -> Vec<T> {
    let mut out = Vec::with_capacity(len);
    fill(&mut out.spare_capacity_mut()[..len]);
    // SAFETY: the capacity is at least `len`, and `fill` wrote all `len` values (its contract:
    // the kernels' closures write every position of the slices `elementwise` hands them,
    // zipping each with inputs of the same length).
    unsafe { out.set_len(len) };
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::AtomicU32;

    /// Counts how often `on_pool` calls each index of a job large enough for the pool.
    fn hits(items: usize) -> Vec<u32> {
        let counts: Vec<AtomicU32> = (0..items).map(|_| AtomicU32::new(0)).collect();
        on_pool(items, MIN_POOL_VALUES, |i| {
            counts[i].fetch_add(1, Relaxed);
        });
        counts.into_iter().map(AtomicU32::into_inner).collect()
    }

    #[test]
    fn every_index_runs_once() {
        for items in [1, 2, 3, 7, 64, 1000, 4097] {
            assert!(hits(items).iter().all(|&n| n == 1), "{items} items");
        }
    }

    /// A job started from inside a pool job runs inline, every index once, on whichever
    /// thread started it (one of the pool's workers, or the thread that started the outer job,
    /// which works on it too and once waited forever for the pool's lock it held).
    #[test]
    fn a_nested_job_runs_every_index_once() {
        let (done, finished) = std::sync::mpsc::channel();
        std::thread::spawn(move || {
            let inner: Vec<AtomicU32> = (0..4 * 300).map(|_| AtomicU32::new(0)).collect();
            on_pool(4, MIN_POOL_VALUES, |o| {
                on_pool(300, MIN_POOL_VALUES, |i| {
                    inner[o * 300 + i].fetch_add(1, Relaxed);
                });
            });
            done.send(inner.iter().all(|n| n.load(Relaxed) == 1))
        });
        let once = finished.recv_timeout(std::time::Duration::from_secs(60));
        assert_eq!(
            once,
            Ok(true),
            "nested jobs: every index once, within a minute"
        );
    }

    #[test]
    fn runs_shrink_and_cover_the_job() {
        let next = AtomicUsize::new(0);
        let runs: Vec<Range<usize>> = std::iter::from_fn(|| grab(&next, 100, 2)).collect();
        assert_eq!(runs[0], 0..25);
        assert_eq!(runs[1], 25..43);
        assert!(runs
            .windows(2)
            .all(|w| w[0].end == w[1].start && w[1].len() <= w[0].len()));
        assert_eq!(runs.last().map(|r| r.end), Some(100));
        assert_eq!(runs.last().map(Range::len), Some(1));
    }

    /// A panic in a work item reaches the caller with its payload, after the pool has stopped,
    /// and the pool runs the next job normally.
    #[test]
    fn a_panic_reaches_the_caller_and_the_pool_goes_on() {
        let ran = AtomicU32::new(0);
        let caught = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            on_pool(1000, MIN_POOL_VALUES, |i| {
                ran.fetch_add(1, Relaxed);
                if i == 600 {
                    panic!("item {i} failed");
                }
            })
        }));
        let payload = caught.expect_err("the panic of item 600");
        let msg = payload.downcast_ref::<String>().map(String::as_str);
        assert_eq!(msg, Some("item 600 failed"));
        assert!(ran.load(Relaxed) <= 1000);
        assert!(hits(1000).iter().all(|&n| n == 1));
    }

    /// The channels-last path of `reduce2` on inputs big enough for the pool and for several
    /// items, with C not a multiple of 4 (sums off the cache-line boundary) and rows that do
    /// not fill the last item: each item gets zeroed sums and a row range of its own, the rows
    /// cover the input once, and the items' sums add up in item order.
    #[test]
    fn channels_last_items_get_zeroed_sums_and_cover_every_row() {
        for (c, nrows) in [
            (3usize, 700_001usize),
            (96, 12_800),
            (256, 12_544),
            (2048, 600),
        ] {
            let g = Geometry::of(
                "test",
                &[nrows, c],
                crate::layout::ChannelLayout::ChannelsLast,
            )
            .unwrap();
            let value = |r: usize, ch: usize| ((r * 31 + ch * 7) % 97) as f64 - 48.0;
            let seen: Vec<AtomicU32> = (0..nrows).map(|_| AtomicU32::new(0)).collect();
            let rows = |lo: usize, hi: usize, acc: &mut [f64]| {
                assert_eq!(acc.len(), 2 * c);
                assert!(acc.iter().all(|&v| v == 0.0), "zeroed sums");
                for (r, seen) in seen.iter().enumerate().take(hi).skip(lo) {
                    seen.fetch_add(1, Relaxed);
                    for ch in 0..c {
                        acc[ch] += value(r, ch);
                        acc[c + ch] += value(r, ch) * value(r, ch);
                    }
                }
            };
            let out = reduce2(&g, |_, _, _| unreachable!("channels-last"), rows);
            assert!(
                seen.iter().all(|n| n.load(Relaxed) == 1),
                "C = {c}: every row once"
            );
            // The sums are of small integers: exact in any order.
            for ch in 0..c {
                let a: f64 = (0..nrows).map(|r| value(r, ch)).sum();
                let b: f64 = (0..nrows).map(|r| value(r, ch) * value(r, ch)).sum();
                assert_eq!((out[ch], out[c + ch]), (a, b), "C = {c}, channel {ch}");
            }
        }
    }

    /// The channels-first path of `reduce2`: planes shorter than a block several to an item,
    /// planes longer than one in several segments, one value per plane: every segment is
    /// summed once with its own channel, and the sums add up per channel.
    #[test]
    fn channels_first_segments_are_each_summed_once_with_their_channel() {
        for [n, c, s] in [
            [64usize, 256, 196],
            [3, 5, BLOCK + 5],
            [7, 3, 50_001],
            [2, 400_000, 2],
        ] {
            let g = Geometry::of(
                "test",
                &[n, c, s],
                crate::layout::ChannelLayout::ChannelsFirst,
            )
            .unwrap();
            let value = |i: usize| ((i * 31) % 97) as f64 - 48.0;
            let calls = AtomicU32::new(0);
            let plane = |ch: usize, lo: usize, hi: usize| {
                assert!(lo < hi && hi <= g.len(), "segment {lo}..{hi}");
                assert_eq!(lo / s, (hi - 1) / s, "one plane per segment");
                assert_eq!(lo / s % c, ch, "segment {lo}..{hi} of channel {ch}");
                calls.fetch_add(1, Relaxed);
                let a: f64 = (lo..hi).map(value).sum();
                (a, (lo..hi).map(|i| value(i) * value(i)).sum())
            };
            let out = reduce2(&g, plane, |_, _, _| unreachable!("channels-first"));
            let segs = s.div_ceil(BLOCK) as u32;
            assert_eq!(calls.into_inner(), (n * c) as u32 * segs, "{n}x{c}x{s}");
            for ch in 0..c {
                let idx = || (0..n).flat_map(|k| (k * c + ch) * s..(k * c + ch + 1) * s);
                let a: f64 = idx().map(value).sum();
                let b: f64 = idx().map(|i| value(i) * value(i)).sum();
                assert_eq!((out[ch], out[c + ch]), (a, b), "{n}x{c}x{s}, channel {ch}");
            }
        }
    }
}
