//! Which samples each rank trains on: [`DistributedSampler`], the counterpart of PyTorch's
//! `torch.utils.data.distributed.DistributedSampler` for candle training loops.
//!
//! Each epoch has one order of the data set, a function of `(seed, epoch)` and the data set's
//! length only (not of the world size, the rank or the backend). Rank `r` of `W` takes the
//! positions `r, r + W, r + 2W, …` of that order, as PyTorch's sampler does, so that
//!
//! - the ranks' indices are disjoint and together the epoch's order ([`Remainder::Exact`]), that
//!   order less its last `len mod W` samples ([`Remainder::Drop`]) or padded by repeating its
//!   first samples ([`Remainder::Pad`], PyTorch's default);
//! - with `b` samples per rank and step, the ranks' batches of step `s` are together the
//!   positions `[s·b·W, (s+1)·b·W)` of the order: the global batches of one process with batch
//!   size `b·W`, whatever `W` (a run can resume at another world size with the same global batch
//!   and see the same data in the same steps);
//! - a run resumed at `(epoch, step)` continues with exactly the batches it would have had
//!   ([`DistributedSampler::batches`]`(epoch, b, step)`).
//!
//! The shuffle is this crate's own (SplitMix64 and a Fisher–Yates shuffle with unbiased
//! bounded draws), so that an order never changes with a dependency's version or the platform
//! (`rand`'s `StdRng` promises neither); a test pins its values. It is not PyTorch's
//! `randperm`: the same seed gives a different order than PyTorch's sampler.
//!
//! Checked in `tests/sampler.rs`: every data set length 0–150 and world sizes 1–9, with each
//! remainder policy, batch sizes 1–5, shuffled or not.

use candle_core::{bail, Device, Result, Tensor};

use candle_collective::Collective;

/// What becomes of the `len mod W` samples of an epoch that do not divide evenly among the
/// `W` ranks.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Remainder {
    /// PyTorch's default (`drop_last=False`): the epoch's order is extended by repeating its
    /// first samples until every rank has `ceil(len / W)`; those samples count twice.
    #[default]
    Pad,
    /// PyTorch's `drop_last=True`: the last `len mod W` samples of the epoch's order are left
    /// out (others next epoch, when shuffled); every rank has `floor(len / W)`.
    Drop,
    /// Every sample exactly once: the first `len mod W` ranks have one sample more. The ranks'
    /// batches then differ in size, and one may be empty at the end of an epoch:
    /// [`crate::DataParallel::join_step`] keeps the gradients those of the global batch.
    Exact,
}

/// This rank's share of a data set of `len` samples, epoch by epoch (see the
/// [module documentation](self)). Shuffled with seed 0 and [`Remainder::Pad`] unless set
/// otherwise; cheap to clone.
///
/// ```
/// use candle_distributed::sampler::{DistributedSampler, Remainder};
///
/// // 10 samples on 3 ranks, each exactly once, 2 per rank and step.
/// let shares: Vec<Vec<usize>> = (0..3)
///     .map(|rank| {
///         let s = DistributedSampler::new(10, rank, 3)?.with_remainder(Remainder::Exact);
///         Ok(s.indices(0))
///     })
///     .collect::<candle_core::Result<_>>()?;
/// let mut all: Vec<usize> = shares.concat();
/// all.sort();
/// assert_eq!(all, (0..10).collect::<Vec<_>>());
/// let s = DistributedSampler::new(10, 2, 3)?.with_remainder(Remainder::Exact);
/// assert_eq!(s.steps(2)?, 2); // rank 0 has 4 samples: 2 steps on every rank
/// assert_eq!(s.batches(0, 2, 0)?.count(), 2); // rank 2 has 3: a full batch, then one sample
/// # Ok::<(), candle_core::Error>(())
/// ```
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DistributedSampler {
    len: usize,
    rank: usize,
    world_size: usize,
    seed: u64,
    shuffle: bool,
    remainder: Remainder,
}

impl DistributedSampler {
    /// Rank `rank` of `world_size` over a data set of `len` samples.
    ///
    /// # Errors
    ///
    /// When `world_size` is 0 or `rank` is not below it.
    pub fn new(len: usize, rank: usize, world_size: usize) -> Result<Self> {
        if world_size == 0 || rank >= world_size {
            bail!("DistributedSampler: rank {rank} of a world of {world_size}: needs rank < world size")
        }
        Ok(Self {
            len,
            rank,
            world_size,
            seed: 0,
            shuffle: true,
            remainder: Remainder::default(),
        })
    }

    /// For this rank of `comm`'s group, after the ranks agreed on `len` (one all-gather of a
    /// few values, on the communicator's device: a rank whose copy of the data set has another
    /// length would share samples with the others and skip some, silently). The settings made
    /// afterwards (`with_seed`, ...) are checked by [`DistributedSampler::agree`].
    ///
    /// # Errors
    ///
    /// On every rank when the ranks' lengths differ (naming each rank's), or when the
    /// all-gather fails.
    pub fn for_comm(len: usize, comm: &dyn Collective) -> Result<Self> {
        let s = Self::new(len, comm.rank(), comm.world_size())?;
        s.agree_on(comm, false)?;
        Ok(s)
    }

