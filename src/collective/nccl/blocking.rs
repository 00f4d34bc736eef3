//! Where NCCL would find `NCCL_COMM_BLOCKING`, read before the first NCCL call: NCCL applies it
//! over a communicator's config, and blocking mode voids every timeout and abort of this
//! backend (a call then waits inside NCCL, holding the communicator, out of the watchdog's
//! reach). NCCL takes the environment first, then the lines `KEY=VALUE` of the file
//! `NCCL_CONF_FILE` names (else `~/.nccl.conf`), then `/etc/nccl.conf`, each one not
//! overriding what an earlier one set.

use std::path::{Path, PathBuf};

const VAR: &str = "NCCL_COMM_BLOCKING";

/// The value of `NCCL_COMM_BLOCKING` in a configuration file of `KEY=VALUE` lines (`#` starts
/// a comment line); the last setting wins, as NCCL reads them in order.
fn in_file(path: &Path) -> Option<String> {
    let text = std::fs::read_to_string(path).ok()?;
    text.lines()
        .filter(|l| !l.trim_start().starts_with('#'))
        .filter_map(|l| l.split_once('='))
        .filter(|(k, _)| k.trim() == VAR)
        .map(|(_, v)| v.trim().to_string())
        .next_back()
}

fn blocking(value: &str) -> bool {
    value.parse::<i64>().map_or(!value.is_empty(), |v| v != 0)
}

/// Where blocking mode is asked for (`"NCCL_COMM_BLOCKING=1 in the environment"`, or in a
/// named file), or `None` when NCCL will honour the non-blocking config.
pub(super) fn blocking_setting() -> Option<String> {
    if let Ok(v) = std::env::var(VAR) {
        return blocking(&v).then(|| format!("{VAR}={v} in the environment"));
    }
    let user = std::env::var_os("NCCL_CONF_FILE")
        .map(PathBuf::from)
        .or_else(|| std::env::var_os("HOME").map(|h| Path::new(&h).join(".nccl.conf")));
    let files = user.into_iter().chain([PathBuf::from("/etc/nccl.conf")]);
    for file in files {
        if let Some(v) = in_file(&file) {
            return blocking(&v).then(|| format!("{VAR}={v} in {}", file.display()));
        }
    }
    None
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_conf_file_is_read_line_by_line() {
        let dir = std::env::temp_dir().join(format!("nccl-conf-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let f = dir.join("nccl.conf");
        std::fs::write(
            &f,
            "# NCCL_COMM_BLOCKING=1\nNCCL_DEBUG=WARN\nNCCL_COMM_BLOCKING = 0\n",
        )
        .unwrap();
        assert_eq!(in_file(&f).as_deref(), Some("0"));
        std::fs::write(&f, "NCCL_COMM_BLOCKING=1\n").unwrap();
        assert_eq!(in_file(&f).as_deref(), Some("1"));
        assert_eq!(in_file(&dir.join("absent")), None);
        assert!(blocking("1") && blocking("yes") && !blocking("0") && !blocking(""));
        std::fs::remove_dir_all(dir).unwrap();
    }
}
