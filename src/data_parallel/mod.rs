//! Data-parallel training: `N` replicas of one model, each on its share of the global batch,
//! that take exactly the steps of one model.
//!
//! At start, every variable is broadcast from rank 0 (replicas start identical whatever their
//! initialisation). After `loss.backward()`, [`DataParallel::sync_gradients`] averages every
//! trainable gradient over the ranks in flattened buckets (one all-reduce per bucket, buckets in
//! a fixed order) and returns a `GradStore` that any candle optimizer accepts.
//!
//! What the average is: with each rank's loss the mean over its own batch, the synchronised
//! gradient is `(1/W) Σ_r ∇L_r`, the mean over ranks of per-rank means — PyTorch DDP's
//! convention. With equal per-rank batches this is the gradient of the mean over the global
//! batch, so `W` ranks take the steps of one process on the concatenated batch (with
//! [`crate::SyncBatchNorm`] for batch norm). With unequal batches, samples of smaller batches
//! weigh more; scale each rank's loss by `W·n_r / N` to get the global mean instead.
//!
//! Also here: gradient accumulation over micro-batches with one all-reduce per step
//! ([`DataParallel::accumulate`], PyTorch's `no_sync`), 16-bit gradients on the wire
//! ([`DataParallel::with_wire_dtype`]), and loops over uneven inputs ([`join`]).
//!
//! # The smallest loop
//!
//! With any backend and any candle model built from a `VarMap`:
//!
//! ```rust,ignore
//! let dp = DataParallel::new(&varmap, comm.clone())?;        // broadcasts every variable from rank 0
//! let mut opt = candle_nn::AdamW::new(dp.trainable(), params)?; // batch-norm buffers excluded
//! let loss = candle_nn::loss::cross_entropy(&model.forward(&x_local, true)?, &y_local)?;
//! opt.step(&dp.sync_gradients(loss.backward()?)?)?;          // averaged over ranks, in buckets
//! ```
//!
//! `examples/sync_train.rs` is this loop end to end, in one file: a 2-layer CNN with
//! `SyncBatchNorm` on 4 thread ranks of unequal batches (14, 10, 14, 10), each rank's loss scaled
//! by `W·n_r/N`, stepped beside `candle_nn::BatchNorm` on one process with the concatenated batch
//! (`cargo run --release --example sync_train`); it exits non-zero when the largest relative
//! difference from the one process is above 1e-3 (measured: docs/benchmarks.md, section "The
//! `sync_train` example against one process").
//!
//! `DataParallel::new` receives every variable from rank 0 before it sets any, so a start that
//! fails midway (a rank that left, a timeout) leaves every rank's variables as they were
//! (`tests/data_parallel.rs::cpu::a_failed_start_changes_no_variable`).
//!
//! Gradients are flattened into buckets (25 MiB by default, `with_bucket_bytes`), in name order,
//! one all-reduce (average) per bucket (on the host handed over as the gradients themselves,
//! the parts of one `Collective::all_reduce_with`: thread ranks sum them where they lie,
//! without copying them into a bucket first); a variable without a gradient on some rank counts
//! as zero there (one without a gradient on every rank gets none, so an optimizer leaves it
//! alone), and every rank issues the same collectives. The result is PyTorch DDP's: the mean over
//! ranks of each rank's gradient. With each rank's loss the mean over its own batch and equal
//! per-rank batches, N ranks with `SyncBatchNorm` take exactly the steps of one process with plain
//! batch norm on the concatenated batch (`tests/data_parallel.rs`: SGD and AdamW, rounding-level
//! differences in f64); with unequal batches, samples of smaller batches weigh more — scale each
//! rank's loss by `W·n_r / Σn` for the global mean (the ResNet example does). A different model on
//! some rank is an error on every rank.
//!
//! # The training loop
//! The loop a user writes around `DataParallel`, with everything below tested on thread ranks in
//! `cargo test` (`tests/training.rs`) and, where marked, on 4 MPI processes (`scripts/test-mpi.sh`):
//!
//! ```rust,ignore
//! use candle_distributed::amp::{GradScaler, GradScalerConfig};
//! let dp = DataParallel::new(&varmap, comm.clone())?;
//! let mut scaler = GradScaler::new(GradScalerConfig::default())?;  // f16 only; PyTorch's defaults
//! loop {
//!     let batch = my_batches.next();                           // None once this rank is done
//!     let step = dp.join_step(batch.as_ref().map_or(0, len))?; // one all-reduce of 2 values
//!     if step.done() { break }                                 // every rank is out of data
//!     let mut grads = None;
//!     for micro in split(batch.unwrap_or(empty), k) {          // gradient accumulation
//!         let loss = (loss_sum(&model, &micro)? * step.loss_weight())?; // W / N_step
//!         grads = Some(dp.accumulate(grads, scaler.scale(&loss)?.backward()?)?);
//!     }
//!     let synced = dp.sync_gradients(grads.unwrap_or_default())?; // once per step
//!     scaler.step(&mut opt, synced, &dp.trainable())?;          // skipped on every rank on overflow
//! }
//! ```
//!
//! - **Loss scaling** (`amp::GradScaler`): dynamic scale with PyTorch's defaults (2¹⁶, ×2 after
//!   2000 clean steps, ×0.5 on overflow) and update rule
//!   (`the_scale_follows_pytorchs_rule`), bad settings refused (`bad_scaler_settings_are_refused`).
//!   The found-inf flag needs no collective of its own: it is read from the *averaged* gradients,
//!   which are the same on every rank and non-finite as soon as one rank's are. A rank whose loss
//!   is Inf makes every rank skip the step and halve its scale, and the steps taken equal one
//!   unscaled process (`an_overflow_on_one_rank_skips_the_step_on_every_rank`). With f16 compute and
//!   f32 master weights, a loss whose every gradient underflows to 0 without scaling gets gradients
//!   within f16 precision of an f64 computation with it
//!   (`scaling_keeps_f16_gradients_from_underflowing`).
//! - **Uneven inputs** (`DataParallel::join_step`): a rank out of data runs forward and backward on
//!   an empty batch, so that its SyncBatchNorm layers serve the others' all-reduces with a count of
//!   0 (exact), and contributes zero gradients. The average divides by the initial world size
//!   (PyTorch's default, `divide_by_initial_world_size=True`); weighting each rank's loss *sum* by
//!   `W / N_step` makes it the mean over the step's samples. Ranks with 5, 3 and 0 batches all
//!   finish after 5 steps and equal one process on each step's concatenated batches
//!   (`uneven_inputs_finish_everywhere_and_match_one_process`; MPI: 5, 3, 0 and 2 batches). Note
//!   that candle drops `x.affine(0., 0.)` from the autograd graph and refuses `log_softmax` on an
//!   empty tensor: an empty rank's loss must be a product with a zero *tensor* (see the example's
//!   `loss_sum`), or its batch norms' backward never runs and the others wait.
//! - **Gradient accumulation** (`DataParallel::accumulate`, PyTorch's `no_sync`): gradients summed
//!   locally over `k` micro-batches, one all-reduce per bucket per step; SyncBatchNorm still
//!   synchronises each micro-batch's forward and backward. 3 micro-batches on 2 ranks issue exactly
//!   `2 × 2 × 3 + 1` collectives per step and equal one process accumulating the same
//!   micro-batches (`accumulation_all_reduces_gradients_once_per_step`; MPI: the same on 4
//!   processes).
//! - **16-bit gradients on the wire** (`DataParallel::with_wire_dtype(Some(BF16 | F16))`): the
//!   bucket goes through `Collective::all_reduce_with` with the wire dtype (`AllReduce::wire`;
//!   host gradients as its parts), which casts it before the all-reduce and
//!   back after (NCCL), or rounds each value to the wire dtype on the host, bitwise the same
//!   without the casts (`ThreadGroup` while it sums, MPI in the buffer it sends); 16-bit values
//!   are summed in f32 except on NCCL.
//!   Steps stay within the wire dtype's rounding of the f32 ones
//!   (`sixteen_bit_gradients_on_the_wire_stay_close`). What it buys on each backend (nothing on
//!   `ThreadGroup`, whose ranks share memory, nor on MPI, which sends f32 whatever the wire dtype;
//!   NCCL reduces 16-bit values natively, not measured) is in the crate's `docs/benchmarks.md`.
//! - **The all-reduce overlapped with the backward** ([`GradHooks`], [`DataParallel::with_overlap`],
//!   [`DataParallel::backward`], [`DataParallel::step`]; PyTorch DDP's bucket hooks): the model
//!   is built from `hooks.var_builder(&varmap, ..)`, whose trainable tensors are copies of the
//!   variables through an identity op that reports each variable's complete gradient during the
//!   backward. From the second step on, a bucket's all-reduce starts as soon as its gradients
//!   are in, at a place every rank agreed on between the collectives the backward itself
//!   issues (SyncBatchNorm's, the tensor-parallel layers'), so that a model whose used
//!   variables differ between ranks (stochastic depth, expert routing, a data-dependent
//!   branch) still issues one collective order on every rank; a bucket still incomplete at its
//!   place starts with what it has and is sent again, whole, after the backward. The first
//!   step learns the order the gradients arrive in and the places, and sends every bucket
//!   after its backward. After every
//!   overlapped backward one small all-reduce (max of a few hundred bytes, whatever the world
//!   size) and one host read tell every rank whether any rank's backward failed (then every
//!   rank fails the step, nothing returned), whether any model computed with stale hooked
//!   copies, and which buckets to send again. The gradients equal
//!   `sync_gradients(loss.backward()?)`'s bit for bit, with f32 and the 16-bit wires, an
//!   unused layer, a shared weight, accumulated micro-batches and a layer used on some ranks
//!   only beside SyncBatchNorm and a tensor-parallel layer (`tests/overlap.rs`, thread ranks on
//!   the CPU and the simulated GPU; `tests/mpi.rs` on 4 MPI processes; `tests/nccl.rs`, the
//!   simulated NCCL in both of its progress modes). Thread ranks sum every element in rank
//!   order whatever the bucket; a real NCCL (and MPI, by message size) may choose the order of
//!   a bucket's sums by its size and an element's offset in it, and the overlapped buckets are
//!   cut differently from `sync_gradients`' (by arrival, not by name), so there the two may
//!   differ by rounding beyond two ranks (untried on real hardware). With one bucket per variable every
//!   bucket starts inside the backward from the second step on. Costs: a second copy of the
//!   trainable variables (the hooked copies) and one device copy of them per step
//!   ([`DataParallel::refresh`], which [`DataParallel::step`] calls after the optimizer), and
//!   the exchange; in exchange the hooks hand each gradient over instead of letting candle add
//!   it into a zeroed slot: on the simulated GPU one allocation, memset and launch fewer per
//!   variable than `loss.backward()` + `sync_gradients`
//!   (`tests/gpu_counts.rs::an_overlapped_backward_starts_buckets_before_its_last_kernel`). A
//!   variable used both through the builder and directly is an error naming it (its gradient
//!   would be split). The hooked copies are never silently stale: a backward through hooks no
//!   `DataParallel` took is refused, and a backward whose model computed with copies that
//!   differ from their variables (an optimizer step without a refresh, a load after
//!   `with_overlap`) is refused on every rank naming the variable and `dp.refresh()`
//!   (compared on every step on the CPU; on other devices after `with_overlap` and after
//!   gradients were handed out without a refresh since). Behind a stand-in link as slow as
//!   the compute, a ResNet-20/56 step on 2 and 4 thread ranks takes well under the sum of
//!   compute and communication, every bucket started inside the backward (`cargo bench
//!   --bench ddp_overlap`; the figures are in the crate's `docs/benchmarks.md`).
//! - **Checkpoints** are the program's: the ResNet example (`examples/resnet/`) writes weights,
//!   batch-norm buffers, optimizer moments and step, scaler state, epoch and step as one
//!   consistent pair of files and resumes bit for bit.

