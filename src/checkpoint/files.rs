//! Files that survive a kill at any moment: written to a temporary name, flushed to disk
//! (`fsync`), renamed into place, and the directory entry flushed too; the folder lock that
//! keeps a second writer out; the clean-up of what killed saves left behind.

use std::fs::{File, TryLockError};
use std::io::{Read, Write};
use std::path::Path;

use candle_core::Result;

/// The lock file a save holds in its folder.
pub(super) const LOCK: &str = ".checkpoint.lock";

/// An I/O error as a candle error naming what was done to which file.
pub(super) fn io_err(what: &str, path: &Path, e: impl std::fmt::Display) -> candle_core::Error {
    candle_core::Error::Msg(format!("checkpoint: {what} {}: {e}", path.display()))
}

/// Writes `bytes` to `path` atomically: a temporary file of a unique name in the same
/// directory (`.<file name>.<random>.tmp`), `fsync`, rename, `fsync` of the directory. A kill at any point
/// leaves the old file or the new one, whole; two writers to one folder never share a
/// temporary file. The file gets the permissions of a file the program creates itself
/// (`0o666` less the process's umask, as `std::fs::write` gives). For a run's other outputs
/// (metrics, charts) beside its checkpoints.
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
/// (`tempfile`: created exclusively, removed when dropped unless published), created with
/// mode `0o666` so that the umask alone decides who may read it (`tempfile`'s own default,
/// `0o600`, would make every output private whatever the user's umask). A save killed midway
/// leaves one such file behind, which the next save removes ([`remove_stale_temps`]).
fn temp_beside(path: &Path) -> Result<tempfile::NamedTempFile> {
    let dir = path.parent().filter(|d| !d.as_os_str().is_empty());
    let dir = dir.unwrap_or(Path::new("."));
    let name = path.file_name().unwrap_or_default().to_string_lossy();
    let prefix = format!(".{name}.");
    let mut builder = tempfile::Builder::new();
    builder.prefix(&prefix).suffix(".tmp");
    #[cfg(unix)]
    {
        use std::os::unix::fs::PermissionsExt;
        builder.permissions(std::fs::Permissions::from_mode(0o666));
    }
    builder
        .tempfile_in(dir)
        .map_err(|e| io_err("creating a temporary file for", path, e))
}

/// A private folder beside a checkpoint for writing its tensor file
/// (`.checkpoint-<tag>.<random>.tmp/`): the safetensors writer makes temporary files of its own
/// next to its target, so they land in here, and a kill leaves one folder for the next save's
/// clean-up ([`remove_stale_temps`]). Removed when dropped.
pub(super) struct Staging {
    dir: tempfile::TempDir,
    file: std::path::PathBuf,
}

impl Staging {
    /// A new staging folder in `dir` for a tensor file tagged `tag`.
    pub fn new(dir: &Path, tag: &str) -> Result<Self> {
        let prefix = format!(".checkpoint-{tag}.");
        let mut builder = tempfile::Builder::new();
        builder.prefix(&prefix).suffix(".tmp");
        #[cfg(unix)]
        {
            use std::os::unix::fs::PermissionsExt;
            // Created as 0o777 less the umask: the tensor file gets the same less execution.
            builder.permissions(std::fs::Permissions::from_mode(0o777));
        }
        let dir = builder
            .tempdir_in(dir)
            .map_err(|e| io_err("creating a staging folder in", dir, e))?;
        let file = dir.path().join("tensors.safetensors");
        Ok(Self { dir, file })
    }

    /// Where the tensor file is written.
    pub fn file(&self) -> &Path {
        &self.file
    }

    /// Gives the written file the permissions of a new file of the process (the writer's own
    /// temporary file is private), renames it to `path` and flushes the directory entry.
    pub fn publish(self, path: &Path) -> Result<()> {
        #[cfg(unix)]
        {
            use std::os::unix::fs::PermissionsExt;
            let umasked = std::fs::metadata(self.dir.path())
                .map_err(|e| io_err("reading", self.dir.path(), e))?
                .permissions()
                .mode()
                & 0o666;
            std::fs::set_permissions(&self.file, std::fs::Permissions::from_mode(umasked))
                .map_err(|e| io_err("setting the permissions of", &self.file, e))?;
        }
        std::fs::rename(&self.file, path).map_err(|e| {
            io_err(
                "renaming",
                &self.file,
                format!("to {}: {e}", path.display()),
            )
        })?;
        sync_parent(path)
    }
}

/// Renames the temporary file `tmp` to `path` and flushes the directory entry.
fn publish(tmp: tempfile::NamedTempFile, path: &Path) -> Result<()> {
    let from = tmp.path().to_path_buf();
    tmp.persist(path).map_err(|e| {
        io_err(
            "renaming",
            &from,
            format!("to {}: {}", path.display(), e.error),
        )
    })?;
    sync_parent(path)
}

