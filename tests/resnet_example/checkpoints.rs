//! Checkpoints: a round trip, a resume equal to an uninterrupted run bit for bit, and damage
//! refused.

use candle_core::{DType, Device};

use crate::model::{Arch, NormKind};
use crate::*;

#[test]
fn a_checkpoint_round_trips() {
    let vm = build(Arch::ResNet20, &NormKind::Bn, 10);
    train::init_weights(&vm, 3).unwrap();
    let dir = std::env::temp_dir().join(format!("resnet-ckpt-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let path = dir.join("checkpoint.safetensors");
    vm.save(&path).unwrap();
    let mut other = build(Arch::ResNet20, &NormKind::Bn, 10);
    train::init_weights(&other, 4).unwrap();
    other.load(&path).unwrap();
    let (a, b) = (vm.data().lock().unwrap(), other.data().lock().unwrap());
    assert_eq!(a.len(), b.len());
    for (k, v) in a.iter() {
        let d = (v.as_tensor() - b[k].as_tensor())
            .unwrap()
            .abs()
            .unwrap()
            .flatten_all()
            .unwrap();
        let d = d.max(0).unwrap().to_scalar::<f32>().unwrap();
        assert_eq!(d, 0.0, "{k} differs after loading");
    }
    std::fs::remove_dir_all(&dir).unwrap();
}

/// A tiny run writing its outputs to a fresh directory (3 ranks, 50 images: every epoch ends
/// with a partial batch that leaves rank 2 empty).
fn tiny_run(
    dir: &std::path::Path,
    stop_after: Option<usize>,
    resume: bool,
    precision: train::Precision,
) -> train::Summary {
    // `--resume auto`: the folder's checkpoint when there is one, else a fresh start.
    let auto = std::path::Path::new("auto");
    let cfg = train::Config {
        stop_after_epoch: stop_after,
        resume: resume
            .then(|| checkpoint::resolve_resume(Some(auto), dir))
            .flatten(),
        ..tiny_config(dir, precision)
    };
    train::run(&cfg).unwrap()
}

/// 3 ranks, 50 images of 8×8 in batches of 16 (the last epoch's batch leaves rank 2 empty),
/// 4 epochs, outputs in `dir`.
fn tiny_config(dir: &std::path::Path, precision: train::Precision) -> train::Config {
    train::Config {
        arch: Arch::ResNet20,
        world_size: 3,
        batch_size: 16,
        image_size: 8,
        train_size: 50,
        val_size: 12,
        epochs: 4,
        precision,
        out_dir: dir.to_path_buf(),
        ..Default::default()
    }
}

/// A resume into another `--out-dir`: the new folder's `metrics.csv` continues the rows of
/// the run that wrote the checkpoint (they were read from the new, empty folder), its seconds
/// counting on from theirs.
#[test]
fn a_resume_into_another_folder_continues_the_metrics() {
    let (a, b) = (fresh_dir("first-half"), fresh_dir("second-half"));
    tiny_run(&a, Some(2), false, train::Precision::Full);
    let cfg = train::Config {
        arch: Arch::ResNet20,
        world_size: 3,
        batch_size: 16,
        image_size: 8,
        train_size: 50,
        val_size: 12,
        epochs: 3,
        out_dir: b.clone(),
        resume: Some(a.join("checkpoint.json")),
        ..Default::default()
    };
    train::run(&cfg).unwrap();
    let rows = report::read_csv(&b.join("metrics.csv")).unwrap();
    let first = report::read_csv(&a.join("metrics.csv")).unwrap();
    assert_eq!(
        rows.iter().map(|r| r.epoch).collect::<Vec<_>>(),
        vec![1, 2, 3]
    );
    assert_eq!(
        rows[0].train_loss, first[0].train_loss,
        "epoch 1's row carried over"
    );
    // The run's time continues across the resume: epoch 3's seconds count on from epoch 2's.
    assert!(
        rows[2].seconds > rows[1].seconds && rows[1].seconds >= rows[0].seconds,
        "seconds {:?}",
        rows.iter().map(|r| r.seconds).collect::<Vec<_>>()
    );
    for d in [a, b] {
        std::fs::remove_dir_all(d).unwrap();
    }
}

/// Ranks given different checkpoints (one after epoch 1, one after epoch 2): every rank refuses
/// to start, naming both (only the weights would have been re-broadcast). The library's
/// agreement (`candle_distributed::checkpoint::restore_training_checked`, which loads through
/// `checkpoint::load`), as the example uses it.
#[test]
fn ranks_with_different_checkpoints_refuse_to_start() {
    let (a, b) = (fresh_dir("after-one"), fresh_dir("after-two"));
    tiny_run(&a, Some(1), false, train::Precision::Full);
    tiny_run(&b, Some(2), false, train::Precision::Full);
    let errs = candle_distributed::collective::ThreadGroup::run(2, |comm| {
        let cfg = train::Config {
            arch: Arch::ResNet20,
            world_size: 2,
            image_size: 8,
            resume: Some([&a, &b][comm.rank()].join("checkpoint.json")),
            ..Default::default()
        };
        let got = state::setup(&comm, &Device::Cpu, &cfg, 10, 50);
        Ok(got.err().map(|e| e.to_string()))
    })
    .unwrap();
    for (r, e) in errs.iter().enumerate() {
        let e = e.as_deref().unwrap_or("no error");
        assert!(
            e.contains("different checkpoints")
                && e.contains("rank 0: tensors CRC-32")
                && e.contains("rank 1: tensors CRC-32"),
            "rank {r}: {e}"
        );
    }
    for d in [a, b] {
        std::fs::remove_dir_all(d).unwrap();
    }
}

/// Rank 0's checkpoint write fails at the end of the first epoch (a folder stands where the
/// save's lock file goes, so the save cannot even start): every rank stops with the error
/// within a second of the others. An output folder that cannot be made at all stops every rank
/// at the start, before any training.
#[test]
fn a_failed_write_on_rank_zero_stops_every_rank_at_once() {
    let dir = fresh_dir("not-a-folder");
    let file = dir.join("out");
    std::fs::create_dir_all(file.join(".checkpoint.lock")).unwrap();
    let cfg = train::Config {
        arch: Arch::ResNet20,
        world_size: 2,
        batch_size: 8,
        image_size: 8,
        train_size: 16,
        val_size: 8,
        epochs: 3,
        out_dir: file,
        ..Default::default()
    };
    let (train_set, val_set) = train::datasets(&cfg).unwrap();
    let out = candle_distributed::collective::ThreadGroup::run(2, |comm| {
        let got = train::train_rank(comm, Device::Cpu, &cfg, &train_set, &val_set);
        Ok((
            got.err().map(|e| format!("{e:#}")),
            std::time::Instant::now(),
        ))
    })
    .unwrap();
    let ends: Vec<_> = out.iter().map(|(_, t)| *t).collect();
    for (r, (e, _)) in out.iter().enumerate() {
        let e = e.as_deref().unwrap_or("no error");
        assert!(
            e.contains("could not write the checkpoint"),
            "rank {r}: {e}"
        );
    }
    let apart = ends[0].max(ends[1]) - ends[0].min(ends[1]);
    assert!(
        apart < std::time::Duration::from_secs(1),
        "the ranks stopped {apart:?} apart"
    );
    let blocked = dir.join("blocked");
    std::fs::write(&blocked, b"a file where the outputs should go").unwrap();
    let cfg = train::Config {
        out_dir: blocked,
        ..cfg
    };
    let errs = candle_distributed::collective::ThreadGroup::run(2, |comm| {
        let got = train::train_rank(comm, Device::Cpu, &cfg, &train_set, &val_set);
        Ok(got.err().map(|e| format!("{e:#}")))
    })
    .unwrap();
    for (r, e) in errs.iter().enumerate() {
        let e = e.as_deref().unwrap_or("no error");
        assert!(
            e.contains("could not take the output folder"),
            "rank {r}: {e}"
        );
    }
    std::fs::remove_dir_all(dir).unwrap();
}

fn fresh_dir(tag: &str) -> std::path::PathBuf {
    let dir = std::env::temp_dir().join(format!("resnet-{tag}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

/// 4 epochs in one run equal 2 epochs, a resume from the checkpoint (both runs started with
/// `--resume auto`), and 2 more, bit for bit:
/// weights, batch-norm statistics and counters (AdamW's moments and step, the step count
/// that drives the schedule and augmentation, SyncBatchNorm's shifts and, in f16, the loss
/// scaler's state all come back).
#[test]
fn four_epochs_equal_two_plus_resume_plus_two_bitwise() {
    for precision in [train::Precision::Full, train::Precision::F16] {
        resume_bitwise(precision);
    }
}

fn resume_bitwise(precision: train::Precision) {
    let (a, b) = (fresh_dir("straight"), fresh_dir("resumed"));
    let straight = tiny_run(&a, None, false, precision);
    // The same command (`--resume auto`) starts afresh in an empty folder, then resumes.
    let auto = Some(std::path::Path::new("auto"));
    assert_eq!(checkpoint::resolve_resume(auto, &b), None);
    tiny_run(&b, Some(2), true, precision);
    assert_eq!(
        checkpoint::resolve_resume(auto, &b),
        Some(b.join("checkpoint.json"))
    );
    let resumed = tiny_run(&b, None, true, precision);
    assert_params_bitwise(
        &straight.params,
        &resumed.params,
        &format!("{precision:?}, after resuming"),
    );
    // The one-line summary is JSON with the run's numbers.
    let line: serde_json::Value = serde_json::from_str(&resumed.json().unwrap()).unwrap();
    assert_eq!(line["epochs"], 4);
    assert_eq!(line["world_size"], 3);
    assert!(
        line["val_acc"]
            .as_f64()
            .is_some_and(|a| (0.0..=1.0).contains(&a)),
        "{line}"
    );
    let rows = report::read_csv(&b.join("metrics.csv")).unwrap();
    assert_eq!(
        rows.iter().map(|r| r.epoch).collect::<Vec<_>>(),
        vec![1, 2, 3, 4],
        "the CSV is continued"
    );
    // The checkpoint pair is the only one left (the older tensor files are removed).
    let mut files: Vec<String> = std::fs::read_dir(&b)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .filter(|n| n.starts_with("checkpoint"))
        .collect();
    files.sort();
    assert_eq!(files.len(), 2, "{files:?}");
    assert!(
        files[0].starts_with("checkpoint-e0004-") && files[0].ends_with(".safetensors"),
        "{files:?}"
    );
    assert_eq!(files[1], "checkpoint.json");
    std::fs::remove_dir_all(&a).unwrap();
    std::fs::remove_dir_all(&b).unwrap();
}

/// Checkpoints every 3 steps, the run left after step 6 (mid-way through the second epoch of
/// 4 steps), resumed from the folder's newest checkpoint: the weights, batch-norm statistics and
/// counters at the end equal an uninterrupted run's bit for bit, and so do the metrics of the
/// interrupted epoch and the later ones (the sums before the interruption travel in the
/// checkpoint; the first epoch's row comes back from the CSV, within its printed precision).
#[test]
fn a_resume_mid_epoch_continues_bitwise() {
    let (a, b) = (fresh_dir("mid-straight"), fresh_dir("mid-resumed"));
    let straight = tiny_run(&a, None, false, train::Precision::Full);
    let cfg = train::Config {
        save_every: Some(3),
        stop_after_step: Some(6),
        ..tiny_config(&b, train::Precision::Full)
    };
    train::run(&cfg).unwrap();
    let comm = candle_distributed::collective::ThreadGroup::new(1)
        .unwrap()
        .remove(0);
    let loaded = candle_distributed::checkpoint::load(Some(&b), &*comm)
        .unwrap()
        .unwrap();
    // The library's position (epoch 1, its third step: 4 steps an epoch) and the example's
    // metadata beside it.
    let saved = &loaded.metadata;
    let position = serde_json::json!({ "epoch": 1, "step": 2 });
    assert_eq!(saved["position"], position, "{saved}");
    let meta: checkpoint::Meta = serde_json::from_value(saved["user"].clone()).unwrap();
    assert_eq!(meta.step, 6, "{meta:?}");
    assert!(meta.partial.is_some_and(|p| p[2] > 0.0), "{meta:?}");
    let id = state::identity(&tiny_config(&b, train::Precision::Full), 50);
    assert_eq!(meta.identity, id);
    let resumed = tiny_run(&b, None, true, train::Precision::Full);
    assert_params_bitwise(
        &straight.params,
        &resumed.params,
        "after a resume mid-epoch",
    );
    let rows = |s: &train::Summary| {
        s.epochs
            .iter()
            .map(|m| {
                (
                    m.epoch,
                    m.train_loss.to_bits(),
                    m.train_acc.to_bits(),
                    m.val_loss.to_bits(),
                )
            })
            .collect::<Vec<_>>()
    };
    // Epoch 1's row comes back from the CSV (printed decimals): the interrupted epoch and the
    // later ones are computed again, bit for bit.
    assert_eq!(rows(&straight)[1..], rows(&resumed)[1..]);
    let (x, y) = (straight.epochs[0].train_loss, resumed.epochs[0].train_loss);
    assert!(
        (x - y).abs() <= 1e-6 * x.abs(),
        "epoch 1 from the CSV: {x} against {y}"
    );
    for d in [a, b] {
        std::fs::remove_dir_all(d).unwrap();
    }
}

/// A run checkpointed by 4 ranks resumes on 2, and one by 2 on 4: the global batches are the
/// same at any world size (each is split among the ranks; SyncBatchNorm's statistics and the
/// gradient average cover the whole of it), so the resumed run's last two epochs match an
/// uninterrupted run at the first world size up to rounding: training and validation losses
/// within a relative 1e-5 (measured: at most 1.0e-6, the validation loss after the second
/// resumed epoch, 2026-11-27, with the CPU convolution whose weight gradient sums each rank's
/// samples in groups; 6e-8 with candle's; printed with --nocapture). The augmentation draws
/// per sample, so it does not depend on the world size either: with the earlier per-rank draws
/// this test saw 3e-2.
#[test]
fn a_run_resumes_at_another_world_size() {
    const TOLERANCE: f64 = 1e-5;
    for (before, after) in [(4, 2), (2, 4)] {
        let (a, b) = (fresh_dir("ws-straight"), fresh_dir("ws-resumed"));
        let cfg = |dir: &std::path::Path, world_size: usize| train::Config {
            world_size,
            ..tiny_config(dir, train::Precision::Full)
        };
        let straight = train::run(&cfg(&a, before)).unwrap();
        train::run(&train::Config {
            stop_after_epoch: Some(2),
            ..cfg(&b, before)
        })
        .unwrap();
        let resumed = train::run(&train::Config {
            resume: Some(b.join("checkpoint.json")),
            ..cfg(&b, after)
        })
        .unwrap();
        assert_eq!(resumed.world_size, after);
        for (x, y) in straight.epochs[2..].iter().zip(&resumed.epochs[2..]) {
            for (what, p, q) in [
                ("train loss", x.train_loss, y.train_loss),
                ("val loss", x.val_loss, y.val_loss),
            ] {
                let rel = (p - q).abs() / p.abs();
                eprintln!("{before} -> {after} ranks, epoch {}: {what} {p} against {q} (relative {rel:.1e})", x.epoch);
                assert!(
                    rel <= TOLERANCE,
                    "{before} -> {after}, epoch {}: {what} {p} against {q}",
                    x.epoch
                );
            }
        }
        for d in [a, b] {
            std::fs::remove_dir_all(d).unwrap();
        }
    }
}

/// `--overlap on` (the default: buckets started from the gradient hooks during the last
/// micro-batch's backward) and `--overlap off` (`sync_gradients` after it) train to the same
/// weights, bit for bit: 3 ranks, 2 epochs with a partial last batch that leaves rank 2 empty,
/// `--accumulate 2` (earlier micro-batches riding along), in f32 and in f16 with loss scaling.
#[test]
fn overlap_on_and_off_train_the_same_weights_bitwise() {
    for precision in [train::Precision::Full, train::Precision::F16] {
        let params = |overlap: bool| {
            let dir = fresh_dir(if overlap { "overlap-on" } else { "overlap-off" });
            let cfg = train::Config {
                epochs: 2,
                accumulate: 2,
                overlap,
                ..tiny_config(&dir, precision)
            };
            let s = train::run(&cfg).unwrap();
            std::fs::remove_dir_all(&dir).unwrap();
            s.params
        };
        let (on, off) = (params(true), params(false));
        assert_params_bitwise(&on, &off, &format!("{precision:?}, overlap on and off"));
    }
}

/// A checkpoint of another model is refused, naming both models and the file, and nothing is
/// restored (damage of every kind is the library's:
/// `tests/checkpoint.rs::a_damaged_checkpoint_is_refused_naming_the_file`).
#[test]
fn a_checkpoint_of_another_model_is_refused() {
    let dir = fresh_dir("other-model");
    tiny_run(&dir, Some(1), false, train::Precision::Full);
    let manifest = std::fs::read(dir.join("checkpoint.json")).unwrap();
    let cfg = train::Config {
        arch: Arch::ResNet56,
        resume: Some(dir.join("checkpoint.json")),
        ..tiny_config(&dir, train::Precision::Full)
    };
    let err = format!("{:#}", train::run(&cfg).unwrap_err());
    assert!(
        err.contains("resnet20") && err.contains("resnet56") && err.contains("checkpoint.json"),
        "{err}"
    );
    assert!(err.contains("nothing was restored on any rank"), "{err}");
    assert_eq!(
        std::fs::read(dir.join("checkpoint.json")).unwrap(),
        manifest
    );
    std::fs::remove_dir_all(&dir).unwrap();
}

/// `--resume auto` after a restart with another global batch size, seed or training set (or a
/// sweep sharing the output folder) is refused on every rank, naming the setting: the epoch
/// would resume at another place of another order. A second live run into the same folder is
/// refused at its start, naming the lock, and leaves the folder's checkpoint as it was.
#[test]
fn a_resume_with_other_settings_or_a_second_run_is_refused() {
    let dir = fresh_dir("other-settings");
    tiny_run(&dir, Some(1), false, train::Precision::Full);
    let manifest = std::fs::read(dir.join("checkpoint.json")).unwrap();
    let auto = std::path::Path::new("auto");
    let cases: [(&str, train::Config); 3] = [
        (
            "--batch-size 8",
            train::Config {
                batch_size: 8,
                ..tiny_config(&dir, train::Precision::Full)
            },
        ),
        (
            "--seed 7",
            train::Config {
                seed: 7,
                ..tiny_config(&dir, train::Precision::Full)
            },
        ),
        (
            "training-set size 60",
            train::Config {
                train_size: 60,
                ..tiny_config(&dir, train::Precision::Full)
            },
        ),
    ];
    for (what, cfg) in cases {
        let cfg = train::Config {
            resume: checkpoint::resolve_resume(Some(auto), &dir),
            ..cfg
        };
        let err = format!("{:#}", train::run(&cfg).unwrap_err());
        let setting = what.rsplit_once(' ').unwrap().0;
        assert!(
            err.contains(setting) && err.contains("this run has"),
            "{what}: {err}"
        );
    }
    // Another run holds the folder.
    let lock = std::fs::File::create(dir.join(".run.lock")).unwrap();
    lock.try_lock().unwrap();
    let err = format!(
        "{:#}",
        train::run(&tiny_config(&dir, train::Precision::Full)).unwrap_err()
    );
    assert!(
        err.contains("another run writing into this folder holds"),
        "{err}"
    );
    drop(lock);
    assert_eq!(
        std::fs::read(dir.join("checkpoint.json")).unwrap(),
        manifest
    );
    std::fs::remove_dir_all(&dir).unwrap();
}

/// Both runs' variables have the same names and the same bits, naming the first that differs.
fn assert_params_bitwise(
    a: &[(String, candle_core::Tensor)],
    b: &[(String, candle_core::Tensor)],
    what: &str,
) {
    let names =
        |p: &[(String, candle_core::Tensor)]| p.iter().map(|(n, _)| n.clone()).collect::<Vec<_>>();
    assert_eq!(names(a), names(b), "{what}: the variables");
    let bits = |t: &candle_core::Tensor| {
        (t.flatten_all().unwrap().to_dtype(DType::F64).unwrap())
            .to_vec1::<f64>()
            .unwrap()
            .iter()
            .map(|v| v.to_bits())
            .collect::<Vec<_>>()
    };
    for ((name, x), (_, y)) in a.iter().zip(b) {
        assert_eq!(bits(x), bits(y), "{what}: {name} differs");
    }
}

/// `metrics.csv` (the `csv` crate): rows come back as written, rounded as documented; a
/// missing file is no rows; a malformed one is an error naming the file.
#[test]
fn the_metrics_file_round_trips_and_a_malformed_one_is_named() {
    let dir = fresh_dir("csv");
    let path = dir.join("metrics.csv");
    let rows: Vec<report::EpochMetrics> = (1..=3)
        .map(|e| report::EpochMetrics {
            epoch: e,
            train_loss: 1.0 / e as f64 + 1e-9,
            train_acc: 0.5 + 0.1 * e as f64,
            val_loss: 0.25 * e as f64,
            val_acc: 0.9,
            images_per_sec: 863.94,
            seconds: 27.777,
        })
        .collect();
    report::write_csv(&path, &rows).unwrap();
    let text = std::fs::read_to_string(&path).unwrap();
    assert!(
        text.starts_with("epoch,train_loss,train_acc,val_loss,val_acc,images_per_sec,seconds\n"),
        "{text}"
    );
    let back = report::read_csv(&path).unwrap();
    assert_eq!(back.len(), 3);
    for (a, b) in rows.iter().zip(&back) {
        assert_eq!(a.epoch, b.epoch);
        assert!((a.train_loss - b.train_loss).abs() <= 5e-7);
        assert_eq!((b.images_per_sec, b.seconds), (863.9, 27.78));
    }
    assert!(report::read_csv(&dir.join("absent.csv"))
        .unwrap()
        .is_empty());
    std::fs::write(&path, "epoch,train_loss\n1,not-a-number\n").unwrap();
    let e = format!("{:#}", report::read_csv(&path).unwrap_err());
    assert!(e.contains("metrics.csv") && e.contains("malformed"), "{e}");
    std::fs::remove_dir_all(dir).unwrap();
}