mod check;
mod hooks;
pub mod join;
mod overlap;
mod pack;

use std::sync::{Arc, Mutex};

use candle_core::backprop::GradStore;
use candle_core::{bail, DType, Device, Result, Tensor, Var};
use candle_nn::VarMap;

use crate::ops;
use candle_collective::{AllReduce, Collective, ReduceOp};

pub use hooks::GradHooks;
pub use join::JoinStep;
pub use overlap::OverlapStats;

/// Default bucket size: 25 MiB of gradients per all-reduce (PyTorch DDP's default).
pub const DEFAULT_BUCKET_BYTES: usize = 25 << 20;

/// Names of batch-norm buffers: variables of a `VarMap` that no optimizer should touch.
const BUFFER_SUFFIXES: [&str; 3] = ["running_mean", "running_var", "num_batches_tracked"];

/// Gradient averaging across the ranks of a [`Collective`] group for one model.
///
/// ```
/// use candle_core::{DType, Device, Tensor};
/// use candle_distributed::collective::ThreadGroup;
/// use candle_distributed::DataParallel;
/// use candle_nn::{linear, Module, Optimizer, VarBuilder, VarMap, SGD};
///
/// ThreadGroup::run(2, |comm| {
///     let vm = VarMap::new();
///     let model = linear(4, 1, VarBuilder::from_varmap(&vm, DType::F32, &Device::Cpu))?;
///     let dp = DataParallel::new(&vm, comm.clone())?; // rank 0's weights everywhere
///     let mut opt = SGD::new(dp.trainable(), 0.1)?;
///     let x = Tensor::full(comm.rank() as f32, (3, 4), &Device::Cpu)?; // this rank's batch
///     let loss = model.forward(&x)?.sqr()?.mean_all()?;
///     let grads = dp.sync_gradients(loss.backward()?)?; // averaged over both ranks
///     opt.step(&grads)
/// })?;
/// # Ok::<(), candle_core::Error>(())
/// ```
#[derive(Debug)]
pub struct DataParallel {
    comm: Arc<dyn Collective>,
    /// Trainable variables, by name (the bucket order).
    params: Vec<(String, Var)>,
    bucket_bytes: usize,
    /// The dtype gradients travel in (None: their own).
    wire: Option<DType>,
    /// The variables' device (the communicator's): where the small control tensors live.
    device: Device,
    /// The model's gradient hooks, when the all-reduce overlaps the backward.
    overlap: Option<GradHooks>,
    /// What the last overlapped backward did.
    stats: Mutex<OverlapStats>,
    /// What the last overlapped backward agreed on for the next one (the buckets' order and
    /// places).
    learned: Mutex<Option<overlap::Learned>>,
}

