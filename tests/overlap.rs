//! The overlapped backward of `DataParallel` (`GradHooks`, `DataParallel::backward`): the same
//! gradients, bit for bit, as `loss.backward()` + `sync_gradients` on the same replicas, for f32
//! and the 16-bit wires, with small and default buckets, unused variables, a shared weight and
//! accumulated micro-batches; buckets started while the backward runs; misuse refused.

mod common;

use std::sync::{Arc, Mutex};

use candle_core::{DType, Device, Module, Tensor};
use candle_distributed::collective::{Collective, Decorator, Op, ThreadGroup};
use candle_distributed::{DataParallel, GradHooks};
use candle_nn::{linear, Optimizer, VarBuilder, VarMap, SGD};
use common::overlap::{
    assert_twins_equal, batch, flat, net, one_bucket_each, seed, twin, twin_of, twin_steps, Twin,
};
use common::*;

/// f32 and both 16-bit wires, each variable a bucket of its own and the default 25 MiB: the
/// overlapped steps equal the synced ones bit for bit on every rank (3 ranks, 3 SGD steps,
/// the batch norm's running statistics included). With one variable per bucket and every
/// variable used, every bucket starts while the backward runs.
fn overlapped_steps_equal_synced_ones(dev: &Device) -> anyhow::Result<()> {
    for wire in [None, Some(DType::BF16), Some(DType::F16)] {
        for bucket_bytes in [1, candle_distributed::data_parallel::DEFAULT_BUCKET_BYTES] {
            let outs = run_ranks_on(3, dev, |c| twin_steps(c, dev, wire, bucket_bytes, false));
            for (rank, (_, _, stats)) in outs.iter().enumerate() {
                if bucket_bytes == 1 {
                    assert_eq!(
                        stats.started_during_backward, stats.buckets,
                        "rank {rank}, wire {wire:?}: every bucket starts inside the backward: {stats:?}"
                    );
                    assert_eq!(
                        stats.buckets, 8,
                        "rank {rank}: one bucket per trainable variable"
                    );
                }
            }
            assert_twins_equal(
                &format!("wire {wire:?}, buckets of {bucket_bytes} bytes"),
                outs,
            );
        }
    }
    Ok(())
}

/// Records every call's operation and element count, in call order.
#[derive(Debug)]
struct Recorded {
    inner: Arc<dyn Collective>,
    log: Mutex<Vec<(String, usize)>>,
}

impl Recorded {
    /// `inner` wrapped: the recorder (to read its log) and the communicator to hand out.
    fn wrap(inner: Arc<dyn Collective>) -> (Arc<Self>, Arc<dyn Collective>) {
        let rec = Arc::new(Self {
            inner,
            log: Mutex::new(Vec::new()),
        });
        let comm: Arc<dyn Collective> = rec.clone();
        (rec, comm)
    }
}

impl Decorator for Recorded {
    fn inner(&self) -> &Arc<dyn Collective> {
        &self.inner
    }
    fn before(&self, op: Op, t: Option<&Tensor>) -> candle_core::Result<()> {
        let n = t.map_or(0, Tensor::elem_count);
        self.log.lock().unwrap().push((format!("{op:?}"), n));
        Ok(())
    }
}

/// Every rank issues the same collectives in the same order, buckets included, although the
/// hooks start them as gradients complete and each rank's data differs (3 ranks, one bucket per
/// variable, an unused layer whose bucket waits for the end): recorded by a `Decorator`.
fn every_rank_starts_the_same_buckets_in_the_same_order(dev: &Device) -> anyhow::Result<()> {
    let logs = run_ranks_on(3, dev, |c| {
        let (rec, comm) = Recorded::wrap(c);
        let vm = VarMap::new();
        let hooks = GradHooks::new();
        let model = net(hooks.var_builder(&vm, DType::F32, dev), comm.clone(), true)?;
        seed(&vm);
        let dp = DataParallel::new(&vm, comm.clone())?
            .with_bucket_bytes(1)
            .with_overlap(&hooks)?;
        rec.log.lock().unwrap().clear();
        for s in 0..2 {
            dp.backward(&model.loss(&batch(comm.rank(), 40 + s, dev))?)?;
        }
        let log = rec.log.lock().unwrap().clone();
        Ok(log)
    });
    let buckets = logs[0]
        .iter()
        .filter(|(op, _)| op.starts_with("AllReduce"))
        .count();
    assert!(
        buckets >= 2 * 10,
        "the buckets and the batch norm's all-reduces: {:?}",
        logs[0]
    );
    for (rank, log) in logs.iter().enumerate() {
        assert_eq!(log, &logs[0], "rank {rank}'s collectives against rank 0's");
    }
    Ok(())
}

