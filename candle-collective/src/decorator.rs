//! [`Decorator`]: a communicator that wraps another and changes only what it needs to.

use std::sync::Arc;

use candle_core::{Result, Tensor};

use super::{AllReduce, Collective, Op, Pending, ReduceOp};

/// A communicator that wraps another one: implement [`Decorator::inner`] and the hooks you
/// need, and the type is a [`Collective`] whose every call goes to `inner` through them.
///
/// Every call runs [`before`](Decorator::before) (an error fails it on this rank without
/// reaching `inner`), then `inner`'s method; a synchronous call's result passes
/// [`after`](Decorator::after), an asynchronous call's [`Pending`] passes
/// [`after_async`](Decorator::after_async), and the subgroups of `split` (and so of
/// `new_group`) pass [`subgroup`](Decorator::subgroup), where a decorator usually wraps them
/// alike. [`super::Checked`] is one.
///
/// ```
/// use std::sync::atomic::{AtomicUsize, Ordering};
/// use std::sync::Arc;
/// use candle_core::Tensor;
/// use candle_collective::{Collective, Decorator, Op, ReduceOp, ThreadGroup};
///
/// /// Counts the calls that carry a tensor.
/// #[derive(Debug)]
/// struct Counted {
///     inner: Arc<dyn Collective>,
///     calls: AtomicUsize,
/// }
///
/// impl Decorator for Counted {
///     fn inner(&self) -> &Arc<dyn Collective> {
///         &self.inner
///     }
///     fn before(&self, _op: Op, t: Option<&Tensor>) -> candle_core::Result<()> {
///         if t.is_some() {
///             self.calls.fetch_add(1, Ordering::Relaxed);
///         }
///         Ok(())
///     }
/// }
///
/// let calls = ThreadGroup::run(2, |comm| {
///     let counted = Counted { inner: comm, calls: AtomicUsize::new(0) };
///     let t = Tensor::new(&[1f32, 2.], &candle_core::Device::Cpu)?;
///     counted.all_reduce(&t, ReduceOp::Sum)?;
///     counted.barrier()?;
///     Ok(counted.calls.load(Ordering::Relaxed))
/// })?;
/// assert_eq!(calls, [1, 1]);
/// # Ok::<(), candle_core::Error>(())
/// ```
pub trait Decorator: Send + Sync + std::fmt::Debug {
    /// The communicator every call goes on to.
    fn inner(&self) -> &Arc<dyn Collective>;

    /// Runs before every call, with its tensor (none for `barrier` and `split`).
    ///
    /// For an all-reduce with [`AllReduce::in_place`](field@AllReduce::in_place) the tensor is one the caller gave up: `inner` may
    /// write the result into its storage once this returns, so a clone kept here would show the
    /// result, not the input (copy it, e.g. with `Tensor::copy`, to keep the input).
    ///
    /// # Errors
    ///
    /// The decorator's own: the call then fails on this rank, without reaching `inner` (other
    /// ranks that reach it wait for this one until their timeout, as with any rank that does not
    /// arrive).
    fn before(&self, op: Op, t: Option<&Tensor>) -> Result<()> {
        let _ = (op, t);
        Ok(())
    }

    /// The result of a synchronous call that returns a tensor, before the caller sees it.
    ///
    /// # Errors
    ///
    /// The decorator's own.
    fn after(&self, op: Op, out: Tensor) -> Result<Tensor> {
        let _ = op;
        Ok(out)
    }

    /// An asynchronous call as `inner` started it, before the caller gets it.
    ///
    /// # Errors
    ///
    /// The decorator's own.
    fn after_async(&self, op: Op, pending: Pending) -> Result<Pending> {
        let _ = op;
        Ok(pending)
    }

    /// A subgroup communicator that `inner`'s `split` made (returned by `split` and
    /// `new_group` in its place).
    fn subgroup(&self, sub: Arc<dyn Collective>) -> Arc<dyn Collective> {
        sub
    }