impl DataParallel {
    /// Every variable of `varmap` is broadcast from rank 0; the trainable ones are those of a
    /// float dtype whose name does not end in `running_mean`, `running_var` or
    /// `num_batches_tracked` (batch-norm buffers). Collective: every rank calls it with a
    /// `VarMap` of the same names and shapes (checked: a difference is an error on every rank).
    ///
    /// # Errors
    ///
    /// When the `VarMap`'s lock is poisoned, and as [`DataParallel::from_vars`] with every variable
    /// of `varmap` in `all`.
    pub fn new(varmap: &VarMap, comm: Arc<dyn Collective>) -> Result<Self> {
        let mut all: Vec<(String, Var)> = varmap
            .data()
            .lock()
            .map_err(|_| {
                candle_core::Error::Msg("data_parallel: the VarMap's lock is poisoned".into())
            })?
            .iter()
            .map(|(k, v)| (k.clone(), v.clone()))
            .collect();
        all.sort_by(|a, b| a.0.cmp(&b.0));
        let params = all
            .iter()
            .filter(|(name, v)| {
                v.dtype().is_float() && !BUFFER_SUFFIXES.iter().any(|s| name.ends_with(s))
            })
            .cloned()
            .collect();
        Self::from_vars(all, params, comm)
    }

    /// Explicit lists: `all` (name, variable) pairs broadcast from rank 0, `trainable` those
    /// whose gradients are averaged. Both are put in name order.
    ///
    /// # Errors
    ///
    /// When the ranks' `all` lists differ in names, shapes or dtypes, or their `trainable` lists
    /// in names, or when a `trainable` entry is not one of `all` (the same variable under the
    /// same name) on some rank (each an error on every rank); when
    /// the check's all-gather or a broadcast fails (a rank that left, a timeout, a variable on
    /// another device than the communicator takes); or when a variable cannot be set to rank 0's
    /// value. After a failed broadcast this rank's variables are all unchanged.
    pub fn from_vars(
        mut all: Vec<(String, Var)>,
        mut trainable: Vec<(String, Var)>,
        comm: Arc<dyn Collective>,
    ) -> Result<Self> {
        all.sort_by(|a, b| a.0.cmp(&b.0));
        trainable.sort_by(|a, b| a.0.cmp(&b.0));
        // The fingerprint travels on the variables' device, which is the communicator's (NCCL
        // takes tensors on its own GPU only).
        let device = all.first().map_or(Device::Cpu, |(_, v)| v.device().clone());
        check::same_model(&*comm, &all, &trainable, &device)?;
        // Every broadcast first, then every assignment: a failure in the middle (a rank that
        // left, a timeout) leaves this rank's variables all as they were, not half rank 0's.
        let from_root = all
            .iter()
            .map(|(_, v)| comm.broadcast(v.as_tensor(), 0))
            .collect::<Result<Vec<_>>>()?;
        // Rank 0 keeps its own values (a backend may hand the very same tensor back).
        if comm.rank() != 0 {
            for ((_, v), t) in all.iter().zip(&from_root) {
                v.set(t)?;
            }
        }
        Ok(Self {
            comm,
            params: trainable,
            bucket_bytes: DEFAULT_BUCKET_BYTES,
            wire: None,
            device,
            overlap: None,
            stats: Mutex::new(OverlapStats::default()),
            learned: Mutex::new(None),
        })
    }

