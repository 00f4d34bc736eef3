//! The `ThreadGroup` backend beyond the contract every backend passes (`tests/conformance.rs`):
//! values at a world size that is not a power of two, a broadcast racing the root's writes,
//! argument checks, ranks that leave, the parallel summation and its parts, the wire dtypes.

mod common;

use candle_core::{DType, Device, Tensor};
use candle_distributed::collective::{AllReduce, Collective, ReduceOp, ThreadGroup};
use common::*;

#[test]
fn all_reduce_every_op() {
    let outs = run_ranks(3, |comm| {
        let r = comm.rank() as f32;
        let t = Tensor::new(&[r + 1.0, 10.0 - r, -r], &Device::Cpu)?;
        let mut res = Vec::new();
        for op in [ReduceOp::Sum, ReduceOp::Avg, ReduceOp::Max, ReduceOp::Min] {
            res.push(comm.all_reduce(&t, op)?.to_vec1::<f32>()?);
        }
        let ints = Tensor::new(&[comm.rank() as i64 * 5], &Device::Cpu)?;
        res.push(vec![
            comm.all_reduce(&ints, ReduceOp::Max)?.to_vec1::<i64>()?[0] as f32,
        ]);
        let half = Tensor::new(&[1.5f32, 2.0], &Device::Cpu)?.to_dtype(DType::BF16)?;
        res.push(
            comm.all_reduce(&half, ReduceOp::Sum)?
                .to_dtype(DType::F32)?
                .to_vec1::<f32>()?,
        );
        Ok(res)
    });
    for out in &outs {
        assert_eq!(out[0], vec![6.0, 27.0, -3.0]);
        assert_eq!(out[1], vec![2.0, 9.0, -1.0]);
        assert_eq!(out[2], vec![3.0, 10.0, 0.0]);
        assert_eq!(out[3], vec![1.0, 8.0, -2.0]);
        assert_eq!(out[4], vec![10.0]);
        assert_eq!(out[5], vec![4.5, 6.0]);
    }
}

/// A broadcast's result on the other ranks is rank 0's value at the call, even when rank 0
/// changes its tensor in place (`Var::set`, an optimizer step) the moment the call returns:
/// 200 rounds of a 4 MiB variable, rank 0 overwriting it at once, every round's value received
/// whole by ranks 1 and 2.
#[test]
fn a_broadcast_result_does_not_change_with_the_roots_tensor() {
    let outs = run_ranks(3, |comm| {
        let v = candle_core::Var::zeros(1 << 20, DType::F32, &Device::Cpu)?;
        let mut wrong = 0;
        for round in 0..200u32 {
            if comm.rank() == 0 {
                v.set(&Tensor::full(round as f32, 1 << 20, &Device::Cpu)?)?;
            }
            let got = comm.broadcast(v.as_tensor(), 0)?;
            if comm.rank() == 0 {
                v.set(&Tensor::full(-1f32, 1 << 20, &Device::Cpu)?)?;
            }
            let (lo, hi) = (
                got.min(0)?.to_scalar::<f32>()?,
                got.max(0)?.to_scalar::<f32>()?,
            );
            if comm.rank() != 0 && (lo, hi) != (round as f32, round as f32) {
                wrong += 1;
            }
        }
        Ok(wrong)
    });
    assert_eq!(outs, [0, 0, 0], "rounds received changed, per rank");
}

#[test]
fn argument_errors_reach_every_rank() {
    let outs = run_ranks(2, |comm| {
        let t = Tensor::new(&[1u32], &Device::Cpu)?;
        let avg = comm
            .all_reduce(&t, ReduceOp::Avg)
            .map_err(|e| e.to_string());
        let root = comm.broadcast(&t, 5).map_err(|e| e.to_string());
        let shape = Tensor::zeros(comm.rank() + 1, DType::F32, &Device::Cpu)?;
        let mismatch = comm
            .all_reduce(&shape, ReduceOp::Sum)
            .map_err(|e| e.to_string());
        let dtype = if comm.rank() == 0 {
            DType::F32
        } else {
            DType::F64
        };
        let dtypes = comm
            .all_gather(&Tensor::ones(3, dtype, &Device::Cpu)?)
            .map_err(|e| e.to_string());
        Ok((
            avg.unwrap_err(),
            root.unwrap_err(),
            mismatch.unwrap_err(),
            dtypes.unwrap_err(),
        ))
    });
    for (avg, root, mismatch, dtypes) in outs {
        assert!(
            dtypes.contains("rank 0: all_gather F32 [3]")
                && dtypes.contains("rank 1: all_gather F64 [3]"),
            "{dtypes}"
        );
        assert!(avg.contains("Avg needs a float dtype"), "{avg}");
        assert!(root.contains("root 5 out of range"), "{root}");
        assert!(
            mismatch.contains("rank 0: all_reduce(Sum) F32 [1]")
                && mismatch.contains("rank 1: all_reduce(Sum) F32 [2]"),
            "{mismatch}"
        );
    }
    assert!(ThreadGroup::new(0).is_err());
}

