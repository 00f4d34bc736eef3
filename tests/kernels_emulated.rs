//! The CUDA kernels of `kernels/*.cu`, compiled unchanged by g++ against the emulator in
//! `tests/emu/`, launched by name with the launch configurations of
//! `candle_distributed::launch` and compared with the CPU ops on the same inputs, under the
//! three thread orders of the emulator (forward, reverse, random). Needs g++ only; no CUDA.

mod common;

use std::collections::BTreeSet;
use std::ffi::{c_char, c_void, CString};
use std::path::PathBuf;
use std::process::Command;
use std::sync::OnceLock;

use candle_core::{DType, Device, Tensor};
use candle_distributed::launch::{self, Launch};
use candle_distributed::ops;
use common::{assert_close_rel, tol};
use rand::{Rng, SeedableRng};

/// Orders in which the emulator resumes a block's threads between barriers.
const SCHEDULES: [&str; 3] = ["forward", "reverse", "random:7"];
/// Storage types of the entry points, with their suffix.
const DTYPES: [(DType, &str); 4] = [
    (DType::F32, "f32"),
    (DType::F64, "f64"),
    (DType::F16, "f16"),
    (DType::BF16, "bf16"),
];
/// Entry points with a single dtype, each launched by a test below (none today).
const SINGLE: [&str; 0] = [];
/// Kernel roots stamped for every dtype; every `<root>_<suffix>` must be launched by a test
/// below.
const ROOTS: [&str; 11] = [
    "bn_finalize",
    "max_pool2d_fwd",
    "max_pool2d_bwd",
    "bn_stats_nchw",
    "bn_stats_nhwc",
    "bn_apply_nchw",
    "bn_apply_nhwc",
    "bn_backward_reduce_nchw",
    "bn_backward_reduce_nhwc",
    "bn_backward_elemt_nchw",
    "bn_backward_elemt_nhwc",
];
// ------------------------------------------------------------------------------ the emulator

struct Emu {
    lib: libloading::Library,
}

type LaunchFn = unsafe extern "C" fn(
    *const c_char,
    *const u32,
    *const u32,
    usize,
    *mut *mut c_void,
    *const c_char,
    *mut c_char,
    usize,
) -> i32;
type NamesFn = unsafe extern "C" fn(*mut c_char, usize) -> usize;

fn emu() -> &'static Emu {
    static EMU: OnceLock<Emu> = OnceLock::new();
    EMU.get_or_init(|| {
        let root = PathBuf::from(env!("CARGO_MANIFEST_DIR"));
        let out = PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join("libcuda_emu.so");
        let mut sources: Vec<PathBuf> = std::fs::read_dir(root.join("kernels"))
            .unwrap()
            .map(|e| e.unwrap().path())
            .filter(|p| p.extension().is_some_and(|e| e == "cu"))
            .collect();
        sources.sort();
        let status = Command::new(std::env::var("CXX").unwrap_or_else(|_| "g++".into()))
            .args(["-std=c++17", "-O2", "-shared", "-fPIC", "-Wall", "-Werror"])
            .arg("-I")
            .arg(root.join("tests/emu"))
            .arg("-I")
            .arg(root.join("kernels"))
            .arg("-o")
            .arg(&out)
            .arg(root.join("tests/emu/emu.cpp"))
            .args(["-x", "c++"])
            .args(&sources)
            .status()
            .expect("g++ is needed for the kernel emulation tests");
        assert!(
            status.success(),
            "compiling the kernels for the emulator failed"
        );
        // SAFETY: the library is ours, built just above; its initialisers only register kernels.
        let lib = unsafe { libloading::Library::new(&out) }.unwrap();
        Emu { lib }
    })
}

/// One kernel argument, held where the emulator can read it (as cuLaunchKernel takes them).
#[derive(Clone, Copy)]
enum Arg {
    Ptr(*mut c_void),
    I64(i64),
    I32(i32),
    F64(f64),
}

impl Arg {
    fn addr(&mut self) -> *mut c_void {
        match self {
            Arg::Ptr(p) => p as *mut *mut c_void as *mut c_void,
            Arg::I64(v) => v as *mut i64 as *mut c_void,
            Arg::I32(v) => v as *mut i32 as *mut c_void,
            Arg::F64(v) => v as *mut f64 as *mut c_void,
        }
    }
}

