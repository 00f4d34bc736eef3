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
    unsupported("", dev.location()).is_some() || forced()
}

/// True when [`FORCE_COMPOSITE`] is set to something other than empty or `0`.
fn forced() -> bool {
    std::env::var_os(FORCE_COMPOSITE).is_some_and(|v| !v.is_empty() && v != "0")
}

/// Errors unless the crate has kernels for `dev`: the CPU always, CUDA GPUs with the `cuda`
/// feature. The error names `op`, the device and the remedy, where candle's own would only say
/// that a custom op has no implementation for it.
pub(crate) fn check_supported(op: &str, dev: &candle_core::Device) -> Result<()> {
    match unsupported(op, dev.location()) {
        Some(msg) => Err(candle_core::Error::Msg(msg)),
        None => Ok(()),
    }
}

/// The message for a device at `loc` without kernels, `None` for a supported one.
fn unsupported(op: &str, loc: DeviceLocation) -> Option<String> {
    const HAS: &str = "candle-distributed has kernels for the CPU and, with its `cuda` feature, \
                       for CUDA GPUs";
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
            "{op}: the input is on Metal device {gpu_id}, which candle-distributed does not \
             support ({HAS}): move the model and its inputs to the CPU (`Device::Cpu`) or to a \
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
    #[test]
    fn unsupported_devices_get_a_remedy() {
        assert_eq!(unsupported("sync-batch-norm", DeviceLocation::Cpu), None);
        let metal = unsupported("sync-batch-norm", DeviceLocation::Metal { gpu_id: 0 }).unwrap();
        for part in ["sync-batch-norm", "Metal device 0", "Device::Cpu", "CUDA"] {
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
