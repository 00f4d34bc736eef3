//! Tensor-parallel linear layers: the weight of a `(in → out)` layer split across the ranks by
//! output features ([`ColumnParallelLinear`]) or by input features ([`RowParallelLinear`]).
//!
//! Both follow the replicated-loss convention of [`super`]: the loss is computed identically on
//! every rank from the layers' (gathered or reduced) outputs.

use std::sync::Arc;

use candle_core::{bail, Module, Result, Tensor};
use candle_nn::{Init, VarBuilder};

use super::{
    attach2, copy_to_parallel, gather_from_parallel, reduce_from_parallel, reduce_scatter,
};
use candle_collective::{Collective, ReduceOp};

/// How activations are laid out across the ranks around a tensor-parallel pair.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ParallelMode {
    /// Inputs of the column layer and outputs of the row layer replicated on every rank; the
    /// column layer's backward all-reduces the input gradient, the row layer's forward
    /// all-reduces its output.
    AllReduce,
    /// Sequence parallelism: inputs of the column layer and outputs of the row layer sharded
    /// along dimension 0 (batch or sequence, `W` equal parts). The column layer all-gathers its
    /// input in the forward and reduce-scatters the input gradient in the backward; the row
    /// layer reduce-scatters its output.
    ReduceScatter,
}

/// `y = x·Wᵀ + b` with `W` (`out × in`) split by output features: this rank holds rows
/// `[r·out/W, (r+1)·out/W)` of `W` and `b`, and produces that slice of the output features.
///
/// Input: `(…, in)` replicated (`AllReduce`), or `(n/W, …, in)` this rank's part along
/// dimension 0 (`ReduceScatter`). Output: `(…, out/W)` (all rows, this rank's features).
///
/// Backward: the input-gradient collective (all-reduce, or reduce-scatter) is started first and
/// overlaps the weight-gradient matmul, then is waited for.
#[derive(Debug)]
pub struct ColumnParallelLinear {
    weight: Tensor,
    bias: Option<Tensor>,
    comm: Arc<dyn Collective>,
    mode: ParallelMode,
    regather_input: bool,
    overlap: bool,
}

/// `y = x·Wᵀ + b` with `W` (`out × in`) split by input features: this rank holds columns
/// `[r·in/W, (r+1)·in/W)` of `W` (and the whole `b`), and its input is that slice of the
/// features (the output of a [`ColumnParallelLinear`]).
///
/// Input: `(…, in/W)`. Output: `(…, out)` replicated (`AllReduce`: the partial products are
/// all-reduced), or this rank's `1/W` of dimension 0 (`ReduceScatter`: reduce-scattered); the
/// bias is added after the reduction.
#[derive(Debug)]
pub struct RowParallelLinear {
    weight: Tensor,
    bias: Option<Tensor>,
    comm: Arc<dyn Collective>,
    mode: ParallelMode,
}

/// `n / world`, or an error naming the layer and the sizes.
fn shard(what: &str, n: usize, world: usize) -> Result<usize> {
    if world == 0 || !n.is_multiple_of(world) {
        bail!("{what}: {n} features do not split evenly over {world} ranks")
    }
    Ok(n / world)
}

/// Variables `weight` (`rows × cols`) and `bias` (`bias_len`) initialised as `candle_nn::linear`
/// initialises the full layer (bounds from the full fan-in).
fn vars(
    vb: &VarBuilder,
    rows: usize,
    cols: usize,
    fan_in: usize,
    bias_len: Option<usize>,
) -> Result<(Tensor, Option<Tensor>)> {
    let bound = 1.0 / (fan_in as f64).sqrt();
    let init = Init::Uniform {
        lo: -bound,
        up: bound,
    };
    let weight = vb.get_with_hints((rows, cols), "weight", init)?;
    let bias = bias_len
        .map(|n| vb.get_with_hints(n, "bias", init))
        .transpose()?;
    Ok((weight, bias))
}

/// `(…, k)` as `(m, k)`.
fn rows2(t: &Tensor) -> Result<Tensor> {
    let k = t.dims().last().copied().unwrap_or(0);
    t.reshape(((), k))
}