fn run(name: &str, cfg: &Launch, mut args: Vec<Arg>, schedule: &str) {
    let e = emu();
    let mut ptrs: Vec<*mut c_void> = args.iter_mut().map(Arg::addr).collect();
    let (cname, csched) = (CString::new(name).unwrap(), CString::new(schedule).unwrap());
    let mut err = vec![0 as c_char; 1024];
    // SAFETY: `emu_launch` has the signature of `LaunchFn` (tests/emu/emu.cpp); the argument
    // pointers point at live values of the kernel's parameter types, and every buffer pointer
    // covers the extent the kernel's documented shapes give it.
    let rc = unsafe {
        let f: libloading::Symbol<LaunchFn> = e.lib.get(b"emu_launch").unwrap();
        f(
            cname.as_ptr(),
            cfg.grid.as_ptr(),
            cfg.block.as_ptr(),
            cfg.shared_mem_bytes as usize,
            ptrs.as_mut_ptr(),
            csched.as_ptr(),
            err.as_mut_ptr(),
            err.len(),
        )
    };
    if rc != 0 {
        // SAFETY: the emulator wrote a NUL-terminated message into `err`.
        let msg = unsafe { std::ffi::CStr::from_ptr(err.as_ptr()) };
        panic!("{name} under {schedule}: {}", msg.to_string_lossy());
    }
}

fn registered() -> BTreeSet<String> {
    let e = emu();
    // SAFETY: `emu_kernel_names` has the signature of `NamesFn` and writes at most `len` bytes.
    unsafe {
        let f: libloading::Symbol<NamesFn> = e.lib.get(b"emu_kernel_names").unwrap();
        let len = f(std::ptr::null_mut(), 0);
        let mut buf = vec![0 as c_char; len + 1];
        f(buf.as_mut_ptr(), buf.len());
        std::ffi::CStr::from_ptr(buf.as_ptr())
            .to_string_lossy()
            .lines()
            .map(str::to_string)
            .collect()
    }
}

// ------------------------------------------------------------------------------ device buffers

/// A host buffer standing in for device memory: the raw bytes of a tensor.
struct Buf {
    bytes: Vec<u8>,
    dtype: DType,
    dims: Vec<usize>,
}

impl Buf {
    fn of(t: &Tensor) -> Self {
        let t = t.flatten_all().unwrap();
        let bytes: Vec<u8> = match t.dtype() {
            DType::F32 => t
                .to_vec1::<f32>()
                .unwrap()
                .iter()
                .flat_map(|v| v.to_le_bytes())
                .collect(),
            DType::F64 => t
                .to_vec1::<f64>()
                .unwrap()
                .iter()
                .flat_map(|v| v.to_le_bytes())
                .collect(),
            DType::F16 => t
                .to_vec1::<half::f16>()
                .unwrap()
                .iter()
                .flat_map(|v| v.to_le_bytes())
                .collect(),
            DType::BF16 => t
                .to_vec1::<half::bf16>()
                .unwrap()
                .iter()
                .flat_map(|v| v.to_le_bytes())
                .collect(),
            DType::I64 => t
                .to_vec1::<i64>()
                .unwrap()
                .iter()
                .flat_map(|v| v.to_le_bytes())
                .collect(),
            DType::U32 => t
                .to_vec1::<u32>()
                .unwrap()
                .iter()
                .flat_map(|v| v.to_le_bytes())
                .collect(),
            d => panic!("unsupported {d:?}"),
        };
        Self {
            bytes,
            dtype: t.dtype(),
            dims: t.dims().to_vec(),
        }
    }

    /// A buffer of `len` values of `dtype` filled with NaN bytes (poison: must be overwritten).
    fn poisoned(dtype: DType, dims: &[usize]) -> Self {
        let len: usize = dims.iter().product();
        Self {
            bytes: vec![0xFF; len * dtype.size_in_bytes()],
            dtype,
            dims: dims.to_vec(),
        }
    }

    fn zeros_u32(len: usize) -> Self {
        Self {
            bytes: vec![0; 4 * len.max(1)],
            dtype: DType::U32,
            dims: vec![len.max(1)],
        }
    }

    /// The buffer's address. Buffers of 16 bytes or more come from malloc, 16-byte aligned on
    /// our platforms, so the kernels' 16-byte paths run; asserted, so that they cannot silently
    /// fall back to the scalar path.
    fn ptr(&mut self) -> Arg {
        let p = self.bytes.as_mut_ptr();
        assert!(
            self.bytes.len() < 16 || (p as usize).is_multiple_of(16),
            "test buffer not 16-byte aligned"
        );
        Arg::Ptr(p as *mut c_void)
    }

