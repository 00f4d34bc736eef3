//! Bad inputs and collective failures: each gives a clear error, within a bounded time, and
//! leaves running statistics, `num_batches_tracked` and parameters untouched.

mod common;

use std::sync::Arc;
use std::time::{Duration, Instant};

use candle_core::{DType, Device, Tensor};
use candle_distributed::collective::recorder::CallState;
use candle_distributed::collective::{Collective, ReduceOp, ThreadGroup};
use candle_distributed::{SyncBatchNorm, SyncBatchNormConfig};
use candle_nn::ModuleT;
use common::*;

/// Timeout given to groups whose failures are provoked on purpose.
const SHORT: Duration = Duration::from_millis(300);
/// A failure caused by a rank that left must be reported well before any timeout.
const PROMPT: Duration = Duration::from_secs(5);

/// Everything a failed call must leave untouched.
fn snapshot(bn: &SyncBatchNorm) -> (Vec<f32>, Vec<f32>, u64, Vec<f32>, Vec<f32>) {
    let v = |t: Option<&Tensor>| t.map(|t| t.to_vec1::<f32>().unwrap()).unwrap_or_default();
    (
        v(bn.running_mean()),
        v(bn.running_var()),
        bn.num_batches_tracked(),
        v(bn.weight()),
        v(bn.bias()),
    )
}

/// A layer of 4 channels on `dev` that has already taken one training step.
fn trained_layer(comm: Arc<dyn Collective>, dev: &Device) -> SyncBatchNorm {
    let (bn, _) = layer(
        4,
        SyncBatchNormConfig::default(),
        comm,
        Some(&Params::random(2, 4)),
        DType::F32,
        dev,
    );
    let x = randn(1, &[3, 4, 2, 2], 1.0, 1.0)
        .to_dtype(DType::F32)
        .unwrap();
    bn.forward_t(&on(dev, &x), true).unwrap();
    bn
}

/// Fewer than 2 values per channel in a training batch: an error on the CPU, as in PyTorch;
/// on a GPU, where the count is known only on the device, NaN outputs (see the README). Either
/// way the layer is left as it was (checked by the callers).
#[track_caller]
fn expect_too_few_values(dev: &Device, r: candle_core::Result<Tensor>, needles: &[&str]) {
    if common::counts_on_host(dev) {
        return expect_err(r, needles);
    }
    let y = cpu(&r.expect("on a GPU the step runs"));
    let v = y.flatten_all().unwrap().to_dtype(DType::F32).unwrap();
    assert!(
        v.to_vec1::<f32>().unwrap().iter().all(|v| v.is_nan()),
        "on a GPU, one value per channel gives NaN outputs"
    );
}

#[track_caller]
fn expect_err(r: candle_core::Result<Tensor>, needles: &[&str]) {
    let msg = format!("{}", r.expect_err("expected an error"));
    for n in needles {
        assert!(msg.contains(n), "error {msg:?} does not mention {n:?}");
    }
}