/// A rank that contributes a tensor whose autograd graph holds its own communicator (here
/// through a SyncBatchNorm op) and drops everything as soon as its collective returns: the
/// group's shared state must not keep that graph, or the last rank to read the result drops
/// the first rank's communicator while holding the group's lock (it deadlocked). Repeated,
/// since which rank reads last is up to the scheduler; a watchdog turns a hang into a failure.
#[test]
fn a_contribution_with_a_graph_does_not_outlive_its_rank() {
    let (done_tx, done_rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        for round in 0..30u64 {
            ThreadGroup::run(2, |comm| {
                let vm = candle_nn::VarMap::new();
                let vb = candle_nn::VarBuilder::from_varmap(&vm, DType::F32, &Device::Cpu);
                let bn = candle_distributed::sync_batch_norm(
                    2,
                    candle_distributed::SyncBatchNormConfig::default(),
                    vb,
                    comm.clone(),
                )?;
                let x = randn(round, &[3, 2], 0.0, 1.0).to_dtype(DType::F32)?;
                let y = candle_nn::ModuleT::forward_t(&bn, &x, true)?;
                drop(bn);
                let summed = comm.all_reduce(&y, ReduceOp::Sum)?;
                drop((y, comm, vm));
                Ok(summed.dims().to_vec())
            })
            .unwrap();
        }
        done_tx.send(()).unwrap();
    });
    done_rx
        .recv_timeout(std::time::Duration::from_secs(60))
        .expect("30 rounds of two ranks must finish within 60 s (a rank deadlocked)");
}

/// A rank that leaves without panicking, with an asynchronous call of a subgroup outstanding,
/// fails its peer's call on the world group at once: its drop does not wait for that call,
/// whose peer joins it only after the world call. The call it had started still completes,
/// with its contribution, when the peer joins it. (Its drop used to wait for the call first,
/// and both ranks waited for the whole timeout.)
#[test]
fn a_rank_that_leaves_with_an_async_call_outstanding_fails_its_peers_at_once() {
    const TIMEOUT: std::time::Duration = std::time::Duration::from_secs(30);
    const PROMPT: std::time::Duration = std::time::Duration::from_secs(5);
    let comms = ThreadGroup::with_timeout(2, TIMEOUT).unwrap();
    let start = std::time::Instant::now();
    let mut outcomes = std::thread::scope(|s| {
        let hs: Vec<_> = comms
            .into_iter()
            .map(|world| {
                s.spawn(move || -> anyhow::Result<(String, Vec<f32>)> {
                    let rank = world.rank();
                    let sub = world.split(Some(0), rank as u32)?.expect("a member");
                    let x = Tensor::new(&[rank as f32 + 1.0, 10.0], &Device::Cpu)?;
                    if rank == 1 {
                        // Starts the subgroup's call, then leaves (as an error return would).
                        let pending =
                            sub.start_all_reduce(std::slice::from_ref(&x), ReduceOp::Sum.into())?;
                        drop((pending, sub, world));
                        return Ok((String::new(), Vec::new()));
                    }
                    let err = world.barrier().expect_err("rank 1 left the world group");
                    let joined = sub.all_reduce(&x, ReduceOp::Sum)?.to_vec1::<f32>()?;
                    Ok((err.to_string(), joined))
                })
            })
            .collect();
        hs.into_iter()
            .map(|h| h.join().expect("no rank panics"))
            .collect::<Vec<_>>()
    });
    let elapsed = start.elapsed();
    assert!(
        elapsed < PROMPT,
        "rank 0 waited {elapsed:?} (timeout {TIMEOUT:?})"
    );
    outcomes.truncate(1);
    let (msg, joined) = outcomes.pop().unwrap().unwrap();
    assert!(msg.contains("rank 1 dropped its communicator"), "{msg}");
    assert_eq!(
        joined,
        vec![3.0, 20.0],
        "rank 1's started call keeps its contribution"
    );
}