    fn tensor(&self) -> Tensor {
        Tensor::from_raw_buffer(&self.bytes, self.dtype, &self.dims, &Device::Cpu).unwrap()
    }
}

fn null() -> Arg {
    Arg::Ptr(std::ptr::null_mut())
}

// ------------------------------------------------------------------------------ inputs

/// One test shape: `(n, c, hw)` in a layout.
#[derive(Debug, Clone, Copy)]
struct Case {
    n: usize,
    c: usize,
    hw: usize,
    cl: bool,
}

impl Case {
    fn dims(&self) -> Vec<usize> {
        if self.cl {
            vec![self.n, self.hw, self.c]
        } else {
            vec![self.n, self.c, self.hw]
        }
    }

    fn sizes(&self) -> [Arg; 3] {
        [
            Arg::I64(self.n as i64),
            Arg::I64(self.c as i64),
            Arg::I64(self.hw as i64),
        ]
    }

    /// Seeded values of mean `mean` and spread about 1, rounded to `dtype`.
    fn data(&self, seed: u64, mean: f64, dtype: DType) -> Tensor {
        let mut rng = rand::rngs::StdRng::seed_from_u64(seed);
        let len: usize = self.dims().iter().product();
        let v: Vec<f64> = (0..len)
            .map(|_| mean + 2.0 * rng.gen::<f64>() - 1.0)
            .collect();
        Tensor::from_vec(v, self.dims(), &Device::Cpu)
            .unwrap()
            .to_dtype(dtype)
            .unwrap()
    }
}

/// Shapes: C = 1, 3, 32, 65, 2048; one element per channel; an empty batch; sizes that take the
/// grid-split path; odd HW and C = 65 (scalar paths), HW and C multiples of 8 (16-byte packs,
/// channels-first and channels-last); both layouts.
fn cases() -> Vec<Case> {
    let mut v = Vec::new();
    for cl in [false, true] {
        for (n, c, hw) in [
            (3, 1, 7),
            (2, 3, 5),
            (4, 32, 9),
            (2, 65, 3),
            (1, 2048, 1),
            (1, 5, 1),
            (0, 3, 4),
            // HW a multiple of every pack length (4 f32, 2 f64, 8 f16/bf16): 16-byte path.
            (2, 3, 16),
            (2, 2, 4104),
        ] {
            v.push(Case { n, c, hw, cl });
        }
    }
    // Grid split: few channels, many elements per channel.
    v.push(Case {
        n: 4,
        c: 1,
        hw: 4099,
        cl: false,
    });
    v.push(Case {
        n: 2,
        c: 3,
        hw: 2049,
        cl: false,
    });
    v.push(Case {
        n: 3,
        c: 5,
        hw: 700,
        cl: true,
    });
    v
}

/// Per-channel f64 vectors used as statistics.
fn per_channel(c: usize, seed: u64, lo: f64, hi: f64) -> Tensor {
    let mut rng = rand::rngs::StdRng::seed_from_u64(seed);
    let v: Vec<f64> = (0..c).map(|_| rng.gen_range(lo..hi)).collect();
    Tensor::from_vec(v, c, &Device::Cpu).unwrap()
}

fn layout(cl: bool) -> &'static str {
    if cl {
        "nhwc"
    } else {
        "nchw"
    }
}

/// The dtype of the per-channel parameters the kernels take (f64 for f64 inputs, else f32).
fn acc(dtype: DType) -> DType {
    if dtype == DType::F64 {
        DType::F64
    } else {
        DType::F32
    }
}

// ------------------------------------------------------------------------------ the tests

/// Runs a reduction kernel twice on the same counters (they must be left at zero) and returns
/// its output.
fn reduce(name: &str, case: &Case, inputs: Vec<Arg>, rows: usize, sched: &str) -> Tensor {
    let r = launch::reduction(case.n, case.c, case.hw, case.cl).unwrap();
    let mut counters = Buf::zeros_u32(r.counters);
    let mut work = Buf::poisoned(DType::F64, &[r.work_len.max(1)]);
    let mut first = None;
    for _ in 0..2 {
        let mut out = Buf::poisoned(DType::F64, &[rows, case.c]);
        let mut args = inputs.clone();
        args.extend([out.ptr(), work.ptr(), counters.ptr()]);
        args.extend(case.sizes());
        run(name, &r.launch, args, sched);
        let t = out.tensor();
        if let Some(f) = &first {
            let same = (f - &t)
                .unwrap()
                .abs()
                .unwrap()
                .flatten_all()
                .unwrap()
                .max(0)
                .unwrap();
            assert_eq!(
                same.to_scalar::<f64>().unwrap(),
                0.0,
                "{name}: a second launch differs"
            );
        }
        first = Some(t);
    }
    assert!(
        counters.bytes.iter().all(|&b| b == 0),
        "{name}: counters not reset"
    );
    first.unwrap()
}