    /// What [`Collective::deferred_error`] reports: by default `inner`'s.
    ///
    /// # Errors
    ///
    /// As [`Collective::deferred_error`].
    fn check_deferred(&self) -> Result<()> {
        self.inner().deferred_error()
    }

    /// What [`Collective::device`] reports: by default `inner`'s.
    fn tensor_device(&self) -> candle_core::Device {
        self.inner().device()
    }

    /// What [`Collective::defers_errors`] reports: by default `inner`'s.
    fn reports_deferred(&self) -> bool {
        self.inner().defers_errors()
    }
}

impl<D: Decorator> Collective for D {
    fn rank(&self) -> usize {
        self.inner().rank()
    }

    fn world_size(&self) -> usize {
        self.inner().world_size()
    }

    fn recorder(&self) -> Option<&super::recorder::FlightRecorder> {
        self.inner().recorder()
    }

    fn device(&self) -> candle_core::Device {
        self.tensor_device()
    }

    /// One tensor goes to `inner`'s own all-reduce with the options (its hooks see an
    /// all-reduce of that tensor), so that a decorated backend keeps the way it carries them
    /// (NCCL reduces in place, thread ranks and MPI round a wire on the host); several parts are
    /// concatenated first, and the hooks see the concatenation.
    fn all_reduce_with(&self, parts: &[Tensor], options: AllReduce) -> Result<Tensor> {
        let [t] = parts else {
            return super::all_reduce_as_one(self, parts, options);
        };
        let call = Op::AllReduce(options.op);
        self.before(call, Some(t))?;
        let out = self.inner().all_reduce_with(parts, options)?;
        self.after(call, out)
    }

    fn all_gather(&self, t: &Tensor) -> Result<Tensor> {
        self.before(Op::AllGather, Some(t))?;
        let out = self.inner().all_gather(t)?;
        self.after(Op::AllGather, out)
    }

    fn broadcast(&self, t: &Tensor, root: usize) -> Result<Tensor> {
        let call = Op::Broadcast(root);
        self.before(call, Some(t))?;
        let out = self.inner().broadcast(t, root)?;
        self.after(call, out)
    }

    fn barrier(&self) -> Result<()> {
        self.before(Op::Barrier, None)?;
        self.inner().barrier()
    }

    fn reduce_scatter(&self, t: &Tensor, op: ReduceOp) -> Result<Tensor> {
        let call = Op::ReduceScatter(op);
        self.before(call, Some(t))?;
        let out = self.inner().reduce_scatter(t, op)?;
        self.after(call, out)
    }

    /// As [`Collective::all_reduce_with`] on this type, started.
    fn start_all_reduce(&self, parts: &[Tensor], options: AllReduce) -> Result<Pending> {
        let [t] = parts else {
            return super::start_as_one(self, parts, options);
        };
        let call = Op::AllReduce(options.op);
        self.before(call, Some(t))?;
        let pending = self.inner().start_all_reduce(parts, options)?;
        self.after_async(call, pending)
    }

    fn all_gather_async(&self, t: &Tensor) -> Result<Pending> {
        self.before(Op::AllGather, Some(t))?;
        let pending = self.inner().all_gather_async(t)?;
        self.after_async(Op::AllGather, pending)
    }

    fn reduce_scatter_async(&self, t: &Tensor, op: ReduceOp) -> Result<Pending> {
        let call = Op::ReduceScatter(op);
        self.before(call, Some(t))?;
        let pending = self.inner().reduce_scatter_async(t, op)?;
        self.after_async(call, pending)
    }

    fn deferred_error(&self) -> Result<()> {
        self.check_deferred()
    }

    fn defers_errors(&self) -> bool {
        self.reports_deferred()
    }

    fn split(&self, color: Option<u32>, key: u32) -> Result<Option<Arc<dyn Collective>>> {
        self.before(Op::Split, None)?;
        Ok(self
            .inner()
            .split(color, key)?
            .map(|sub| self.subgroup(sub)))
    }
}
