//! Which devices the crate has kernels for, which path an op takes on a device (its kernels, or
//! the composite path built from candle's tensor ops), and the error of the functional ops that
//! have kernels only.

use candle_core::{DeviceLocation, Result};

/// The environment variable that forces the composite path on every device (any value but
/// empty or `0`): how the tests run it on the CPU and on CUDA, where the kernels would
/// otherwise be taken.
pub(crate) const FORCE_COMPOSITE: &str = "CANDLE_DISTRIBUTED_COMPOSITE";

/// True when the layers and ops that have a composite path take it on `dev`: on a device
/// without the crate's kernels (Metal; CUDA in a build without the `cuda` feature), or on any
/// device when [`FORCE_COMPOSITE`] is set.
pub(crate) fn composite(dev: &candle_core::Device) -> bool {
    composite_at(dev.location(), forced())
}

/// [`composite`] for a device at `loc`, `forced` or not.
fn composite_at(loc: DeviceLocation, forced: bool) -> bool {
    forced || unsupported("", loc).is_some()
}

/// True when [`FORCE_COMPOSITE`] is set to something other than empty or `0`.
fn forced() -> bool {
    std::env::var_os(FORCE_COMPOSITE).is_some_and(|v| !v.is_empty() && v != "0")
}

/// The crate feature without which this build's custom ops that only copy (the attach ops
/// that put a value computed outside the graph into it, the data-parallel gradient hooks) have
/// no forward on `dev`: `cuda` for a CUDA device, `metal` for a Metal one; `None` where they
/// run. candle-core's own device features cannot be seen from here: a user who turns them on
/// without ours gets devices whose storage type this build does not know.
pub(crate) fn missing_copy_feature(dev: &candle_core::Device) -> Option<&'static str> {
    missing_copy_feature_at(dev.location())
}

/// [`missing_copy_feature`] for a device at `loc`.
fn missing_copy_feature_at(loc: DeviceLocation) -> Option<&'static str> {
    match loc {
        DeviceLocation::Cpu => None,
        DeviceLocation::Cuda { .. } if cfg!(feature = "cuda") => None,
        DeviceLocation::Cuda { .. } => Some("cuda"),
        DeviceLocation::Metal { .. } if cfg!(feature = "metal") => None,
        DeviceLocation::Metal { .. } => Some("metal"),
    }
}

/// Errors unless the crate has kernels for `dev`: the CPU always, CUDA GPUs with the `cuda`
/// feature. The error names `op`, the device and the remedy, where candle's own would only say
/// that a custom op has no implementation for it. For the functional ops of `crate::ops` that
/// have no composite path.
pub(crate) fn check_supported(op: &str, dev: &candle_core::Device) -> Result<()> {
    match unsupported(op, dev.location()) {
        Some(msg) => Err(candle_core::Error::Msg(msg)),
        None => Ok(()),
    }
}

/// The message for a device at `loc` without kernels, `None` for a supported one.
fn unsupported(op: &str, loc: DeviceLocation) -> Option<String> {
    const HAS: &str = "the functional ops have kernels for the CPU and, with the `cuda` \
                       feature, for CUDA GPUs; `SyncBatchNorm`, `max_pool2d` and `conv2d` run on \
                       every candle device";
    match loc {
        DeviceLocation::Cpu => None,
        DeviceLocation::Cuda { .. } if cfg!(feature = "cuda") => None,
        DeviceLocation::Cuda { gpu_id } => Some(format!(
            "{op}: the input is on CUDA device {gpu_id}, but this build of candle-distributed \
             lacks its `cuda` feature: enable it (`candle-distributed = {{ version = \"…\", \
             features = [\"cuda\"] }}`; `nccl` for NCCL collectives), or move the tensors to the \
             CPU ({HAS})"
        )),
        DeviceLocation::Metal { gpu_id } => Some(format!(
            "{op}: the input is on Metal device {gpu_id}, where this op has no implementation \
             ({HAS}): use `SyncBatchNorm`, or move the tensors to the CPU (`Device::Cpu`) or to a \
             CUDA device"
        )),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Each unsupported device gets a message naming the op, the device and the remedy; the
    /// CPU (and CUDA with the feature) none. (A Metal or, in this build, CUDA tensor cannot be
    /// made on a machine without one, so the message is checked from the device's location.)
    /// The composite path is taken on the devices without kernels, and everywhere when forced;
    /// the kernels elsewhere.
    #[test]
    fn devices_without_kernels_take_the_composite_path() {
        let metal = DeviceLocation::Metal { gpu_id: 0 };
        let cuda = DeviceLocation::Cuda { gpu_id: 0 };
        assert!(composite_at(metal, false));
        assert_eq!(composite_at(cuda, false), !cfg!(feature = "cuda"));
        assert!(!composite_at(DeviceLocation::Cpu, false));
        for loc in [DeviceLocation::Cpu, cuda, metal] {
            assert!(composite_at(loc, true), "{loc:?} forced");
        }
    }

    /// The copying custom ops run on the CPU always, on CUDA and Metal with the crate's
    /// feature of that name, which is named where it is missing.
    #[test]
    fn the_copying_ops_name_the_feature_they_need() {
        assert_eq!(missing_copy_feature_at(DeviceLocation::Cpu), None);
        let cuda = missing_copy_feature_at(DeviceLocation::Cuda { gpu_id: 0 });
        assert_eq!(cuda, (!cfg!(feature = "cuda")).then_some("cuda"));
        let metal = missing_copy_feature_at(DeviceLocation::Metal { gpu_id: 0 });
        assert_eq!(metal, (!cfg!(feature = "metal")).then_some("metal"));
    }

    #[test]
    fn unsupported_devices_get_a_remedy() {
        assert_eq!(unsupported("sync-batch-norm", DeviceLocation::Cpu), None);
        let metal = unsupported("sync-batch-norm", DeviceLocation::Metal { gpu_id: 0 }).unwrap();
        for part in [
            "sync-batch-norm",
            "Metal device 0",
            "Device::Cpu",
            "CUDA",
            "SyncBatchNorm",
        ] {
            assert!(metal.contains(part), "{part:?} in {metal}");
        }
        let cuda = unsupported("max-pool2d", DeviceLocation::Cuda { gpu_id: 1 });
        if cfg!(feature = "cuda") {
            assert_eq!(cuda, None);
        } else {
            let cuda = cuda.unwrap();
            for part in [
                "max-pool2d",
                "CUDA device 1",
                "`cuda` feature",
                "features = [\"cuda\"]",
            ] {
                assert!(cuda.contains(part), "{part:?} in {cuda}");
            }
        }
    }
}