/// Runs `body(dtype, suffix, case, k, schedule)` for every dtype, test shape and schedule
/// (`k` indexes the schedule, used to vary the optional parts of a kernel across launches).
fn for_each_launch(mut body: impl FnMut(DType, &str, Case, usize, &str)) {
    for (dtype, suffix) in DTYPES {
        for case in cases() {
            for (k, sched) in SCHEDULES.iter().enumerate() {
                body(dtype, suffix, case, k, sched);
            }
        }
    }
}

#[test]
fn statistics_match_the_cpu_op() {
    for_each_launch(|dtype, suffix, case, _, sched| {
        let x = case.data(1, 3.0, dtype);
        let shift = per_channel(case.c, 2, 2.5, 3.5);
        let want = ops::batch_norm_stats(&x, &shift, case.cl).unwrap();
        let (mut xb, mut kb) = (Buf::of(&x), Buf::of(&shift));
        let name = format!("bn_stats_{}_{suffix}", layout(case.cl));
        let got = reduce(&name, &case, vec![xb.ptr(), kb.ptr()], 3, sched);
        assert_close_rel(
            &format!("{name} {case:?} {sched}"),
            &got,
            &want,
            tol::emulated_reduce(dtype),
        );
    });
}

/// Launches `bn_finalize_<suffix>` on sums `[3, C]` and shift `[C]` (f64), with the running
/// mean, variance and `num_batches_tracked` buffers when given (null pointers otherwise);
/// returns the output rows `[10, C]`.
fn finalize(
    suffix: &str,
    sums: &Tensor,
    shift: &Tensor,
    running: Option<(&mut Buf, &mut Buf, &mut Buf)>,
    momentum: f64,
    eps: f64,
    sched: &str,
) -> Tensor {
    let c = shift.elem_count();
    let (mut sb, mut kb) = (Buf::of(sums), Buf::of(shift));
    let mut out = Buf::poisoned(DType::F64, &[10, c]);
    let mut args = vec![sb.ptr(), kb.ptr(), out.ptr()];
    match running {
        Some((m, v, b)) => args.extend([m.ptr(), v.ptr(), b.ptr()]),
        None => args.extend([null(), null(), null()]),
    }
    args.extend([Arg::F64(momentum), Arg::F64(eps), Arg::I64(c as i64)]);
    let name = format!("bn_finalize_{suffix}");
    run(&name, &launch::finalize(c).unwrap(), args, sched);
    out.tensor()
}

#[test]
fn finalize_matches_gather_stats_and_the_blend_weight() {
    let (eps, momentum) = (1e-5, 0.1);
    // The CPU finalize (which `batch_norm_gather_stats` runs) errors on n ≤ 1: those counts are
    // checked against the documented values directly.
    for (c, n, hw) in [
        (1usize, 3, 5),
        (3, 3, 5),
        (65, 2, 7),
        (300, 3, 5),
        (4, 1, 1),
        (4, 0, 3),
    ] {
        let case = Case {
            n,
            c,
            hw,
            cl: false,
        };
        let x = case.data(3, 7.0, DType::F64);
        let shift = per_channel(c, 4, 6.5, 7.5);
        let sums = ops::batch_norm_stats(&x, &shift, false).unwrap();
        let got = finalize("f64", &sums, &shift, None, momentum, eps, "random:3");
        let row = |i: usize| got.get(i).unwrap();
        let count = (n * hw) as f64;
        assert_close_rel(
            "count",
            &row(0),
            &Tensor::full(count, c, &Device::Cpu).unwrap(),
            0.0,
        );
        if count > 1.0 {
            let st = ops::batch_norm_gather_stats(&sums, &shift, eps).unwrap();
            for (i, want, what) in [
                (1, &st.mean, "mean"),
                (2, &st.invstd, "invstd"),
                (3, &st.var, "var"),
                (4, &st.var_unbiased, "var_unbiased"),
            ] {
                assert_close_rel(
                    &format!("bn_finalize_f64 {what} C={c}"),
                    &row(i),
                    want,
                    1e-12,
                );
            }
            let w = Tensor::full(momentum, c, &Device::Cpu).unwrap();
            assert_close_rel("blend weight", &row(5), &w, 0.0);
            // Finite batch: the next shift is the mean, the running variance's target the
            // unbiased variance.
            assert_close_rel("next shift", &row(6), &row(1), 0.0);
            assert_close_rel("running-variance target", &row(7), &row(4), 0.0);
        } else {
            let v = row(2).to_vec1::<f64>().unwrap();
            if count == 1.0 {
                assert!(v.iter().all(|v| v.is_nan()), "n = 1: invstd NaN, got {v:?}");
            } else {
                assert!(v.iter().all(|&v| v == 1.0), "n = 0: invstd 1, got {v:?}");
                assert_close_rel("n = 0: mean is the shift", &row(1), &shift, 0.0);
            }
            let zeros = Tensor::zeros(c, DType::F64, &Device::Cpu).unwrap();
            assert_close_rel("n ≤ 1: unbiased var 0", &row(4), &zeros, 0.0);
            assert_close_rel("n ≤ 1: blend weight 0", &row(5), &zeros, 0.0);
        }
    }
}