fn bad_inputs_are_named_and_change_nothing(dev: &Device) -> anyhow::Result<()> {
    let comm = ThreadGroup::new(1).unwrap().remove(0);
    let bn = trained_layer(comm, dev);
    let before = snapshot(&bn);
    let f32t = |dims: &[usize]| on(dev, &randn(5, dims, 0.0, 1.0).to_dtype(DType::F32).unwrap());
    expect_err(
        bn.forward_t(&f32t(&[8, 3, 7, 7]), true),
        &[
            "sync-batch-norm",
            "expected 4 channels, got 3",
            "[8, 3, 7, 7]",
        ],
    );
    // A channels-last input given to a channels-first layer: the error says which setting to use.
    expect_err(
        bn.forward_t(&f32t(&[8, 3, 7, 4]), true),
        &[
            "expected 4 channels, got 3",
            "a channels-last input? make the layer with `SyncBatchNormConfig::default().with_layout(ChannelLayout::ChannelsLast)`",
        ],
    );
    let plain = bn
        .forward_t(&f32t(&[8, 3, 7, 7]), true)
        .unwrap_err()
        .to_string();
    assert!(
        !plain.contains("channels-last input?"),
        "no hint when no layout fits: {plain}"
    );
    expect_err(bn.forward_t(&f32t(&[8]), true), &["rank 2 to 5", "[8]"]);
    expect_err(
        bn.forward_t(&f32t(&[2, 4, 1, 1, 1, 2]), true),
        &["rank 2 to 5"],
    );
    expect_too_few_values(
        dev,
        bn.forward_t(&f32t(&[1, 4]), true),
        &["more than 1 value per channel", "got 1"],
    );
    expect_too_few_values(
        dev,
        bn.forward_t(&f32t(&[1, 4, 1, 1]), true),
        &["more than 1 value per channel"],
    );
    expect_too_few_values(
        dev,
        bn.forward_t(&f32t(&[0, 4, 2]), true),
        &["more than 1 value per channel", "got 0"],
    );
    let ints = Tensor::zeros((2, 4, 3), DType::U32, dev).unwrap();
    expect_err(bn.forward_t(&ints, true), &["unsupported input dtype U32"]);
    let x = f32t(&[2, 4, 3, 3]);
    expect_err(
        bn.forward_residual(&x, &f32t(&[2, 4, 3, 2]), true),
        &["residual", "[2, 4, 3, 2]", "[2, 4, 3, 3]"],
    );
    expect_err(
        bn.forward_residual(&x, &x.to_dtype(DType::F64).unwrap(), true),
        &["residual", "F64", "F32"],
    );
    let mut expected = before.clone();
    if !common::counts_on_host(dev) {
        // The three steps with too few values ran on the GPU (NaN outputs, running statistics
        // untouched) and count in `num_batches_tracked`, on the host and on the device alike.
        expected.2 += 3;
    }
    assert_eq!(snapshot(&bn), expected, "a failed call changed the layer");
    // Eval with one value per channel is fine (running statistics).
    bn.forward_t(&f32t(&[1, 4]), false).unwrap();
    assert_eq!(snapshot(&bn), expected);
    Ok(())
}

#[test]
fn bad_configurations_are_rejected() {
    let comm = ThreadGroup::new(1).unwrap().remove(0);
    let vm = candle_nn::VarMap::new();
    let vb = || candle_nn::VarBuilder::from_varmap(&vm, DType::F32, &Device::Cpu);
    let bad = [
        (SyncBatchNormConfig::default().with_eps(-1.0), "eps"),
        (
            SyncBatchNormConfig::default().with_momentum(Some(1.5)),
            "momentum",
        ),
    ];
    for (cfg, needle) in bad {
        let e = candle_distributed::sync_batch_norm(4, cfg, vb(), comm.clone()).unwrap_err();
        assert!(e.to_string().contains(needle), "{e}");
    }
    let e = candle_distributed::sync_batch_norm(
        0,
        candle_distributed::SyncBatchNormConfig::default(),
        vb(),
        comm,
    )
    .unwrap_err();
    assert!(
        e.to_string().contains("num_features must be at least 1"),
        "{e}"
    );
}

#[test]
fn a_missing_rank_times_out_on_every_waiting_rank() {
    let comms = ThreadGroup::with_timeout(3, SHORT).unwrap();
    let start = Instant::now();
    let results: Vec<_> = std::thread::scope(|s| {
        let hs: Vec<_> = comms[..2]
            .iter()
            .map(|comm| {
                let comm = comm.clone();
                s.spawn(move || {
                    let bn = trained_layer(comm, &Device::Cpu);
                    let before = snapshot(&bn);
                    let r = bn.forward_t(
                        &randn(3, &[2, 4, 2], 0.0, 1.0).to_dtype(DType::F32).unwrap(),
                        true,
                    );
                    (
                        r.map(|_| ()).map_err(|e| e.to_string()),
                        snapshot(&bn) == before,
                    )
                })
            })
            .collect();
        // Rank 2 takes part in the first step, then never calls again (but stays alive).
        let bn2 = trained_layer(comms[2].clone(), &Device::Cpu);
        let out = hs.into_iter().map(|h| h.join().unwrap()).collect();
        drop(bn2);
        out
    });
    assert!(
        start.elapsed() < SHORT + PROMPT,
        "took {:?}",
        start.elapsed()
    );
    for (r, (res, untouched)) in results.into_iter().enumerate() {
        let msg = res.expect_err("the step must fail");
        assert!(
            msg.contains("timed out") && msg.contains("all_reduce") && msg.contains("[2]"),
            "rank {r}: {msg}"
        );
        assert!(untouched, "rank {r}: a failed step changed the layer");
    }
}

