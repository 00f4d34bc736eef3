//! With the `cuda` feature: compiles every `kernels/*.cu` with nvcc into a fatbin holding
//! machine code (SASS) for sm_80 and sm_90, and for `CUDA_COMPUTE_CAP` when it names another
//! architecture, plus PTX of the newest of them for GPUs that are newer still; writes
//! `$OUT_DIR/kernels.rs`, one `pub const <FILE>: &[u8]` image per kernel file. A GPU of a
//! shipped architecture loads its machine code directly: no JIT compilation at start. Without
//! the feature: nothing (the CPU build needs no CUDA toolkit).

fn main() -> anyhow::Result<()> {
    println!("cargo::rerun-if-changed=build.rs");
    #[cfg(feature = "cuda")]
    cuda::build()?;
    Ok(())
}

#[cfg(feature = "cuda")]
mod cuda {
    use std::path::{Path, PathBuf};
    use std::process::Command;

    use anyhow::{bail, Context};

    /// Architectures whose machine code always ships (A100, H100).
    const ALWAYS: [u32; 2] = [80, 90];

    pub fn build() -> anyhow::Result<()> {
        println!("cargo::rerun-if-env-changed=CUDA_COMPUTE_CAP");
        println!("cargo::rerun-if-env-changed=CUDA_PATH");
        println!("cargo::rerun-if-env-changed=NVCC_CCBIN");
        println!("cargo::rerun-if-changed=kernels");
        let archs = archs()?;
        let nvcc = nvcc()?;
        let out_dir = PathBuf::from(std::env::var("OUT_DIR")?);
        let kernels = files("kernels", "cu")?;
        for path in kernels.iter().chain(&files("kernels", "cuh")?) {
            println!("cargo::rerun-if-changed={}", path.display());
        }
        // One nvcc per kernel file, in parallel: the build script reruns only when a kernel
        // source, a header or the architecture list changes, and then rebuilds every image.
        let results: Vec<anyhow::Result<()>> = std::thread::scope(|s| {
            let jobs: Vec<_> = kernels
                .iter()
                .map(|k| s.spawn(|| compile(&nvcc, k, &fatbin_path(&out_dir, k)?, &archs)))
                .collect();
            jobs.into_iter()
                .map(|j| j.join().expect("nvcc thread"))
                .collect()
        });
        for r in results {
            r?;
        }
        let mut consts = format!(
            "/// Architectures with machine code in every image (`sm_XX` as XX); the newest also ships as PTX.\npub const SASS_ARCHS: &[u32] = &{archs:?};\n"
        );
        for k in &kernels {
            let stem = k
                .file_stem()
                .and_then(|s| s.to_str())
                .context("kernel name")?;
            consts.push_str(&format!(
                "/// Fatbin of `kernels/{stem}.cu`.\npub const {}: &[u8] = include_bytes!({:?});\n",
                stem.to_uppercase(),
                fatbin_path(&out_dir, k)?
            ));
        }
        std::fs::write(out_dir.join("kernels.rs"), consts)?;
        Ok(())
    }

    fn fatbin_path(out_dir: &Path, kernel: &Path) -> anyhow::Result<PathBuf> {
        let name = kernel.file_name().context("kernel name")?;
        Ok(out_dir.join(Path::new(name).with_extension("fatbin")))
    }

    /// `nvcc --fatbin` with one `-gencode` per architecture and PTX of the newest.
    fn compile(nvcc: &Path, src: &Path, out: &Path, archs: &[u32]) -> anyhow::Result<()> {
        let newest = archs.iter().max().context("no architecture")?;
        let mut cmd = Command::new(nvcc);
        cmd.args(["--fatbin", "-std=c++17", "-O3", "-Ikernels"]);
        if let Ok(ccbin) = std::env::var("NVCC_CCBIN") {
            cmd.args(["-ccbin", &ccbin]);
        }
        for a in archs {
            cmd.arg(format!("-gencode=arch=compute_{a},code=sm_{a}"));
        }
        cmd.arg(format!(
            "-gencode=arch=compute_{newest},code=compute_{newest}"
        ));
        cmd.arg("-o").arg(out).arg(src);
        let o = cmd
            .output()
            .with_context(|| format!("candle-distributed: running {cmd:?}"))?;
        if !o.status.success() {
            bail!(
                "candle-distributed: nvcc failed on {} ({}):\n{}{}",
                src.display(),
                o.status,
                String::from_utf8_lossy(&o.stdout),
                String::from_utf8_lossy(&o.stderr)
            )
        }
        Ok(())
    }

    /// sm_80 and sm_90, plus `CUDA_COMPUTE_CAP` (e.g. 89 or 120) when set to another one.
    fn archs() -> anyhow::Result<Vec<u32>> {
        let mut archs = ALWAYS.to_vec();
        if let Ok(v) = std::env::var("CUDA_COMPUTE_CAP") {
            let cap: u32 = v.trim().replace('.', "").parse().with_context(|| {
                format!("candle-distributed: CUDA_COMPUTE_CAP={v:?} is not a compute capability such as 80 or 90")
            })?;
            if !archs.contains(&cap) {
                archs.push(cap);
            }
        }
        archs.sort();
        Ok(archs)
    }

    /// nvcc from `CUDA_PATH/bin`, else from `PATH`, with a message that says how to get one.
    fn nvcc() -> anyhow::Result<PathBuf> {
        let nvcc = match std::env::var_os("CUDA_PATH") {
            Some(p) => Path::new(&p).join("bin").join("nvcc"),
            None => PathBuf::from("nvcc"),
        };
        match Command::new(&nvcc).arg("--version").output() {
            Ok(o) if o.status.success() => Ok(nvcc),
            Ok(o) => bail!(
                "candle-distributed: `{} --version` failed ({}): {}",
                nvcc.display(),
                o.status,
                String::from_utf8_lossy(&o.stderr)
            ),
            Err(e) => bail!(
                "candle-distributed: the `cuda` feature needs nvcc ({}: {e}); install a CUDA \
                 toolkit 12 or 13, or the nvidia-cuda-nvcc wheels (see the README's CUDA \
                 section), and set CUDA_PATH or PATH",
                nvcc.display()
            ),
        }
    }

    fn files(dir: &str, ext: &str) -> anyhow::Result<Vec<PathBuf>> {
        let mut out: Vec<PathBuf> = std::fs::read_dir(dir)?
            .filter_map(|e| e.ok().map(|e| e.path()))
            .filter(|p| p.extension().is_some_and(|e| e == ext))
            .collect();
        out.sort();
        Ok(out)
    }
}
