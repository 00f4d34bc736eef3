//! The ResNet example's pieces: models build with both norms under torchvision's names and
//! parameter counts, a checkpoint round-trips, data and plots are well-formed, and `--check`
//! (N-rank SyncBatchNorm against 1-rank batch norm) passes for a tiny model.

#[allow(dead_code)]
#[path = "../examples/resnet/check.rs"]
mod check;
#[allow(dead_code)]
#[path = "../examples/resnet/checkpoint.rs"]
mod checkpoint;
#[allow(dead_code)]
#[path = "../examples/resnet/cli.rs"]
mod cli;
#[allow(dead_code)]
#[path = "../examples/resnet/config.rs"]
mod config;

#[path = "../examples/resnet/data.rs"]
mod data;
#[allow(dead_code)]
#[path = "../examples/resnet/model.rs"]
mod model;
#[allow(dead_code)]
#[path = "../examples/resnet/optim.rs"]
mod optim;
#[allow(dead_code)]
#[path = "../examples/resnet/report.rs"]
mod report;
#[allow(dead_code)]
#[path = "../examples/resnet/state.rs"]
mod state;

#[path = "../examples/resnet/train.rs"]
mod train;

use candle_core::{DType, Device, Tensor};
use candle_distributed::collective::ThreadGroup;
use candle_nn::{VarBuilder, VarMap};
use model::{Arch, NormKind, ResNet};

/// Builds `arch` and returns its VarMap (names → variables).
fn build(arch: Arch, norm: &NormKind, classes: usize) -> VarMap {
    let vm = VarMap::new();
    let vb = VarBuilder::from_varmap(&vm, DType::F32, &Device::Cpu);
    ResNet::new(arch, classes, norm, vb).unwrap();
    vm
}

fn trainable_count(vm: &VarMap) -> usize {
    let data = vm.data().lock().unwrap();
    data.iter()
        .filter(|(k, _)| {
            !(k.ends_with("running_mean")
                || k.ends_with("running_var")
                || k.ends_with("num_batches_tracked"))
        })
        .map(|(_, v)| v.elem_count())
        .sum()
}

/// torchvision's parameter counts (1000 classes) and state-dict sizes (with
/// `num_batches_tracked`): ResNet-18 11,689,512 / 122, ResNet-34 21,797,672 / 218,
/// ResNet-50 25,557,032 / 320.
#[test]
fn torchvision_models_have_torchvisions_names_and_sizes() {
    let comm = ThreadGroup::new(1).unwrap().remove(0);
    for (arch, params, entries) in [
        (Arch::ResNet18, 11_689_512, 122),
        (Arch::ResNet34, 21_797_672, 218),
        (Arch::ResNet50, 25_557_032, 320),
    ] {
        let vm = build(arch, &NormKind::SyncBn(comm.clone()), 1000);
        assert_eq!(trainable_count(&vm), params, "{arch:?} parameters");
        assert_eq!(
            vm.data().lock().unwrap().len(),
            entries,
            "{arch:?} state-dict entries"
        );
        let data = vm.data().lock().unwrap();
        for name in [
            "conv1.weight",
            "bn1.running_var",
            "bn1.num_batches_tracked",
            "layer1.0.conv1.weight",
            "layer2.0.downsample.0.weight",
            "layer2.0.downsample.1.bias",
            "layer4.1.bn2.weight",
            "fc.weight",
            "fc.bias",
        ] {
            assert!(data.contains_key(name), "{arch:?} lacks {name}");
        }
        assert_eq!(data["conv1.weight"].dims(), [64, 3, 7, 7]);
        if arch == Arch::ResNet50 {
            assert_eq!(data["layer1.0.conv3.weight"].dims(), [256, 64, 1, 1]);
            assert_eq!(data["fc.weight"].dims(), [1000, 2048]);
        }
    }
}