#[test]
fn a_rank_that_drops_out_or_panics_fails_the_others_promptly() {
    for panics in [false, true] {
        let comms = ThreadGroup::new(3).unwrap(); // default timeout: minutes
        let start = Instant::now();
        let results: Vec<_> = std::thread::scope(|s| {
            let mut it = comms.into_iter();
            let leaver = it.next().unwrap();
            let hs: Vec<_> = it
                .map(|comm| {
                    s.spawn(move || {
                        let bn = trained_layer(comm, &Device::Cpu);
                        let before = snapshot(&bn);
                        let r = bn.forward_t(
                            &randn(3, &[2, 4], 0.0, 1.0).to_dtype(DType::F32).unwrap(),
                            true,
                        );
                        (
                            r.map(|_| ()).map_err(|e| e.to_string()),
                            snapshot(&bn) == before,
                        )
                    })
                })
                .collect();
            let h = s.spawn(move || {
                let bn = trained_layer(leaver, &Device::Cpu);
                if panics {
                    panic!("rank 0 fails on purpose");
                }
                drop(bn);
            });
            let out: Vec<_> = hs.into_iter().map(|h| h.join().unwrap()).collect();
            assert_eq!(h.join().is_err(), panics);
            out
        });
        assert!(start.elapsed() < PROMPT, "took {:?}", start.elapsed());
        let what = if panics {
            "rank 0 panicked"
        } else {
            "rank 0 dropped its communicator"
        };
        for (res, untouched) in results {
            let msg = res.expect_err("the step must fail");
            assert!(msg.contains(what), "{msg}");
            assert!(untouched);
        }
    }
}

fn ranks_with_different_channel_counts_all_get_a_mismatch_error(
    dev: &Device,
) -> anyhow::Result<()> {
    let outs = run_ranks_on(2, dev, |comm| {
        let c = 3 + comm.rank();
        let (bn, _) = layer(
            c,
            SyncBatchNormConfig::default(),
            comm,
            None,
            DType::F32,
            dev,
        );
        let before = snapshot(&bn);
        let x = randn(1, &[2, c, 3], 0.0, 1.0).to_dtype(DType::F32)?;
        let r = bn.forward_t(&on(dev, &x), true);
        Ok((
            r.map(|_| ()).map_err(|e| e.to_string()),
            snapshot(&bn) == before,
        ))
    });
    for (res, untouched) in outs {
        let msg = res.expect_err("mismatch must fail");
        assert!(
            msg.contains("ranks disagree") && msg.contains("[3, 3]") && msg.contains("[3, 4]"),
            "{msg}"
        );
        assert!(untouched);
    }
    Ok(())
}

fn eval_issues_no_collective(dev: &Device) -> anyhow::Result<()> {
    let counts = run_ranks_on(2, dev, |comm| {
        let counting = Counting::new(comm);
        let comm: Arc<dyn Collective> = counting.clone();
        let bn = trained_layer(comm, dev);
        let before = counting.count();
        let x = randn(4, &[3, 4, 2, 2], 0.0, 1.0).to_dtype(DType::F32)?;
        let x = candle_core::Var::from_tensor(&on(dev, &x))?;
        bn.forward_t(x.as_tensor(), false)?.sum_all()?.backward()?;
        Ok(counting.count() - before)
    });
    assert_eq!(counts, vec![0, 0]);
    Ok(())
}