/// Channels whose sums hold NaN (channel 1) or Inf (channel 2): blend weight 0, the next shift
/// is the old shift, the running-variance target 0; channel 0 (finite) as usual. The CPU twin
/// is checked through the layer in `tests/non_finite.rs`.
#[test]
fn finalize_holds_a_non_finite_channel() {
    let (eps, momentum) = (1e-5, 0.1);
    let sums = Tensor::new(
        &[
            [12f64, 12.0, 12.0],
            [3.0, f64::NAN, 3.0],
            [40.0, 40.0, f64::INFINITY],
        ],
        &Device::Cpu,
    )
    .unwrap();
    let shift = Tensor::new(&[1.5f64, -2.0, 0.25], &Device::Cpu).unwrap();
    let got = finalize("f64", &sums, &shift, None, momentum, eps, "random:3")
        .to_vec2::<f64>()
        .unwrap();
    let (mean0, unbiased0) = (1.5 + 3.0 / 12.0, (40.0 - 3.0 * 3.0 / 12.0) / 11.0);
    assert_eq!(
        [got[5][0], got[6][0], got[7][0]],
        [momentum, mean0, unbiased0]
    );
    for c in [1, 2] {
        assert_eq!(
            [got[5][c], got[6][c], got[7][c]],
            [0.0, [1.5, -2.0, 0.25][c], 0.0],
            "channel {c}"
        );
    }
    assert!(
        got[1][1].is_nan() && !got[3][2].is_finite(),
        "the batch rows still show the bad data"
    );
}