    /// Checks, on every rank, that every rank's sampler has the same length, seed, shuffle and
    /// remainder policy, and is its communicator's rank and world size (one all-gather of five
    /// values per rank): call it once the settings are made. Samplers that differ in any of
    /// these would give ranks overlapping shares, or different numbers of steps, silently.
    ///
    /// # Errors
    ///
    /// On every rank when a setting differs (naming it and each rank's value), or when the
    /// all-gather fails.
    pub fn agree(&self, comm: &dyn Collective) -> Result<()> {
        self.agree_on(comm, true)
    }

    fn agree_on(&self, comm: &dyn Collective, settings: bool) -> Result<()> {
        const POLICIES: [Remainder; 3] = [Remainder::Pad, Remainder::Drop, Remainder::Exact];
        let device = &comm.device();
        let remainder = POLICIES
            .iter()
            .position(|&p| p == self.remainder)
            .unwrap_or(0) as i64;
        // Each rank's verdict on its own rank and world size first, then the settings.
        let own = i64::from(self.rank == comm.rank() && self.world_size == comm.world_size());
        let row = [
            own,
            self.len as i64,
            self.seed as i64,
            i64::from(self.shuffle),
            remainder,
        ];
        let n = if settings { row.len() } else { 2 };
        let all = comm
            .all_gather(&candle_core::Tensor::new(&row[..n], device)?.reshape((1, n))?)?
            .to_vec2::<i64>()?;
        let wrong: Vec<usize> = (0..all.len()).filter(|&r| all[r][0] == 0).collect();
        if !wrong.is_empty() {
            bail!(
                "DistributedSampler: rank(s) {wrong:?} hold a sampler of another rank or world size than their communicator's (this rank: sampler rank {} of {}, communicator rank {} of {})",
                self.rank,
                self.world_size,
                comm.rank(),
                comm.world_size()
            )
        }
        let names = ["", "length", "seed", "shuffle", "remainder"];
        for (i, name) in names.iter().enumerate().take(n).skip(1) {
            if all.iter().any(|r| r[i] != all[0][i]) {
                let each: Vec<String> = (all.iter().enumerate())
                    .map(|(r, v)| match i {
                        2 => format!("rank {r}: {}", v[i] as u64),
                        3 => format!("rank {r}: {}", v[i] != 0),
                        4 => format!("rank {r}: {:?}", POLICIES[v[i].clamp(0, 2) as usize]),
                        _ => format!("rank {r}: {}", v[i]),
                    })
                    .collect();
                bail!(
                    "DistributedSampler: the ranks' samplers differ in their {name} ({}); every rank must sample the same data set the same way (a data set copy of another length?)",
                    each.join(", ")
                )
            }
        }
        Ok(())
    }

    /// The seed of the epochs' orders (the same on every rank).
    pub fn with_seed(mut self, seed: u64) -> Self {
        self.seed = seed;
        self
    }

    /// Whether each epoch shuffles (`false`: the data set's own order, every epoch).
    pub fn with_shuffle(mut self, shuffle: bool) -> Self {
        self.shuffle = shuffle;
        self
    }

    /// What becomes of the samples that do not divide evenly ([`Remainder`]).
    pub fn with_remainder(mut self, remainder: Remainder) -> Self {
        self.remainder = remainder;
        self
    }

    /// The data set's length.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether the data set is empty.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// This sampler's rank.
    pub fn rank(&self) -> usize {
        self.rank
    }

    /// The number of ranks.
    pub fn world_size(&self) -> usize {
        self.world_size
    }

    /// The remainder policy.
    pub fn remainder(&self) -> Remainder {
        self.remainder
    }

    /// The epoch's order over every rank: a permutation of `0..len` (the identity unshuffled),
    /// less its tail ([`Remainder::Drop`]) or padded with its head ([`Remainder::Pad`]). Rank `r`
    /// takes its positions `r, r + W, …`.
    pub fn epoch_order(&self, epoch: u64) -> Vec<usize> {
        let mut order: Vec<usize> = (0..self.len).collect();
        if self.shuffle {
            shuffle(&mut order, self.seed, epoch);
        }
        let w = self.world_size;
        match self.remainder {
            Remainder::Exact => {}
            Remainder::Drop => order.truncate(self.len / w * w),
            Remainder::Pad if self.len > 0 => {
                let total = self.len.div_ceil(w) * w;
                let head = order.clone();
                order.extend(head.iter().cycle().take(total - self.len));
            }
            Remainder::Pad => {}
        }
        order
    }

    /// This rank's samples in `epoch` (0-based), in order.
    pub fn indices(&self, epoch: u64) -> Vec<usize> {
        let order = self.epoch_order(epoch);
        order
            .into_iter()
            .skip(self.rank)
            .step_by(self.world_size)
            .collect()
    }