fn one_value_per_channel_in_the_global_batch_fails_on_every_rank(
    dev: &Device,
) -> anyhow::Result<()> {
    // Rank 0 holds the only sample: the count is known only after the all-reduce, and every
    // rank must reach the same verdict (none may wait for a backward the others skip). On a
    // GPU the verdict is NaN outputs on every rank, with the running statistics untouched and
    // the step counted in num_batches_tracked (as PyTorch counts every training forward).
    let outs = run_ranks_on(2, dev, |comm| {
        let bn = trained_layer(comm.clone(), dev);
        let mut before = snapshot(&bn);
        if !common::counts_on_host(dev) {
            before.2 += 1;
        }
        let x = randn(6, &[1 - comm.rank(), 4], 0.0, 1.0).to_dtype(DType::F32)?;
        let r = bn.forward_t(&on(dev, &x), true);
        let verdict = match r {
            Err(e) => Err(e.to_string()),
            Ok(y) => Ok(cpu(&y).flatten_all()?.to_vec1::<f32>()?),
        };
        Ok((verdict, snapshot(&bn) == before))
    });
    for (r, (res, untouched)) in outs.into_iter().enumerate() {
        if common::counts_on_host(dev) {
            let msg = res.expect_err("one value per channel must fail");
            assert!(
                msg.contains("more than 1 value per channel")
                    && msg.contains("got 1 in the global"),
                "rank {r}: {msg}"
            );
        } else {
            let y = res.expect("on a GPU the step runs");
            assert!(y.iter().all(|v| v.is_nan()), "rank {r}: {y:?}");
        }
        assert!(untouched, "rank {r}: a failed step changed the layer");
    }
    Ok(())
}

/// A rank that fails on its own (a channel count the layer does not have) and leaves: the
/// others then fail because it left. `ThreadGroup::run` returns the error that started it,
/// with its rank, the others' errors after it, and no line of candle's context after a
/// collective's message.
#[test]
fn run_returns_the_error_that_started_the_failure() {
    let err = ThreadGroup::run(3, |comm| {
        let vm = candle_nn::VarMap::new();
        let vb = candle_nn::VarBuilder::from_varmap(&vm, DType::F32, &Device::Cpu);
        let bn = candle_distributed::sync_batch_norm(3, 1e-5, vb, comm.clone())?;
        let c = if comm.rank() == 1 { 16 } else { 3 };
        let x = Tensor::ones((2, c, 2, 2), DType::F32, &Device::Cpu)?;
        bn.forward_t(&x, true)
    })
    .unwrap_err();
    let e = err.to_string();
    let first = e.lines().next().unwrap_or("");
    assert!(
        first.starts_with("rank 1 (where the failure started; then rank 0: ")
            && first.contains("rank 2: "),
        "{e}"
    );
    assert!(e.contains("expected 3 channels, got 16"), "{e}");
    // A collective's own error prints its message alone.
    let left = ThreadGroup::run(2, |comm| {
        if comm.rank() == 1 {
            return Ok(());
        }
        comm.barrier()
    })
    .unwrap_err()
    .to_string();
    assert!(!left.contains("a collective operation failed"), "{left}");
    assert!(left.contains("rank 1 dropped its communicator"), "{left}");
}

#[test]
fn a_rank_that_leaves_before_the_backward_fails_the_others_promptly() {
    let comms = ThreadGroup::new(3).unwrap(); // default timeout: minutes
    let start = Instant::now();
    let results: Vec<String> = std::thread::scope(|s| {
        let hs: Vec<_> = comms
            .into_iter()
            .map(|comm| {
                s.spawn(move || {
                    let rank = comm.rank();
                    let bn = trained_layer(comm, &Device::Cpu);
                    let x = candle_core::Var::from_tensor(
                        &randn(7, &[2, 4, 3], 0.0, 1.0).to_dtype(DType::F32).unwrap(),
                    )
                    .unwrap();
                    let y = bn.forward_t(x.as_tensor(), true).unwrap();
                    if rank == 0 {
                        // Leaves after the forward: the layer, the graph and its communicator go.
                        drop((y, bn));
                        return String::new();
                    }
                    let err = y
                        .sum_all()
                        .unwrap()
                        .backward()
                        .expect_err("backward must fail");
                    err.to_string()
                })
            })
            .collect();
        hs.into_iter().map(|h| h.join().unwrap()).collect()
    });
    assert!(start.elapsed() < PROMPT, "took {:?}", start.elapsed());
    for msg in &results[1..] {
        assert!(
            msg.contains("all_reduce") && msg.contains("rank 0 dropped its communicator"),
            "{msg}"
        );
    }
}

