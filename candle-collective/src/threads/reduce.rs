//! The parallel sum of a [`super::ThreadGroup`] all-reduce: every rank of the group helps.
//!
//! Once the last rank has deposited its tensor, the result is computed in blocks of
//! [`BLOCK`] elements that the ranks claim one at a time, each block written once into a single
//! output shared by all ranks: the inputs are read once, the result written once, by as many
//! threads as there are ranks. Within a block the sum runs in rank order in f32 (f16 and bf16
//! inputs are widened), so the result is bitwise the same on every rank, whichever thread
//! computed which block.
//!
//! With a wire dtype (`AllReduce::wire`), each rank's value is rounded to the wire
//! dtype before it is added and the result is rounded to it after the average: the values
//! another backend would carry in that dtype, without the two casts that would carry them.
//!
//! f32 blocks take one pass on a CPU with AVX2 and F16C ([`super::fused`]); other dtypes, and
//! every dtype on other CPUs, go a strip at a time through working buffers.

use std::mem::MaybeUninit;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Mutex;

use candle_core::{bail, DType, Device, Result, Shape, Storage, Tensor, WithDType};
use half::{bf16, f16, slice::HalfFloatSliceExt};

use super::fused;
use crate::round::Wire;
use crate::ReduceOp;

/// Elements per claimed block (64 KiB of f32): few enough claims that their atomic counter
/// costs nothing, enough blocks that the ranks share a large reduction evenly.
pub(super) const BLOCK: usize = 16384;

/// Elements summed at a time within a block: the partial sums and one widened input (4 KiB
/// each) stay in the L1 cache while the ranks' inputs stream through.
const STRIP: usize = 1024;

/// A reduction the ranks of a call compute together.
pub(super) trait Work: Send + Sync + std::fmt::Debug {
    /// Whether every block has been claimed (a rank that finds so waits for the result).
    fn claimed_all(&self) -> bool;

    /// Computes blocks until none is left to claim. Returns the result when this thread
    /// completed the last block, `None` otherwise.
    fn help(&self) -> Option<Result<Tensor>>;
}

/// Builds the parallel reduction of `inputs` (`inputs[r]`: rank `r`'s values, one tensor or the
/// parts of one `Collective::all_reduce_with` laid end to end; every rank's parts of the same
/// element counts and dtype, on the host) into a result of `shape`, or `None` when the dtype
/// or the operation is one it does not cover (integer dtypes, f64, maximum and minimum; the
/// caller then reduces on one thread).
pub(super) fn plan(
    inputs: &[&[Tensor]],
    shape: &Shape,
    op: ReduceOp,
    wire: Option<DType>,
) -> Result<Option<Box<dyn Work>>> {
    if !matches!(op, ReduceOp::Sum | ReduceOp::Avg) || shape.elem_count() == 0 {
        return Ok(None);
    }
    if !matches!(wire, None | Some(DType::F16 | DType::BF16)) {
        return Ok(None);
    }
    let Some(first) = inputs[0].first() else {
        return Ok(None);
    };
    Ok(match first.dtype() {
        DType::F32 => Some(Box::new(Job::<f32>::new(inputs, shape, op, wire)?)),
        DType::F16 => Some(Box::new(Job::<f16>::new(inputs, shape, op, wire)?)),
        DType::BF16 => Some(Box::new(Job::<bf16>::new(inputs, shape, op, wire)?)),
        _ => None,
    })
}

/// An element type the parallel reduction widens to f32 and narrows back.
trait Lane: WithDType + std::fmt::Debug {
    /// `dst[i] = src[i]` as f32 (exact).
    fn widen(src: &[Self], dst: &mut [f32]);
    /// `dst[i] = src[i]` rounded to `Self` (to nearest, ties to even).
    fn narrow(src: &[f32], dst: &mut [Self]);
    /// `acc[i] += src[i]` as f32; `tmp` (as long as `src`) holds the widened values if needed.
    fn add_widened(src: &[Self], acc: &mut [f32], tmp: &mut [f32]) {
        Self::widen(src, tmp);
        add(acc, tmp);
    }
    /// `dst[i] = src[i]` as f32, rounded to the wire dtype.
    fn widen_rounded(src: &[Self], dst: &mut [f32], wire: &Wire) {
        Self::widen(src, dst);
        wire.round(dst);
    }
    /// Elements `range` of the result into `dst` in one pass, bitwise what the strips give;
    /// `false` (nothing written) where this type or CPU has no such pass.
    fn fused(
        _ins: &[&[Self]],
        _range: std::ops::Range<usize>,
        _dst: &mut [MaybeUninit<Self>],
        _scale: Option<f32>,
        _wire: &Wire,
        _stream: bool,
    ) -> bool {
        false
    }
}

/// `acc[i] += v[i]`.
fn add(acc: &mut [f32], v: &[f32]) {
    acc.iter_mut().zip(v).for_each(|(a, v)| *a += v);
}

