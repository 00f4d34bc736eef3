//! The `Collective` interface of NCCL ranks: argument checks, then the NCCL call enqueued on
//! the communicator's stream under the watchdog.

use std::sync::Arc;

use candle_core::{DType, Result, Tensor};

use super::*;

impl Collective for NcclCollective {
    fn rank(&self) -> usize {
        self.rank
    }

    fn world_size(&self) -> usize {
        self.world
    }

    fn recorder(&self) -> Option<&crate::recorder::FlightRecorder> {
        Some(self.watch.recorder())
    }

    /// Fails once the communicator was aborted (a collective that did not complete in time, a
    /// CUDA error, an asynchronous NCCL error, a failed call) while collectives enqueued before
    /// were not known complete: conservatively, one that completed in the last 10 ms before the
    /// abort counts as lost.
    fn defers_errors(&self) -> bool {
        true
    }

    fn device(&self) -> candle_core::Device {
        NcclCollective::device(self)
    }

    /// Whether a collective enqueued without error was later lost to an abort of the communicator.
    ///
    /// # Errors
    ///
    /// [`CollectiveError::RankLeft`], with the abort's reason, once the watchdog aborted the
    /// communicator (a collective that did not complete in time, a CUDA error, an asynchronous NCCL
    /// error, a failed call) while collectives enqueued earlier were not known complete.
    fn deferred_error(&self) -> Result<()> {
        match self.watch.lost() {
            Some(why) => Err(self.left("deferred_error", why)),
            None => Ok(()),
        }
    }

    /// Enqueues an NCCL all-reduce of one tensor on the device's stream, with no host wait;
    /// with `in_place`, of a contiguous tensor into that tensor itself (NCCL's in-place form:
    /// one buffer sent and received, no allocation), returned. A wire dtype is cast to and from
    /// around it (NCCL then moves the wire's bytes), several parts are concatenated first (and
    /// reduced in place).
    ///
    /// # Errors
    ///
    /// As [`Collective::all_reduce_with`]: [`CollectiveError::InvalidArgument`] for a tensor not
    /// on [`NcclCollective::device`] or of a dtype NCCL does not take here,
    /// [`CollectiveError::RankLeft`] once the communicator was aborted or dropped,
    /// [`CollectiveError::Library`] when NCCL rejects the call (which aborts the communicator), or
    /// a CUDA error recording the completion event. A failure after the collective was enqueued (a
    /// timeout, a peer that left) is reported by later calls and by [`Collective::deferred_error`],
    /// not by this one. The ranks' arguments are not compared (see [`crate::Checked`]).
    fn all_reduce_with(&self, parts: &[Tensor], options: AllReduce) -> Result<Tensor> {
        let op = Op::AllReduce(options.op);
        match (parts, options.wire) {
            ([t], None) if options.in_place && t.is_contiguous() => {
                self.enqueue_in_place(op, t)?;
                Ok(t.clone())
            }
            ([t], None) => self.enqueue(op, t),
            _ => crate::all_reduce_as_one(self, parts, options),
        }
    }

    /// Enqueues an NCCL reduce-scatter of `t` on the device's stream, with no host wait.
    ///
    /// # Errors
    ///
    /// As [`Collective::reduce_scatter`]: when `t` is a scalar or its dimension 0 is not a multiple
    /// of the world size (checked on this rank only), and otherwise as `all_reduce` on this type:
    /// [`CollectiveError::InvalidArgument`] for a tensor not on [`NcclCollective::device`] or of a
    /// dtype NCCL does not take here, [`CollectiveError::RankLeft`] once the communicator was
    /// aborted or dropped, [`CollectiveError::Library`] when NCCL rejects the call (which aborts
    /// the communicator), or a CUDA error recording the completion event. A failure after the
    /// collective was enqueued (a timeout, a peer that left) is reported by later calls and by
    /// [`Collective::deferred_error`], not by this one. The ranks' arguments are not compared (see
    /// [`crate::Checked`]).
    fn reduce_scatter(&self, t: &Tensor, op: ReduceOp) -> Result<Tensor> {
        crate::scatter_rows(t, self.rank, self.world)?;
        self.enqueue(Op::ReduceScatter(op), t)
    }

