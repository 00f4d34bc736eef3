//! A bucket of 40 variables of which each rank uses some (`tests/data_parallel.rs` on thread
//! ranks, `tests/nccl.rs` over NCCL): rank `r` uses variable `i` unless `(i + r) % 3 == 0`
//! (the last variable no rank uses), with loss `Σ (r + 1)/4 · w_i²`, so gradient
//! `(r + 1)/2 · w_i`; values are multiples of a quarter, exact in f32 before the average.

use anyhow::Result;
use candle_core::{DType, Device, Tensor, Var};

pub const VARS: usize = 40;

/// Whether rank `r` uses variable `i`.
pub fn used(r: usize, i: usize) -> bool {
    i != VARS - 1 && !(i + r).is_multiple_of(3)
}

/// Variable `i`'s values (1 to 23 of them).
pub fn values(i: usize) -> Vec<f64> {
    (0..1 + i * 5 % 23)
        .map(|j| ((i * 7 + j * 3) % 11) as f64 - 5.25)
        .collect()
}

/// The variables, named `v0`, `v1`, …, in `dtype` on `dev`.
pub fn vars(dtype: DType, dev: &Device) -> Result<Vec<(String, Var)>> {
    (0..VARS)
        .map(|i| {
            let t = Tensor::new(values(i), dev)?.to_dtype(dtype)?;
            Ok((format!("v{i}"), Var::from_tensor(&t)?))
        })
        .collect()
}

/// Rank `r`'s loss over `vars`.
pub fn loss(vars: &[(String, Var)], r: usize) -> Result<Tensor> {
    let v0 = vars[0].1.as_tensor();
    let mut loss = Tensor::zeros((), v0.dtype(), v0.device())?;
    for (i, (_, v)) in vars.iter().enumerate() {
        if used(r, i) {
            let half_sq = (v.as_tensor().sqr()? * (0.25 * (r + 1) as f64))?;
            loss = (loss + half_sq.sum_all()?)?;
        }
    }
    Ok(loss)
}

/// `got[rank][i]`: variable `i`'s averaged gradient on `rank` (as f64), against the mean over
/// the `world` ranks (zero where a rank has none), relative tolerance `tol`; the variable no rank
/// uses must have none.
pub fn check(what: &str, got: &[Vec<Option<Vec<f64>>>], world: usize, tol: f64) {
    for (rank, got) in got.iter().enumerate() {
        for (i, g) in got.iter().enumerate() {
            let what = format!("{what}, rank {rank}, variable {i}");
            if i == VARS - 1 {
                assert!(g.is_none(), "{what}: unused everywhere, yet a gradient");
                continue;
            }
            let g = g.as_ref().unwrap_or_else(|| panic!("{what}: no gradient"));
            let k: f64 = (0..world)
                .filter(|&r| used(r, i))
                .map(|r| 0.5 * (r + 1) as f64)
                .sum();
            let want: Vec<f64> = values(i).iter().map(|v| k * v / world as f64).collect();
            assert_eq!(g.len(), want.len(), "{what}");
            for (a, b) in g.iter().zip(&want) {
                assert!(
                    (a - b).abs() <= tol * b.abs().max(1.0),
                    "{what}: {a} vs {b}"
                );
            }
        }
    }
}