/// A model that takes its layers from the builder in another order than the forward uses them
/// (the output layer first): on the first backward nothing is known yet and every bucket goes
/// after the backward; from the second backward on the buckets follow the order rank 0's
/// gradients arrived in, none is held back and every one starts inside the backward. The
/// gradients equal `sync_gradients`' bit for bit at every step, and both ranks issue the same
/// collectives.
fn buckets_follow_the_observed_order_after_the_first_step(dev: &Device) -> anyhow::Result<()> {
    let outs = run_ranks_on(2, dev, |c| {
        let (rec, comm) = Recorded::wrap(c);
        let build = |vb: VarBuilder| -> anyhow::Result<[candle_nn::Linear; 3]> {
            let out = linear(8, 2, vb.pp("out"))?;
            let first = linear(4, 8, vb.pp("first"))?;
            let mid = linear(8, 8, vb.pp("mid"))?;
            Ok([first, mid, out])
        };
        let loss = |m: &[candle_nn::Linear; 3], x: &Tensor| -> candle_core::Result<Tensor> {
            let h = m[0].forward(x)?.relu()?;
            m[2].forward(&m[1].forward(&h)?.relu()?)?.sqr()?.mean_all()
        };
        let t = twin_of(dev, build)?;
        let (dp_o, dp_p) = one_bucket_each(&t, &comm)?;
        let Twin {
            vm_o,
            model_o,
            vm_p,
            model_p,
            ..
        } = t;
        let mut stats = Vec::new();
        for s in 0..3u64 {
            let seed_of = 300 + 10 * s + comm.rank() as u64;
            let x = on(
                dev,
                &randn(seed_of, &[5, 4], 0.0, 1.0).to_dtype(DType::F32)?,
            );
            let g_o = dp_o.backward(&loss(&model_o, &x)?)?;
            let g_p = dp_p.sync_gradients(loss(&model_p, &x)?.backward()?)?;
            assert_eq!(flat(&vm_o, &g_o), flat(&vm_p, &g_p), "step {s}");
            stats.push(dp_o.overlap_stats());
        }
        let log = rec.log.lock().unwrap().clone();
        Ok((stats, log))
    });
    for (rank, (stats, log)) in outs.iter().enumerate() {
        assert_eq!(
            stats[0].started_during_backward, 0,
            "rank {rank}: nothing starts inside the first backward: {stats:?}"
        );
        for s in &stats[1..] {
            assert_eq!(s.held_back, 0, "rank {rank}: {stats:?}");
            assert_eq!(s.started_during_backward, 6, "rank {rank}: {stats:?}");
        }
        assert_eq!(
            log, &outs[0].1,
            "rank {rank}'s collectives against rank 0's"
        );
    }
    Ok(())
}

/// A layer the forward never uses: its bucket (and every later one) is sent after the backward,
/// with the presence flags; its variables get no gradient, as with `sync_gradients`.
fn an_unused_layer_is_sent_after_the_backward(dev: &Device) -> anyhow::Result<()> {
    let outs = run_ranks_on(2, dev, |c| twin_steps(c, dev, None, 1, true));
    for (rank, (steps, _, stats)) in outs.iter().enumerate() {
        assert!(
            stats.started_during_backward < stats.buckets,
            "rank {rank}: the unused layer's bucket waits for the end: {stats:?}"
        );
        let spare: Vec<_> = steps[0][0]
            .iter()
            .filter(|(n, _)| n.starts_with("spare"))
            .collect();
        assert!(
            spare.iter().all(|(_, g)| g.is_none()),
            "rank {rank}: {spare:?}"
        );
    }
    assert_twins_equal("an unused layer", outs);
    Ok(())
}

