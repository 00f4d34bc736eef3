//! `--check`: N ranks of SyncBatchNorm against one process with plain batch norm, in f64, with
//! uneven batches and accumulation, and in reduced precision.

use candle_core::Device;

use crate::model::Arch;
use crate::*;

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

crate::device_tests!(
    check_passes_for_a_tiny_model,
    uneven_last_batch_and_accumulation_match_one_process
);