/// Elements of the large-tensor tests: more than two of the parallel sum's blocks (16384
/// elements each), the last one partial, so that several ranks share the work.
const LARGE: usize = 2 * 16384 + 4321;

/// The reference of an all-reduce on `wire` (or none): each rank's values widened to f32 and
/// rounded to the wire dtype, summed in rank order in f32, scaled by `1/W` as an f32 for an
/// average, rounded to the wire dtype. Written element by element with `half`'s scalar
/// conversions, independently of the backend's block code.
fn reduce_reference(ranks: &[Vec<f32>], avg: bool, wire: Option<DType>) -> Vec<f32> {
    let round = |v: f32| match wire {
        Some(DType::BF16) => half::bf16::from_f32(v).to_f32(),
        Some(DType::F16) => half::f16::from_f32(v).to_f32(),
        _ => v,
    };
    let scale = (1.0 / ranks.len() as f64) as f32;
    (0..ranks[0].len())
        .map(|i| {
            let mut acc = round(ranks[0][i]);
            for r in &ranks[1..] {
                acc += round(r[i]);
            }
            round(if avg { acc * scale } else { acc })
        })
        .collect()
}

/// Rank `r`'s seeded values, uniform in about ±17 around 0.5: the sum's rounding depends on the
/// order, and the rounding to 16 bits changes most values.
fn large_input(r: usize) -> Vec<f32> {
    randn(100 + r as u64, &[LARGE], 0.5, 10.0)
        .to_dtype(DType::F32)
        .unwrap()
        .to_vec1::<f32>()
        .unwrap()
}

/// The sum every rank helps compute, block by block, is bitwise the single sum in rank order
/// (f32, and f16/bf16 accumulated in f32), for a sum and an average over 3 ranks.
#[test]
fn a_parallel_sum_matches_one_in_rank_order() {
    let inputs: Vec<Vec<f32>> = (0..3).map(large_input).collect();
    for dtype in [DType::F32, DType::F16, DType::BF16] {
        // The ranks' values in `dtype`, and the same values widened back to f32.
        let narrowed: Vec<Tensor> = inputs
            .iter()
            .map(|v| Tensor::new(v.as_slice(), &Device::Cpu)?.to_dtype(dtype))
            .collect::<candle_core::Result<_>>()
            .unwrap();
        let widened: Vec<Vec<f32>> = narrowed
            .iter()
            .map(|t| t.to_dtype(DType::F32)?.to_vec1::<f32>())
            .collect::<candle_core::Result<_>>()
            .unwrap();
        for (op, avg) in [(ReduceOp::Sum, false), (ReduceOp::Avg, true)] {
            let outs = run_ranks(3, |comm| {
                let t = &narrowed[comm.rank()];
                Ok(comm
                    .all_reduce(t, op)?
                    .to_dtype(DType::F32)?
                    .to_vec1::<f32>()?)
            });
            // Widened values summed in f32, then rounded to the dtype of the call.
            let wire = (dtype != DType::F32).then_some(dtype);
            let want = reduce_reference(&widened, avg, wire);
            for (r, got) in outs.iter().enumerate() {
                let bad = got
                    .iter()
                    .zip(&want)
                    .position(|(a, b)| a.to_bits() != b.to_bits());
                assert!(
                    bad.is_none(),
                    "{dtype:?} {op:?} rank {r}: element {bad:?} differs: {} vs {}",
                    got[bad.unwrap()],
                    want[bad.unwrap()]
                );
            }
        }
    }
}

