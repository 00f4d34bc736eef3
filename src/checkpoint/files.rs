//! Files that survive a kill at any moment: written to a temporary name, flushed to disk
//! (`fsync`), renamed into place, and the directory entry flushed too.

use std::io::Write;
use std::path::Path;

use candle_core::Result;

/// An I/O error as a candle error naming what was done to which file.
pub(super) fn io_err(what: &str, path: &Path, e: impl std::fmt::Display) -> candle_core::Error {
    candle_core::Error::Msg(format!("checkpoint: {what} {}: {e}", path.display()))
}

/// Writes `bytes` to `path` atomically: a temporary file of a unique name in the same
/// directory (`.<file name>.<random>.tmp`), `fsync`, rename, `fsync` of the directory. A kill at any point
/// leaves the old file or the new one, whole; two writers to one folder never share a
/// temporary file. For a run's other outputs (metrics, charts) beside its checkpoints.
///
/// # Errors
///
/// When the temporary file cannot be created, written, flushed or renamed, naming it.
pub fn write_atomic(path: &Path, bytes: &[u8]) -> Result<()> {
    let mut tmp = temp_beside(path)?;
    tmp.write_all(bytes)
        .and_then(|()| tmp.as_file().sync_all())
        .map_err(|e| io_err("writing", tmp.path(), e))?;
    publish(tmp, path)
}

/// A new, empty temporary file in `path`'s directory, named `.<file name>.<random>.tmp`
/// (`tempfile`: created exclusively, removed when dropped unless published). A save killed
/// midway leaves one such file behind, which can be deleted.
pub(super) fn temp_beside(path: &Path) -> Result<tempfile::NamedTempFile> {
    let dir = path.parent().filter(|d| !d.as_os_str().is_empty());
    let dir = dir.unwrap_or(Path::new("."));
    let name = path.file_name().unwrap_or_default().to_string_lossy();
    tempfile::Builder::new()
        .prefix(&format!(".{name}."))
        .suffix(".tmp")
        .tempfile_in(dir)
        .map_err(|e| io_err("creating a temporary file for", path, e))
}

/// Renames the temporary file `tmp` to `path` and flushes the directory entry.
pub(super) fn publish(tmp: tempfile::NamedTempFile, path: &Path) -> Result<()> {
    let from = tmp.path().to_path_buf();
    tmp.persist(path).map_err(|e| {
        io_err(
            "renaming",
            &from,
            format!("to {}: {}", path.display(), e.error),
        )
    })?;
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
    ///
    /// Two writers of one file in one folder (two jobs with the same output folder) each write
    /// a temporary file of their own: both writes complete whole, the last one in place.
    #[test]
    fn files_and_their_folder_are_flushed() {
        let dir = std::env::temp_dir().join(format!("ckpt-sync-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let f = dir.join("x.bin");
        write_atomic(&f, b"abc").unwrap();
        assert_eq!(std::fs::read(&f).unwrap(), b"abc");
        let left: Vec<_> = std::fs::read_dir(&dir)
            .unwrap()
            .flatten()
            .map(|e| e.file_name())
            .collect();
        assert_eq!(
            left,
            [std::ffi::OsString::from("x.bin")],
            "no temporary file left"
        );
        // Two writers at once, 20 writes each of 1 MiB of their own byte: every write lands
        // whole (a shared temporary name would interleave or truncate them).
        std::thread::scope(|s| {
            for b in [1u8, 2] {
                let f = &f;
                s.spawn(move || {
                    for _ in 0..20 {
                        write_atomic(f, &vec![b; 1 << 20]).unwrap();
                        let got = std::fs::read(f).unwrap();
                        assert!(got.len() == 1 << 20 && got.iter().all(|&v| v == got[0]));
                    }
                });
            }
        });
        let left = std::fs::read_dir(&dir).unwrap().count();
        assert_eq!(left, 1, "no temporary file left by either writer");
        sync_file(&f).unwrap();
        sync_dir(&dir).unwrap();
        let e = sync_file(&dir.join("absent.bin")).unwrap_err().to_string();
        assert!(e.contains("absent.bin"), "{e}");
        std::fs::remove_dir_all(dir).unwrap();
    }
}
