//! With the `cuda` feature: compiles `kernels/*.cu` to PTX with nvcc (through bindgen_cuda) and
//! writes `$OUT_DIR/ptx.rs`, one `pub const <FILE>: &str` of PTX per kernel file. Without it:
//! nothing (the CPU build needs no CUDA toolkit).

fn main() -> anyhow::Result<()> {
    println!("cargo::rerun-if-changed=build.rs");
    #[cfg(feature = "cuda")]
    cuda::build()?;
    Ok(())
}

#[cfg(feature = "cuda")]
mod cuda {
    use std::path::{Path, PathBuf};
    use std::time::SystemTime;

    use anyhow::{bail, Context};

    pub fn build() -> anyhow::Result<()> {
        println!("cargo::rerun-if-env-changed=CUDA_COMPUTE_CAP");
        println!("cargo::rerun-if-env-changed=CUDA_PATH");
        println!("cargo::rerun-if-changed=kernels");
        let cap = compute_cap()?;
        check_nvcc()?;
        let out_dir = PathBuf::from(std::env::var("OUT_DIR")?);
        let kernels = files("kernels", "cu")?;
        let headers = files("kernels", "cuh")?;
        for path in kernels.iter().chain(&headers) {
            println!("cargo::rerun-if-changed={}", path.display());
        }
        // bindgen_cuda recompiles a `.cu` only when it is newer than its PTX: a header edit alone
        // would leave stale PTX, so drop every PTX older than the newest header.
        let newest_header = headers.iter().filter_map(|h| modified(h)).max();
        for k in &kernels {
            let ptx = out_dir.join(k.with_extension("ptx").file_name().context("kernel name")?);
            if let (Some(h), Some(p)) = (newest_header, modified(&ptx)) {
                if h > p {
                    std::fs::remove_file(&ptx)?;
                }
            }
        }
        bindgen_cuda::Builder::default()
            .kernel_paths(kernels.clone())
            .include_paths(headers)
            .compute_cap(cap)
            .arg("-std=c++17")
            .arg("-O3")
            .arg("-Ikernels")
            .build_ptx()
            .map_err(|e| anyhow::anyhow!("nvcc failed on kernels/*.cu: {e:?}"))?;
        let mut consts = String::new();
        for k in &kernels {
            let stem = k
                .file_stem()
                .and_then(|s| s.to_str())
                .context("kernel name")?;
            consts.push_str(&format!(
                "/// PTX of `kernels/{stem}.cu`.\npub const {}: &str = include_str!(concat!(env!(\"OUT_DIR\"), \"/{stem}.ptx\"));\n",
                stem.to_uppercase()
            ));
        }
        std::fs::write(out_dir.join("ptx.rs"), consts)?;
        Ok(())
    }

    /// `CUDA_COMPUTE_CAP` as a number (80 for sm_80); required, with a message that says how.
    fn compute_cap() -> anyhow::Result<usize> {
        match std::env::var("CUDA_COMPUTE_CAP") {
            Ok(v) => v.trim().replace('.', "").parse().with_context(|| {
                format!("candle-distributed: CUDA_COMPUTE_CAP={v:?} is not a compute capability such as 80 or 90")
            }),
            Err(_) => bail!(
                "candle-distributed: the `cuda` feature needs CUDA_COMPUTE_CAP, the GPU's compute \
                 capability without the dot (80 for A100, 90 for H100; `nvidia-smi \
                 --query-gpu=compute_cap --format=csv` prints it)"
            ),
        }
    }

    fn check_nvcc() -> anyhow::Result<()> {
        match std::process::Command::new("nvcc").arg("--version").output() {
            Ok(o) if o.status.success() => Ok(()),
            Ok(o) => bail!(
                "candle-distributed: `nvcc --version` failed ({}): {}",
                o.status,
                String::from_utf8_lossy(&o.stderr)
            ),
            Err(e) => bail!(
                "candle-distributed: the `cuda` feature needs nvcc on PATH (CUDA toolkit 12 or \
                 13, or the nvidia-cuda-nvcc wheels; see the README's CUDA section): {e}"
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

    fn modified(p: &Path) -> Option<SystemTime> {
        std::fs::metadata(p).and_then(|m| m.modified()).ok()
    }
}