/// The running statistics in every dtype, updated in place by `bn_finalize_<dtype>` over two
/// blocks of channels (C = 300): the new values are `old + w·(target − old)` in f64 stored
/// through f32 (an independent host computation from the kernel's own rows), the old ones
/// land in rows 8 and 9, a channel whose sums hold NaN keeps its values bitwise, and
/// `num_batches_tracked` grows by exactly 1.
#[test]
fn finalize_updates_the_running_statistics_in_place() {
    let (eps, momentum, c) = (1e-5, 0.1, 300usize);
    let case = Case {
        n: 3,
        c,
        hw: 5,
        cl: false,
    };
    let x = case.data(13, 4.0, DType::F64);
    let shift = per_channel(c, 14, 3.5, 4.5);
    let mut sums = ops::batch_norm_stats(&x, &shift, false)
        .unwrap()
        .to_vec2::<f64>()
        .unwrap();
    sums[1][7] = f64::NAN;
    let sums = Tensor::new(sums, &Device::Cpu).unwrap();
    for (dtype, suffix) in DTYPES {
        let old_mean = per_channel(c, 15, 3.0, 5.0).to_dtype(dtype).unwrap();
        let old_var = per_channel(c, 16, 0.5, 2.0).to_dtype(dtype).unwrap();
        let (mut mb, mut vb) = (Buf::of(&old_mean), Buf::of(&old_var));
        let mut bb = Buf::of(&Tensor::new(&[41i64], &Device::Cpu).unwrap());
        let name = format!("bn_finalize_{suffix}");
        let running = Some((&mut mb, &mut vb, &mut bb));
        let rows = finalize(suffix, &sums, &shift, running, momentum, eps, "random:5")
            .to_vec2::<f64>()
            .unwrap();
        let as_f64 = |t: &Tensor| t.to_dtype(DType::F64).unwrap().to_vec1::<f64>().unwrap();
        let (m0, v0) = (as_f64(&old_mean), as_f64(&old_var));
        let (m1, v1) = (as_f64(&mb.tensor()), as_f64(&vb.tensor()));
        let stored = |v: f64| {
            let t = Tensor::new(&[v], &Device::Cpu).unwrap();
            let t = if dtype == DType::F64 {
                t
            } else {
                t.to_dtype(DType::F32).unwrap().to_dtype(dtype).unwrap()
            };
            as_f64(&t)[0]
        };
        for j in 0..c {
            assert_eq!(
                [rows[8][j], rows[9][j]],
                [m0[j], v0[j]],
                "{name} old rows, channel {j}"
            );
            let w = rows[5][j];
            let want_m = stored(m0[j] + (rows[6][j] - m0[j]) * w);
            let want_v = stored(v0[j] + (rows[7][j] - v0[j]) * w);
            assert_eq!([m1[j], v1[j]], [want_m, want_v], "{name} channel {j}");
            if j == 7 {
                assert_eq!(
                    [w, m1[j], v1[j]],
                    [0.0, m0[j], v0[j]],
                    "{name}: NaN channel held"
                );
            } else {
                assert_eq!(w, momentum, "{name} channel {j}");
                // (A step can round back to the old value in f16/bf16.)
                if matches!(dtype, DType::F32 | DType::F64) {
                    assert_ne!(m1[j], m0[j], "{name}: channel {j} moved");
                }
            }
        }
        let batches = bb.tensor().to_vec1::<i64>().unwrap();
        assert_eq!(batches, [42], "{name}: num_batches_tracked");
    }
}

#[test]
fn apply_matches_the_cpu_op() {
    for_each_launch(|dtype, suffix, case, k, sched| {
        // Alternate the optional parts across schedules: residual, ReLU, parameters.
        let (residual, relu, affine) = (k != 1, k != 0, k != 2);
        let x = case.data(7, 2.0, dtype);
        let z = case.data(8, 0.0, dtype);
        let mean = per_channel(case.c, 9, 1.5, 2.5);
        let invstd = per_channel(case.c, 10, 0.5, 2.0);
        let w = per_channel(case.c, 11, 0.5, 1.5)
            .to_dtype(acc(dtype))
            .unwrap();
        let b = per_channel(case.c, 12, -0.5, 0.5)
            .to_dtype(acc(dtype))
            .unwrap();
        let want = ops::batch_norm_elemt(
            &x,
            &mean,
            &invstd,
            affine.then_some(&w),
            affine.then_some(&b),
            residual.then_some(&z),
            relu,
            case.cl,
        )
        .unwrap();
        let Some(cfg) = launch::elementwise(case.n, case.c, case.hw, case.cl) else {
            assert_eq!(want.elem_count(), 0);
            return;
        };
        let params = Tensor::stack(&[&w, &b], 0).unwrap();
        let (mut xb, mut zb, mut mb, mut ib, mut pb) = (
            Buf::of(&x),
            Buf::of(&z),
            Buf::of(&mean),
            Buf::of(&invstd),
            Buf::of(&params),
        );
        let mut y = Buf::poisoned(dtype, &case.dims());
        let mut args = vec![
            xb.ptr(),
            if residual { zb.ptr() } else { null() },
            mb.ptr(),
            ib.ptr(),
            if affine { pb.ptr() } else { null() },
            y.ptr(),
        ];
        args.extend(case.sizes());
        args.push(Arg::I32(relu as i32));
        let name = format!("bn_apply_{}_{suffix}", layout(case.cl));
        run(&name, &cfg, args, sched);
        assert_close_rel(
            &format!("{name} {case:?} {sched}"),
            &y.tensor(),
            &want,
            tol::emulated_elem(dtype),
        );
    });
}