/// CIFAR ResNet-20 has 0.27 M parameters (He et al.), ResNet-56 0.85 M; here with 1×1
/// projection shortcuts (option B), which add a few thousand.
#[test]
fn cifar_models_build_with_both_norms_and_run() {
    let comm = ThreadGroup::new(1).unwrap().remove(0);
    for norm in [NormKind::Bn, NormKind::SyncBn(comm)] {
        let vm = VarMap::new();
        let vb = VarBuilder::from_varmap(&vm, DType::F32, &Device::Cpu);
        let model = ResNet::new(Arch::ResNet20, 10, &norm, vb).unwrap();
        let n = trainable_count(&vm);
        assert!((270_000..285_000).contains(&n), "ResNet-20 parameters: {n}");
        let x = Tensor::randn(0f32, 1f32, (3, 3, 16, 16), &Device::Cpu).unwrap();
        for train in [true, false] {
            let y = model.forward(&x, train).unwrap();
            assert_eq!(y.dims(), [3, 10]);
            assert!(y
                .to_vec2::<f32>()
                .unwrap()
                .iter()
                .flatten()
                .all(|v| v.is_finite()));
        }
    }
    let n56 = trainable_count(&build(Arch::ResNet56, &NormKind::Bn, 10));
    assert!(
        (850_000..870_000).contains(&n56),
        "ResNet-56 parameters: {n56}"
    );
}

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

#[test]
fn synthetic_data_is_deterministic_balanced_and_not_constant() {
    let a = data::synthetic(50, 16, 9);
    let b = data::synthetic(50, 16, 9);
    assert_eq!(a.images, b.images);
    assert_eq!(a.labels, b.labels);
    for c in 0..10u8 {
        assert_eq!(a.labels.iter().filter(|&&l| l == c).count(), 5);
    }
    let (mean, std) = data::channel_stats(&a);
    assert!(mean.iter().all(|m| (0.2..0.8).contains(m)) && std.iter().all(|s| *s > 0.1));
    let c = data::synthetic(50, 16, 10);
    assert_ne!(a.images, c.images, "another seed, other images");
}

/// The chart, decoded: its size, both curves in both panels going the way the numbers go (loss
/// down, accuracy up), and a title drawn in the font the example found.
#[test]
fn the_chart_shows_both_curves_and_its_title() -> anyhow::Result<()> {
    let rows: Vec<report::EpochMetrics> = (1..=6)
        .map(|e| report::EpochMetrics {
            epoch: e,
            train_loss: 2.0 / e as f64,
            train_acc: 0.15 * e as f64,
            val_loss: 2.3 / e as f64,
            val_acc: 0.14 * e as f64,
            images_per_sec: 100.0,
            seconds: e as f64,
        })
        .collect();
    let path = std::env::temp_dir().join(format!("curves-{}.png", std::process::id()));
    report::write_plot(&path, "resnet20 test chart", &rows)?;
    let img = image::open(&path)?.to_rgb8();
    std::fs::remove_file(&path)?;
    let (w, h) = report::PLOT_SIZE;
    assert_eq!(img.dimensions(), (w, h));
    // Mean height (pixels from the top) of one colour in columns [x0, x1).
    let mean_y = |colour: plotters::style::RGBColor, x0: u32, x1: u32| {
        let ys: Vec<u32> = (x0..x1)
            .flat_map(|x| (0..h).map(move |y| (x, y)))
            .filter(|&(x, y)| img.get_pixel(x, y).0 == [colour.0, colour.1, colour.2])
            .map(|(_, y)| y)
            .collect();
        assert!(
            ys.len() > 30,
            "{colour:?}: {} pixels in x {x0}..{x1}",
            ys.len()
        );
        ys.iter().sum::<u32>() as f64 / ys.len() as f64
    };
    // Each panel's plot spans roughly its middle; the legend sits in the upper right.
    let half = w / 2;
    for (panel, x0, falling) in [("loss", 0, true), ("accuracy", half, false)] {
        for colour in [report::TRAIN_COLOUR, report::VAL_COLOUR] {
            let first = mean_y(colour, x0 + 70, x0 + 70 + half / 5);
            let middle = mean_y(colour, x0 + half / 2 - 30, x0 + half / 2 + 30);
            assert_eq!(
                first < middle,
                falling,
                "{panel}: {colour:?} at {first:.0} px on the left, {middle:.0} px in the middle"
            );
        }
    }
    // The title: dark, anti-aliased glyph pixels in the top band.
    let dark = (0..w)
        .flat_map(|x| (0..30).map(move |y| (x, y)))
        .filter(|&(x, y)| img.get_pixel(x, y).0.iter().all(|&c| c < 80))
        .count();
    let grey = (0..w)
        .flat_map(|x| (0..30).map(move |y| (x, y)))
        .filter(|&(x, y)| {
            img.get_pixel(x, y)
                .0
                .iter()
                .all(|&c| (100..200).contains(&c))
        })
        .count();
    assert!(
        dark > 100 && grey > 20,
        "title: {dark} dark, {grey} grey pixels"
    );
    Ok(())
}

