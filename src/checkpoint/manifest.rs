//! `checkpoint.json`: what it holds, and one rank's read of a checkpoint with every check
//! (the manifest's form, the tensor file's name, size and CRC-32) before anything is parsed.

use std::collections::HashMap;
use std::path::{Component, Path, PathBuf};

use candle_core::{bail, Device, Result};
use serde::{Deserialize, Serialize};

use super::files::io_err;
use super::{Loaded, FORMAT, MANIFEST};

/// The largest manifest read: the caller's metadata is small (positions, a loss scale); a
/// larger file is not a manifest of this crate.
const MAX_MANIFEST_BYTES: u64 = 16 << 20;

/// `checkpoint.json`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub(super) struct Manifest {
    pub format: u32,
    /// The tensor file, next to the manifest: a plain file name.
    pub tensors: String,
    pub tensors_bytes: u64,
    pub tensors_crc32: u32,
    /// The caller's.
    pub metadata: serde_json::Value,
}

impl Manifest {
    /// The CRC-32 of the manifest's content (every field, the metadata included), in one
    /// serialisation whatever the file's spacing: what the ranks compare at a load.
    pub fn crc32(&self) -> u32 {
        crc32fast::hash(&serde_json::to_vec(self).unwrap_or_default())
    }
}

/// Whether `name` is a plain file name: one normal component, no separator, no `..`.
pub(super) fn is_plain_name(name: &str) -> bool {
    let mut parts = Path::new(name).components();
    matches!(
        (parts.next(), parts.next()),
        (Some(Component::Normal(n)), None) if n == std::ffi::OsStr::new(name)
    ) && !name.contains(['/', '\\'])
}

/// Whether `tag` can name a save: letters, digits, `-` and `_`, at least one.
pub(super) fn is_tag(tag: &str) -> bool {
    !tag.is_empty()
        && tag
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || c == '-' || c == '_')
}

/// Whether `name` is a tensor file's name as [`super::save`] makes them:
/// `checkpoint-<tag>-<8 hex digits>.safetensors`.
pub(super) fn is_tensor_file_name(name: &str) -> bool {
    let Some(stem) = name
        .strip_prefix("checkpoint-")
        .and_then(|n| n.strip_suffix(".safetensors"))
    else {
        return false;
    };
    let Some((tag, crc)) = stem.rsplit_once('-') else {
        return false;
    };
    is_plain_name(name)
        && is_tag(tag)
        && crc.len() == 8
        && crc.chars().all(|c| c.is_ascii_hexdigit())
}

/// The manifest at `path`, parsed and checked (size bound, format, a plain tensor file name).
pub(super) fn read_manifest(path: &Path) -> Result<Manifest> {
    let len = std::fs::metadata(path)
        .map_err(|e| io_err("reading", path, e))?
        .len();
    if len > MAX_MANIFEST_BYTES {
        bail!(
            "checkpoint {}: {len} bytes, more than a manifest's {MAX_MANIFEST_BYTES}",
            path.display()
        )
    }
    let text = std::fs::read(path).map_err(|e| io_err("reading", path, e))?;
    if text.is_empty() {
        bail!("checkpoint {} is empty", path.display())
    }
    let m: Manifest = serde_json::from_slice(&text).map_err(|e| {
        candle_core::Error::Msg(format!(
            "checkpoint {} is not a valid manifest: {e}",
            path.display()
        ))
    })?;
    if m.format != FORMAT {
        bail!(
            "checkpoint {}: format {} (this build reads {FORMAT})",
            path.display(),
            m.format
        )
    }
    if !is_plain_name(&m.tensors) {
        bail!(
            "checkpoint {}: names the tensor file {:?}, which is not a plain file name beside it \
             (a path, or `..`): refused",
            path.display(),
            m.tensors
        )
    }
    Ok(m)
}