    /// Sets the bytes of gradients per all-reduce (at least one variable per bucket).
    pub fn with_bucket_bytes(mut self, bytes: usize) -> Self {
        self.bucket_bytes = bytes.max(1);
        self
    }

    /// Gradients travel as `dtype` (`F16` or `BF16`: half the bytes of f32) and come back in
    /// their own dtype; `None` (the default) sends them as they are. Every rank must choose
    /// the same. The bucket goes through [`crate::collective::Collective::all_reduce_with`]
    /// with the wire dtype (a [`crate::collective::AllReduce`]'s `wire`; host gradients as its
    /// parts); what the sum is computed in is the backend's: [`crate::collective::ThreadGroup`]
    /// and MPI accumulate 16-bit values in f32 (MPI also sends them as f32, having no 16-bit
    /// float type, so it saves no bytes; both round f32 gradients to the wire dtype on the host
    /// instead of casting them), NCCL in the wire dtype. f16's range is narrow: a gradient
    /// above 65504 becomes Inf (with a [`crate::amp::GradScaler`] that reads as an
    /// overflow and skips the step; without one it reaches the weights), and values below
    /// 6·10⁻⁵ lose precision, below 6·10⁻⁸ become 0. bf16 keeps f32's range with 8 significant
    /// bits.
    ///
    /// # Errors
    /// A `dtype` that is not `F16` or `BF16`.
    pub fn with_wire_dtype(mut self, dtype: Option<DType>) -> Result<Self> {
        if let Some(d) = dtype {
            if !matches!(d, DType::F16 | DType::BF16) {
                bail!("data_parallel: wire dtype {d:?}: expected F16 or BF16 (or None)")
            }
        }
        self.wire = dtype;
        Ok(self)
    }