/// The example's device for a test device (thread ranks on the CPU, or sharing GPU 0).
fn device_kind(dev: &Device) -> train::DeviceKind {
    if dev.is_cuda() {
        train::DeviceKind::Cuda
    } else {
        train::DeviceKind::Cpu
    }
}

/// `--check` for a tiny model: 4 ranks of SyncBatchNorm with data-parallel averaging take the
/// steps of one process with plain batch norm (f64, rounding-level differences).
fn check_passes_for_a_tiny_model(dev: &Device) -> anyhow::Result<()> {
    let cfg = train::Config {
        arch: Arch::ResNet20,
        device: device_kind(dev),
        world_size: 4,
        batch_size: 16,
        image_size: 8,
        train_size: 64,
        val_size: 16,
        ..Default::default()
    };
    let diff = check::check(&cfg, 3, true)?.max_abs;
    assert!(diff <= 1e-6, "largest parameter difference {diff:e}");
    // The comparison can fail: per-rank batch norm (statistics of 4 images) drifts away.
    let unsynced = check::check(&cfg, 3, false)?.max_abs;
    assert!(
        unsynced > 1e-3,
        "plain batch norm on 4 ranks differs by only {unsynced:e}"
    );
    Ok(())
}

/// torchvision's ResNet-18/34/50 (7×7 stem, overlapping 3×3 stride-2 max pool, bottlenecks)
/// train end to end through the example's loop: 2 thread ranks with SyncBatchNorm fit one
/// batch of 4 images of 32×32 for 8 steps; the last step's loss is below half the first's.
fn torchvision_models_train(dev: &Device) -> anyhow::Result<()> {
    for arch in [Arch::ResNet18, Arch::ResNet34, Arch::ResNet50] {
        let cfg = train::Config {
            arch,
            device: device_kind(dev),
            world_size: 2,
            batch_size: 4,
            image_size: 32,
            train_size: 4,
            val_size: 4,
            epochs: 8,
            lr: 2e-3,
            augment: false,
            write_outputs: false,
            ..Default::default()
        };
        let s = train::run(&cfg)?;
        let losses: Vec<f64> = s.epochs.iter().map(|m| m.train_loss).collect();
        assert_eq!(losses.len(), 8, "{arch:?}: every step ran");
        assert!(
            losses.iter().all(|l| l.is_finite()) && losses[7] < 0.5 * losses[0],
            "{arch:?}: training losses per epoch {losses:?} do not fall"
        );
    }
    Ok(())
}

/// The last global batch of an epoch is partial and some ranks' shares are empty (50 images,
/// batches of 16, 3 ranks: the 4th step has 2 images, split 1, 1, 0), with and without
/// gradient accumulation: `--check` over the whole epoch still equals one process.
fn uneven_last_batch_and_accumulation_match_one_process(dev: &Device) -> anyhow::Result<()> {
    for accumulate in [1, 3] {
        let cfg = train::Config {
            arch: Arch::ResNet20,
            device: device_kind(dev),
            world_size: 3,
            batch_size: 16,
            image_size: 8,
            train_size: 50,
            val_size: 16,
            accumulate,
            ..Default::default()
        };
        let diff = check::check(&cfg, 4, true)?.max_abs;
        assert!(
            diff <= 1e-6,
            "accumulate {accumulate}: largest parameter difference {diff:e}"
        );
    }
    Ok(())
}