impl Lane for f32 {
    fn widen(src: &[f32], dst: &mut [f32]) {
        dst.copy_from_slice(src);
    }
    fn narrow(src: &[f32], dst: &mut [f32]) {
        dst.copy_from_slice(src);
    }
    fn add_widened(src: &[f32], acc: &mut [f32], _: &mut [f32]) {
        add(acc, src);
    }
    fn widen_rounded(src: &[f32], dst: &mut [f32], wire: &Wire) {
        wire.round_from(src, dst);
    }
    fn fused(
        ins: &[&[f32]],
        range: std::ops::Range<usize>,
        dst: &mut [MaybeUninit<f32>],
        scale: Option<f32>,
        wire: &Wire,
        stream: bool,
    ) -> bool {
        fused::sum(ins, range, dst, scale, wire, stream)
    }
}

impl Lane for f16 {
    fn widen(src: &[f16], dst: &mut [f32]) {
        src.convert_to_f32_slice(dst);
    }
    fn narrow(src: &[f32], dst: &mut [f16]) {
        dst.convert_from_f32_slice(src);
    }
}

impl Lane for bf16 {
    fn widen(src: &[bf16], dst: &mut [f32]) {
        src.convert_to_f32_slice(dst);
    }
    fn narrow(src: &[f32], dst: &mut [bf16]) {
        dst.convert_from_f32_slice(src);
    }
}

/// The output every rank shares, written block by block before it is handed out.
struct Output<T> {
    /// The buffer, with capacity for every element; taken by the thread that completes the
    /// last block.
    buf: Mutex<Option<Vec<T>>>,
    /// `buf`'s heap allocation, which does not move while the `Vec` sits in the mutex.
    ptr: *mut MaybeUninit<T>,
}

// SAFETY: `ptr` points into the heap allocation `buf` owns, which lives as long as the job.
// Threads write through it only to blocks they claimed with `Job::next` (each block by exactly
// one thread, disjoint ranges), and the buffer is read only after every block's completion has
// been counted in `Job::finished` (release by the writers, acquire by the reader).
unsafe impl<T: Send> Send for Output<T> {}
// SAFETY: as above; shared access goes through the mutex or through disjoint claimed ranges.
unsafe impl<T: Send> Sync for Output<T> {}

impl<T> std::fmt::Debug for Output<T> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Output")
    }
}

/// The reduction of one call's inputs, in blocks.
#[derive(Debug)]
struct Job<T> {
    /// `inputs[r][p]`: rank `r`'s part `p` (one part but for an all-reduce of several), contiguous.
    inputs: Vec<Vec<Tensor>>,
    /// Where each part starts in the result, then the result's length.
    starts: Vec<usize>,
    shape: Shape,
    len: usize,
    /// The factor of an average (`1 / world`), `None` for a sum.
    scale: Option<f32>,
    wire: Option<DType>,
    /// Whether the result is large enough for non-temporal stores ([`fused::STREAM_BYTES`]).
    stream: bool,
    blocks: usize,
    /// The next block to claim.
    next: AtomicUsize,
    /// Blocks written.
    finished: AtomicUsize,
    out: Output<T>,
}

impl<T: Lane> Job<T> {
    fn new(inputs: &[&[Tensor]], shape: &Shape, op: ReduceOp, wire: Option<DType>) -> Result<Self> {
        let inputs = inputs
            .iter()
            .map(|parts| parts.iter().map(|t| t.contiguous()).collect())
            .collect::<Result<Vec<Vec<_>>>>()?;
        let mut starts = vec![0];
        for t in &inputs[0] {
            starts.push(starts[starts.len() - 1] + t.elem_count());
        }
        let len = shape.elem_count();
        if starts[starts.len() - 1] != len {
            bail!(
                "all_reduce: parts of {} values for a result of {len}",
                starts[starts.len() - 1]
            )
        }
        let mut buf = Vec::<T>::with_capacity(len);
        let ptr = buf.as_mut_ptr().cast::<MaybeUninit<T>>();
        Ok(Self {
            shape: shape.clone(),
            scale: (op == ReduceOp::Avg).then(|| (1.0 / inputs.len() as f64) as f32),
            inputs,
            starts,
            len,
            wire,
            stream: len * std::mem::size_of::<T>() >= fused::STREAM_BYTES,
            blocks: len.div_ceil(BLOCK),
            next: AtomicUsize::new(0),
            finished: AtomicUsize::new(0),
            out: Output {
                buf: Mutex::new(Some(buf)),
                ptr,
            },
        })
    }