    /// Adds the gradients of the trainable variables in `micro` to those in `total` (when
    /// given) and returns the sum, for gradient accumulation: run `k` micro-batches, each
    /// `loss.backward()` passed through `accumulate`, then call [`Self::sync_gradients`] once
    /// on the sum (one all-reduce per bucket per step instead of per micro-batch, PyTorch's
    /// `no_sync`). Purely local. With each micro-batch's loss divided by `k`, the step is that
    /// of one process on the `k` micro-batches at once, except for batch norm, whose
    /// statistics are per micro-batch ([`crate::SyncBatchNorm`] still synchronises each
    /// micro-batch's forward and backward, as in PyTorch). Other entries of `micro` (gradients
    /// of non-trainable tensors) are dropped.
    ///
    /// # Errors
    /// Those of the additions (a gradient whose shape or dtype changed between micro-batches).
    pub fn accumulate(&self, total: Option<GradStore>, mut micro: GradStore) -> Result<GradStore> {
        let mut sum = total.unwrap_or_default();
        for (_, v) in &self.params {
            let Some(g) = micro.remove(v.as_tensor()) else {
                continue;
            };
            let next = match sum.get(v.as_tensor()) {
                Some(acc) => (acc + &g)?,
                None => g,
            };
            sum.insert(v.as_tensor(), next);
        }
        Ok(sum)
    }

    /// The trainable variables, to hand to an optimizer.
    pub fn trainable(&self) -> Vec<Var> {
        self.params.iter().map(|(_, v)| v.clone()).collect()
    }

    /// The trainable variables with their names, in bucket (name) order.
    pub fn named_trainable(&self) -> &[(String, Var)] {
        &self.params
    }

    /// The communicator.
    pub fn comm(&self) -> &Arc<dyn Collective> {
        &self.comm
    }

    /// Averages the gradient of every trainable variable over the ranks: `grads` (this rank's,
    /// from `loss.backward()`) comes back with each trainable variable's gradient replaced by
    /// the mean over ranks. A variable without a gradient on some rank counts as zero there; one
    /// without a gradient on every rank gets none. Every rank issues the same all-reduces
    /// whatever gradients it has (one per bucket, with a flag per variable riding along; only a
    /// rank missing a gradient reads those flags back). With [`DataParallel::with_overlap`]
    /// (gradients of a plain backward through the hooks, as for accumulated micro-batches), the
    /// ranks first agree that no model computed with stale hooked copies (one all-reduce of a
    /// flag, read on the host).
    ///
    /// # Errors
    ///
    /// With the overlap, on every rank when some rank's model computed with stale hooked copies
    /// (naming the variable there). When a bucket's all-reduce fails: a rank that left, a timeout, ranks whose trainable
    /// variables differ (possible with lists passed to [`DataParallel::from_vars`]), or, on
    /// `ThreadGroup` and MPI, a trainable variable of an integer dtype (an average needs a float
    /// dtype); also when a gradient cannot be converted to its variable's dtype and flattened into
    /// the bucket, or has another element count than its variable (an error on that rank only,
    /// before the all-reduce: the other ranks wait in it until their timeout).
    pub fn sync_gradients(&self, grads: GradStore) -> Result<GradStore> {
        if let Some(hooks) = &self.overlap {
            // Gradients of a plain backward through adopted hooks: computed with the hooked
            // copies, which every rank checks (one all-reduce of a flag) before any bucket.
            let stale = hooks.stale(&self.device)?;
            let flag = Tensor::new(&[f32::from(u8::from(stale.is_some()))], &self.device)?;
            let any = self
                .comm
                .all_reduce(&flag, ReduceOp::Max)?
                .to_vec1::<f32>()?[0];
            if let Some(e) = stale {
                bail!(
                    "{}",
                    e.replace("DataParallel::backward", "DataParallel::sync_gradients")
                )
            }
            if any > 0.0 {
                return Err(candle_collective::CollectiveError::elsewhere(
                    self.comm.rank(),
                    format!(
                        "DataParallel::sync_gradients: rank {}: another rank's model computed \
                         with stale hooked copies of its variables (its error says which)",
                        self.comm.rank()
                    ),
                ));
            }
            let synced = self.sync_buckets(grads)?;
            hooks.handed_out();
            return Ok(synced);
        }
        self.sync_buckets(grads)
    }