device_tests!(
    bad_inputs_are_named_and_change_nothing,
    ranks_with_different_channel_counts_all_get_a_mismatch_error,
    eval_issues_no_collective,
    one_value_per_channel_in_the_global_batch_fails_on_every_rank,
);

/// The CPU backward passes refuse a gradient or ReLU output of another dtype than the input,
/// naming which (`ops::backward_slices`, shared by both passes).
#[test]
fn backward_inputs_of_another_dtype_are_named() -> anyhow::Result<()> {
    use candle_distributed::ops::{
        batch_norm_backward_elemt, batch_norm_backward_reduce, BackwardElemtConfig,
    };
    let x = Tensor::randn(0f32, 1.0, (2, 3, 4), &Device::Cpu)?;
    let dy64 = Tensor::randn(0f64, 1.0, (2, 3, 4), &Device::Cpu)?;
    let mean = Tensor::new(&[0.1f64, 0.2, 0.3], &Device::Cpu)?;
    expect_err(
        batch_norm_backward_reduce(&dy64, &x, &mean, None, ChannelLayout::ChannelsFirst),
        &["gradient dtype F64 differs from input dtype F32"],
    );
    let (invstd, sums, count) = (
        Tensor::new(&[1.5f64, 2.0, 0.5], &Device::Cpu)?,
        Tensor::new(&[[0.3f64, 0.1, 0.2], [1.0, 2.0, 3.0]], &Device::Cpu)?,
        Tensor::new(&[24f64], &Device::Cpu)?,
    );
    let dy = x.affine(0.5, 0.25)?;
    let relu64 = dy64.relu()?;
    let err = batch_norm_backward_elemt(
        &dy,
        &x,
        &mean,
        &invstd,
        &sums,
        &count,
        BackwardElemtConfig {
            relu_output: Some(&relu64),
            ..Default::default()
        },
    )
    .map(|(dx, _)| dx);
    expect_err(err, &["relu output dtype F64 differs from input dtype F32"]);
    Ok(())
}

/// Per-channel arguments of the functional ops need their documented shape and a float dtype:
/// as many values in another shape (the backward's `[2, C]` sums transposed, a `[1, C]` shift)
/// or integer statistics are errors naming the argument, while the same values in the right
/// form are accepted.
#[test]
fn per_channel_arguments_need_their_shape() -> anyhow::Result<()> {
    use candle_distributed::ops::{
        batch_norm_backward_elemt, batch_norm_elemt, batch_norm_stats, BackwardElemtConfig,
        ElemtConfig,
    };
    let dev = Device::Cpu;
    let x = Tensor::randn(0f32, 1.0, (2, 3, 4), &dev)?;
    let mean = Tensor::new(&[0.1f64, 0.2, 0.3], &dev)?;
    let invstd = Tensor::new(&[1.5f64, 2.0, 0.5], &dev)?;
    let sums = Tensor::new(&[[0.3f64, 0.1, 0.2], [1.0, 2.0, 3.0]], &dev)?;
    let count = Tensor::new(&[24f64], &dev)?;
    let elemt = |sums: &Tensor| {
        batch_norm_backward_elemt(
            &x,
            &x,
            &mean,
            &invstd,
            sums,
            &count,
            BackwardElemtConfig {
                ..Default::default()
            },
        )
        .map(|(dx, _)| dx)
    };
    elemt(&sums)?;
    expect_err(
        elemt(&sums.t()?),
        &["expected sums of shape [2, 3] in a float dtype, got shape [3, 2]"],
    );
    batch_norm_stats(&x, &mean, ChannelLayout::ChannelsFirst)?;
    expect_err(
        batch_norm_stats(&x, &mean.unsqueeze(0)?, ChannelLayout::ChannelsFirst),
        &["expected shift of shape [3]", "got shape [1, 3]"],
    );
    let apply = |mean: &Tensor| {
        batch_norm_elemt(
            &x,
            mean,
            &invstd,
            ElemtConfig {
                ..Default::default()
            },
        )
    };
    apply(&mean)?;
    expect_err(
        apply(&Tensor::new(&[0u32, 1, 2], &dev)?),
        &["expected mean of shape [3] in a float dtype, got shape [3] U32"],
    );
    Ok(())
}