/// A weight taken twice from the builder (tied layers) is one hooked tensor: its gradient is the
/// sum of both uses, as without hooks.
fn a_shared_weight_gets_both_uses(dev: &Device) -> anyhow::Result<()> {
    let outs = run_ranks_on(2, dev, |c| {
        let grads = |hooked: bool| -> anyhow::Result<Vec<f32>> {
            let vm = VarMap::new();
            let hooks = GradHooks::new();
            let vb = if hooked {
                hooks.var_builder(&vm, DType::F32, dev)
            } else {
                VarBuilder::from_varmap(&vm, DType::F32, dev)
            };
            let a = linear(4, 4, vb.pp("tied"))?;
            let b = linear(4, 4, vb.pp("tied"))?;
            seed(&vm);
            let mut dp = DataParallel::new(&vm, c.clone())?;
            if hooked {
                dp = dp.with_overlap(&hooks)?;
            }
            let x = on(
                dev,
                &randn(9 + c.rank() as u64, &[3, 4], 0.0, 1.0).to_dtype(DType::F32)?,
            );
            let loss = b.forward(&a.forward(&x)?.tanh()?)?.sqr()?.mean_all()?;
            let g = dp.backward(&loss)?;
            let w = vm.data().lock().unwrap()["tied.weight"].clone();
            Ok(g.get(w.as_tensor())
                .unwrap()
                .flatten_all()?
                .to_vec1::<f32>()?)
        };
        Ok((grads(true)?, grads(false)?))
    });
    for (rank, (hooked, plain)) in outs.iter().enumerate() {
        assert_eq!(hooked, plain, "rank {rank}: tied weight");
    }
    Ok(())
}

/// Micro-batches: the first two backwards plain (`accumulate`), the last one overlapped with the
/// sum so far: the same gradients, bit for bit, as accumulating all three and `sync_gradients`.
fn accumulated_micro_batches_equal_synced_ones(dev: &Device) -> anyhow::Result<()> {
    let outs = run_ranks_on(2, dev, |c| {
        let Twin {
            vm_o,
            model_o,
            vm_p,
            model_p,
            hooks,
        } = twin(c.clone(), dev, false)?;
        let dp_o = DataParallel::new(&vm_o, c.clone())?
            .with_bucket_bytes(64)
            .with_overlap(&hooks)?;
        let dp_p = DataParallel::new(&vm_p, c.clone())?.with_bucket_bytes(64);
        let (mut acc_o, mut acc_p) = (None, None);
        for m in 0..2 {
            let x = batch(c.rank(), 10 + m, dev);
            acc_o = Some(dp_o.accumulate(acc_o, model_o.loss(&x)?.backward()?)?);
            acc_p = Some(dp_p.accumulate(acc_p, model_p.loss(&x)?.backward()?)?);
        }
        let x = batch(c.rank(), 12, dev);
        let g_o = dp_o.backward_accumulated(&model_o.loss(&x)?, acc_o)?;
        let g_p = dp_p.accumulate(acc_p, model_p.loss(&x)?.backward()?)?;
        let g_p = dp_p.sync_gradients(g_p)?;
        Ok((flat(&vm_o, &g_o), flat(&vm_p, &g_p)))
    });
    for (rank, (o, p)) in outs.iter().enumerate() {
        assert_eq!(o, p, "rank {rank}: accumulated micro-batches");
    }
    Ok(())
}

