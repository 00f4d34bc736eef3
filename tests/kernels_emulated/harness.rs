//! The harness: the emulator library (built once per test process), kernel arguments, host
//! buffers standing in for device memory, the test shapes and the launch loop.

use std::collections::BTreeSet;
use std::ffi::{c_char, c_void, CString};
use std::path::PathBuf;
use std::process::Command;
use std::sync::OnceLock;

use candle_core::{DType, Device, Tensor};
use candle_distributed::args::{Arg, Buffer, Call, Geometry, KernelGeometry, Scratch};
use rand::{Rng, SeedableRng};

/// Orders in which the emulator resumes a block's threads between barriers.
pub const SCHEDULES: [&str; 3] = ["forward", "reverse", "random:7"];
/// Storage types of the entry points, with their suffix.
pub const DTYPES: [(DType, &str); 4] = [
    (DType::F32, "f32"),
    (DType::F64, "f64"),
    (DType::F16, "f16"),
    (DType::BF16, "bf16"),
];
/// Entry points with a single dtype, each launched by a test (none today).
pub const SINGLE: [&str; 0] = [];
/// Kernel roots stamped for every dtype; every `<root>_<suffix>` must be launched by a test.
pub const ROOTS: [&str; 12] = [
    "pack",
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

pub struct Emu {
    lib: libloading::Library,
}

type LaunchFn = unsafe extern "C" fn(
    *const c_char,
    *const u32,
    *const u32,
    usize,
    *mut *mut c_void,
    *const c_char,
    *const c_char,
    *mut c_char,
    usize,
) -> i32;
type NamesFn = unsafe extern "C" fn(*mut c_char, usize) -> usize;

pub fn emu() -> &'static Emu {
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

/// The emulator's letter for an argument (`param_code` in `tests/emu/cuda_emu.h`).
fn code(arg: &Arg) -> char {
    match arg {
        Arg::Ptr(_) => 'p',
        Arg::I64(_) => 'l',
        Arg::I32(_) => 'i',
        Arg::F64(_) => 'd',
    }
}

/// Where the emulator reads one argument from (as cuLaunchKernel takes them: the address of
/// each parameter's value).
fn addr(arg: &mut Arg) -> *mut c_void {
    match arg {
        Arg::Ptr(p) => p as *mut u64 as *mut c_void,
        Arg::I64(v) => v as *mut i64 as *mut c_void,
        Arg::I32(v) => v as *mut i32 as *mut c_void,
        Arg::F64(v) => v as *mut f64 as *mut c_void,
    }
}

/// Runs `call`, as built by `candle_distributed::args` for the CUDA path, under `schedule`.
pub fn run(call: &Call, schedule: &str) {
    let e = emu();
    let name = &call.name;
    let mut args = call.args.clone();
    let mut ptrs: Vec<*mut c_void> = args.iter_mut().map(addr).collect();
    let (cname, csched) = (
        CString::new(name.as_str()).unwrap(),
        CString::new(schedule).unwrap(),
    );
    let csig = CString::new(call.args.iter().map(code).collect::<String>()).unwrap();
    let cfg = &call.launch;
    let mut err = vec![0 as c_char; 1024];
    // SAFETY: `emu_launch` has the signature of `LaunchFn` (tests/emu/emu.cpp); it reads the
    // arguments only after checking their kinds and number (`csig`) against the kernel's
    // parameters; the argument pointers point at live values of those types (the list the
    // CUDA path launches), and every buffer holds what the launch touches (checked by the
    // builder).
    let rc = unsafe {
        let f: libloading::Symbol<LaunchFn> = e.lib.get(b"emu_launch").unwrap();
        f(
            cname.as_ptr(),
            cfg.grid.as_ptr(),
            cfg.block.as_ptr(),
            cfg.shared_mem_bytes as usize,
            ptrs.as_mut_ptr(),
            csig.as_ptr(),
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

pub fn registered() -> BTreeSet<String> {
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
pub struct Buf {
    pub bytes: Vec<u8>,
    pub dtype: DType,
    pub dims: Vec<usize>,
}

impl Buf {
    pub fn of(t: &Tensor) -> Self {
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
    pub fn poisoned(dtype: DType, dims: &[usize]) -> Self {
        let len: usize = dims.iter().product();
        Self {
            bytes: vec![0xFF; len * dtype.size_in_bytes()],
            dtype,
            dims: dims.to_vec(),
        }
    }

    pub fn zeros_u32(len: usize) -> Self {
        Self {
            bytes: vec![0; 4 * len.max(1)],
            dtype: DType::U32,
            dims: vec![len.max(1)],
        }
    }

    /// The buffer as a kernel receives it: its address and its length in elements. Buffers of
    /// 16 bytes or more come from malloc, 16-byte aligned on our platforms, so the kernels'
    /// 16-byte paths run; asserted, so that they cannot silently fall back to the scalar path.
    pub fn buffer(&mut self) -> Buffer {
        let p = self.bytes.as_mut_ptr();
        assert!(
            self.bytes.len() < 16 || (p as usize).is_multiple_of(16),
            "test buffer not 16-byte aligned"
        );
        Buffer {
            addr: p as u64,
            len: self.bytes.len() / self.dtype.size_in_bytes(),
        }
    }

    pub fn tensor(&self) -> Tensor {
        Tensor::from_raw_buffer(&self.bytes, self.dtype, &self.dims, &Device::Cpu).unwrap()
    }
}

// ------------------------------------------------------------------------------ inputs

/// One test shape: `(n, c, hw)` in a layout.
#[derive(Debug, Clone, Copy)]
pub struct Case {
    pub n: usize,
    pub c: usize,
    pub hw: usize,
    pub cl: bool,
}

impl Case {
    pub fn dims(&self) -> Vec<usize> {
        if self.cl {
            vec![self.n, self.hw, self.c]
        } else {
            vec![self.n, self.c, self.hw]
        }
    }

    /// The case as the kernels see it (planes even when `hw` is 1: the emulation runs both
    /// kernel forms, where the CUDA path picks rows for contiguous channels).
    pub fn extent(&self) -> Geometry {
        Geometry {
            n: self.n,
            c: self.c,
            s: self.hw,
            layout: crate::common::layout_of(self.cl),
        }
    }

    /// Seeded values of mean `mean` and spread about 1, rounded to `dtype`.
    pub fn data(&self, seed: u64, mean: f64, dtype: DType) -> Tensor {
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
pub fn cases() -> Vec<Case> {
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
pub fn per_channel(c: usize, seed: u64, lo: f64, hi: f64) -> Tensor {
    let mut rng = rand::rngs::StdRng::seed_from_u64(seed);
    let v: Vec<f64> = (0..c).map(|_| rng.gen_range(lo..hi)).collect();
    Tensor::from_vec(v, c, &Device::Cpu).unwrap()
}

/// The dtype of the per-channel parameters the kernels take (f64 for f64 inputs, else f32).
pub fn acc(dtype: DType) -> DType {
    if dtype == DType::F64 {
        DType::F64
    } else {
        DType::F32
    }
}

// ------------------------------------------------------------------------------ the tests

/// Runs the reduction `call(out, scratch)` builds twice on the same counters (they must be
/// left at zero) and returns its name and output `[rows, C]`.
pub fn reduce(
    case: &Case,
    rows: usize,
    sched: &str,
    mut call: impl FnMut(Buffer, Scratch) -> Call,
) -> (String, Tensor) {
    let r = case.extent().reduction().unwrap();
    let mut counters = Buf::zeros_u32(r.counters);
    let mut work = Buf::poisoned(DType::F64, &[r.work_len.max(1)]);
    let mut first: Option<(String, Tensor)> = None;
    for _ in 0..2 {
        let mut out = Buf::poisoned(DType::F64, &[rows, case.c]);
        let scratch = Scratch {
            work: work.buffer(),
            counters: counters.buffer(),
        };
        let c = call(out.buffer(), scratch);
        run(&c, sched);
        let t = out.tensor();
        if let Some((_, f)) = &first {
            assert_eq!(
                crate::common::max_abs_diff(f, &t),
                0.0,
                "{}: a second launch differs",
                c.name
            );
        }
        first = Some((c.name, t));
    }
    let (name, out) = first.unwrap();
    assert!(
        counters.bytes.iter().all(|&b| b == 0),
        "{name}: counters not reset"
    );
    (name, out)
}

/// Runs `body(dtype, case, k, schedule)` for every dtype, test shape and schedule (`k` indexes
/// the schedule, used to vary the optional parts of a kernel across launches).
pub fn for_each_launch(mut body: impl FnMut(DType, Case, usize, &str)) {
    for (dtype, _) in DTYPES {
        for case in cases() {
            for (k, sched) in SCHEDULES.iter().enumerate() {
                body(dtype, case, k, sched);
            }
        }
    }
}