/// A rank that stops after its second collective: the ranks that time out at the third name
/// it and where it stopped ("rank 2 never reached all_reduce #2; its last collective:
/// all_reduce #1 F32×4, completed ..."), from the flight recorders, and each rank's recorder
/// holds its own calls in order with their states.
#[test]
fn a_timeout_names_where_the_laggard_stopped() {
    let comms = ThreadGroup::with_timeout(3, SHORT).unwrap();
    let t = Tensor::ones(4, DType::F32, &Device::Cpu).unwrap();
    let results: Vec<Result<(), String>> = std::thread::scope(|s| {
        let hs: Vec<_> = comms
            .iter()
            .enumerate()
            .map(|(rank, comm)| {
                let (comm, t) = (comm.clone(), t.clone());
                s.spawn(move || -> Result<(), String> {
                    let calls = if rank == 2 { 2 } else { 3 };
                    for _ in 0..calls {
                        comm.all_reduce(&t, ReduceOp::Sum)
                            .map_err(|e| e.to_string())?;
                    }
                    Ok(())
                })
            })
            .collect();
        hs.into_iter().map(|h| h.join().unwrap()).collect()
    });
    assert!(results[2].is_ok());
    for (r, result) in results.iter().enumerate().take(2) {
        let msg = result.as_ref().expect_err("ranks 0 and 1 time out");
        assert!(
            msg.contains("waiting for ranks [2]")
                && msg.contains("rank 2 never reached all_reduce #2; its last collective: all_reduce #1 F32×4, completed"),
            "rank {r}: {msg}"
        );
    }
    let states = |rank: usize| -> Vec<(u64, CallState)> {
        let rec = comms[rank].recorder().expect("thread ranks record");
        rec.records().iter().map(|c| (c.call, c.state)).collect()
    };
    assert_eq!(
        states(0),
        [
            (0, CallState::Completed),
            (1, CallState::Completed),
            (2, CallState::Failed)
        ]
    );
    assert_eq!(
        states(2),
        [(0, CallState::Completed), (1, CallState::Completed)]
    );
}

/// `CANDLE_DISTRIBUTED_TIMEOUT` sets the timeout of a group made without one (seconds,
/// fractions allowed): a missing rank fails the others after it; a value that is not a
/// positive number is refused naming the variable. In a child process, so that the variable
/// reaches no other test.
#[test]
fn one_variable_sets_the_default_timeout() {
    const CHILD: &str = "CANDLE_DISTRIBUTED_TIMEOUT_TEST_CHILD";
    if std::env::var_os(CHILD).is_some() {
        let bad = std::env::var(candle_distributed::collective::TIMEOUT_VAR).unwrap() == "soon";
        match ThreadGroup::new(2) {
            Err(e) if bad => {
                assert!(
                    e.to_string()
                        .contains("CANDLE_DISTRIBUTED_TIMEOUT=\"soon\""),
                    "{e}"
                );
            }
            Ok(comms) if !bad => {
                let start = Instant::now();
                let t = Tensor::ones(2, DType::F32, &Device::Cpu).unwrap();
                let e = comms[0]
                    .all_reduce(&t, ReduceOp::Sum)
                    .unwrap_err()
                    .to_string();
                assert!(e.contains("timed out after 300ms"), "{e}");
                assert!(
                    start.elapsed() < Duration::from_secs(3),
                    "{:?}",
                    start.elapsed()
                );
            }
            other => panic!("{other:?}"),
        }
        return;
    }
    for value in ["0.3", "soon"] {
        let out = std::process::Command::new(std::env::current_exe().unwrap())
            .args([
                "one_variable_sets_the_default_timeout",
                "--exact",
                "--nocapture",
            ])
            .env(CHILD, "1")
            .env(candle_distributed::collective::TIMEOUT_VAR, value)
            .output()
            .unwrap();
        assert!(
            out.status.success(),
            "{value}: {}",
            String::from_utf8_lossy(&out.stderr)
        );
    }
}