/// A variable used both through the builder and directly (its own tensor) would have its
/// gradient split between the hook and the variable: an error naming it on every rank, after
/// every bucket was sent (no rank waits for another).
fn a_variable_used_also_without_its_hook_is_refused(dev: &Device) -> anyhow::Result<()> {
    let errs = run_ranks_on(2, dev, |c| {
        let vm = VarMap::new();
        let hooks = GradHooks::new();
        let fc = linear(4, 2, hooks.var_builder(&vm, DType::F32, dev).pp("fc"))?;
        seed(&vm);
        let dp = DataParallel::new(&vm, c.clone())?.with_overlap(&hooks)?;
        let raw = vm.data().lock().unwrap()["fc.weight"].as_tensor().clone();
        let x = on(dev, &randn(3, &[3, 4], 0.0, 1.0).to_dtype(DType::F32)?);
        let loss = (fc.forward(&x)?.sum_all()? + raw.sqr()?.sum_all()?)?;
        Ok(dp.backward(&loss).err().map(|e| e.to_string()))
    });
    for (rank, e) in errs.iter().enumerate() {
        let e = e.as_deref().unwrap_or("no error");
        assert!(
            e.contains("fc.weight") && e.contains("directly"),
            "rank {rank}: {e}"
        );
    }
    Ok(())
}

/// Models built in a different order on some rank would start their buckets in different
/// orders: `with_overlap` fails on every rank.
fn a_different_build_order_fails_on_every_rank(dev: &Device) -> anyhow::Result<()> {
    let errs = run_ranks_on(2, dev, |c| {
        let vm = VarMap::new();
        let hooks = GradHooks::new();
        let vb = hooks.var_builder(&vm, DType::F32, dev);
        let names = if c.rank() == 0 {
            ["a", "b"]
        } else {
            ["b", "a"]
        };
        for n in names {
            linear(3, 3, vb.pp(n))?;
        }
        Ok(DataParallel::new(&vm, c.clone())?
            .with_overlap(&hooks)
            .err()
            .map(|e| e.to_string()))
    });
    for (rank, e) in errs.iter().enumerate() {
        let e = e.as_deref().unwrap_or("no error");
        assert!(e.contains("order"), "rank {rank}: {e}");
    }
    Ok(())
}

/// Two SGD steps on batches `first` and `first + 1`: the hooked model through
/// `DataParallel::step`, the plain one through `sync_gradients`; then both models' losses on
/// batch `first + 10`, and that batch.
fn two_steps_alike(
    rank: usize,
    dev: &Device,
    first: u64,
    (dp_o, model_o, opt_o): (&DataParallel, &common::overlap::Net, &mut SGD),
    (dp_p, model_p): (&DataParallel, &common::overlap::Net),
) -> anyhow::Result<((f32, f32), Tensor)> {
    let mut opt_p = SGD::new(dp_p.trainable(), 0.1)?;
    for s in 0..2 {
        let x = batch(rank, first + s, dev);
        dp_o.step(opt_o, &model_o.loss(&x)?)?;
        opt_p.step(&dp_p.sync_gradients(model_p.loss(&x)?.backward()?)?)?;
    }
    let x = batch(rank, first + 10, dev);
    let losses = (
        model_o.loss(&x)?.to_scalar::<f32>()?,
        model_p.loss(&x)?.to_scalar::<f32>()?,
    );
    Ok((losses, x))
}

/// `DataParallel::step` refreshes the hooked copies: after two steps, the hooked model's loss
/// equals, bit for bit, that of the same model stepped with `sync_gradients` and the optimizer.
fn step_refreshes_what_the_model_computes_with(dev: &Device) -> anyhow::Result<()> {
    let outs = run_ranks_on(2, dev, |c| {
        let Twin {
            vm_o,
            model_o,
            vm_p,
            model_p,
            hooks,
        } = twin(c.clone(), dev, false)?;
        let dp_o = DataParallel::new(&vm_o, c.clone())?.with_overlap(&hooks)?;
        let dp_p = DataParallel::new(&vm_p, c.clone())?;
        let mut opt_o = SGD::new(dp_o.trainable(), 0.1)?;
        let (losses, _) = two_steps_alike(
            c.rank(),
            dev,
            20,
            (&dp_o, &model_o, &mut opt_o),
            (&dp_p, &model_p),
        )?;
        Ok(losses)
    });
    for (rank, (o, p)) in outs.iter().enumerate() {
        assert_eq!(
            o.to_bits(),
            p.to_bits(),
            "rank {rank}: loss after two steps: {o} vs {p}"
        );
    }
    Ok(())
}

