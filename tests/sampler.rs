//! `DistributedSampler` over every data set length 0–150 and world sizes 1–9, with each
//! remainder policy, shuffled or not: the ranks' shares are disjoint and make up the epoch's
//! order, each step's batches over the ranks are one window of that order (the global batch of
//! one process), resuming mid-epoch gives the same batches, the order depends on (seed, epoch)
//! only, and the shuffle is uniform and pinned.

use std::collections::HashMap;

use candle_distributed::sampler::{index_tensor, DistributedSampler, Remainder};

const POLICIES: [Remainder; 3] = [Remainder::Pad, Remainder::Drop, Remainder::Exact];

fn sampler(
    len: usize,
    rank: usize,
    world: usize,
    p: Remainder,
    shuffle: bool,
) -> DistributedSampler {
    DistributedSampler::new(len, rank, world)
        .unwrap()
        .with_seed(7)
        .with_shuffle(shuffle)
        .with_remainder(p)
}

fn sorted(mut v: Vec<usize>) -> Vec<usize> {
    v.sort_unstable();
    v
}

/// Every length, world size and policy: the epoch's order is what the policy says, the ranks'
/// shares are its strided positions (disjoint where nothing is padded), of the announced sizes.
#[test]
fn shares_are_disjoint_and_make_up_the_epoch() {
    for len in 0..=150 {
        for world in 1..=9 {
            for p in POLICIES {
                for shuffle in [false, true] {
                    let what = format!("len {len}, world {world}, {p:?}, shuffle {shuffle}");
                    let order = sampler(len, 0, world, p, shuffle).epoch_order(3);
                    let full = sampler(len, 0, world, Remainder::Exact, shuffle).epoch_order(3);
                    assert_eq!(sorted(full.clone()), (0..len).collect::<Vec<_>>(), "{what}");
                    match p {
                        Remainder::Exact => assert_eq!(order, full, "{what}"),
                        Remainder::Drop => assert_eq!(order, full[..len / world * world], "{what}"),
                        Remainder::Pad => {
                            let total = len.div_ceil(world) * world;
                            assert_eq!(order.len(), total, "{what}");
                            assert_eq!(order[..len], full[..], "{what}");
                            for (k, &i) in order[len..].iter().enumerate() {
                                assert_eq!(i, full[k % len.max(1)], "{what}: padding {k}");
                            }
                        }
                    }
                    let shares: Vec<Vec<usize>> = (0..world)
                        .map(|r| sampler(len, r, world, p, shuffle).indices(3))
                        .collect();
                    for (r, share) in shares.iter().enumerate() {
                        let want: Vec<usize> =
                            order.iter().copied().skip(r).step_by(world).collect();
                        assert_eq!(share, &want, "{what}: rank {r}");
                        assert_eq!(
                            share.len(),
                            sampler(len, r, world, p, shuffle).num_samples(),
                            "{what}: rank {r}"
                        );
                    }
                    let sizes: Vec<usize> = shares.iter().map(Vec::len).collect();
                    let (lo, hi) = (sizes.iter().min().unwrap(), sizes.iter().max().unwrap());
                    match p {
                        Remainder::Exact => assert!(hi - lo <= 1, "{what}: {sizes:?}"),
                        _ => assert_eq!(lo, hi, "{what}: {sizes:?}"),
                    }
                    assert_eq!(sorted(shares.concat()), sorted(order.clone()), "{what}");
                    if p != Remainder::Pad {
                        let all = shares.concat();
                        let mut seen = vec![false; len];
                        for i in all {
                            assert!(!std::mem::replace(&mut seen[i], true), "{what}: {i} twice");
                        }
                    }
                }
            }
        }
    }
}

