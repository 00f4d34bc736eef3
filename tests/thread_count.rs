//! The CPU kernels' results do not depend on the number of threads candle's worker pool has:
//! this test runs its own binary again with `CANDLE_NUM_THREADS` 1 and 3, each child printing
//! the bits of every op's output on seeded inputs, and compares them.

mod common;

use std::process::Command;

use candle_core::DType;
use candle_distributed::ops;
use common::layout_of;

const CHILD: &str = "CANDLE_DISTRIBUTED_THREAD_COUNT_CHILD";

/// Every op on seeded f32 inputs large enough to run on the pool (over 2^16 values; planes of
/// 3·2^15 values, rows of 96 channels), as one line of hexadecimal bits.
fn fingerprint() -> anyhow::Result<String> {
    let mut out = String::new();
    for (dims, cl) in [
        (&[4usize, 3, 320, 320][..], false),
        (&[8, 40, 40, 96][..], true),
    ] {
        let x = common::randn(1, dims, 2.0, 1.5).to_dtype(DType::F32)?;
        let dy = common::randn(2, dims, 0.0, 1.0).to_dtype(DType::F32)?;
        let c = dims[if cl { 3 } else { 1 }];
        let shift = common::randn(3, &[c], 2.0, 0.1);
        let sums = ops::batch_norm_stats(&x, &shift, layout_of(cl))?;
        let st = ops::batch_norm_gather_stats(&sums, &shift, 1e-5)?;
        let y = ops::batch_norm_elemt(
            &x,
            &st.mean,
            &st.invstd,
            ops::ElemtConfig {
                relu: true,
                layout: layout_of(cl),
                ..Default::default()
            },
        )?;
        let red = ops::batch_norm_backward_reduce(&dy, &x, &st.mean, Some(&y), layout_of(cl))?;
        let (dx, _) = ops::batch_norm_backward_elemt(
            &dy,
            &x,
            &st.mean,
            &st.invstd,
            &red,
            &st.count,
            ops::BackwardElemtConfig {
                relu_output: Some(&y),
                layout: layout_of(cl),
                ..Default::default()
            },
        )?;
        let pooled = ops::max_pool2d(&x.reshape((dims[0], dims[1], dims[2], dims[3]))?, 3, 2, 1)?;
        for t in [&sums, &red] {
            for v in t.flatten_all()?.to_vec1::<f64>()? {
                out.push_str(&format!("{:x} ", v.to_bits()));
            }
        }
        for t in [&y, &dx, &pooled] {
            let v = t.flatten_all()?.to_vec1::<f32>()?;
            let h = v.iter().fold(0u64, |h, v| {
                (h ^ u64::from(v.to_bits())).wrapping_mul(0x0000_0100_0000_01b3)
            });
            out.push_str(&format!("{h:x} "));
        }
    }
    Ok(out)
}

#[test]
fn results_do_not_depend_on_the_thread_count() -> anyhow::Result<()> {
    if std::env::var_os(CHILD).is_some() {
        println!("BITS {}", fingerprint()?);
        return Ok(());
    }
    let run = |threads: &str| -> anyhow::Result<String> {
        let out = Command::new(std::env::current_exe()?)
            .args([
                "--exact",
                "results_do_not_depend_on_the_thread_count",
                "--nocapture",
            ])
            .env(CHILD, "1")
            .env("CANDLE_NUM_THREADS", threads)
            .output()?;
        let text = String::from_utf8(out.stdout)?;
        anyhow::ensure!(
            out.status.success(),
            "child with {threads} threads failed: {text}"
        );
        let line = text
            .lines()
            .find(|l| l.starts_with("BITS "))
            .unwrap_or_default();
        anyhow::ensure!(
            line.len() > 100,
            "child with {threads} threads printed no bits: {text}"
        );
        Ok(line.to_string())
    };
    let (one, three) = (run("1")?, run("3")?);
    assert!(one == three, "1 thread and 3 threads differ");
    Ok(())
}