/// A plain `loss.backward()` through hooked tensors (accumulated micro-batches) gives every
/// variable its gradient, as if there were no hook (the hooks only report inside
/// `DataParallel::backward`), once a `DataParallel` took the hooks.
fn a_plain_backward_through_hooks_is_unchanged(dev: &Device) -> anyhow::Result<()> {
    let vm = VarMap::new();
    let hooks = GradHooks::new();
    let fc = linear(4, 2, hooks.var_builder(&vm, DType::F32, dev).pp("fc"))?;
    seed(&vm);
    let comm = Probe::on_device(ThreadGroup::new(1)?.remove(0), dev);
    let _dp = DataParallel::new(&vm, comm)?.with_overlap(&hooks)?;
    let x = on(dev, &randn(5, &[3, 4], 0.0, 1.0).to_dtype(DType::F32)?);
    let g = fc.forward(&x)?.sum_all()?.backward()?;
    let w = vm.data().lock().unwrap()["fc.weight"].clone();
    // d(sum(x·wᵀ))/dw = column sums of x, in each row.
    let want = x
        .sum(0)?
        .unsqueeze(0)?
        .broadcast_as((2, 4))?
        .flatten_all()?
        .to_vec1::<f32>()?;
    assert_eq!(
        g.get(w.as_tensor())
            .unwrap()
            .flatten_all()?
            .to_vec1::<f32>()?,
        want
    );
    Ok(())
}

/// A layer that some ranks use and others not, moving from step to step (after the
/// tensor-parallel layer on rank 0, before it on rank 1, …: `common::overlap::route`), in a
/// model whose backward also all-reduces in SyncBatchNorm and in a tensor-parallel layer, one
/// bucket per variable: every step's gradients equal `sync_gradients`' bit for bit, both ranks
/// issue the same collectives in the same order (recorded by a `Decorator`), and the step that
/// routes the layer later than its learned place sends its bucket again.
fn a_layer_used_on_some_ranks_keeps_the_collectives_in_step(dev: &Device) -> anyhow::Result<()> {
    let outs = run_ranks_on(2, dev, |c| {
        let (rec, comm) = Recorded::wrap(c);
        let got = common::overlap::routed_steps(comm, dev)?;
        let log = rec.log.lock().unwrap().clone();
        Ok((got, log))
    });
    for (rank, (_, log)) in outs.iter().enumerate() {
        assert_eq!(
            log, &outs[0].1,
            "rank {rank}'s collectives against rank 0's"
        );
    }
    let outs: Vec<_> = outs.into_iter().map(|(got, _)| got).collect();
    common::overlap::assert_routed("thread ranks", &outs);
    Ok(())
}

/// Micro-batches with a routed layer: an earlier micro-batch uses the layer, the last one does
/// not, and the layer's bucket has its place before the backward's last collective: the bucket
/// starts there with the earlier micro-batches' gradient (not zeros), and the step equals
/// accumulating every micro-batch and `sync_gradients`, bit for bit.
fn accumulated_micro_batches_with_a_routed_layer_equal_synced_ones(
    dev: &Device,
) -> anyhow::Result<()> {
    use common::overlap::{routed, Route};
    let outs = run_ranks_on(2, dev, |c| {
        let t = twin_of(dev, |vb| routed(vb, c.clone()))?;
        let (dp_o, dp_p) = one_bucket_each(&t, &c)?;
        let Twin {
            vm_o,
            model_o,
            vm_p,
            model_p,
            ..
        } = t;
        let mut steps = Vec::new();
        for (s, routes) in [
            (0u64, [Route::AfterTp, Route::AfterTp]),
            (1, [Route::AfterTp, Route::Skip]),
        ] {
            let (mut acc_o, mut acc_p) = (None, None);
            let x = batch(c.rank(), 200 + 10 * s, dev);
            acc_o = Some(dp_o.accumulate(acc_o, model_o.loss(&x, routes[0])?.backward()?)?);
            acc_p = Some(dp_p.accumulate(acc_p, model_p.loss(&x, routes[0])?.backward()?)?);
            let x = batch(c.rank(), 201 + 10 * s, dev);
            let g_o = dp_o.backward_accumulated(&model_o.loss(&x, routes[1])?, acc_o)?;
            let g_p = dp_p.accumulate(acc_p, model_p.loss(&x, routes[1])?.backward()?)?;
            let g_p = dp_p.sync_gradients(g_p)?;
            steps.push((flat(&vm_o, &g_o), flat(&vm_p, &g_p)));
        }
        Ok(steps)
    });
    for (rank, steps) in outs.iter().enumerate() {
        for (s, (o, p)) in steps.iter().enumerate() {
            assert_eq!(o, p, "rank {rank}, step {s}");
        }
    }
    Ok(())
}