/// A result too large for the caches (over 4 MiB: written with non-temporal stores on a CPU
/// with AVX2) is still bitwise the rank-order sum, with and without a wire, on every rank.
#[test]
fn a_result_larger_than_the_caches_is_the_same_sum() {
    let n = (4 << 20) / 4 + 16384 + 333;
    let inputs: Vec<Vec<f32>> = (0..4)
        .map(|r| {
            randn(200 + r, &[n], -0.25, 3.0)
                .to_dtype(DType::F32)
                .unwrap()
                .to_vec1::<f32>()
                .unwrap()
        })
        .collect();
    for wire in [None, Some(DType::BF16)] {
        let outs = run_ranks(4, |comm| {
            let t = Tensor::new(inputs[comm.rank()].as_slice(), &Device::Cpu)?;
            let out = match wire {
                Some(w) => comm.all_reduce_with(
                    std::slice::from_ref(&t),
                    AllReduce::new(ReduceOp::Avg).wire(w),
                )?,
                None => comm.all_reduce(&t, ReduceOp::Avg)?,
            };
            Ok(out.to_vec1::<f32>()?)
        });
        let want = reduce_reference(&inputs, true, wire);
        for (r, got) in outs.iter().enumerate() {
            let bad = got
                .iter()
                .zip(&want)
                .position(|(a, b)| a.to_bits() != b.to_bits());
            assert!(bad.is_none(), "{wire:?} rank {r}: element {bad:?} differs");
        }
    }
}

/// An all-reduce of several parts on thread ranks sums each rank's parts where they lie:
/// bitwise the all-reduce of the parts laid end to end, and a decorator's (`Probe`, which
/// concatenates and then all-reduces). Parts that cross the sum's blocks, an
/// empty part, a 2-D part, views at offsets into one tensor; f32, f16 and bf16 (the parallel
/// sum) and f64 (summed on one thread); sum and average; an f32 average on a bf16 wire.
#[test]
fn parts_are_summed_where_they_lie() {
    // Parts across blocks of 16384, one ending on a block's boundary, empty ones first, in
    // a block, on a boundary and last.
    let lens = [
        0usize,
        5,
        0,
        16384 + 7,
        3,
        20000,
        1,
        32768 - 20016,
        0,
        16384,
        2,
        0,
    ];
    let total: usize = lens.iter().sum();
    let inputs: Vec<Vec<f32>> = (0..3)
        .map(|r| {
            randn(300 + r as u64, &[total], 0.5, 10.0)
                .to_dtype(DType::F32)
                .unwrap()
                .to_vec1::<f32>()
                .unwrap()
        })
        .collect();
    let bits = |t: Tensor| -> candle_core::Result<Vec<u64>> {
        let v = t.to_dtype(DType::F64)?.flatten_all()?.to_vec1::<f64>()?;
        Ok(v.into_iter().map(f64::to_bits).collect())
    };
    let cases = [
        (DType::F32, ReduceOp::Sum, None),
        (DType::F32, ReduceOp::Avg, None),
        (DType::F32, ReduceOp::Avg, Some(DType::BF16)),
        (DType::F16, ReduceOp::Avg, None),
        (DType::BF16, ReduceOp::Sum, None),
        (DType::F64, ReduceOp::Avg, None),
    ];
    for (dtype, op, wire) in cases {
        let outs = run_ranks(3, |comm| {
            let all = Tensor::new(inputs[comm.rank()].as_slice(), &Device::Cpu)?.to_dtype(dtype)?;
            let mut parts = Vec::new();
            let mut at = 0;
            for (i, &n) in lens.iter().enumerate() {
                let part = all.narrow(0, at, n)?;
                parts.push(if i == 5 {
                    part.reshape((100, 200))?
                } else {
                    part
                });
                at += n;
            }
            let got = comm.all_reduce_with(&parts, AllReduce { wire, ..op.into() })?;
            assert_eq!(got.dims(), [total]);
            let whole = match wire {
                Some(w) => {
                    comm.all_reduce_with(std::slice::from_ref(&all), AllReduce::new(op).wire(w))?
                }
                None => comm.all_reduce(&all, op)?,
            };
            let default = Probe::new(comm.clone())
                .all_reduce_with(&parts, AllReduce { wire, ..op.into() })?;
            Ok([bits(got)?, bits(whole)?, bits(default)?])
        });
        for (r, [got, whole, default]) in outs.into_iter().enumerate() {
            let what = format!("{dtype:?} {op:?} wire {wire:?} rank {r}");
            assert!(got == whole, "{what}: not the all-reduce of the whole");
            assert!(got == default, "{what}: not the default's result");
        }
    }
}

