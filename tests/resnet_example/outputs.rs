//! What a run reads and writes besides checkpoints: the synthetic data, the chart and the
//! command line.

use crate::model::Arch;
use crate::*;

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
        "--overlap",
        "off",
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
    assert!(!c.overlap && d.overlap, "--overlap off, on by default");
    for bad in [
        ["--model", "resnet19"],
        ["--world-size", "0"],
        ["--precision", "f8"],
        ["--overlap", "maybe"],
    ] {
        let err = cli::Cli::try_parse_from(["resnet", bad[0], bad[1]])
            .unwrap_err()
            .to_string();
        assert!(err.contains(bad[0]), "{bad:?}: {err}");
    }
}