/// A backward that fails on one rank fails the step on every rank (nothing returned, no partial
/// average): the failing rank with its own error, the others naming the failure elsewhere. The
/// ranks stay in step: the next step runs and equals `sync_gradients`' bit for bit.
fn a_backward_that_fails_on_one_rank_fails_every_rank(dev: &Device) -> anyhow::Result<()> {
    let outs = run_ranks_on(2, dev, |c| {
        let build = |vb: VarBuilder| -> anyhow::Result<[candle_nn::Linear; 2]> {
            Ok([linear(4, 6, vb.pp("a"))?, linear(6, 2, vb.pp("b"))?])
        };
        let t = twin_of(dev, build)?;
        let (dp_o, dp_p) = one_bucket_each(&t, &c)?;
        let Twin {
            vm_o,
            model_o: m_o,
            vm_p,
            model_p: m_p,
            ..
        } = t;
        let loss = |m: &[candle_nn::Linear; 2], x: &Tensor, fail: bool| {
            let h = m[0].forward(x)?.apply_op1(Probed { comm: None, fail })?;
            m[1].forward(&h.tanh()?)?.sqr()?.mean_all()
        };
        let mut outcomes = Vec::new();
        for s in 0..3u64 {
            let x = on(
                dev,
                &randn(70 + 10 * s + c.rank() as u64, &[3, 4], 0.0, 1.0).to_dtype(DType::F32)?,
            );
            let fail = s == 1 && c.rank() == 1;
            match dp_o.backward(&loss(&m_o, &x, fail)?) {
                Ok(g) => {
                    let g_p = dp_p.sync_gradients(loss(&m_p, &x, false)?.backward()?)?;
                    assert_eq!(flat(&vm_o, &g), flat(&vm_p, &g_p), "step {s}");
                    outcomes.push(None);
                }
                Err(e) => outcomes.push(Some(format!("{e:#}"))),
            }
        }
        Ok(outcomes)
    });
    for (rank, outcomes) in outs.iter().enumerate() {
        assert!(
            outcomes[0].is_none() && outcomes[2].is_none(),
            "rank {rank}: {outcomes:?}"
        );
        let e = outcomes[1].as_deref().unwrap_or("no error");
        let want = if rank == 1 {
            "the backward failed here"
        } else {
            "another rank's backward failed"
        };
        assert!(e.contains(want), "rank {rank}: {e}");
    }
    Ok(())
}

/// The identity, whose backward fails where `fail` says (an op's error, an out-of-memory in the
/// backward); with `comm`, it all-reduces its gradient through
/// `collective::in_backward::collective` and fails inside it, after the announcement and
/// before the all-reduce.
struct Probed {
    comm: Option<Arc<dyn Collective>>,
    fail: bool,
}