#[test]
fn backward_reduce_matches_the_cpu_op() {
    for_each_launch(|dtype, suffix, case, k, sched| {
        let relu = k != 1;
        let dy = case.data(13, 0.0, dtype);
        let x = case.data(14, 1.0, dtype);
        // A fused-ReLU output whose sign varies: y = x − 1 (mean 0).
        let y = case.data(14, 0.0, dtype);
        let mean = per_channel(case.c, 15, 0.5, 1.5);
        let want =
            ops::batch_norm_backward_reduce(&dy, &x, &mean, relu.then_some(&y), case.cl).unwrap();
        let (mut db, mut xb, mut yb, mut mb) =
            (Buf::of(&dy), Buf::of(&x), Buf::of(&y), Buf::of(&mean));
        let inputs = vec![
            db.ptr(),
            xb.ptr(),
            if relu { yb.ptr() } else { null() },
            mb.ptr(),
        ];
        let name = format!("bn_backward_reduce_{}_{suffix}", layout(case.cl));
        let got = reduce(&name, &case, inputs, 2, sched);
        assert_close_rel(
            &format!("{name} {case:?} {sched}"),
            &got,
            &want,
            tol::emulated_reduce(dtype),
        );
    });
}

#[test]
fn backward_elemt_matches_the_cpu_op() {
    for_each_launch(|dtype, suffix, case, k, sched| {
        let (relu, want_dz, affine) = (k != 1, k != 2, k != 0);
        let dy = case.data(16, 0.0, dtype);
        let x = case.data(17, 1.0, dtype);
        let y = case.data(17, 0.0, dtype);
        let mean = per_channel(case.c, 18, 0.5, 1.5);
        let invstd = per_channel(case.c, 19, 0.5, 2.0);
        let w = per_channel(case.c, 20, 0.5, 1.5)
            .to_dtype(acc(dtype))
            .unwrap();
        let sums = Tensor::stack(
            &[
                per_channel(case.c, 21, -5.0, 5.0),
                per_channel(case.c, 22, -5.0, 5.0),
            ],
            0,
        )
        .unwrap();
        let count = 37.0;
        let counts = Tensor::full(count, case.c, &Device::Cpu).unwrap();
        let (dx_want, dz_want) = ops::batch_norm_backward_elemt(
            &dy,
            &x,
            &mean,
            &invstd,
            affine.then_some(&w),
            &sums,
            &counts,
            relu.then_some(&y),
            want_dz,
            case.cl,
        )
        .unwrap();
        let Some(cfg) = launch::elementwise(case.n, case.c, case.hw, case.cl) else {
            assert_eq!(dx_want.elem_count(), 0);
            return;
        };
        let (mut db, mut xb, mut yb, mut mb, mut ib, mut wb, mut sb, mut cb) = (
            Buf::of(&dy),
            Buf::of(&x),
            Buf::of(&y),
            Buf::of(&mean),
            Buf::of(&invstd),
            Buf::of(&w),
            Buf::of(&sums),
            Buf::of(&counts),
        );
        let mut dx = Buf::poisoned(dtype, &case.dims());
        let mut dz = Buf::poisoned(dtype, &case.dims());
        let mut args = vec![
            db.ptr(),
            xb.ptr(),
            if relu { yb.ptr() } else { null() },
            mb.ptr(),
            ib.ptr(),
            if affine { wb.ptr() } else { null() },
            sb.ptr(),
            cb.ptr(),
            dx.ptr(),
            if want_dz { dz.ptr() } else { null() },
        ];
        args.extend(case.sizes());
        let name = format!("bn_backward_elemt_{}_{suffix}", layout(case.cl));
        run(&name, &cfg, args, sched);
        let what = format!("{name} {case:?} {sched}");
        assert_close_rel(
            &format!("{what} dx"),
            &dx.tensor(),
            &dx_want,
            tol::emulated_elem(dtype),
        );
        match dz_want {
            Some(dz_want) => assert_close_rel(
                &format!("{what} dz"),
                &dz.tensor(),
                &dz_want,
                tol::emulated_elem(dtype),
            ),
            // Without a ReLU the CPU op leaves dz = dy to the caller.
            None if want_dz => assert_close_rel(&format!("{what} dz"), &dz.tensor(), &dy, 0.0),
            None => {}
        }
    });
}