/// Flushes the entry of `path` in its folder (after a rename into it).
fn sync_parent(path: &Path) -> Result<()> {
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

/// The CRC-32 and length of a file, read in 1 MiB pieces (never the whole file in memory).
pub(super) fn crc32_of(path: &Path) -> Result<(u32, u64)> {
    let mut f = File::open(path).map_err(|e| io_err("reading back", path, e))?;
    let mut hasher = crc32fast::Hasher::new();
    let mut buf = vec![0u8; 1 << 20];
    let mut len = 0u64;
    loop {
        let n = f
            .read(&mut buf)
            .map_err(|e| io_err("reading back", path, e))?;
        if n == 0 {
            break;
        }
        hasher.update(&buf[..n]);
        len += n as u64;
    }
    Ok((hasher.finalize(), len))
}

/// An exclusive advisory lock on a file (`flock` on Unix, `LockFileEx` on Windows), created if
/// missing, held until dropped and released by the operating system when its holder dies, so a
/// crashed holder leaves no stale lock behind: what a save holds on its folder
/// (`.checkpoint.lock`), and what a run can hold on its output folder for as long as it lives.
#[derive(Debug)]
pub struct FileLock {
    _file: File,
}

impl FileLock {
    /// Takes the lock on `path` without waiting; `holder` says who holds it when it is taken
    /// (for the error: "another `holder` holds …").
    ///
    /// # Errors
    ///
    /// When another holder (this process or another) has it, naming the file; when the file
    /// cannot be opened. A file system without locks is logged and not refused.
    pub fn take(path: &Path, holder: &str) -> Result<Self> {
        let file = std::fs::OpenOptions::new()
            .create(true)
            .truncate(false)
            .read(true)
            .write(true)
            .open(path)
            .map_err(|e| io_err("opening the lock", path, e))?;
        match file.try_lock() {
            Ok(()) => {}
            Err(TryLockError::WouldBlock) => candle_core::bail!(
                "another {holder} holds {}: nothing was done (give each run a folder of its own)",
                path.display()
            ),
            Err(TryLockError::Error(e)) if e.kind() == std::io::ErrorKind::Unsupported => {
                log::warn!(
                    "{} cannot be locked on this file system ({e}): a second {holder} is not kept out",
                    path.display()
                );
            }
            Err(TryLockError::Error(e)) => return Err(io_err("locking", path, e)),
        }
        Ok(Self { _file: file })
    }

    /// The lock a save holds on checkpoint folder `dir` (`.checkpoint.lock`).
    ///
    /// # Errors
    ///
    /// As [`FileLock::take`].
    pub(super) fn of_folder(dir: &Path) -> Result<Self> {
        Self::take(&dir.join(LOCK), "save")
    }
}

/// Removes what killed saves left in `dir`: staging folders and temporary files
/// (`.checkpoint-*.tmp`, `.checkpoint.json.*.tmp`). Called with the folder's [`FolderLock`]
/// held, so no live save owns them; other temporary files (a run's metrics) are left alone,
/// and a link is removed as a link, never followed. Returns how many went.
pub(super) fn remove_stale_temps(dir: &Path) -> usize {
    let mut removed = 0;
    for entry in std::fs::read_dir(dir).into_iter().flatten().flatten() {
        let name = entry.file_name().to_string_lossy().into_owned();
        let ours = name.starts_with(".checkpoint-") || name.starts_with(".checkpoint.json.");
        if !ours || !name.ends_with(".tmp") {
            continue;
        }
        let gone = match entry.file_type() {
            Ok(t) if t.is_dir() => std::fs::remove_dir_all(entry.path()),
            Ok(_) => std::fs::remove_file(entry.path()),
            Err(e) => Err(e),
        };
        removed += usize::from(gone.is_ok());
    }
    removed
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

    /// An atomic write gets the permissions `std::fs::write` gives a new file in the same
    /// folder (0o666 less the umask), not the temporary file's private 0o600.
    #[cfg(unix)]
    #[test]
    fn written_files_get_the_umask() {
        use std::os::unix::fs::PermissionsExt;
        let dir = std::env::temp_dir().join(format!("ckpt-umask-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        std::fs::write(dir.join("plain"), b"x").unwrap();
        write_atomic(&dir.join("atomic"), b"x").unwrap();
        let mode = |n: &str| (std::fs::metadata(dir.join(n)).unwrap().permissions().mode()) & 0o777;
        assert_eq!(mode("atomic"), mode("plain"), "as std::fs::write's");
        std::fs::remove_dir_all(dir).unwrap();
    }

    /// One writer at a time: a second lock on the folder (this process or another) is refused
    /// naming the lock file, and the lock is free again once the first is dropped.
    #[test]
    fn the_folder_lock_keeps_a_second_writer_out() {
        let dir = std::env::temp_dir().join(format!("ckpt-lock-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let first = FileLock::of_folder(&dir).unwrap();
        let e = FileLock::of_folder(&dir).unwrap_err().to_string();
        assert!(e.contains(LOCK) && e.contains("another save"), "{e}");
        drop(first);
        FileLock::of_folder(&dir).expect("free after the first writer");
        std::fs::remove_dir_all(dir).unwrap();
    }
}