impl candle_core::CustomOp1 for Probed {
    fn name(&self) -> &'static str {
        "probed-identity"
    }
    fn cpu_fwd(
        &self,
        s: &candle_core::CpuStorage,
        l: &candle_core::Layout,
    ) -> candle_core::Result<(candle_core::CpuStorage, candle_core::Shape)> {
        use candle_core::backend::BackendStorage;
        Ok((s.try_clone(l)?, l.shape().clone()))
    }
    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        s: &candle_core::CudaStorage,
        l: &candle_core::Layout,
    ) -> candle_core::Result<(candle_core::CudaStorage, candle_core::Shape)> {
        use candle_core::backend::BackendStorage;
        Ok((s.try_clone(l)?, l.shape().clone()))
    }
    fn bwd(&self, _: &Tensor, _: &Tensor, g: &Tensor) -> candle_core::Result<Option<Tensor>> {
        let fail = || -> candle_core::Result<()> {
            if self.fail {
                candle_core::bail!(
                    "probed-identity: the backward failed here (as out of memory would)"
                )
            }
            Ok(())
        };
        let Some(comm) = &self.comm else {
            return fail().map(|()| Some(g.clone()));
        };
        candle_distributed::collective::in_backward::collective(|| {
            fail()?;
            comm.all_reduce(
                &g.contiguous()?,
                candle_distributed::collective::ReduceOp::Sum,
            )
        })
        .map(Some)
    }
}

/// A backward that fails on one rank after a collective of the backward was announced and
/// before it was issued cannot take part in it: that rank leaves the step at once, saying so,
/// and sends nothing more (a bucket or the exchange would meet the others' all-reduce); the
/// others fail because it left, not with mismatched calls.
fn a_rank_that_fails_inside_a_collective_of_the_backward_leaves_the_step(
    dev: &Device,
) -> anyhow::Result<()> {
    let outs = run_ranks_on(2, dev, |c| {
        let (vm, hooks) = (VarMap::new(), GradHooks::new());
        let vb = hooks.var_builder(&vm, DType::F32, dev);
        let (a, b) = (linear(4, 6, vb.pp("a"))?, linear(6, 2, vb.pp("b"))?);
        seed(&vm);
        let dp = DataParallel::new(&vm, c.clone())?
            .with_bucket_bytes(1)
            .with_overlap(&hooks)?;
        let mut outcomes = Vec::new();
        for s in 0..2u64 {
            let x = on(
                dev,
                &randn(90 + s + c.rank() as u64, &[3, 4], 0.0, 1.0).to_dtype(DType::F32)?,
            );
            let op = Probed {
                comm: Some(c.clone()),
                fail: s == 1 && c.rank() == 1,
            };
            let h = a.forward(&x)?.apply_op1(op)?;
            let loss = b.forward(&h.tanh()?)?.sqr()?.mean_all()?;
            outcomes.push(dp.backward(&loss).err().map(|e| format!("{e:#}")));
        }
        Ok(outcomes)
    });
    for (rank, o) in outs.iter().enumerate() {
        assert!(o[0].is_none(), "rank {rank}: {o:?}");
        let e = o[1].as_deref().unwrap_or("no error");
        match rank {
            1 => assert!(
                e.contains("the backward failed here") && e.contains("leaves the step"),
                "{e}"
            ),
            _ => assert!(
                e.contains("dropped its communicator") && !e.contains("disagree"),
                "{e}"
            ),
        }
    }
    Ok(())
}

/// A model built through `GradHooks` whose hooks no `DataParallel` took (stepped the plain way:
/// `sync_gradients` and the optimizer) would compute with copies that never see a step: its
/// first backward is refused on every rank, saying what to call.
fn hooks_no_data_parallel_took_are_refused(dev: &Device) -> anyhow::Result<()> {
    let errs = run_ranks_on(2, dev, |c| {
        let vm = VarMap::new();
        let hooks = GradHooks::new();
        let fc = linear(4, 2, hooks.var_builder(&vm, DType::F32, dev).pp("fc"))?;
        seed(&vm);
        let _dp = DataParallel::new(&vm, c.clone())?;
        let x = on(dev, &randn(5, &[3, 4], 0.0, 1.0).to_dtype(DType::F32)?);
        Ok(fc
            .forward(&x)?
            .sum_all()?
            .backward()
            .err()
            .map(|e| e.to_string()))
    });
    for (rank, e) in errs.iter().enumerate() {
        let e = e.as_deref().unwrap_or("no error");
        assert!(
            e.contains("`fc.") && e.contains("no DataParallel took") && e.contains("with_overlap"),
            "rank {rank}: {e}"
        );
    }
    Ok(())
}