    /// Unequal row counts are supported: the counts are all-gathered and read back to the host
    /// (one synchronisation), every rank's rows padded to the largest, gathered, then unpadded.
    ///
    /// # Errors
    ///
    /// As [`Collective::all_gather`]: when `t` is a scalar; the failures of the row-count exchange,
    /// which waits for the stream and so also reports an abort that happened meanwhile;
    /// [`CollectiveError::InvalidArgument`] when a rank reports an impossible row count (ranks at
    /// different calls); and for the gather itself as `all_reduce` on this type:
    /// [`CollectiveError::InvalidArgument`] for a tensor not on [`NcclCollective::device`] or of a
    /// dtype NCCL does not take here, [`CollectiveError::RankLeft`] once the communicator was
    /// aborted or dropped, [`CollectiveError::Library`] when NCCL rejects the call (which aborts
    /// the communicator), or a CUDA error recording the completion event.
    fn all_gather(&self, t: &Tensor) -> Result<Tensor> {
        let (padded, counts, max) = self.pad_for_gather(t)?;
        unpad(&self.enqueue(Op::AllGather, &padded)?, &counts, max)
    }

    /// Enqueues an NCCL broadcast from `root` on the device's stream, with no host wait.
    ///
    /// # Errors
    ///
    /// As [`Collective::broadcast`]: [`CollectiveError::InvalidArgument`] when `root` is not below
    /// the world size (checked on this rank only), and otherwise as `all_reduce` on this type:
    /// [`CollectiveError::InvalidArgument`] for a tensor not on [`NcclCollective::device`] or of a
    /// dtype NCCL does not take here, [`CollectiveError::RankLeft`] once the communicator was
    /// aborted or dropped, [`CollectiveError::Library`] when NCCL rejects the call (which aborts
    /// the communicator), or a CUDA error recording the completion event. A failure after the
    /// collective was enqueued (a timeout, a peer that left) is reported by later calls and by
    /// [`Collective::deferred_error`], not by this one. The ranks' arguments are not compared (see
    /// [`crate::Checked`]).
    fn broadcast(&self, t: &Tensor, root: usize) -> Result<Tensor> {
        if root >= self.world {
            return Err(invalid(
                "broadcast",
                format!("root {root} out of range for world size {}", self.world),
            ));
        }
        self.enqueue(Op::Broadcast(root), t)
    }

    /// An all-reduce of one value, then a wait for the stream: returns once every rank arrived.
    ///
    /// # Errors
    ///
    /// As [`Collective::barrier`]: [`CollectiveError::RankLeft`] when the communicator was aborted
    /// before or while the stream drained (a rank that never arrives is noticed at the timeout), a
    /// CUDA error while waiting for the stream, or the enqueue failures of
    /// [`Collective::all_reduce`].
    fn barrier(&self) -> Result<()> {
        let token = Tensor::zeros(1, DType::F32, &self.device())?;
        self.enqueue(Op::AllReduce(ReduceOp::Sum), &token)?;
        self.device.cuda_stream().synchronize().w()?;
        self.check_usable("barrier")
    }

    /// Enqueues an NCCL all-reduce of one tensor on the side stream, after the work already
    /// queued on the device's stream (a wire cast and parts concatenated first, on the device's
    /// stream).
    ///
    /// # Errors
    ///
    /// As [`Collective::start_all_reduce`]: the enqueue failures of [`Collective::all_reduce_with`]
    /// are returned here. [`Pending::wait`] fails with [`CollectiveError::RankLeft`] when the
    /// communicator was aborted before the collective was known complete, or on a CUDA error while
    /// making the device's stream wait for the side stream.
    fn start_all_reduce(&self, parts: &[Tensor], options: AllReduce) -> Result<Pending> {
        match (parts, options.wire) {
            ([t], None) => self.begin(Op::AllReduce(options.op), t, Ok),
            _ => crate::start_as_one(self, parts, options),
        }
    }