    /// How many samples rank `rank` has per epoch.
    fn share_of(&self, rank: usize) -> usize {
        let w = self.world_size;
        match self.remainder {
            Remainder::Pad => self.len.div_ceil(w),
            Remainder::Drop => self.len / w,
            Remainder::Exact => self.len / w + usize::from(rank < self.len % w),
        }
    }

    /// This rank's samples per epoch.
    pub fn num_samples(&self) -> usize {
        self.share_of(self.rank)
    }

    /// The steps of an epoch with `per_rank` samples per rank and step: the same on every rank
    /// (enough for the rank with the most samples; a rank with fewer gets a short or an empty
    /// batch at the end, [`Remainder::Exact`] only).
    ///
    /// # Errors
    ///
    /// When `per_rank` is 0, the data set is empty, or [`Remainder::Drop`] leaves every rank
    /// without a sample (fewer samples than ranks).
    pub fn steps(&self, per_rank: usize) -> Result<usize> {
        if per_rank == 0 {
            bail!("DistributedSampler: a batch needs at least one sample per rank, got 0")
        }
        if self.len == 0 {
            bail!("DistributedSampler: the data set is empty: no epoch to sample")
        }
        if self.share_of(0) == 0 {
            bail!(
                "DistributedSampler: {} samples on {} ranks with Remainder::Drop leave every rank without a sample (use Remainder::Pad or Remainder::Exact, or fewer ranks)",
                self.len,
                self.world_size
            )
        }
        Ok(self.share_of(0).div_ceil(per_rank))
    }

    /// This rank's batches of `epoch`, `per_rank` samples each (the last may be shorter, or
    /// empty under [`Remainder::Exact`]), from step `from_step` to the end of the epoch:
    /// [`DistributedSampler::steps`] batches in all when `from_step` is 0, and the tail of the
    /// same batches when a run resumes mid-epoch.
    ///
    /// # Errors
    ///
    /// As [`DistributedSampler::steps`].
    pub fn batches(
        &self,
        epoch: u64,
        per_rank: usize,
        from_step: usize,
    ) -> Result<impl Iterator<Item = Vec<usize>>> {
        let steps = self.steps(per_rank)?;
        let mine = self.indices(epoch);
        Ok((from_step..steps).map(move |s| {
            let start = (s * per_rank).min(mine.len());
            let end = ((s + 1) * per_rank).min(mine.len());
            mine[start..end].to_vec()
        }))
    }
}

/// A batch's sample indices (from [`DistributedSampler::batches`] or
/// [`DistributedSampler::indices`]) as the `u32` tensor of shape `(len,)` on `device` that
/// candle's `Tensor::index_select` takes: `data.index_select(&index_tensor(&batch, &dev)?, 0)?`
/// gathers the batch's rows of a data set held as one tensor.
///
/// # Errors
///
/// When an index does not fit in `u32` (naming it), or the tensor cannot be made on `device`.
pub fn index_tensor(batch: &[usize], device: &Device) -> Result<Tensor> {
    let ids = batch
        .iter()
        .map(|&i| {
            u32::try_from(i).map_err(|_| {
                candle_core::Error::Msg(format!(
                    "sampler::index_tensor: sample index {i} does not fit in u32, the index type of index_select"
                ))
            })
        })
        .collect::<Result<Vec<u32>>>()?;
    Tensor::from_vec(ids, batch.len(), device)
}

/// Shuffles `v` in place: Fisher–Yates driven by SplitMix64 seeded from `(seed, epoch)`.
fn shuffle(v: &mut [usize], seed: u64, epoch: u64) {
    let mut rng = SplitMix64(seed);
    let mut rng = SplitMix64(rng.next() ^ epoch.wrapping_mul(0xD1B5_4A32_D192_ED03));
    for i in (1..v.len()).rev() {
        let j = rng.below(i as u64 + 1) as usize;
        v.swap(i, j);
    }
}

/// Vigna's SplitMix64 generator.
struct SplitMix64(u64);

impl SplitMix64 {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    /// Uniform in `0..n` (`n > 0`): Lemire's multiply-and-shift with rejection of the biased
    /// low products.
    fn below(&mut self, n: u64) -> u64 {
        let mut m = u128::from(self.next()) * u128::from(n);
        if (m as u64) < n {
            let threshold = n.wrapping_neg() % n;
            while (m as u64) < threshold {
                m = u128::from(self.next()) * u128::from(n);
            }
        }
        (m >> 64) as u64
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Draws below `n` are uniform: 60 000 draws below 6 land within 5 standard deviations of
    /// 10 000 in every bucket.
    #[test]
    fn bounded_draws_are_uniform() {
        let mut rng = SplitMix64(42);
        let mut counts = [0u32; 6];
        for _ in 0..60_000 {
            counts[rng.below(6) as usize] += 1;
        }
        let sd = (60_000.0_f64 * (1.0 / 6.0) * (5.0 / 6.0)).sqrt();
        for c in counts {
            assert!((f64::from(c) - 10_000.0).abs() < 5.0 * sd, "{counts:?}");
        }
    }
}