/// PyTorch's usual order, wrap then load: variables set (a checkpoint loaded) after
/// `with_overlap`, or stepped by an optimizer without a refresh, leave the hooked copies stale.
/// The next backward is refused on every rank, naming the variable and `dp.refresh()`; after the
/// refresh the model trains as one that never had hooks, bit for bit.
fn a_stale_hooked_copy_is_refused_until_refreshed(dev: &Device) -> anyhow::Result<()> {
    let outs = run_ranks_on(2, dev, |c| {
        let Twin {
            vm_o,
            model_o,
            vm_p,
            model_p,
            hooks,
        } = twin(c.clone(), dev, false)?;
        let dp_o = DataParallel::new(&vm_o, c.clone())?.with_overlap(&hooks)?;
        let dp_p = DataParallel::new(&vm_p, c.clone())?;
        // "Loaded" after with_overlap: other values into both models' variables.
        for vm in [&vm_o, &vm_p] {
            for (name, v) in vm.data().lock().unwrap().iter() {
                if !name.contains("running") && !name.contains("num_batches") {
                    v.set(&(v.as_tensor() * 1.5)?)?;
                }
            }
        }
        let x = batch(c.rank(), 80, dev);
        let loaded = dp_o
            .backward(&model_o.loss(&x)?)
            .err()
            .map(|e| e.to_string());
        // The same forward on the other model: its batch norm's state advances alike.
        model_p.loss(&x)?;
        dp_o.refresh()?;
        let mut opt_o = SGD::new(dp_o.trainable(), 0.1)?;
        let (losses, x) = two_steps_alike(
            c.rank(),
            dev,
            81,
            (&dp_o, &model_o, &mut opt_o),
            (&dp_p, &model_p),
        )?;
        // An optimizer step without a refresh: the next backward is refused too.
        opt_o.step(&dp_o.backward(&model_o.loss(&x)?)?)?;
        let unrefreshed = dp_o
            .backward(&model_o.loss(&x)?)
            .err()
            .map(|e| e.to_string());
        Ok((loaded, losses, unrefreshed))
    });
    for (rank, (loaded, (o, p), unrefreshed)) in outs.iter().enumerate() {
        for e in [loaded, unrefreshed] {
            let e = e.as_deref().unwrap_or("no error");
            assert!(
                e.contains("stale") && e.contains("dp.refresh()"),
                "rank {rank}: {e}"
            );
        }
        assert_eq!(
            o.to_bits(),
            p.to_bits(),
            "rank {rank}: after the refresh: {o} vs {p}"
        );
    }
    Ok(())
}

device_tests!(
    a_layer_used_on_some_ranks_keeps_the_collectives_in_step,
    accumulated_micro_batches_with_a_routed_layer_equal_synced_ones,
    a_rank_that_fails_inside_a_collective_of_the_backward_leaves_the_step,
    a_backward_that_fails_on_one_rank_fails_every_rank,
    hooks_no_data_parallel_took_are_refused,
    a_stale_hooked_copy_is_refused_until_refreshed,
    overlapped_steps_equal_synced_ones,
    an_unused_layer_is_sent_after_the_backward,
    a_shared_weight_gets_both_uses,
    accumulated_micro_batches_equal_synced_ones,
    a_variable_used_also_without_its_hook_is_refused,
    a_different_build_order_fails_on_every_rank,
    a_plain_backward_through_hooks_is_unchanged,
    step_refreshes_what_the_model_computes_with,
    every_rank_starts_the_same_buckets_in_the_same_order,
    buckets_follow_the_observed_order_after_the_first_step,
);
