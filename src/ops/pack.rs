//! The flat buffer of a gradient bucket: every gradient (zeros where this rank has none), then
//! one flag per gradient (1 where this rank has one), all in the bucket's dtype: what
//! `DataParallel` all-reduces.
//!
//! On the CPU the parts go to `Collective::all_reduce_with` as they are ([`parts`]: thread
//! ranks sum them where they lie, MPI reads the large f32 and f64 ones in place, other
//! backends concatenate them). On a GPU, `cat` launched
//! one copy kernel per part and the zeros a memset each; here `kernels/pack.cu` fills up to
//! [`PACK_SEGS`](crate::kernels::args::PACK_SEGS) gradients, their zeros and their flags per launch,
//! reading each gradient where it lies.

use candle_core::{DType, Device, Result, Tensor};

/// What the op calls itself in errors (its one caller's name: the user sees that call).
#[cfg(feature = "cuda")]
const OP: &str = "DataParallel::sync_gradients";

/// `[total + k]` values of `dtype` on `device`: the `k = grads.len()` gradients flattened one
/// after the other (`lens[i]` values each, zeros for `None`), then `k` flags, 1 for `Some`.
///
/// `grads` are already in `dtype` and on `device`, `lens[i]` the element count of the i-th.
pub(crate) fn pack(
    grads: &[Option<Tensor>],
    lens: &[usize],
    dtype: DType,
    device: &Device,
) -> Result<Tensor> {
    #[cfg(feature = "cuda")]
    if let Device::Cuda(dev) = device {
        if matches!(dtype, DType::F32 | DType::F64 | DType::F16 | DType::BF16) {
            return cuda::pack(dev, grads, lens, dtype);
        }
    }
    Tensor::cat(&parts(grads, lens, dtype, device)?, 0)
}

/// The parts [`pack`] lays end to end on the CPU: each gradient flattened (a view of it, or
/// `lens[i]` zeros for `None`), then the `k` flags. `Collective::all_reduce_with` takes them as
/// they are.
pub(crate) fn parts(
    grads: &[Option<Tensor>],
    lens: &[usize],
    dtype: DType,
    device: &Device,
) -> Result<Vec<Tensor>> {
    let mut parts: Vec<Tensor> = Vec::with_capacity(grads.len() + 1);
    for (g, &n) in grads.iter().zip(lens) {
        parts.push(match g {
            Some(g) => g.flatten_all()?,
            None => Tensor::zeros(n, dtype, device)?,
        });
    }
    let flags: Vec<f32> = grads
        .iter()
        .map(|g| f32::from(u8::from(g.is_some())))
        .collect();
    parts.push(Tensor::new(flags.as_slice(), device)?.to_dtype(dtype)?);
    Ok(parts)
}

#[cfg(feature = "cuda")]
mod cuda {
    use candle_core::backend::{BackendDevice, BackendStorage};
    use candle_core::op::BackpropOp;
    use candle_core::{bail, CudaDevice, CudaStorage, DType, Result, Storage, Tensor};

    use super::OP;
    use crate::device::cuda::{dispatch, view, Buffers};
    use crate::kernels::args::{Pack, Segment, PACK_SEGS};
    use crate::kernels::{launch, KernelElem, Module};

    /// [`super::pack`] on `dev`: one `pack_<dtype>` launch per [`PACK_SEGS`] variables.
    pub(super) fn pack(
        dev: &CudaDevice,
        grads: &[Option<Tensor>],
        lens: &[usize],
        dtype: DType,
    ) -> Result<Tensor> {
        fn run<T: KernelElem>(
            dev: &CudaDevice,
            grads: &[Option<Tensor>],
            lens: &[usize],
            dtype: DType,
        ) -> Result<CudaStorage> {
            let total: usize = lens.iter().sum();
            let locked: Vec<_> = (grads.iter())
                .map(|g| g.as_ref().map(Tensor::storage_and_layout))
                .collect();
            let mut views = Vec::with_capacity(grads.len());
            for (i, l) in locked.iter().enumerate() {
                views.push(match l {
                    None => None,
                    Some((s, layout)) => match &**s {
                        Storage::Cuda(s) if s.dtype() == dtype && s.device.same_device(dev) => {
                            Some(view::<T>(OP, s, layout, "gradient")?)
                        }
                        s => bail!(
                            "{OP}: gradient {i} is {:?} on {:?}, the bucket {dtype:?} on {:?}",
                            s.dtype(),
                            s.device().location(),
                            dev.location()
                        ),
                    },
                });
            }
            // SAFETY: the launches below write every element: each variable's range (its
            // gradient or zeros) and its flag.
            let mut out = unsafe { dev.alloc::<T>(total + lens.len())? };
            let stream = dev.cuda_stream();
            let mut at = 0;
            for (first, chunk) in (0..lens.len())
                .step_by(PACK_SEGS)
                .zip(lens.chunks(PACK_SEGS))
            {
                let mut b = Buffers::on(&stream);
                let out_buf = b.write(&mut out);
                let segments = (views[first..].iter().zip(chunk))
                    .map(|(v, &len)| Segment {
                        src: v.as_ref().map(|v| b.read(v)),
                        len,
                        present: v.is_some(),
                    })
                    .collect::<Vec<_>>();
                let pack = Pack {
                    out: out_buf,
                    at,
                    segments,
                    flags_at: Some(total + first),
                };
                launch(dev, Module::Pack, pack.call(OP, dtype)?, b)?;
                at += chunk.iter().sum::<usize>();
            }
            Ok(CudaStorage::wrap_cuda_slice(out, dev.clone()))
        }
        let n = lens.iter().sum::<usize>() + lens.len();
        let storage = dispatch!(OP, dtype, run(dev, grads, lens, dtype))?;
        Ok(Tensor::from_storage(
            Storage::Cuda(storage),
            n,
            BackpropOp::none(),
            false,
        ))
    }
}