impl ColumnParallelLinear {
    /// The shard of a `in_features → out_features` layer for `comm`'s rank, variables
    /// `weight` (`out/W × in`) and `bias` (`out/W`) in `vb`. `out_features` must be a multiple
    /// of the world size. Keeps the gathered input for the backward (see
    /// [`ColumnParallelLinear::regather_input`]).
    ///
    /// # Errors
    ///
    /// When `out_features` is not a multiple of the world size, or when `vb` cannot provide
    /// `weight` or `bias` (for instance a stored tensor of another shape).
    pub fn new(
        in_features: usize,
        out_features: usize,
        bias: bool,
        mode: ParallelMode,
        vb: VarBuilder,
        comm: Arc<dyn Collective>,
    ) -> Result<Self> {
        let local = shard("ColumnParallelLinear", out_features, comm.world_size())?;
        let (weight, bias) = vars(&vb, local, in_features, in_features, bias.then_some(local))?;
        Ok(Self {
            weight,
            bias,
            comm,
            mode,
            regather_input: false,
            overlap: true,
        })
    }

    /// In `ReduceScatter` mode, all-gather the input again in the backward instead of keeping
    /// the gathered input from the forward (less memory, one more collective).
    pub fn regather_input(mut self, yes: bool) -> Self {
        self.regather_input = yes;
        self
    }

    /// Overlap the backward's input-gradient collective with the weight-gradient matmul
    /// (default). `false` waits for the collective before the matmul: the baseline of
    /// `benches/overlap.rs`.
    pub fn overlap(mut self, yes: bool) -> Self {
        self.overlap = yes;
        self
    }

    /// This rank's weight shard `(out/W, in)`.
    pub fn weight(&self) -> &Tensor {
        &self.weight
    }

    /// This rank's bias shard `(out/W)`, if any.
    pub fn bias(&self) -> Option<&Tensor> {
        self.bias.as_ref()
    }
}

impl Module for ColumnParallelLinear {
    /// `x·Wᵀ + b` for this rank's output features; in `ReduceScatter` mode the input is first
    /// all-gathered along dimension 0.
    ///
    /// # Errors
    ///
    /// When the last dimension of `x` is not `in_features` or the dtype or device of `x` differs
    /// from the weight's; in `ReduceScatter` mode, when the all-gather of the input fails (ranks
    /// whose shapes differ other than in dimension 0, a rank that left, a timeout). The collectives
    /// of the backward fail in `backward()`, not here.
    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        let in_features = self.weight.dim(1)?;
        if x.dims().last() != Some(&in_features) {
            bail!(
                "ColumnParallelLinear: the input {:?} does not end in the layer's {in_features} \
                 input features",
                x.dims()
            );
        }
        let comm = self.comm.clone();
        let w = self.weight.detach();
        let xd = x.detach();
        let full = match self.mode {
            ParallelMode::AllReduce => xd.clone(),
            ParallelMode::ReduceScatter => comm.all_gather(&xd.contiguous()?)?,
        };
        let mut out_dims = full.dims().to_vec();
        // Not empty: `x` ends in `in_features` and the all-gather keeps its rank.
        *out_dims.last_mut().expect("checked above") = w.dim(0)?;
        let y = rows2(&full)?.matmul(&w.t()?)?.reshape(out_dims)?;
        let (mode, regather, overlap) = (self.mode, self.regather_input, self.overlap);
        let kept = if mode == ParallelMode::ReduceScatter && regather {
            xd.clone()
        } else {
            full
        };
        let x_dims = x.dims().to_vec();
        let backward = move |g: &Tensor| -> Result<(Option<Tensor>, Option<Tensor>)> {
            // The collectives below, told to an overlapped data-parallel backward.
            candle_collective::in_backward::collective(|| {
                let g2 = rows2(g)?;
                // Input gradient first, its collective started at once ...
                let dx_full = g2.matmul(&w)?.contiguous()?;
                let pending = match mode {
                    ParallelMode::AllReduce => {
                        comm.start_all_reduce(std::slice::from_ref(&dx_full), ReduceOp::Sum.into())?
                    }
                    ParallelMode::ReduceScatter => {
                        comm.reduce_scatter_async(&dx_full, ReduceOp::Sum)?
                    }
                };
                // (Without overlap, the baseline of benches/overlap.rs: wait here.)
                let (waited, pending) = if overlap {
                    (None, Some(pending))
                } else {
                    (Some(pending.wait()?), None)
                };
                // ... overlapping the weight gradient.
                let input = if mode == ParallelMode::ReduceScatter && regather {
                    comm.all_gather(&kept.contiguous()?)?
                } else {
                    kept.clone()
                };
                let dw = g2.t()?.matmul(&rows2(&input)?)?;
                let dx = match (waited, pending) {
                    (Some(dx), _) => dx,
                    (None, Some(p)) => p.wait()?,
                    (None, None) => unreachable!("either waited or pending"),
                };
                let dx = dx.reshape(x_dims.as_slice())?;
                Ok((Some(dx), Some(dw)))
            })
        };
        let y = attach2(
            x,
            &self.weight,
            y,
            "column-parallel-linear",
            Box::new(backward),
        )?;
        match &self.bias {
            Some(b) => y.broadcast_add(b),
            None => Ok(y),
        }
    }
}

