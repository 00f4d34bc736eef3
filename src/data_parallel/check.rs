//! The check that every rank builds the same model: one all-gather of a fingerprint; where
//! they differ, each rank's variables in words, so that the error names what differs.

use candle_core::{bail, Device, Result, Tensor, Var};

use candle_collective::Collective;

/// Errors on every rank unless every rank has the same variable names, shapes and dtypes.
pub(super) fn same_model(
    comm: &dyn Collective,
    all: &[(String, Var)],
    trainable: &[(String, Var)],
    device: &Device,
) -> Result<()> {
    // FNV-1a over names, dims and dtypes, then the trainable names; compared through an
    // all-gather with each rank's count of trainable variables missing from `all`, so that
    // every rank sees every verdict and fails alike.
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    let mut eat = |bytes: &[u8]| {
        for &b in bytes {
            h = (h ^ u64::from(b)).wrapping_mul(0x0000_0100_0000_01b3);
        }
    };
    for (name, v) in all {
        eat(name.as_bytes());
        for &d in v.dims() {
            eat(&(d as u64).to_le_bytes());
        }
        eat(v.dtype().as_str().as_bytes());
    }
    eat(b"\0trainable");
    for (name, _) in trainable {
        eat(name.as_bytes());
        eat(b"\0");
    }
    // A trainable variable must be one of `all` (the same variable under the same name), or
    // rank 0 would never broadcast it and the replicas would start apart.
    let known: std::collections::HashSet<(&str, candle_core::TensorId)> = all
        .iter()
        .map(|(n, v)| (n.as_str(), v.as_tensor().id()))
        .collect();
    let stray: Vec<&str> = trainable
        .iter()
        .filter(|(name, v)| !known.contains(&(name.as_str(), v.as_tensor().id())))
        .map(|(name, _)| name.as_str())
        .collect();
    let mine = Tensor::new(
        &[[all.len() as i64, (h >> 1) as i64, stray.len() as i64]],
        device,
    )?;
    let every = comm.all_gather(&mine)?.to_vec2::<i64>()?;
    let ranks: Vec<usize> = (0..every.len()).filter(|&r| every[r][2] > 0).collect();
    if !ranks.is_empty() {
        let here = if stray.is_empty() {
            String::new()
        } else {
            format!("; here: {stray:?}")
        };
        bail!(
            "data_parallel: every trainable variable must be one of `all` (the same variable under the same name), which rank 0 broadcasts; not so on rank(s) {ranks:?}{here}"
        )
    }
    if every.iter().any(|f| f != &every[0]) {
        // Only now, on the way to the error: every rank's variables in words, so that each rank
        // can name what differs.
        let differences = describe_differences(comm, all, trainable, device)?;
        bail!(
            "data_parallel: the ranks' models differ: {differences}; every rank must build the same model"
        )
    }
    Ok(())
}

/// One line per variable: `name<TAB>dims<TAB>dtype<TAB>trainable`.
fn listing(all: &[(String, Var)], trainable: &[(String, Var)]) -> String {
    let trained: std::collections::HashSet<&str> =
        trainable.iter().map(|(n, _)| n.as_str()).collect();
    let mut out = String::new();
    for (name, v) in all {
        let t = if trained.contains(name.as_str()) {
            "trainable"
        } else {
            "buffer"
        };
        out.push_str(&format!("{name}\t{:?}\t{:?}\t{t}\n", v.dims(), v.dtype()));
    }
    for (name, _) in trainable {
        if !all.iter().any(|(n, _)| n == name) {
            out.push_str(&format!("{name}\t-\t-\ttrainable only\n"));
        }
    }
    out
}

/// Every rank's [`listing`] through two all-gathers (the lengths, then the bytes), and how this
/// rank's differs from rank 0's, or, on rank 0, how the first rank that differs does: the
/// first three differences, each naming the variable and what differs (missing, shape, dtype,
/// trainable or not).
fn describe_differences(
    comm: &dyn Collective,
    all: &[(String, Var)],
    trainable: &[(String, Var)],
    device: &Device,
) -> Result<String> {
    let mine = listing(all, trainable).into_bytes();
    let lens = comm
        .all_gather(&Tensor::new(&[mine.len() as i64], device)?)?
        .to_vec1::<i64>()?;
    let bytes = comm
        .all_gather(&Tensor::new(mine.as_slice(), device)?)?
        .to_vec1::<u8>()?;
    let mut texts = Vec::with_capacity(lens.len());
    let mut at = 0usize;
    for &n in &lens {
        let n = usize::try_from(n).unwrap_or(0).min(bytes.len() - at);
        texts.push(String::from_utf8_lossy(&bytes[at..at + n]).into_owned());
        at += n;
    }
    let parse = |text: &str| -> std::collections::BTreeMap<String, String> {
        (text.lines())
            .filter_map(|l| l.split_once('\t'))
            .map(|(n, rest)| (n.to_string(), rest.replace('\t', " ")))
            .collect()
    };
    let root = parse(&texts[0]);
    let other = match comm.rank() {
        0 => (1..texts.len()).find(|&r| parse(&texts[r]) != root),
        r => Some(r),
    };
    let Some(r) = other else {
        return Ok("the fingerprints differ, the listings do not".into());
    };
    let theirs = parse(&texts[r]);
    let mut diffs = Vec::new();
    for (name, want) in &root {
        match theirs.get(name) {
            None => diffs.push(format!("rank {r} has no `{name}` (rank 0: {want})")),
            Some(got) if got != want => {
                diffs.push(format!("`{name}` is {got} on rank {r}, {want} on rank 0"))
            }
            Some(_) => {}
        }
    }
    for (name, got) in &theirs {
        if !root.contains_key(name) {
            diffs.push(format!(
                "rank {r} has `{name}` ({got}), which rank 0 has not"
            ));
        }
    }
    let more = diffs.len().saturating_sub(3);
    diffs.truncate(3);
    if more > 0 {
        diffs.push(format!("and {more} more"));
    }
    Ok(diffs.join("; "))
}