/// With `b` samples per rank and step, step `s`'s batches over the ranks are the positions
/// `[s·b·W, (s+1)·b·W)` of the epoch's order, every rank has `steps(b)` batches, and a run
/// resumed at any step gets the remaining batches unchanged. An empty data set, and fewer
/// samples than ranks under `Remainder::Drop` (no rank would get one), are refused.
#[test]
fn each_step_is_a_window_of_the_epoch_and_resumes_exactly() {
    for len in 0..=150 {
        for world in 1..=9 {
            for p in POLICIES {
                for b in 1..=5 {
                    let what = format!("len {len}, world {world}, {p:?}, {b} per rank");
                    if len == 0 || (p == Remainder::Drop && len < world) {
                        // Nothing to sample on any rank: refused, naming why.
                        let e = sampler(len, 0, world, p, true)
                            .steps(b)
                            .unwrap_err()
                            .to_string();
                        let want = if len == 0 {
                            "empty"
                        } else {
                            "without a sample"
                        };
                        assert!(e.contains(want), "{what}: {e}");
                        continue;
                    }
                    let order = sampler(len, 0, world, p, true).epoch_order(1);
                    let per_rank: Vec<Vec<Vec<usize>>> = (0..world)
                        .map(|r| {
                            let s = sampler(len, r, world, p, true);
                            let all: Vec<Vec<usize>> = s.batches(1, b, 0).unwrap().collect();
                            assert_eq!(all.len(), s.steps(b).unwrap(), "{what}: rank {r}");
                            assert_eq!(all.concat(), s.indices(1), "{what}: rank {r}");
                            for from in 0..=all.len() {
                                let resumed: Vec<Vec<usize>> =
                                    s.batches(1, b, from).unwrap().collect();
                                assert_eq!(resumed, all[from..], "{what}: rank {r}, from {from}");
                            }
                            all
                        })
                        .collect();
                    let steps = per_rank[0].len();
                    assert_eq!(steps, order.len().div_ceil(b * world), "{what}");
                    for s in 0..steps {
                        let global: Vec<usize> =
                            per_rank.iter().flat_map(|r| r[s].clone()).collect();
                        let window = &order[(s * b * world).min(order.len())
                            ..((s + 1) * b * world).min(order.len())];
                        assert_eq!(sorted(global), sorted(window.to_vec()), "{what}: step {s}");
                    }
                }
            }
        }
    }
}

/// The order depends on (seed, epoch) and the length only: the same for every world size and
/// rank, another for another epoch or seed.
#[test]
fn the_order_is_a_function_of_seed_and_epoch() {
    let order = |seed: u64, epoch: u64, world: usize, rank: usize| {
        DistributedSampler::new(100, rank, world)
            .unwrap()
            .with_seed(seed)
            .with_remainder(Remainder::Exact)
            .epoch_order(epoch)
    };
    let base = order(11, 4, 1, 0);
    for world in 2..=9 {
        for rank in 0..world {
            assert_eq!(
                order(11, 4, world, rank),
                base,
                "world {world}, rank {rank}"
            );
        }
    }
    assert_ne!(order(11, 5, 1, 0), base, "another epoch");
    assert_ne!(order(12, 4, 1, 0), base, "another seed");
    let unshuffled = DistributedSampler::new(100, 0, 1)
        .unwrap()
        .with_shuffle(false);
    assert_eq!(unshuffled.epoch_order(9), (0..100).collect::<Vec<_>>());
}

/// Each of the 6 orders of 3 samples comes up about equally often over 6000 epochs (within 5
/// standard deviations of 1000), and the order of 10 samples for seed 0, epoch 0 is pinned, so
/// that a change of the shuffle (which would change every resumed run's data) fails here.
#[test]
fn the_shuffle_is_uniform_and_pinned() {
    let s = DistributedSampler::new(3, 0, 1).unwrap().with_seed(5);
    let mut counts: HashMap<Vec<usize>, u32> = HashMap::new();
    for epoch in 0..6000 {
        *counts.entry(s.epoch_order(epoch)).or_default() += 1;
    }
    assert_eq!(counts.len(), 6, "{counts:?}");
    let sd = (6000.0_f64 * (1.0 / 6.0) * (5.0 / 6.0)).sqrt();
    for (perm, &c) in &counts {
        assert!(
            (f64::from(c) - 1000.0).abs() < 5.0 * sd,
            "{perm:?}: {c} of 6000"
        );
    }
    let pinned = DistributedSampler::new(10, 0, 1).unwrap().epoch_order(0);
    assert_eq!(pinned, PINNED);
}