    /// The buckets of [`DataParallel::sync_gradients`], in name order.
    fn sync_buckets(&self, mut grads: GradStore) -> Result<GradStore> {
        for bucket in self.buckets() {
            let (dtype, device) = (bucket[0].1.dtype(), bucket[0].1.device().clone());
            let mut missing_here = false;
            let mut parts: Vec<Option<Tensor>> = Vec::with_capacity(bucket.len());
            let lens: Vec<usize> = bucket.iter().map(|(_, v)| v.elem_count()).collect();
            for (name, v) in bucket {
                let g = grads.get(v.as_tensor());
                if let Some(g) = g.filter(|g| g.elem_count() != v.elem_count()) {
                    bail!(
                        "DataParallel::sync_gradients: the gradient of `{name}` has shape {:?}, \
                         the variable {:?}",
                        g.dims(),
                        v.dims()
                    )
                }
                missing_here |= g.is_none();
                parts.push(g.map(|g| g.to_dtype(dtype)?.contiguous()).transpose()?);
            }
            // One flag per variable rides along in the same all-reduce: non-zero after it when
            // some rank has a gradient. Only a rank missing a gradient reads the flags back.
            let options = AllReduce {
                wire: self.wire,
                ..ReduceOp::Avg.into()
            };
            let avg = if device.is_cpu() {
                // Thread ranks sum the gradients where they lie; other backends concatenate.
                let parts = ops::pack::parts(&parts, &lens, dtype, &device)?;
                self.comm.all_reduce_with(&parts, options)?
            } else {
                // The bucket is this call's own: NCCL averages it in place.
                let flat = [ops::pack::pack(&parts, &lens, dtype, &device)?];
                self.comm.all_reduce_with(&flat, options.in_place())?
            };
            let vars: Vec<&Var> = bucket.iter().map(|(_, v)| v).collect();
            pack::unpack(&vars, &avg, missing_here, &mut grads)?;
        }
        Ok(grads)
    }

    /// Overlaps the gradient all-reduce with the backward ([`DataParallel::backward`]) for a
    /// model built with `hooks.var_builder(..)` over this `DataParallel`'s `VarMap`: each bucket
    /// starts as soon as its gradients are complete, while the backward computes the earlier
    /// layers' (see [`GradHooks`]). Also copies the variables (now rank 0's) into the hooked
    /// tensors. Collective: every rank calls it with a model built in the same order.
    ///
    /// ```
    /// use candle_core::{DType, Device, Module, Tensor};
    /// use candle_distributed::collective::ThreadGroup;
    /// use candle_distributed::{DataParallel, GradHooks};
    /// use candle_nn::{linear, Optimizer, VarMap, SGD};
    ///
    /// ThreadGroup::run(2, |comm| {
    ///     let vm = VarMap::new();
    ///     let hooks = GradHooks::new();
    ///     let model = linear(4, 1, hooks.var_builder(&vm, DType::F32, &Device::Cpu))?;
    ///     let dp = DataParallel::new(&vm, comm.clone())?.with_overlap(&hooks)?;
    ///     let mut opt = SGD::new(dp.trainable(), 0.1)?;
    ///     let x = Tensor::full(comm.rank() as f32, (3, 4), &Device::Cpu)?;
    ///     let loss = model.forward(&x)?.sqr()?.mean_all()?;
    ///     dp.step(&mut opt, &loss) // overlapped backward, optimizer step, hooked copies refreshed
    /// })?;
    /// # Ok::<(), candle_core::Error>(())
    /// ```
    ///
    /// # Errors
    ///
    /// On every rank, when a hooked variable is not one of this `DataParallel`'s variables on
    /// some rank, or the ranks took their variables from the builder in different orders (their
    /// buckets would start in different orders); when the check's all-gather fails; when a
    /// hooked tensor cannot be refreshed.
    pub fn with_overlap(mut self, hooks: &GradHooks) -> Result<Self> {
        let (names, strays) = hooks.with_hooked(|h| {
            let known: std::collections::HashSet<candle_core::TensorId> = self
                .params
                .iter()
                .map(|(_, v)| v.as_tensor().id())
                .collect();
            let names: Vec<String> = h.iter().map(|x| x.name.clone()).collect();
            let strays = (h.iter())
                .filter(|x| !known.contains(&x.var.as_tensor().id()))
                .filter(|x| !BUFFER_SUFFIXES.iter().any(|b| x.name.ends_with(b)))
                .count();
            (names, strays)
        });
        let mut h: u64 = 0xcbf2_9ce4_8422_2325;
        for n in &names {
            for &b in n.as_bytes().iter().chain(b"\0") {
                h = (h ^ u64::from(b)).wrapping_mul(0x0000_0100_0000_01b3);
            }
        }
        let mine = Tensor::new(
            &[[names.len() as i64, (h >> 1) as i64, strays as i64]],
            &self.device,
        )?;
        let every = self.comm.all_gather(&mine)?.to_vec2::<i64>()?;
        let stray_ranks: Vec<usize> = (0..every.len()).filter(|&r| every[r][2] > 0).collect();
        if !stray_ranks.is_empty() {
            bail!(
                "DataParallel::with_overlap: the hooks hold variables that are not this DataParallel's trainable ones on rank(s) {stray_ranks:?} (build the model with hooks.var_builder over the VarMap given to DataParallel::new)"
            )
        }
        if every.iter().any(|e| e[..2] != every[0][..2]) {
            bail!(
                "DataParallel::with_overlap: the ranks took their variables from the builder in different orders or numbers (count and fingerprint per rank: {:?}); every rank must build the same model in the same order",
                every.iter().map(|e| (e[0], e[1])).collect::<Vec<_>>()
            )
        }
        hooks.refresh()?;
        hooks.adopt();
        self.overlap = Some(hooks.clone());
        *self.learned.get_mut().unwrap_or_else(|e| e.into_inner()) = None;
        Ok(self)
    }

