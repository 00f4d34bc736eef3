//! Files that survive a kill at any moment: written to a temporary name, flushed to disk
//! (`fsync`), renamed into place, and the directory entry flushed too.

use std::io::Write;
use std::path::{Path, PathBuf};

use candle_core::Result;

/// An I/O error as a candle error naming what was done to which file.
pub(super) fn io_err(what: &str, path: &Path, e: impl std::fmt::Display) -> candle_core::Error {
    candle_core::Error::Msg(format!("checkpoint: {what} {}: {e}", path.display()))
}

/// Writes `bytes` to `path` atomically: a temporary file in the same directory (`path` with
/// `.tmp` appended), `fsync`, rename, `fsync` of the directory. A kill at any point leaves the
/// old file or the new one, whole. For a run's other outputs (metrics, charts) beside its
/// checkpoints.
///
/// # Errors
///
/// When the temporary file cannot be created, written, flushed or renamed, naming it.
pub fn write_atomic(path: &Path, bytes: &[u8]) -> Result<()> {
    let tmp = tmp_name(path);
    let mut f = std::fs::File::create(&tmp).map_err(|e| io_err("creating", &tmp, e))?;
    f.write_all(bytes)
        .and_then(|()| f.sync_all())
        .map_err(|e| io_err("writing", &tmp, e))?;
    drop(f);
    publish(&tmp, path)
}

/// `path` with `.tmp` appended to its file name.
pub(super) fn tmp_name(path: &Path) -> PathBuf {
    let mut name = path.file_name().unwrap_or_default().to_os_string();
    name.push(".tmp");
    path.with_file_name(name)
}

/// Renames `tmp` to `path` and flushes the directory entry.
pub(super) fn publish(tmp: &Path, path: &Path) -> Result<()> {
    std::fs::rename(tmp, path)
        .map_err(|e| io_err("renaming", tmp, format!("to {}: {e}", path.display())))?;
    let dir = path.parent().filter(|d| !d.as_os_str().is_empty());
    let dir = dir.unwrap_or(Path::new("."));
    sync_dir(dir).map_err(|e| io_err("syncing the directory", dir, e))
}

/// Flushes a written file to disk through a handle with write access (Windows'
/// `FlushFileBuffers`, behind `sync_all`, refuses a read-only one; Unix accepts either).
pub(super) fn sync_file(path: &Path) -> Result<()> {
    std::fs::OpenOptions::new()
        .write(true)
        .open(path)
        .and_then(|f| f.sync_all())
        .map_err(|e| io_err("syncing", path, e))
}

/// Flushes a directory's entries (a rename into it) to disk: `fsync` of the directory on Unix.
#[cfg(unix)]
fn sync_dir(dir: &Path) -> std::io::Result<()> {
    std::fs::File::open(dir)?.sync_all()
}

/// Elsewhere (Windows) a directory cannot be opened as a file without flags the standard
/// library does not expose, and NTFS journals the rename itself: nothing to do.
#[cfg(not(unix))]
fn sync_dir(_dir: &Path) -> std::io::Result<()> {
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The two flushes a write makes, as this platform runs them: a file through a handle with
    /// write access (a read-only handle fails on Windows), and its folder; a file that is not
    /// there is an error naming it. An atomic write leaves no temporary file.
    #[test]
    fn files_and_their_folder_are_flushed() {
        let dir = std::env::temp_dir().join(format!("ckpt-sync-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let f = dir.join("x.bin");
        write_atomic(&f, b"abc").unwrap();
        assert_eq!(std::fs::read(&f).unwrap(), b"abc");
        assert!(!tmp_name(&f).exists());
        sync_file(&f).unwrap();
        sync_dir(&dir).unwrap();
        let e = sync_file(&dir.join("absent.bin")).unwrap_err().to_string();
        assert!(e.contains("absent.bin"), "{e}");
        std::fs::remove_dir_all(dir).unwrap();
    }
}