/// `--check` with bf16 and f16 activations (f16 with loss scaling): 4 ranks of SyncBatchNorm
/// end no farther than 1.5× (the example's default tolerance) from the one-process run than
/// the reduced precision alone moves that run; per-rank batch norm ends well beyond.
#[test]
fn reduced_precision_check_passes_and_can_fail() {
    for precision in [train::Precision::Bf16, train::Precision::F16] {
        let cfg = train::Config {
            arch: Arch::ResNet20,
            world_size: 4,
            batch_size: 16,
            image_size: 8,
            train_size: 64,
            val_size: 16,
            precision,
            ..Default::default()
        };
        let synced = check::check(&cfg, 3, true).unwrap();
        let ratio = synced.noise_ratio().unwrap();
        assert!(ratio <= 1.5, "{precision:?}: {synced:?}");
        let unsynced = check::check(&cfg, 3, false).unwrap();
        let bad = unsynced.noise_ratio().unwrap();
        assert!(
            bad > 1.5,
            "{precision:?}: per-rank batch norm passes: {unsynced:?}"
        );
        println!("{precision:?}: synced {synced:?}, per-rank {unsynced:?}");
    }
}

/// A tiny run writing its outputs to a fresh directory (3 ranks, 50 images: every epoch ends
/// with a partial batch that leaves rank 2 empty).
fn tiny_run(
    dir: &std::path::Path,
    stop_after: Option<usize>,
    resume: bool,
    precision: train::Precision,
) -> train::Summary {
    let cfg = train::Config {
        arch: Arch::ResNet20,
        world_size: 3,
        batch_size: 16,
        image_size: 8,
        train_size: 50,
        val_size: 12,
        epochs: 4,
        precision,
        stop_after_epoch: stop_after,
        out_dir: dir.to_path_buf(),
        resume: resume.then(|| dir.join("checkpoint.json")),
        ..Default::default()
    };
    train::run(&cfg).unwrap()
}