/// A transposed part is read in its logical (row-major) order, as the default reads it; ranks
/// whose parts differ in element counts (also with the same total) get a mismatch naming every
/// rank's parts (one part is one tensor, named by its shape); an empty list, or parts of two dtypes, on one rank only fails the call on every
/// rank with that rank's reason, and the group goes on in step.
#[test]
fn parts_in_logical_order_and_their_errors() {
    let outs = run_ranks(2, |comm| {
        let r = comm.rank() as f32;
        let ones = |n: usize| Tensor::ones(n, DType::F32, &Device::Cpu);
        let m = (Tensor::arange(0f32, 6.0, &Device::Cpu)?.reshape((2, 3))? + f64::from(r))?;
        let parts = [Tensor::new(&[r, 1.0], &Device::Cpu)?, m.t()?];
        let got = comm.all_reduce_with(&parts, ReduceOp::Sum.into())?;
        let default = Probe::new(comm.clone()).all_reduce_with(&parts, ReduceOp::Sum.into())?;
        let sum = |parts: &[Tensor]| {
            comm.all_reduce_with(parts, ReduceOp::Sum.into())
                .map_err(|e| e.to_string())
        };
        let uneven = sum(&[ones(if comm.rank() == 0 { 2 } else { 3 })?]);
        let split = if comm.rank() == 0 { [1, 3] } else { [2, 2] };
        let split = sum(&[ones(split[0])?, ones(split[1])?]);
        let two = [ones(2)?, ones(2)?];
        let mixed = [ones(2)?, Tensor::ones(2, DType::F64, &Device::Cpu)?];
        // Rank 0 alone passes no parts, then rank 1 alone parts of two dtypes.
        let none = sum(if comm.rank() == 0 { &[] } else { &two });
        let mixed = sum(if comm.rank() == 1 { &mixed } else { &two });
        // In step after the failures: the next call pairs with the same call on the other rank.
        let after = sum(&two)
            .map_err(candle_core::Error::Msg)?
            .to_vec1::<f32>()?;
        Ok((
            got.to_vec1::<f32>()?,
            default.to_vec1::<f32>()?,
            [uneven.unwrap_err(), split.unwrap_err()],
            [none.unwrap_err(), mixed.unwrap_err()],
            after,
        ))
    });
    for (got, default, [uneven, split], [none, mixed], after) in outs {
        // m.t() is [[0, 3], [1, 4], [2, 5]] + r: read as 0, 3, 1, 4, 2, 5, summed over r = 0, 1.
        assert_eq!(got, vec![1.0, 2.0, 1.0, 7.0, 3.0, 9.0, 5.0, 11.0]);
        assert_eq!(got, default);
        assert!(
            uneven.contains("rank 0: all_reduce(Sum) F32 [2]")
                && uneven.contains("rank 1: all_reduce(Sum) F32 [3]"),
            "{uneven}"
        );
        assert!(
            split.contains("rank 0: all_reduce(Sum) F32 parts [1, 3]")
                && split.contains("rank 1: all_reduce(Sum) F32 parts [2, 2]"),
            "{split}"
        );
        assert!(
            none.contains("rank 0 could not take part") && none.contains("at least one part"),
            "{none}"
        );
        assert!(
            mixed.contains("rank 1 could not take part")
                && mixed.contains("part 1 is F64, part 0 F32"),
            "{mixed}"
        );
        assert_eq!(after, vec![2.0; 4]);
    }
}