    /// `loss.backward()` and the gradient average of [`DataParallel::sync_gradients`] in one:
    /// with [`DataParallel::with_overlap`], each bucket's all-reduce starts during the backward
    /// at its agreed place, as soon as its gradients are complete (from the second step on; the
    /// first sends every bucket after its backward and learns the order and the places); without,
    /// the two run one after the other. Either way the result is
    /// `sync_gradients(loss.backward()?)`'s, bit for bit on thread ranks (and on MPI and the
    /// simulated NCCL in the tests; a real NCCL may order a bucket's sums by its layout, see the
    /// module documentation), and every rank issues the same collectives in the same order,
    /// whatever each rank's model routes. With the overlap, every call ends with the exchange
    /// (one all-reduce of `4 + B + P` 64-bit integers, `+ P` on the first step, for `B` buckets
    /// and `P` trainable variables, and one read of it on the host).
    ///
    /// # Errors
    ///
    /// Those of the backward and of [`DataParallel::sync_gradients`]. With the overlap, on
    /// every rank (after every started bucket completed, nothing returned): when any rank's
    /// backward failed (that rank with its error, the others naming it), when a hooked variable
    /// was used directly as well (its gradient would be split), when any rank's model computed
    /// with stale hooked copies (naming the variable and [`DataParallel::refresh`]). A rank whose
    /// backward failed before all of the collectives the backward announces (it cannot take
    /// part in them), or on the first step, leaves at once: the others fail at the
    /// communicator's timeout. Also when called inside another backward of the model.
    pub fn backward(&self, loss: &Tensor) -> Result<GradStore> {
        self.backward_accumulated(loss, None)
    }

    /// [`DataParallel::backward`] of the last micro-batch of a step, with `earlier` the
    /// [`DataParallel::accumulate`]d gradients of the step's other micro-batches (run through a
    /// plain `loss.backward()`, which starts nothing): each variable's bucket carries `earlier`
    /// plus this backward's gradient, so nothing is sent before the last micro-batch.
    ///
    /// # Errors
    ///
    /// As [`DataParallel::backward`]; also when an earlier gradient cannot be added.
    pub fn backward_accumulated(
        &self,
        loss: &Tensor,
        earlier: Option<GradStore>,
    ) -> Result<GradStore> {
        let Some(hooks) = &self.overlap else {
            let grads = loss.backward()?;
            let grads = match earlier {
                Some(e) => self.accumulate(Some(e), grads)?,
                None => grads,
            };
            return self.sync_gradients(grads);
        };
        // The forward that made `loss` computed with the hooked copies: were they current?
        let stale = hooks.stale(&self.device)?;
        let hooked = hooks.with_hooked(|h| h.iter().map(|x| x.var.clone()).collect::<Vec<_>>());
        let learned = self
            .learned
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .clone();
        let plan = overlap::Plan::new(&self.params, &hooked, self.bucket_bytes, learned.as_ref());
        let launcher = overlap::Launcher::new(
            self.comm.clone(),
            self.wire,
            Arc::new(plan),
            self.params.clone(),
            self.device.clone(),
            earlier.as_ref(),
        );
        hooks.arm(launcher)?;
        let result = {
            // Disarmed however the backward ends, a panic included.
            let _armed = hooks.armed_until_dropped();
            // The collectives of the backward place the buckets.
            let _listening = candle_collective::in_backward::listen(hooks.announcer());
            let result = loss.backward();
            (result, hooks.disarm())
        };
        let (result, Some(launcher)) = result else {
            candle_core::bail!("DataParallel::backward: the hooks were disarmed")
        };
        // What every rank agreed on is kept as soon as it is known, before this rank's own
        // waits (a failure there must not leave it on other places than the others).
        let first_order = learned.as_ref().map(|l| l.order.clone());
        let keep = |mut next: overlap::Learned| {
            if let Some(order) = first_order {
                next.order = order; // the order agreed on the first step stays
            }
            *self.learned.lock().unwrap_or_else(|e| e.into_inner()) = Some(next);
        };
        let (grads, stats) =
            launcher.finish(result, learned.as_ref().map(|l| l.announced), stale, keep)?;
        *self.stats.lock().unwrap_or_else(|e| e.into_inner()) = stats;
        hooks.handed_out();
        Ok(grads)
    }

