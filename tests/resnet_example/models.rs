//! The architectures: torchvision's names and sizes, the CIFAR models with both norms, and
//! torchvision's models trained end to end.

use candle_core::{DType, Device, Tensor};
use candle_distributed::collective::ThreadGroup;
use candle_nn::{VarBuilder, VarMap};

use crate::model::{Arch, NormKind, ResNet};
use crate::*;

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

crate::device_tests!(torchvision_models_train);