/// With one rank the result is still a new tensor: an f64 part or tensor (summed on one
/// thread, where a result could be the input itself), and an all-gather's, are copied, so that
/// setting the variable they came from leaves the results alone.
#[test]
fn a_single_part_on_one_rank_is_not_its_own_result() {
    let outs = run_ranks(1, |comm| {
        let v = candle_core::Var::new(&[1.5f64, -2.0, 4.0], &Device::Cpu)?;
        let got = comm.all_reduce_with(&[v.as_tensor().clone()], ReduceOp::Sum.into())?;
        let sum = comm.all_reduce(v.as_tensor(), ReduceOp::Max)?;
        let gathered = comm.all_gather(v.as_tensor())?;
        v.set(&Tensor::zeros(3, DType::F64, &Device::Cpu)?)?;
        let mut out = Vec::new();
        for t in [got, sum, gathered] {
            out.push(t.to_vec1::<f64>()?);
        }
        Ok(out)
    });
    for (r, what) in outs[0].iter().zip(["parts", "all_reduce", "all_gather"]) {
        assert_eq!(r, &vec![1.5, -2.0, 4.0], "{what}");
    }
}

/// An all-reduce with a wire dtype on thread ranks rounds each value to the wire dtype as it
/// sums, without casting: bitwise the result of the casts it saves (cast to the wire dtype,
/// all-reduce, cast back), and of the reference; also through a decorator (`Probe`), which
/// hands the call to the thread ranks' own method.
#[test]
fn a_wire_dtype_rounds_like_the_casts_it_saves() {
    let inputs: Vec<Vec<f32>> = (0..3).map(large_input).collect();
    for wire in [DType::BF16, DType::F16] {
        for (op, avg) in [(ReduceOp::Sum, false), (ReduceOp::Avg, true)] {
            let outs = run_ranks(3, |comm| {
                let t = Tensor::new(inputs[comm.rank()].as_slice(), &Device::Cpu)?;
                let fused =
                    comm.all_reduce_with(std::slice::from_ref(&t), AllReduce::new(op).wire(wire))?;
                let probe = Probe::new(comm.clone());
                let decorated = probe
                    .all_reduce_with(std::slice::from_ref(&t), AllReduce::new(op).wire(wire))?;
                // One all-reduce of `t` itself reached the probe's hooks: f32, not cast.
                assert_eq!(probe.elements(), [t.elem_count()]);
                assert_eq!(probe.dtypes(), [DType::F32]);
                let cast = comm
                    .all_reduce(&t.to_dtype(wire)?, op)?
                    .to_dtype(DType::F32)?;
                assert_eq!(fused.dtype(), DType::F32);
                assert_eq!(decorated.dtype(), DType::F32);
                let v = |t: Tensor| t.to_vec1::<f32>();
                Ok([v(fused)?, v(decorated)?, v(cast)?])
            });
            let want = reduce_reference(&inputs, avg, Some(wire));
            for [fused, decorated, cast] in outs {
                for (name, got) in [("fused", fused), ("decorated", decorated), ("cast", cast)] {
                    let bad = got
                        .iter()
                        .zip(&want)
                        .position(|(a, b)| a.to_bits() != b.to_bits());
                    assert!(bad.is_none(), "{wire:?} {op:?} {name}: element {bad:?}");
                }
            }
        }
    }
}

/// A wire on an integer tensor is refused before any communication, and ranks that disagree
/// on the wire get a mismatch naming each rank's wire.
#[test]
fn wire_errors_name_the_dtypes() {
    let outs = run_ranks(2, |comm| {
        let ints = Tensor::new(&[1u32, 2], &Device::Cpu)?;
        let int_err = comm
            .all_reduce_with(
                std::slice::from_ref(&ints),
                AllReduce::new(ReduceOp::Sum).wire(DType::BF16),
            )
            .unwrap_err()
            .to_string();
        let wire = [DType::BF16, DType::F16][comm.rank()];
        let t = Tensor::new(&[1.5f32, -2.0], &Device::Cpu)?;
        let mismatch = comm
            .all_reduce_with(
                std::slice::from_ref(&t),
                AllReduce::new(ReduceOp::Sum).wire(wire),
            )
            .unwrap_err()
            .to_string();
        Ok((int_err, mismatch))
    });
    for (int_err, mismatch) in outs {
        assert!(
            int_err.contains("all_reduce: a U32 tensor cannot be carried on a BF16 wire"),
            "{int_err}"
        );
        assert!(
            mismatch.contains("rank 0: all_reduce(Sum) F32 [2] on a BF16 wire")
                && mismatch.contains("rank 1: all_reduce(Sum) F32 [2] on a F16 wire"),
            "{mismatch}"
        );
    }
}
