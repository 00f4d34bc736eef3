//! Checkpoints every rank agrees on (`candle_distributed::checkpoint`) and an AdamW whose state
//! they carry (`candle_distributed::optim::AdamW`): a round trip of variables, optimizer state,
//! SyncBatchNorm shifts and metadata; damage of every kind refused naming the file; a rank
//! that cannot load, or holds another checkpoint, or none, failing every rank; rank 0's failed
//! write failing every rank; AdamW's steps equal to candle-nn's, and a resumed AdamW equal to an
//! uninterrupted one, bit for bit.

mod common;

use std::path::{Path, PathBuf};
use std::sync::Arc;

use candle_core::{DType, Device, Module, Tensor};
use candle_distributed::checkpoint::{self, Loaded};
use candle_distributed::collective::{Collective, ThreadGroup};
use candle_distributed::optim::AdamW;
use candle_distributed::{sync_batch_norm, DataParallel, SyncBatchNorm};
use candle_nn::{linear, Linear, ModuleT, Optimizer, ParamsAdamW, VarBuilder, VarMap};
use common::randn;

fn fresh_dir(tag: &str) -> PathBuf {
    let d = std::env::temp_dir().join(format!("ckpt-{tag}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    std::fs::create_dir_all(&d).unwrap();
    d
}

/// A linear layer and a SyncBatchNorm, with an AdamW over both, trained data-parallel (so that
/// every rank holds what rank 0 saves).
struct Model {
    vm: VarMap,
    fc: Linear,
    bn: SyncBatchNorm,
    dp: DataParallel,
    opt: AdamW,
}

fn model(comm: Arc<dyn Collective>) -> anyhow::Result<Model> {
    let vm = VarMap::new();
    let vb = VarBuilder::from_varmap(&vm, DType::F32, &Device::Cpu);
    let fc = linear(4, 3, vb.pp("fc"))?;
    let bn = sync_batch_norm(3, 1e-5, vb.pp("bn"), comm.clone())?;
    let dp = DataParallel::new(&vm, comm)?;
    let opt = AdamW::new_named(dp.named_trainable(), ParamsAdamW::default())?;
    Ok(Model {
        vm,
        fc,
        bn,
        dp,
        opt,
    })
}

impl Model {
    /// One training step on rank `rank`'s batch `s`.
    fn step(&mut self, rank: usize, s: u64) -> anyhow::Result<()> {
        let x = randn(10 * s + rank as u64, &[5, 4], 1.0, 2.0).to_dtype(DType::F32)?;
        let y = self.bn.forward_t(&self.fc.forward(&x)?, true)?;
        let grads = self.dp.sync_gradients(y.sqr()?.mean_all()?.backward()?)?;
        self.opt.step(&grads)?;
        Ok(())
    }

    fn tensors(&self) -> anyhow::Result<Vec<(String, Tensor)>> {
        let mut t = checkpoint::varmap_tensors(&self.vm)?;
        t.extend(self.opt.state().1);
        t.extend(checkpoint::shift_tensors([("bn", &self.bn)]));
        Ok(t)
    }
}

/// One more step of the uninterrupted model `a` and the resumed `b`: every tensor the same bit
/// for bit after it; returns `b`'s, by name.
fn step_both_alike(
    a: &mut Model,
    b: &mut Model,
    rank: usize,
) -> anyhow::Result<Vec<(String, Vec<u64>)>> {
    a.step(rank, 2)?;
    b.step(rank, 2)?;
    let (ta, tb) = (a.tensors()?, b.tensors()?);
    for ((k, x), (_, y)) in ta.iter().zip(tb.iter()) {
        assert_eq!(bits(x), bits(y), "{k} one step after the resume");
    }
    Ok(tb.iter().map(|(k, t)| (k.clone(), bits(t))).collect())
}

/// Every variable's name and bits, sorted by name.
fn var_bits(vm: &VarMap) -> candle_core::Result<Vec<(String, Vec<u64>)>> {
    let tensors = checkpoint::varmap_tensors(vm)?;
    Ok(tensors.iter().map(|(k, t)| (k.clone(), bits(t))).collect())
}

fn bits(t: &Tensor) -> Vec<u64> {
    let v = t.flatten_all().unwrap().to_dtype(DType::F64).unwrap();
    v.to_vec1::<f64>()
        .unwrap()
        .iter()
        .map(|x| x.to_bits())
        .collect()
}

/// Saved after two steps on 2 ranks and loaded into fresh models: every variable, the running
/// statistics, AdamW's moments and step, the shift and the metadata come back, and a third step
/// after the load equals a third step of the model that never stopped, bit for bit.
#[test]
fn a_checkpoint_round_trips_and_resumes_bitwise() -> anyhow::Result<()> {
    let dir = fresh_dir("round-trip");
    let outs = ThreadGroup::run(2, |comm| {
        let run = || -> anyhow::Result<Vec<(String, Vec<u64>)>> {
            let mut a = model(comm.clone())?;
            a.step(comm.rank(), 0)?;
            a.step(comm.rank(), 1)?;
            let meta = serde_json::json!({ "epoch": 2, "note": "two steps" });
            checkpoint::save(&dir, "s0002", &a.tensors()?, &meta, &*comm)?;
            let mut b = model(comm.clone())?;
            let loaded = checkpoint::load(checkpoint::latest(&dir).as_deref(), &*comm)?
                .expect("a checkpoint");
            assert_eq!(loaded.metadata, meta);
            loaded.set_varmap(&b.vm)?;
            loaded.restore_shifts([("bn", &b.bn)])?;
            b.opt.load_state(a.opt.state().0, &loaded.tensors)?;
            let names =
                |t: &[(String, Tensor)]| t.iter().map(|(k, _)| k.clone()).collect::<Vec<_>>();
            assert_eq!(names(&a.tensors()?), names(&b.tensors()?));
            for ((k, x), (_, y)) in a.tensors()?.iter().zip(b.tensors()?.iter()) {
                assert_eq!(bits(x), bits(y), "{k} after loading");
            }
            step_both_alike(&mut a, &mut b, comm.rank())
        };
        run().map_err(|e| candle_core::Error::Msg(format!("{e:#}")))
    })?;
    assert!(outs[0].iter().any(|(k, _)| k == "syncbn_shift.bn"));
    assert!(outs[0].iter().any(|(k, _)| k == "adamw.m.fc.weight"));
    assert_eq!(outs[0], outs[1], "both ranks hold the same state");
    std::fs::remove_dir_all(dir)?;
    Ok(())
}

/// The caller's metadata of `save_training`: any `Serialize`.
#[derive(Debug, Clone, PartialEq, serde::Serialize, serde::Deserialize)]
struct RunInfo {
    model: String,
    batch_size: usize,
    seed: u64,
}

/// `save_training` / `restore_training`: the whole state in one call each way, the layers'
/// shifts found by their own names; the restored run's next step equals the uninterrupted
/// run's bit for bit; the position and the caller's metadata come back typed; `read_model`
/// reads the weights without a communicator; a checkpoint one rank refuses (another model
/// there, or the caller's own check of the metadata: `restore_training_checked`) or metadata of
/// another type fails every rank and restores nothing anywhere.
#[test]
fn the_training_state_saves_and_restores_in_one_call() -> anyhow::Result<()> {
    use checkpoint::{Position, TrainingState};
    let dir = fresh_dir("training");
    let info = RunInfo {
        model: "fc+bn".into(),
        batch_size: 5,
        seed: 7,
    };
    let outs = ThreadGroup::run(2, |comm| {
        let run = || -> anyhow::Result<Vec<(String, Vec<u64>)>> {
            let mut a = model(comm.clone())?;
            a.step(comm.rank(), 0)?;
            a.step(comm.rank(), 1)?;
            assert_eq!(a.bn.name(), "bn");
            let state = TrainingState {
                model: &a.vm,
                optimizer: Some(&a.opt),
                norms: std::slice::from_ref(&a.bn),
                position: Position { epoch: 1, step: 3 },
            };
            checkpoint::save_training(&dir, "s0002", &state, &info, &*comm)?;

            // Refused on one rank (a model of another width there): every rank fails, and
            // nothing is restored anywhere.
            let b = model(comm.clone())?;
            // Bits, not tensors: a variable's tensor shares its storage, which a restore sets.
            let before = var_bits(&b.vm)?;
            let other = VarMap::new();
            let width = if comm.rank() == 1 { 5 } else { 4 };
            linear(
                width,
                3,
                VarBuilder::from_varmap(&other, DType::F32, &Device::Cpu).pp("fc"),
            )?;
            let vm = if comm.rank() == 1 { &other } else { &b.vm };
            let e = checkpoint::restore_training::<RunInfo>(Some(&dir), vm, None, &[], &*comm)
                .unwrap_err()
                .to_string();
            match comm.rank() {
                1 => assert!(
                    e.contains("rank 1 refused") && e.contains("fc.weight"),
                    "{e}"
                ),
                _ => assert!(e.contains("rank(s) [1] refused"), "{e}"),
            }
            assert_eq!(before, var_bits(&b.vm)?, "changed by a refused restore");
            // Metadata of another type: refused by name.
            let e = checkpoint::restore_training::<u64>(Some(&dir), &b.vm, None, &[], &*comm)
                .unwrap_err()
                .to_string();
            assert!(
                e.contains("its metadata is not what save_training wrote"),
                "{e}"
            );
            // The caller's own check refuses on one rank (another batch size there): every
            // rank fails with the reason, the optimizer and the variables untouched.
            let mut b = b;
            let opt_bits = |opt: &AdamW| {
                let (step, moments) = opt.state();
                let moments: Vec<(String, Vec<u64>)> = (moments.iter())
                    .map(|(k, t)| (k.clone(), bits(t)))
                    .collect();
                (step, moments)
            };
            let opt_before = opt_bits(&b.opt);
            let e = checkpoint::restore_training_checked::<RunInfo>(
                Some(&dir),
                &b.vm,
                Some(&mut b.opt),
                std::slice::from_ref(&b.bn),
                &*comm,
                |saved, path| match (comm.rank(), saved.batch_size) {
                    (1, n) if n != 6 => Err(candle_core::Error::Msg(format!(
                        "{}: batch size {n}, this run has 6",
                        path.display()
                    ))),
                    _ => Ok(()),
                },
            )
            .unwrap_err()
            .to_string();
            match comm.rank() {
                1 => assert!(e.contains("batch size 5, this run has 6"), "{e}"),
                _ => assert!(e.contains("rank(s) [1] refused"), "{e}"),
            }
            assert!(e.contains("nothing was restored on any rank"), "{e}");
            assert_eq!(before, var_bits(&b.vm)?, "changed by a refused restore");
            assert_eq!(
                opt_before,
                opt_bits(&b.opt),
                "the optimizer changed by a refusal"
            );

            let restored = checkpoint::restore_training::<RunInfo>(
                checkpoint::latest(&dir).as_deref(),
                &b.vm,
                Some(&mut b.opt),
                std::slice::from_ref(&b.bn),
                &*comm,
            )?
            .expect("a checkpoint");
            assert_eq!(restored.position, Position { epoch: 1, step: 3 });
            assert_eq!(
                b.bn.num_batches_tracked(),
                2,
                "the layer's counter follows its variable"
            );
            assert_eq!(restored.metadata, info);
            step_both_alike(&mut a, &mut b, comm.rank())
        };
        run().map_err(|e| candle_core::Error::Msg(format!("{e:#}")))
    })?;
    assert!(outs[0].iter().any(|(k, _)| k == "syncbn_shift.bn"));
    assert_eq!(outs[0], outs[1], "both ranks hold the same state");
    // Inference: the weights alone, no communicator.
    let vm = VarMap::new();
    let vb = VarBuilder::from_varmap(&vm, DType::F32, &Device::Cpu);
    linear(4, 3, vb.pp("fc"))?;
    let loaded = checkpoint::read_model(&dir, &vm)?;
    let saved = &loaded.tensors["fc.weight"];
    assert_eq!(
        bits(&vm.data().lock().unwrap()["fc.weight"].as_tensor().clone()),
        bits(saved)
    );
    assert_eq!(loaded.metadata["user"]["seed"], 7);
    std::fs::remove_dir_all(dir)?;
    Ok(())
}

/// One rank (every check is local; a one-rank group's agreement passes through).
fn load_alone(path: &Path) -> candle_core::Result<Option<Loaded>> {
    let comm = ThreadGroup::new(1)?.remove(0);
    checkpoint::load(Some(path), &*comm)
}

fn save_alone(dir: &Path, tag: &str, v: f32) -> candle_core::Result<()> {
    let comm = ThreadGroup::new(1)?.remove(0);
    let t = Tensor::new(&[v, 2.0, 3.0, 4.0], &Device::Cpu)?;
    let pad = Tensor::arange(0f32, 64., &Device::Cpu)?;
    let tensors = [("w".to_string(), t), ("pad".to_string(), pad)];
    checkpoint::save(dir, tag, &tensors, &serde_json::json!({ "v": v }), &*comm)
}

/// A checkpoint damaged in any way is refused with a message naming the file; a kill in the
/// middle of writing the next one (its temporary files left behind) still loads the previous.
#[test]
fn a_damaged_checkpoint_is_refused_naming_the_file() -> anyhow::Result<()> {
    let dir = fresh_dir("damaged");
    save_alone(&dir, "e0001", 1.0)?;
    let json = dir.join(checkpoint::MANIFEST);
    let loaded = load_alone(&dir)?.unwrap();
    let manifest: serde_json::Value = serde_json::from_slice(&std::fs::read(&json)?)?;
    let weights = dir.join(manifest["tensors"].as_str().unwrap());
    let (json_bytes, weight_bytes) = (std::fs::read(&json)?, std::fs::read(&weights)?);
    assert_eq!(
        bits(&loaded.tensors["w"]),
        bits(&Tensor::new(&[1f32, 2., 3., 4.], &Device::Cpu)?)
    );
    let refused = |what: &str, want: &str| {
        let err = format!("{:#}", load_alone(&json).unwrap_err());
        assert!(err.contains(want), "{what}: {err}");
    };
    for cut in [0, 1, json_bytes.len() / 2, json_bytes.len() - 2] {
        std::fs::write(&json, &json_bytes[..cut])?;
        refused(&format!("manifest cut at {cut}"), "checkpoint.json");
    }
    std::fs::write(&json, &json_bytes)?;
    let header = 8 + u64::from_le_bytes(weight_bytes[..8].try_into()?) as usize;
    for cut in [
        0,
        4,
        8,
        header / 2,
        header,
        (header + weight_bytes.len()) / 2,
        weight_bytes.len() - 1,
    ] {
        std::fs::write(&weights, &weight_bytes[..cut])?;
        refused(&format!("tensors cut at {cut}"), "truncated or replaced");
    }
    let mut flipped = weight_bytes.clone();
    flipped[header + 20] ^= 1;
    std::fs::write(&weights, &flipped)?;
    refused("a flipped bit", "corrupt");
    std::fs::remove_file(&weights)?;
    refused(
        "the tensor file gone",
        weights.file_name().unwrap().to_str().unwrap(),
    );
    std::fs::write(&weights, &weight_bytes)?;
    let other = String::from_utf8(json_bytes.clone())?.replace("\"format\": 2", "\"format\": 9");
    std::fs::write(&json, other)?;
    refused("format 9", "format 9");
    std::fs::write(&json, &json_bytes)?;
    let err = format!("{:#}", load_alone(&weights).unwrap_err());
    assert!(err.contains("checkpoint.json"), "{err}");
    // Killed while writing the next checkpoint: half-written temporary files stay temporary.
    std::fs::write(
        dir.join("checkpoint-e0002.safetensors.tmp"),
        &weight_bytes[..header],
    )?;
    std::fs::write(dir.join("checkpoint.json.tmp"), &json_bytes[..10])?;
    load_alone(&dir)?.expect("the previous checkpoint, whole");
    std::fs::remove_dir_all(dir)?;
    Ok(())
}

/// Two saves with one tag and other contents (a run restarted into the same folder) use two
/// tensor files: the second never overwrites the file the first manifest names. Only the
/// newest pair stays. The same tensors saved again give the same bytes (a deterministic file:
/// the restart test compares runs by their checkpoints' CRC-32).
#[test]
fn two_saves_with_one_tag_use_two_tensor_files() -> anyhow::Result<()> {
    let dir = fresh_dir("same-tag");
    let tensor_file = |dir: &Path| -> anyhow::Result<String> {
        let m: serde_json::Value =
            serde_json::from_slice(&std::fs::read(dir.join(checkpoint::MANIFEST))?)?;
        Ok(m["tensors"].as_str().unwrap().to_string())
    };
    save_alone(&dir, "e0001", 1.0)?;
    let first = tensor_file(&dir)?;
    save_alone(&dir, "e0001", 1.0)?;
    assert_eq!(
        tensor_file(&dir)?,
        first,
        "the same tensors, the same bytes"
    );
    save_alone(&dir, "e0001", 3.0)?;
    let second = tensor_file(&dir)?;
    assert_ne!(first, second);
    assert!(first.starts_with("checkpoint-e0001-") && first.ends_with(".safetensors"));
    let mut files: Vec<String> = (std::fs::read_dir(&dir)?)
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    files.sort();
    assert_eq!(
        files,
        [
            ".checkpoint.lock".to_string(),
            second,
            checkpoint::MANIFEST.to_string()
        ],
        "the newest pair, and the lock a save takes"
    );
    let e = save_alone(&dir, "../x", 1.0).unwrap_err().to_string();
    assert!(e.contains("tag"), "{e}");
    std::fs::remove_dir_all(dir)?;
    Ok(())
}

/// A case: what, each rank's path, what each rank's error says.
type Case<'a> = (&'a str, [Option<&'a Path>; 2], [&'a str; 2]);

/// Every rank fails together: one rank cannot read its copy (it names the file, the other the
/// rank), one holds none, one holds another checkpoint; and rank 0's write fails (its folder
/// is a file), which every rank reports at once.
#[test]
fn ranks_fail_together() -> anyhow::Result<()> {
    let (a, b) = (fresh_dir("agree-a"), fresh_dir("agree-b"));
    save_alone(&a, "e0001", 1.0)?;
    save_alone(&b, "e0001", 5.0)?;
    let missing = a.join("nowhere").join(checkpoint::MANIFEST);
    let cases: [Case; 3] = [
        (
            "rank 1 cannot read",
            [Some(&a), Some(&missing)],
            ["rank(s) [1] could not load", "nowhere"],
        ),
        (
            "rank 1 holds none",
            [Some(&a), None],
            ["rank 1: none", "rank 1: none"],
        ),
        (
            "different checkpoints",
            [Some(&a), Some(&b)],
            ["different checkpoints", "different checkpoints"],
        ),
    ];
    for (what, paths, want) in cases {
        let errs = ThreadGroup::run(2, |comm| {
            let got = checkpoint::load(paths[comm.rank()], &*comm);
            Ok(format!("{:#}", got.expect_err("an error on every rank")))
        })?;
        for r in 0..2 {
            assert!(errs[r].contains(want[r]), "{what}: rank {r}: {}", errs[r]);
        }
    }
    let file = a.join("a-file");
    std::fs::write(&file, b"not a folder")?;
    let errs = ThreadGroup::run(2, |comm| {
        let t = [("w".to_string(), Tensor::new(&[1f32], &Device::Cpu)?)];
        let got = checkpoint::save(&file, "e0001", &t, &serde_json::Value::Null, &*comm);
        Ok(format!("{:#}", got.expect_err("an error on every rank")))
    })?;
    for (r, e) in errs.iter().enumerate() {
        assert!(
            e.contains("could not write the checkpoint"),
            "rank {r}: {e}"
        );
    }
    std::fs::remove_dir_all(a)?;
    std::fs::remove_dir_all(b)?;
    Ok(())
}

/// Our AdamW's steps equal candle-nn's bit for bit (4 steps with weight decay), and an AdamW
/// restored from `state()` after 2 steps continues as the one that never stopped. A state with
/// a moment missing is refused naming it, and changes nothing.
#[test]
fn adamw_steps_equal_candle_nns_and_resume_exactly() -> anyhow::Result<()> {
    let params = ParamsAdamW {
        lr: 0.01,
        weight_decay: 0.1,
        ..Default::default()
    };
    let var = || -> candle_core::Result<candle_core::Var> {
        candle_core::Var::from_tensor(&randn(1, &[3, 4], 0.0, 1.0).to_dtype(DType::F32)?)
    };
    let (ours, theirs, resumed) = (var()?, var()?, var()?);
    let mut a = AdamW::new_named(&[("w".into(), ours.clone())], params.clone())?;
    let mut b = candle_nn::AdamW::new(vec![theirs.clone()], params.clone())?;
    let mut c = AdamW::new_named(&[("w".into(), resumed.clone())], params.clone())?;
    let input = |s: u64| randn(10 + s, &[4, 1], 0.0, 1.0).to_dtype(DType::F32);
    let loss = |v: &candle_core::Var, x: &Tensor| v.as_tensor().matmul(x)?.sqr()?.sum_all();
    for s in 0..4u64 {
        let x = input(s)?;
        a.step(&loss(&ours, &x)?.backward()?)?;
        b.step(&loss(&theirs, &x)?.backward()?)?;
        assert_eq!(bits(ours.as_tensor()), bits(theirs.as_tensor()), "step {s}");
        if s == 1 {
            // What a checkpoint after 2 steps holds (copies: the optimizer updates in place).
            let (step, state) = a.state();
            let state: std::collections::HashMap<String, Tensor> = (state.into_iter())
                .map(|(k, t)| Ok((k, t.copy()?)))
                .collect::<candle_core::Result<_>>()?;
            resumed.set(&ours.as_tensor().copy()?)?;
            let mut partial = state.clone();
            partial.remove("adamw.v.w");
            let before = bits(resumed.as_tensor());
            let e = c.load_state(step, &partial).unwrap_err().to_string();
            assert!(e.contains("adamw.v.w"), "{e}");
            assert_eq!(bits(resumed.as_tensor()), before);
            c.load_state(step, &state)?;
        }
        if s >= 2 {
            c.step(&loss(&resumed, &x)?.backward()?)?;
            assert_eq!(
                bits(resumed.as_tensor()),
                bits(ours.as_tensor()),
                "resumed, step {s}"
            );
        }
    }
    Ok(())
}

/// Two writers into one folder (two runs with the same output folder, a sweep, a lingering
/// rank 0), 20 rounds of two saves released together: every round leaves a loadable
/// checkpoint. A save either completes or is refused naming the folder's lock, and no save
/// deletes a tensor file that a manifest it did not replace names. The folder ends with the
/// lock, one manifest and the one tensor file it names.
#[test]
fn two_writers_to_one_folder_never_lose_the_checkpoint() -> anyhow::Result<()> {
    let dir = fresh_dir("two-writers");
    let big = |v: f32| -> candle_core::Result<Vec<(String, Tensor)>> {
        Ok(vec![(
            "w".to_string(),
            Tensor::full(v, 1 << 20, &Device::Cpu)?, // 4 MiB: a save takes a while
        )])
    };
    let (mut done, mut refused) = (0, 0);
    for round in 0..20 {
        let gate = std::sync::Barrier::new(2);
        let outcomes: Vec<candle_core::Result<()>> = std::thread::scope(|s| {
            let handles: Vec<_> = (0..2)
                .map(|w| {
                    let (gate, dir) = (&gate, &dir);
                    s.spawn(move || {
                        let comm = ThreadGroup::new(1)?.remove(0);
                        let tensors = big((round * 2 + w) as f32)?;
                        gate.wait();
                        let meta = serde_json::json!({ "writer": w, "round": round });
                        checkpoint::save(dir, &format!("r{round}w{w}"), &tensors, &meta, &*comm)
                    })
                })
                .collect();
            handles.into_iter().map(|h| h.join().unwrap()).collect()
        });
        for o in outcomes {
            match o {
                Ok(()) => done += 1,
                Err(e) => {
                    let e = format!("{e:#}");
                    assert!(e.contains("another save holds"), "round {round}: {e}");
                    refused += 1;
                }
            }
        }
        let loaded = load_alone(&dir)
            .map_err(|e| anyhow::anyhow!("round {round}: {e:#}"))?
            .expect("a checkpoint");
        let w = loaded.metadata["writer"].as_u64().unwrap() as f32;
        let v = loaded.tensors["w"].get(0)?.to_scalar::<f32>()?;
        assert_eq!(
            v,
            (round * 2) as f32 + w,
            "round {round}: its writer's tensors"
        );
    }
    assert_eq!(done + refused, 40);
    assert!(done >= 20, "at least one save per round completes: {done}");
    let mut files: Vec<String> = (std::fs::read_dir(&dir)?)
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    files.sort();
    assert_eq!(files.len(), 3, "{files:?}");
    assert_eq!(files[0], ".checkpoint.lock");
    assert_eq!(files[2], checkpoint::MANIFEST);
    std::fs::remove_dir_all(dir)?;
    Ok(())
}

/// A communicator that reports a lost collective on one rank (as NCCL's after an abort).
#[derive(Debug)]
struct LostOn {
    inner: Arc<dyn Collective>,
    rank: usize,
}

impl candle_distributed::collective::Decorator for LostOn {
    fn inner(&self) -> &Arc<dyn Collective> {
        &self.inner
    }
    fn check_deferred(&self) -> candle_core::Result<()> {
        if self.inner.rank() == self.rank {
            candle_core::bail!("a collective enqueued earlier was lost")
        }
        Ok(())
    }
}

/// A save after a lost collective (the model may hold garbage) writes nothing, on every rank:
/// the folder keeps its last good checkpoint byte for byte, and each rank's error says why.
#[test]
fn a_save_after_a_lost_collective_writes_nothing() -> anyhow::Result<()> {
    let dir = fresh_dir("lost");
    save_alone(&dir, "e0001", 1.0)?;
    let before: Vec<(String, Vec<u8>)> = {
        let mut v: Vec<_> = (std::fs::read_dir(&dir)?)
            .map(|e| {
                let e = e.unwrap();
                (
                    e.file_name().to_string_lossy().into_owned(),
                    std::fs::read(e.path()).unwrap(),
                )
            })
            .collect();
        v.sort();
        v
    };
    for lost_on in [0, 1] {
        let errs = ThreadGroup::run(2, |comm| {
            let comm = LostOn {
                inner: comm,
                rank: lost_on,
            };
            let t = [(
                "w".to_string(),
                Tensor::new(&[f32::NAN, 0.0], &Device::Cpu)?,
            )];
            let got = checkpoint::save(&dir, "garbage", &t, &serde_json::Value::Null, &comm);
            Ok(format!("{:#}", got.expect_err("an error on every rank")))
        })?;
        for (r, e) in errs.iter().enumerate() {
            let want = if r == lost_on {
                "was lost"
            } else {
                "lost a collective"
            };
            assert!(
                e.contains(want) && e.contains("nothing was written"),
                "rank {r}: {e}"
            );
        }
        let mut after: Vec<(String, Vec<u8>)> = (std::fs::read_dir(&dir)?)
            .map(|e| {
                let e = e.unwrap();
                (
                    e.file_name().to_string_lossy().into_owned(),
                    std::fs::read(e.path()).unwrap(),
                )
            })
            .collect();
        after.sort();
        assert_eq!(
            after, before,
            "lost on rank {lost_on}: the folder is untouched"
        );
        // ThreadGroup::run names the rank that lost it (the other's error is a consequence).
        let e = ThreadGroup::run(2, |comm| {
            let comm = LostOn {
                inner: comm,
                rank: lost_on,
            };
            let t = [("w".to_string(), Tensor::new(&[1f32], &Device::Cpu)?)];
            checkpoint::save(&dir, "again", &t, &serde_json::Value::Null, &comm)
        })
        .unwrap_err()
        .to_string();
        assert!(
            e.starts_with(&format!("rank {lost_on} (")) && e.contains("was lost"),
            "{e}"
        );
    }
    std::fs::remove_dir_all(dir)?;
    Ok(())
}

/// Two manifests naming the same tensor file with other metadata (a position, a loss scale)
/// are two checkpoints: ranks holding one each refuse to start, naming both manifests' CRCs.
#[test]
fn the_ranks_agree_on_the_metadata_too() -> anyhow::Result<()> {
    let (a, b) = (fresh_dir("meta-a"), fresh_dir("meta-b"));
    save_alone(&a, "e0001", 1.0)?;
    for e in std::fs::read_dir(&a)? {
        let e = e?;
        std::fs::copy(e.path(), b.join(e.file_name()))?;
    }
    let json = std::fs::read_to_string(b.join(checkpoint::MANIFEST))?;
    assert!(json.contains("\"v\": 1.0"), "{json}");
    std::fs::write(
        b.join(checkpoint::MANIFEST),
        json.replace("\"v\": 1.0", "\"v\": 99.0"),
    )?;
    let errs = ThreadGroup::run(2, |comm| {
        let path = if comm.rank() == 0 { &a } else { &b };
        let got = checkpoint::load(Some(path), &*comm);
        Ok(format!("{:#}", got.expect_err("an error on every rank")))
    })?;
    for (r, e) in errs.iter().enumerate() {
        assert!(
            e.contains("different checkpoints") && e.contains("manifest CRC-32"),
            "rank {r}: {e}"
        );
    }
    // The same manifest with other spacing is the same checkpoint.
    std::fs::write(b.join(checkpoint::MANIFEST), json.replace("  ", "    "))?;
    ThreadGroup::run(2, |comm| {
        let path = if comm.rank() == 0 { &a } else { &b };
        checkpoint::load(Some(path), &*comm).map(|l| l.is_some())
    })?;
    std::fs::remove_dir_all(a)?;
    std::fs::remove_dir_all(b)?;
    Ok(())
}

/// A manifest names its tensor file by a plain name beside it: a path out of the folder (an
/// absolute one, `..`) is refused without being opened; a file that is not a regular one, or
/// of another size than the manifest says, is refused before anything is read (a link to
/// `/dev/zero` would otherwise be read until memory runs out).
#[test]
fn a_manifest_cannot_name_a_file_outside_its_folder() -> anyhow::Result<()> {
    let dir = fresh_dir("hostile");
    save_alone(&dir, "e0001", 1.0)?;
    let json_path = dir.join(checkpoint::MANIFEST);
    let json = std::fs::read_to_string(&json_path)?;
    let m: serde_json::Value = serde_json::from_str(&json)?;
    let named = m["tensors"].as_str().unwrap().to_string();
    for hostile in [
        "/etc/hostname",
        "../outside.safetensors",
        "sub/x.safetensors",
        "..",
    ] {
        std::fs::write(&json_path, json.replace(&named, hostile))?;
        let e = format!("{:#}", load_alone(&dir).unwrap_err());
        assert!(e.contains("not a plain file name"), "{hostile}: {e}");
    }
    #[cfg(unix)]
    {
        std::os::unix::fs::symlink("/dev/zero", dir.join("zero.safetensors"))?;
        std::fs::write(&json_path, json.replace(&named, "zero.safetensors"))?;
        let e = format!("{:#}", load_alone(&dir).unwrap_err());
        assert!(e.contains("not a regular file"), "{e}");
    }
    let bytes = m["tensors_bytes"].as_u64().unwrap();
    let huge = json.replace(
        &format!("\"tensors_bytes\": {bytes}"),
        "\"tensors_bytes\": 1000000000000",
    );
    std::fs::write(&json_path, huge)?;
    let e = format!("{:#}", load_alone(&dir).unwrap_err());
    assert!(e.contains("1000000000000 expected"), "{e}");
    std::fs::write(&json_path, &json)?;
    load_alone(&dir)?.expect("the checkpoint, restored");
    std::fs::remove_dir_all(dir)?;
    Ok(())
}

/// A save removes the temporary files of saves that were killed midway (a model-sized file
/// each), and leaves other temporary files (a run's metrics being written) alone; its outputs
/// get the permissions a new file of the process gets (the umask's), not 0o600.
#[test]
fn a_save_cleans_up_after_killed_saves() -> anyhow::Result<()> {
    let dir = fresh_dir("killed");
    save_alone(&dir, "e0001", 1.0)?;
    let stale = [
        ".checkpoint-e0002.safetensors.Ab3xYz.tmp",
        ".checkpoint.json.Qw7e.tmp",
    ];
    for f in stale {
        std::fs::write(dir.join(f), vec![7u8; 4096])?;
    }
    std::fs::write(dir.join(".metrics.csv.Zz9.tmp"), b"epoch")?;
    // A staging folder with the safetensors writer's own temporary file in it.
    let staged = dir.join(".checkpoint-e0002.Kx81.tmp");
    std::fs::create_dir(&staged)?;
    std::fs::write(staged.join(".tmpAb12Cd"), vec![7u8; 4096])?;
    load_alone(&dir)?.expect("the previous checkpoint, whole");
    save_alone(&dir, "e0002", 2.0)?;
    for f in stale {
        assert!(!dir.join(f).exists(), "{f} removed");
    }
    assert!(!staged.exists(), "the staging folder removed");
    assert!(
        dir.join(".metrics.csv.Zz9.tmp").exists(),
        "not a checkpoint's"
    );
    #[cfg(unix)]
    {
        use std::os::unix::fs::PermissionsExt;
        std::fs::write(dir.join("plain"), b"x")?;
        let mode = |p: &Path| std::fs::metadata(p).unwrap().permissions().mode() & 0o777;
        let want = mode(&dir.join("plain"));
        let m: serde_json::Value =
            serde_json::from_slice(&std::fs::read(dir.join(checkpoint::MANIFEST))?)?;
        for f in [checkpoint::MANIFEST, m["tensors"].as_str().unwrap()] {
            assert_eq!(mode(&dir.join(f)), want, "{f}: the umask's permissions");
        }
    }
    std::fs::remove_dir_all(dir)?;
    Ok(())
}

/// A save removes the file the replaced manifest named only when it is a tensor file of its
/// naming and size: a manifest naming itself, the lock or another file of the folder (damaged
/// or hostile) costs nothing but that manifest.
#[test]
fn a_save_removes_only_a_tensor_file_the_manifest_named() -> anyhow::Result<()> {
    let dir = fresh_dir("named");
    std::fs::write(dir.join("metrics.csv"), b"epoch,loss\n")?;
    for named in ["checkpoint.json", ".checkpoint.lock", "metrics.csv"] {
        save_alone(&dir, "e0001", 1.0)?;
        let json = std::fs::read_to_string(dir.join(checkpoint::MANIFEST))?;
        let m: serde_json::Value = serde_json::from_str(&json)?;
        let tensors = m["tensors"].as_str().unwrap();
        std::fs::write(dir.join(checkpoint::MANIFEST), json.replace(tensors, named))?;
        save_alone(&dir, "e0002", 2.0)?;
        load_alone(&dir)?.expect("the new checkpoint");
        assert!(
            dir.join("metrics.csv").exists(),
            "{named}: metrics.csv kept"
        );
    }
    std::fs::remove_dir_all(dir)?;
    Ok(())
}