    /// Computes block `b` from the ranks' inputs (`parts[p][r]`: rank `r`'s part `p`) into the
    /// output, part by part where the block spans several: in one pass where there is one,
    /// else a strip at a time.
    fn block(&self, b: usize, parts: &[Vec<&[T]>], s: &mut Scratch<T>) {
        let (start, end) = (b * BLOCK, self.len.min((b + 1) * BLOCK));
        // SAFETY: the block lies in a range this thread alone claimed (`next` hands out each
        // index once), `end <= len` is within the allocation's capacity, and no other
        // reference to this range exists until the buffer is handed out after the last block
        // (see `Output`).
        let dst = unsafe { std::slice::from_raw_parts_mut(self.out.ptr.add(start), end - start) };
        // The part holding `start` (the last of several that start there: the others are empty).
        let mut p = self.starts.partition_point(|&at| at <= start) - 1;
        let mut at = start;
        while at < end {
            let (lo, hi) = (self.starts[p], end.min(self.starts[p + 1]));
            if hi > at {
                let (ins, out) = (&parts[p], &mut dst[at - start..hi - start]);
                let range = at - lo..hi - lo;
                if !T::fused(ins, range.clone(), out, self.scale, &s.wire, self.stream) {
                    for (i, o) in range.step_by(STRIP).zip(out.chunks_mut(STRIP)) {
                        self.strip(i, ins, o, s);
                    }
                }
                at = hi;
            }
            p += 1;
        }
    }

    /// Elements `lo..lo + out.len()` of the result into `out`: the ranks' values summed in rank
    /// order.
    fn strip(&self, lo: usize, ins: &[&[T]], out: &mut [MaybeUninit<T>], s: &mut Scratch<T>) {
        let n = out.len();
        let (acc, tmp) = (&mut s.acc[..n], &mut s.tmp[..n]);
        T::widen_rounded(&ins[0][lo..lo + n], acc, &s.wire);
        for x in &ins[1..] {
            if let Wire::None = s.wire {
                T::add_widened(&x[lo..lo + n], acc, tmp);
            } else {
                T::widen_rounded(&x[lo..lo + n], tmp, &s.wire);
                add(acc, tmp);
            }
        }
        s.wire.scale_round(acc, self.scale);
        T::narrow(acc, &mut s.lanes[..n]);
        for (d, v) in out.iter_mut().zip(&s.lanes[..n]) {
            d.write(*v);
        }
    }

    /// The result, once every block is written.
    fn finish(&self) -> Result<Tensor> {
        let mut buf = self
            .out
            .buf
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .take()
            .ok_or_else(|| candle_core::Error::Msg("all_reduce: result taken twice".into()))?;
        // SAFETY: every block `0..blocks` was written (counted in `finished`, read with acquire
        // ordering by the caller), so the first `len` elements are initialised.
        unsafe { buf.set_len(self.len) };
        Tensor::from_vec(buf, self.shape.clone(), &Device::Cpu)
    }
}

impl<T: Lane> Work for Job<T> {
    fn claimed_all(&self) -> bool {
        self.next.load(Ordering::Relaxed) >= self.blocks
    }

    fn help(&self) -> Option<Result<Tensor>> {
        let guards: Vec<Vec<_>> = (self.inputs.iter())
            .map(|parts| parts.iter().map(|t| t.storage_and_layout()).collect())
            .collect();
        // `slices[p][r]`: rank `r`'s part `p`.
        let slices: Result<Vec<Vec<&[T]>>> = (0..self.starts.len() - 1)
            .map(|p| {
                let n = self.starts[p + 1] - self.starts[p];
                (guards.iter())
                    .map(|rank| {
                        let (storage, layout) = &rank[p];
                        match &**storage {
                            Storage::Cpu(cpu) => {
                                let all = cpu.as_slice::<T>()?;
                                let at = layout.start_offset();
                                Ok(&all[at..at + n])
                            }
                            _ => bail!("all_reduce: ThreadGroup reduces on the host"),
                        }
                    })
                    .collect()
            })
            .collect();
        let mut scratch = Scratch::new(self.wire);
        let mut done = false;
        loop {
            let b = self.next.fetch_add(1, Ordering::Relaxed);
            if b >= self.blocks {
                break;
            }
            // An input that is not a host slice cannot be summed; its block still counts, so
            // that the call ends (with the error) instead of leaving the others waiting.
            if let Ok(parts) = &slices {
                self.block(b, parts, &mut scratch);
            }
            done = self.finished.fetch_add(1, Ordering::AcqRel) + 1 == self.blocks;
        }
        if !done {
            return None;
        }
        Some(slices.and_then(|_| self.finish()))
    }
}

/// One thread's working space: a strip of partial sums, a strip of widened input, and a strip
/// of output lanes; the wire's own lanes when there is a wire.
struct Scratch<T> {
    acc: Vec<f32>,
    tmp: Vec<f32>,
    lanes: Vec<T>,
    wire: Wire,
}

impl<T: Lane> Scratch<T> {
    fn new(wire: Option<DType>) -> Self {
        Self {
            acc: vec![0.0; STRIP],
            tmp: vec![0.0; STRIP],
            lanes: vec![T::zero(); STRIP],
            wire: Wire::to(wire),
        }
    }
}