fn fresh_dir(tag: &str) -> std::path::PathBuf {
    let dir = std::env::temp_dir().join(format!("resnet-{tag}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

/// 4 epochs in one run equal 2 epochs, a resume from the checkpoint, and 2 more, bit for bit:
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
    tiny_run(&b, Some(2), false, precision);
    let resumed = tiny_run(&b, None, true, precision);
    assert_eq!(straight.params.len(), resumed.params.len());
    for ((name, x), (_, y)) in straight.params.iter().zip(&resumed.params) {
        let (x, y) = (
            x.flatten_all().unwrap().to_dtype(DType::F64).unwrap(),
            y.flatten_all().unwrap().to_dtype(DType::F64).unwrap(),
        );
        let same = x
            .to_vec1::<f64>()
            .unwrap()
            .iter()
            .zip(y.to_vec1::<f64>().unwrap())
            .all(|(p, q)| p.to_bits() == q.to_bits());
        assert!(same, "{precision:?}: {name} differs after resuming");
    }
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

/// A checkpoint damaged in any way is refused with a message naming the file; a kill in the
/// middle of writing the next one (its temporary files left behind) still loads the previous.
#[test]
fn a_damaged_checkpoint_is_refused() {
    let dir = fresh_dir("damaged");
    tiny_run(&dir, Some(1), false, train::Precision::Full);
    let json = dir.join("checkpoint.json");
    let (meta, _) = checkpoint::load(&dir, "resnet20").unwrap();
    let weights = dir.join(&meta.weights);
    let (json_bytes, weight_bytes) = (
        std::fs::read(&json).unwrap(),
        std::fs::read(&weights).unwrap(),
    );
    let ok = |what: &str| {
        checkpoint::load(&dir, "resnet20").unwrap_or_else(|e| panic!("{what}: {e:#}"));
    };
    let refused = |what: &str, want: &str| {
        let err = format!("{:#}", checkpoint::load(&json, "resnet20").unwrap_err());
        assert!(err.contains(want), "{what}: {err}");
    };
    ok("as written");
    // The JSON: empty, cut anywhere.
    for cut in [0, 1, json_bytes.len() / 2, json_bytes.len() - 2] {
        std::fs::write(&json, &json_bytes[..cut]).unwrap();
        refused(&format!("JSON cut at {cut}"), "checkpoint.json");
    }
    std::fs::write(&json, &json_bytes).unwrap();
    // The tensor file: cut in the header length, the header, the data, the last byte.
    let header = 8 + u64::from_le_bytes(weight_bytes[..8].try_into().unwrap()) as usize;
    for cut in [
        0,
        4,
        8,
        header / 2,
        header,
        (header + weight_bytes.len()) / 2,
        weight_bytes.len() - 1,
    ] {
        std::fs::write(&weights, &weight_bytes[..cut]).unwrap();
        refused(&format!("tensors cut at {cut}"), "truncated or replaced");
    }
    // One flipped bit in the data.
    let mut flipped = weight_bytes.clone();
    flipped[header + 100] ^= 1;
    std::fs::write(&weights, &flipped).unwrap();
    refused("a flipped bit", "corrupt");
    std::fs::write(&weights, &weight_bytes).unwrap();
    // Another model, another format, the tensor file instead of the JSON.
    let err = format!("{:#}", checkpoint::load(&json, "resnet56").unwrap_err());
    assert!(
        err.contains("resnet20") && err.contains("resnet56"),
        "{err}"
    );
    let other = String::from_utf8(json_bytes.clone())
        .unwrap()
        .replace("\"format\": 1", "\"format\": 9");
    std::fs::write(&json, other).unwrap();
    refused("format 9", "format 9");
    std::fs::write(&json, &json_bytes).unwrap();
    let err = format!("{:#}", checkpoint::load(&weights, "resnet20").unwrap_err());
    assert!(err.contains("checkpoint.json"), "{err}");
    // Killed while writing the next checkpoint: half-written temporary files stay temporary.
    std::fs::write(
        dir.join("checkpoint-e0002.safetensors.tmp"),
        &weight_bytes[..header],
    )
    .unwrap();
    std::fs::write(dir.join("checkpoint.json.tmp"), &json_bytes[..10]).unwrap();
    ok("with a half-written successor");
    // Two saves of the same epoch with other contents (a run restarted into the same
    // directory) use two tensor files: the second never overwrites the file the first JSON
    // names, so a kill between its tensor file and its JSON leaves the first loadable.
    let save = |v: f32| {
        let t = Tensor::new(&[v, 2.0], &Device::Cpu).unwrap();
        let meta = checkpoint::Meta {
            format: checkpoint::FORMAT,
            epoch: 1,
            step: 4,
            optimizer_step: 4,
            scaler: None,
            model: "resnet20".into(),
            weights: String::new(),
            weights_bytes: 0,
            weights_crc32: 0,
        };
        let sub = dir.join("same-epoch");
        checkpoint::save(&sub, meta, &[("w".to_string(), t)]).unwrap();
        checkpoint::load(&sub, "resnet20").unwrap().0.weights
    };
    let (first, second) = (save(1.0), save(3.0));
    assert_ne!(first, second, "two contents of epoch 1 share a file name");
    std::fs::remove_dir_all(&dir).unwrap();
}

/// The command line: its defaults are `Config::default()`'s, flags land in their fields, and
/// bad values are refused naming the flag.
#[test]
fn the_command_line_maps_onto_the_config() {
    use clap::Parser;
    let d = cli::Cli::try_parse_from(["resnet"])
        .unwrap()
        .config()
        .unwrap();
    let want = train::Config::default();
    assert_eq!(format!("{d:?}"), format!("{want:?}"));
    let c = cli::Cli::try_parse_from([
        "resnet",
        "--model",
        "resnet50",
        "--norm",
        "bn",
        "--precision",
        "f16",
        "--accumulate",
        "3",
        "--batch-size",
        "64",
        "--backend",
        "nccl",
        "--resume",
        "out/x",
    ])
    .unwrap()
    .config()
    .unwrap();
    assert_eq!(c.arch, Arch::ResNet50);
    assert!(!c.sync_bn);
    assert_eq!(c.precision, train::Precision::F16);
    assert_eq!((c.accumulate, c.batch_size), (3, 64));
    assert_eq!(
        c.device,
        train::DeviceKind::Cuda,
        "nccl defaults to the GPU"
    );
    assert_eq!(c.resume.as_deref(), Some(std::path::Path::new("out/x")));
    for bad in [
        ["--model", "resnet19"],
        ["--world-size", "0"],
        ["--precision", "f8"],
    ] {
        let err = cli::Cli::try_parse_from(["resnet", bad[0], bad[1]])
            .unwrap_err()
            .to_string();
        assert!(err.contains(bad[0]), "{bad:?}: {err}");
    }
}

mod common;
device_tests!(
    check_passes_for_a_tiny_model,
    torchvision_models_train,
    uneven_last_batch_and_accumulation_match_one_process
);