/// Seed 0, epoch 0, 10 samples (printed by the implementation when the pin was set).
const PINNED: [usize; 10] = [1, 2, 5, 7, 0, 8, 4, 3, 9, 6];

#[test]
fn bad_arguments_are_refused() {
    let e = DistributedSampler::new(10, 3, 3).unwrap_err().to_string();
    assert!(e.contains("rank 3") && e.contains("world of 3"), "{e}");
    let e = DistributedSampler::new(10, 0, 0).unwrap_err().to_string();
    assert!(e.contains("world of 0"), "{e}");
    let s = DistributedSampler::new(10, 0, 2).unwrap();
    let e = s.steps(0).unwrap_err().to_string();
    assert!(e.contains("at least one sample"), "{e}");
    assert!(s.batches(0, 0, 0).is_err());
}

/// Ranks whose data sets differ by one sample would share samples and skip others: `for_comm`
/// refuses on every rank, naming each rank's length; `agree` does the same for the seed, the
/// shuffle and the remainder policy set afterwards, and passes samplers that agree.
#[test]
fn ranks_that_disagree_about_the_data_are_refused() {
    use candle_distributed::collective::ThreadGroup;
    let errs = ThreadGroup::run(2, |comm| {
        let len = 1000 - comm.rank();
        Ok(DistributedSampler::for_comm(len, &*comm)
            .unwrap_err()
            .to_string())
    })
    .unwrap();
    for e in &errs {
        assert!(
            e.contains("length") && e.contains("rank 0: 1000, rank 1: 999"),
            "{e}"
        );
    }
    let errs = ThreadGroup::run(2, |comm| {
        let s = DistributedSampler::for_comm(1000, &*comm)?;
        s.clone().with_seed(7).agree(&*comm)?;
        let seeded = s.with_seed(7 + comm.rank() as u64);
        Ok(seeded.agree(&*comm).unwrap_err().to_string())
    })
    .unwrap();
    for e in &errs {
        assert!(
            e.contains("seed") && e.contains("rank 0: 7, rank 1: 8"),
            "{e}"
        );
    }
}

/// A batch's indices as the tensor `index_select` takes: the same rows as gathering them one by
/// one; an index beyond `u32` is refused by name.
#[test]
fn a_batch_gathers_its_rows_with_index_select() -> anyhow::Result<()> {
    use candle_core::{Device, Tensor};
    let dev = Device::Cpu;
    // 23 distinct rows of 3 values (never zeros), 3 ranks, 4 samples per rank and step.
    let data = Tensor::arange(1f32, 70., &dev)?.reshape((23, 3))?;
    let rows = data.to_vec2::<f32>()?;
    for rank in 0..3 {
        let s = DistributedSampler::new(23, rank, 3)?.with_seed(7);
        for batch in s.batches(2, 4, 0)? {
            let got = data
                .index_select(&index_tensor(&batch, &dev)?, 0)?
                .to_vec2::<f32>()?;
            let want: Vec<Vec<f32>> = batch.iter().map(|&i| rows[i].clone()).collect();
            assert_eq!(got, want, "rank {rank}, batch {batch:?}");
        }
    }
    assert_eq!(index_tensor(&[], &dev)?.dims(), [0]);
    #[cfg(target_pointer_width = "64")]
    {
        let e = index_tensor(&[3, u32::MAX as usize + 1], &dev)
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("index_tensor") && e.contains("4294967296"),
            "{e}"
        );
    }
    Ok(())
}