    /// Enqueues an NCCL reduce-scatter of `t` on the side stream, after the work already queued on
    /// the device's stream.
    ///
    /// # Errors
    ///
    /// As [`Collective::reduce_scatter_async`]: a scalar `t`, a dimension 0 that is not a multiple
    /// of the world size, and the enqueue failures of [`Collective::all_reduce`] are returned here.
    /// [`Pending::wait`] fails with [`CollectiveError::RankLeft`] when the communicator was aborted
    /// before the collective was known complete, or on a CUDA error while making the device's
    /// stream wait for the side stream.
    fn reduce_scatter_async(&self, t: &Tensor, op: ReduceOp) -> Result<Pending> {
        crate::scatter_rows(t, self.rank, self.world)?;
        self.begin(Op::ReduceScatter(op), t, Ok)
    }

    /// The row counts are exchanged (and read back) before the gather is started.
    ///
    /// # Errors
    ///
    /// As [`Collective::all_gather_async`]: a scalar `t`, the failures of the row-count exchange
    /// and the enqueue failures of [`Collective::all_reduce`] are returned here. [`Pending::wait`]
    /// fails with [`CollectiveError::RankLeft`] when the communicator was aborted before the
    /// collective was known complete, or on a CUDA error while making the device's stream wait for
    /// the side stream.
    fn all_gather_async(&self, t: &Tensor) -> Result<Pending> {
        let (padded, counts, max) = self.pad_for_gather(t)?;
        self.begin(Op::AllGather, &padded, move |all| unpad(&all, &counts, max))
    }

    /// `ncclCommSplit`, polled on this (the parent) communicator under the timeout; the child
    /// inherits the non-blocking mode and the timeout.
    ///
    /// # Errors
    ///
    /// As [`Collective::split`]: [`CollectiveError::InvalidArgument`] when `color` or `key` exceeds
    /// `i32::MAX` (on this rank only: the others wait in the split until the timeout);
    /// [`CollectiveError::RankLeft`] when the split does not complete within the timeout or the
    /// communicator was aborted; [`CollectiveError::Library`] when NCCL rejects the split (either
    /// failure aborts this communicator too) or the query of the child's rank; a CUDA error
    /// creating the child's side stream.
    fn split(&self, color: Option<u32>, key: u32) -> Result<Option<Arc<dyn Collective>>> {
        let color = match color {
            Some(c) => {
                i32::try_from(c).map_err(|_| invalid("split", format!("color {c} exceeds i32")))?
            }
            None => super::ffi::SPLIT_NOCOLOR,
        };
        let key =
            i32::try_from(key).map_err(|_| invalid("split", format!("key {key} exceeds i32")))?;
        // The slot NCCL fills is kept until the parent's call is settled or aborted (either
        // way NCCL's background thread is done with it); a child made before a failure is
        // aborted too.
        let (split, err) = self.watch.call_keeping("split", |comm| {
            comm.split(color, key).map(|s| (s, Progress::InProgress))
        });
        let child = split.and_then(|s| s.child());
        if let Some(e) = err {
            if let Some(c) = child {
                c.abort();
            }
            return Err(self.call_error("split", e));
        }
        let Some(child) = child else {
            return Ok(None);
        };
        let (rank, world) = match child.rank_and_size() {
            Ok(v) => v,
            Err(f) => {
                child.abort();
                return Err(f.error("split", self.rank));
            }
        };
        let sub = Self::start(
            child,
            self.device.clone(),
            (rank, world),
            self.watch.timeout,
            None,
            None,
        )?;
        Ok(Some(Arc::new(sub) as Arc<dyn Collective>))
    }
}