/// `max_pool2d_{fwd,bwd}_*` against the CPU op (`ops::max_pool2d` and its backward), bitwise:
/// both pick the same element of every window and sum the same gradients in the same order.
/// Values on a coarse grid so that windows are full of ties; shapes with padding, gaps, a
/// 1-pixel-wide plane, an empty batch, and more elements than one grid-stride sweep covers.
#[test]
fn max_pool_matches_the_cpu_op() {
    for (dims, (k, s, p)) in [
        ([2usize, 3, 7, 8], (3usize, 2usize, 1usize)),
        ([1, 2, 6, 5], (3, 1, 1)),
        ([1, 1, 3, 1], (2, 3, 1)),
        ([2, 2, 5, 5], (2, 2, 0)),
        ([0, 2, 5, 5], (3, 2, 1)),
        ([1, 1, 130, 130], (3, 2, 1)),
    ] {
        let (oh, ow) = ((dims[2] + 2 * p - k) / s + 1, (dims[3] + 2 * p - k) / s + 1);
        let odims = [dims[0], dims[1], oh, ow];
        let grid = |d: &[usize]| {
            Tensor::from_vec(
                (0..d.iter().product::<usize>())
                    .map(|i| ((i * 7919 + 13) % 5) as f64 - 2.0)
                    .collect::<Vec<_>>(),
                d,
                &Device::Cpu,
            )
            .unwrap()
        };
        for (dtype, suffix) in DTYPES {
            let x = grid(&dims).to_dtype(dtype).unwrap();
            let dy = (grid(&odims) * 0.25).unwrap().to_dtype(dtype).unwrap();
            let xv = candle_core::Var::from_tensor(&x).unwrap();
            let y_cpu = ops::max_pool2d(xv.as_tensor(), k, s, p).unwrap();
            let g = (&y_cpu * &dy)
                .unwrap()
                .sum_all()
                .unwrap()
                .backward()
                .unwrap();
            let dx_cpu = g.get(xv.as_tensor()).unwrap().clone();
            // (planes, h, w, oh, ow) as long long, then (k, s, p) as int.
            let geometry = || {
                [dims[0] * dims[1], dims[2], dims[3], oh, ow]
                    .map(|v| Arg::I64(v as i64))
                    .into_iter()
                    .chain([k, s, p].map(|v| Arg::I32(v as i32)))
            };
            // The launch the CUDA path makes, and one block that must loop over everything.
            let one_block = |total: usize| {
                launch::grid_stride(total).map(|mut l| {
                    l.grid = [1, 1, 1];
                    l
                })
            };
            for sched in SCHEDULES {
                for grid in [launch::grid_stride, one_block] {
                    let (mut xb, mut dyb) = (Buf::of(&x), Buf::of(&dy));
                    let mut yb = Buf::poisoned(dtype, &odims);
                    let mut dxb = Buf::poisoned(dtype, &dims);
                    let what = format!("{dims:?} (k, s, p) = {:?} {dtype:?} {sched}", (k, s, p));
                    if let Some(l) = grid(odims.iter().product()) {
                        let mut args = vec![xb.ptr(), yb.ptr()];
                        args.extend(geometry());
                        run(&format!("max_pool2d_fwd_{suffix}"), &l, args, sched);
                        assert_close_rel(&format!("forward {what}"), &yb.tensor(), &y_cpu, 0.0);
                    }
                    if let Some(l) = grid(dims.iter().product()) {
                        let mut args = vec![xb.ptr(), dyb.ptr(), dxb.ptr()];
                        args.extend(geometry());
                        run(&format!("max_pool2d_bwd_{suffix}"), &l, args, sched);
                        assert_close_rel(&format!("backward {what}"), &dxb.tensor(), &dx_cpu, 0.0);
                    }
                }
            }
        }
    }
}

#[test]
fn every_entry_point_is_launched_by_a_test() {
    let tested: BTreeSet<String> = ROOTS
        .iter()
        .flat_map(|r| DTYPES.iter().map(move |(_, s)| format!("{r}_{s}")))
        .chain(SINGLE.iter().map(|s| s.to_string()))
        .collect();
    let kernels: BTreeSet<String> = registered()
        .into_iter()
        .filter(|n| !n.starts_with("emu_selftest_"))
        .collect();
    assert_eq!(
        kernels, tested,
        "entry points in kernels/ vs those the tests launch"
    );
    // Every `extern "C"` stamp macro in the sources is one of the roots above.
    let root = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("kernels");
    for entry in std::fs::read_dir(root).unwrap() {
        let text = std::fs::read_to_string(entry.unwrap().path()).unwrap();
        for line in text.lines().filter(|l| l.contains("__global__ void")) {
            let name = line
                .split("void")
                .nth(1)
                .unwrap()
                .trim()
                .split(['#', '('])
                .next()
                .unwrap();
            let root = name.trim_end_matches('_');
            assert!(
                ROOTS.contains(&root) || SINGLE.contains(&name),
                "kernel {name} is not tested"
            );
        }
    }
}