    /// One training step: [`DataParallel::backward`], `opt.step`, then
    /// [`DataParallel::refresh`] (so that the next forward sees the new values).
    ///
    /// # Errors
    ///
    /// Those of the three.
    pub fn step<O: candle_nn::Optimizer>(&self, opt: &mut O, loss: &Tensor) -> Result<()> {
        let grads = self.backward(loss)?;
        opt.step(&grads)?;
        self.refresh()
    }

    /// Copies every hooked variable's value into the hooked tensor the model computes with:
    /// needed after anything changes the variables (an optimizer step, a checkpoint load)
    /// unless [`DataParallel::step`] did it. Nothing without [`DataParallel::with_overlap`].
    ///
    /// # Errors
    ///
    /// When a copy fails.
    pub fn refresh(&self) -> Result<()> {
        match &self.overlap {
            Some(h) => h.refresh(),
            None => Ok(()),
        }
    }

    /// What the last overlapped [`DataParallel::backward`] did: its buckets, how many of them
    /// started while the backward was still running, were held back or sent again, and the
    /// collectives the backward announced.
    pub fn overlap_stats(&self) -> OverlapStats {
        *self.stats.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Consecutive runs of same-dtype, same-device variables of at most `bucket_bytes` (or one).
    fn buckets(&self) -> Vec<&[(String, Var)]> {
        let mut out = Vec::new();
        let mut start = 0;
        let mut bytes = 0;
        for (i, (_, v)) in self.params.iter().enumerate() {
            let size = v.elem_count() * v.dtype().size_in_bytes();
            let first = &self.params[start].1;
            let compatible = v.dtype() == first.dtype() && v.device().same_device(first.device());
            if i > start && (!compatible || bytes + size > self.bucket_bytes) {
                out.push(&self.params[start..i]);
                start = i;
                bytes = 0;
            }
            bytes += size;
        }
        if start < self.params.len() {
            out.push(&self.params[start..]);
        }
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_collective::ThreadGroup;
    use candle_core::{DType, Device};

    #[test]
    fn buckets_respect_size_dtype_and_order() {
        let comm = ThreadGroup::new(1).unwrap().remove(0);
        let v = |n: usize, d: DType| Var::zeros(n, d, &Device::Cpu).unwrap();
        let vars = vec![
            ("a".to_string(), v(4, DType::F32)),
            ("b".to_string(), v(4, DType::F32)),
            ("c".to_string(), v(100, DType::F32)),
            ("d".to_string(), v(2, DType::F64)),
        ];
        let dp = DataParallel::from_vars(vars.clone(), vars, comm)
            .unwrap()
            .with_bucket_bytes(40);
        let names: Vec<Vec<&str>> = dp
            .buckets()
            .iter()
            .map(|b| b.iter().map(|(n, _)| n.as_str()).collect())
            .collect();
        assert_eq!(names, vec![vec!["a", "b"], vec!["c"], vec!["d"]]);
    }

    #[test]
    fn batch_norm_buffers_are_not_trainable() {
        let vm = VarMap::new();
        let vb = candle_nn::VarBuilder::from_varmap(&vm, DType::F32, &Device::Cpu);
        candle_nn::batch_norm(3, candle_nn::BatchNormConfig::default(), vb.pp("bn")).unwrap();
        let comm = ThreadGroup::new(1).unwrap().remove(0);
        let dp = DataParallel::new(&vm, comm).unwrap();
        let names: Vec<&str> = dp.params.iter().map(|(n, _)| n.as_str()).collect();
        assert_eq!(names, vec!["bn.bias", "bn.weight"]);
    }
}