impl RowParallelLinear {
    /// The shard of a `in_features → out_features` layer for `comm`'s rank, variables
    /// `weight` (`out × in/W`) and `bias` (`out`, the whole bias on every rank) in `vb`.
    /// `in_features` must be a multiple of the world size.
    ///
    /// # Errors
    ///
    /// When `in_features` is not a multiple of the world size, or when `vb` cannot provide `weight`
    /// or `bias` (for instance a stored tensor of another shape).
    pub fn new(
        in_features: usize,
        out_features: usize,
        bias: bool,
        mode: ParallelMode,
        vb: VarBuilder,
        comm: Arc<dyn Collective>,
    ) -> Result<Self> {
        let local = shard("RowParallelLinear", in_features, comm.world_size())?;
        let (weight, bias) = vars(
            &vb,
            out_features,
            local,
            in_features,
            bias.then_some(out_features),
        )?;
        Ok(Self {
            weight,
            bias,
            comm,
            mode,
        })
    }

    /// This rank's weight shard `(out, in/W)`.
    pub fn weight(&self) -> &Tensor {
        &self.weight
    }

    /// The bias `(out)`, if any.
    pub fn bias(&self) -> Option<&Tensor> {
        self.bias.as_ref()
    }
}

impl Module for RowParallelLinear {
    /// `x·Wᵀ` for this rank's input features, summed over the ranks (all-reduced, or
    /// reduce-scattered along dimension 0), plus the bias.
    ///
    /// # Errors
    ///
    /// When the last dimension of `x` is not this rank's share of the input features (`in/W`) or
    /// the dtype or device of `x` differs from the weight's; when the reduction fails (ranks with
    /// different shapes, a rank that left, a timeout); in `ReduceScatter` mode, when dimension 0 of
    /// `x` is not a multiple of the world size.
    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        let partial = x.broadcast_matmul(&self.weight.t()?)?;
        let y = match self.mode {
            ParallelMode::AllReduce => reduce_from_parallel(&partial, &self.comm)?,
            ParallelMode::ReduceScatter => reduce_scatter(&partial, &self.comm, 0)?,
        };
        match (&self.bias, self.mode) {
            (Some(b), ParallelMode::AllReduce) => y.broadcast_add(b),
            // Each rank adds the (replicated) bias to its own rows only: its gradient is the
            // sum over every rank's rows, which copy_to_parallel's backward all-reduces.
            (Some(b), ParallelMode::ReduceScatter) => {
                y.broadcast_add(&copy_to_parallel(b, &self.comm)?)
            }
            (None, _) => Ok(y),
        }
    }
}

/// Gathers a column-parallel output's feature shards into the full `(…, out)` features
/// (replicated-loss gradient: each rank keeps its shard's part).
///
/// # Errors
///
/// When `y` is a scalar, or when the exchange of the sizes or the all-gather fails (ranks whose
/// shapes differ other than in the last dimension, a rank that left, a timeout).
pub fn gather_features(y: &Tensor, comm: &Arc<dyn Collective>) -> Result<Tensor> {
    gather_from_parallel(y, comm, y.rank().saturating_sub(1))
}