/// The manifest a path names: the path itself, or the manifest in the folder it names.
pub(super) fn manifest_path(path: &Path) -> Result<PathBuf> {
    if path.is_dir() {
        Ok(path.join(MANIFEST))
    } else if path.extension().is_some_and(|e| e == "safetensors") {
        bail!(
            "checkpoint {}: pass the {MANIFEST} next to it (or its folder): the tensor file alone is not a checkpoint",
            path.display()
        )
    } else {
        Ok(path.to_path_buf())
    }
}

/// One rank's read of the checkpoint `path` names, with every check. The tensor file is
/// mapped, not read into memory: its size is checked against the manifest before anything
/// is read, its CRC-32 computed over the mapping, and the tensors copied out of it once (the
/// only copy of the model this rank holds; the mapping's pages are the page cache's, shared by
/// the ranks of one machine).
pub(super) fn read(path: &Path) -> Result<(Loaded, u32)> {
    let manifest_path = manifest_path(path)?;
    let m = read_manifest(&manifest_path)?;
    let file = manifest_path.with_file_name(&m.tensors);
    let named = |e: &dyn std::fmt::Display| {
        io_err(
            "reading",
            &file,
            format!("(named by {}): {e}", manifest_path.display()),
        )
    };
    let f = std::fs::File::open(&file).map_err(|e| named(&e))?;
    let meta = f.metadata().map_err(|e| named(&e))?;
    if !meta.is_file() {
        bail!(
            "checkpoint {}: not a regular file (named by {})",
            file.display(),
            manifest_path.display()
        )
    }
    if meta.len() != m.tensors_bytes {
        bail!(
            "checkpoint {}: {} bytes, {} expected by {} (truncated or replaced)",
            file.display(),
            meta.len(),
            m.tensors_bytes,
            manifest_path.display()
        )
    }
    // SAFETY: the mapping is read-only and dropped before this function returns (every tensor
    // is copied out of it first). A published tensor file is never written in place by this
    // crate (a save writes a new file and renames it); another program truncating or
    // rewriting it while it is mapped would make these reads fault or see other bytes, as
    // with any memory-mapped file (candle's own `MmapedSafetensors` makes the same
    // assumption), and the CRC below is computed over the same mapping the tensors come from.
    let map = unsafe { memmap2::Mmap::map(&f) }.map_err(|e| named(&e))?;
    let crc = crc32fast::hash(&map);
    if crc != m.tensors_crc32 {
        bail!(
            "checkpoint {}: CRC-32 {crc:08x}, {:08x} expected by {} (corrupt)",
            file.display(),
            m.tensors_crc32,
            manifest_path.display()
        )
    }
    let st = candle_core::safetensors::SliceSafetensors::new(&map)?;
    let tensors = (st.tensors().into_iter())
        .map(|(name, _)| Ok((name.clone(), st.load(&name, &Device::Cpu)?)))
        .collect::<Result<HashMap<_, _>>>()?;
    let manifest_crc = m.crc32();
    Ok((
        Loaded {
            path: manifest_path,
            metadata: m.metadata,
            tensors,
            crc32: crc,
        },
        manifest_crc,
    ))
}

#[cfg(test)]
mod tests {
    use super::{is_plain_name, is_tensor_file_name};

    #[test]
    fn only_plain_names_are_plain() {
        for ok in ["checkpoint-e0001-1a2b3c4d.safetensors", "a", "a..b"] {
            assert!(is_plain_name(ok), "{ok}");
        }
        for bad in ["", ".", "..", "../x", "/etc/hostname", "a/b", "a\\b", "./a"] {
            assert!(!is_plain_name(bad), "{bad}");
        }
        assert!(is_tensor_file_name("checkpoint-e0001-1a2b3c4d.safetensors"));
        assert!(is_tensor_file_name(
            "checkpoint-s-00000012-ffffffff.safetensors"
        ));
        for other in [
            "checkpoint.json",
            ".checkpoint.lock",
            "metrics.csv",
            "checkpoint-e0001.safetensors",
            "checkpoint--1a2b3c4d.safetensors",
            "checkpoint-e0001-1a2b3c4g.safetensors",
            "../checkpoint-e0001-1a2b3c4d.safetensors",
        ] {
            assert!(!is_tensor_file_name(other), "{other}");
        }
    }
}
