//! Reads the table of contents of a CUDA fatbin (the container nvcc's `--fatbin` writes): which
//! machine code (SASS, an ELF cubin per architecture) and which PTX it holds. Used to check that
//! the embedded kernel images ship what the README promises.
//!
//! Layout (little-endian): a 16-byte header `{magic 0xBA55ED50: u32, version: u16,
//! header_size: u16, entries_size: u64}`, then entries, each `{kind: u16 (1 PTX, 2 ELF),
//! version: u16, header_size: u32, payload_size: u64, …, arch: u32 at byte 28, …}` followed by
//! its payload. Test-only: the library itself only loads the images.

/// What one entry of a fatbin holds.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Code {
    /// Machine code for `sm_XX`; `elf` tells whether the payload starts with the ELF magic
    /// (uncompressed).
    Sass { arch: u32, elf: bool },
    /// PTX for `compute_XX`, compiled by the driver at load time.
    Ptx { arch: u32 },
}

const MAGIC: u32 = 0xBA55_ED50;

fn read<const N: usize>(b: &[u8], at: usize) -> Option<[u8; N]> {
    b.get(at..at.checked_add(N)?)?.try_into().ok()
}
fn u16_at(b: &[u8], at: usize) -> Option<u16> {
    read(b, at).map(u16::from_le_bytes)
}
fn u32_at(b: &[u8], at: usize) -> Option<u32> {
    read(b, at).map(u32::from_le_bytes)
}
fn u64_at(b: &[u8], at: usize) -> Option<u64> {
    read(b, at).map(u64::from_le_bytes)
}

/// The entries of a fatbin image, in order; an error names what is malformed.
pub(crate) fn entries(image: &[u8]) -> Result<Vec<Code>, String> {
    let bad = |what: &str| format!("not a fatbin: {what}");
    if u32_at(image, 0) != Some(MAGIC) {
        return Err(bad("no 0xBA55ED50 magic"));
    }
    let header = u16_at(image, 6).ok_or_else(|| bad("short header"))? as usize;
    let size = u64_at(image, 8).ok_or_else(|| bad("short header"))? as usize;
    let end = header
        .checked_add(size)
        .filter(|&e| e <= image.len())
        .ok_or_else(|| bad("entries extend past the image"))?;
    let mut out = Vec::new();
    let mut at = header;
    while at < end {
        let field = |off: usize| bad(&format!("entry at byte {at} is cut off (field at +{off})"));
        let kind = u16_at(image, at).ok_or_else(|| field(0))?;
        let entry_header = u32_at(image, at + 4).ok_or_else(|| field(4))? as usize;
        let payload = u64_at(image, at + 8).ok_or_else(|| field(8))? as usize;
        let arch = u32_at(image, at + 28).ok_or_else(|| field(28))?;
        let body = at
            .checked_add(entry_header)
            .filter(|&b| entry_header >= 32 && b <= end)
            .ok_or_else(|| field(4))?;
        out.push(match kind {
            1 => Code::Ptx { arch },
            2 => Code::Sass {
                arch,
                elf: image.get(body..body + 4) == Some(b"\x7fELF"),
            },
            k => return Err(bad(&format!("entry at byte {at} has unknown kind {k}"))),
        });
        at = body
            .checked_add(payload)
            .filter(|&n| n <= end)
            .ok_or_else(|| bad(&format!("entry at byte {at} extends past the image")))?;
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// An image with the given `(kind, arch, payload)` entries, laid out as nvcc does.
    fn image(parts: &[(u16, u32, &[u8])]) -> Vec<u8> {
        let mut body = Vec::new();
        for (kind, arch, payload) in parts {
            let mut e = vec![0u8; 64];
            e[0..2].copy_from_slice(&kind.to_le_bytes());
            e[4..8].copy_from_slice(&64u32.to_le_bytes());
            e[8..16].copy_from_slice(&(payload.len() as u64).to_le_bytes());
            e[28..32].copy_from_slice(&arch.to_le_bytes());
            body.extend(e);
            body.extend(*payload);
        }
        let mut out = MAGIC.to_le_bytes().to_vec();
        out.extend(1u16.to_le_bytes());
        out.extend(16u16.to_le_bytes());
        out.extend((body.len() as u64).to_le_bytes());
        out.extend(body);
        out
    }

    #[test]
    fn reads_sass_and_ptx_entries() {
        let img = image(&[
            (2, 80, b"\x7fELF...."),
            (1, 90, b".version 9.0"),
            (2, 90, b"zzzz"),
        ]);
        assert_eq!(
            entries(&img).unwrap(),
            vec![
                Code::Sass {
                    arch: 80,
                    elf: true
                },
                Code::Ptx { arch: 90 },
                Code::Sass {
                    arch: 90,
                    elf: false
                },
            ]
        );
    }

    #[test]
    fn malformed_images_are_errors() {
        let img = image(&[(2, 80, b"\x7fELF....")]);
        assert!(entries(b"PTX text").unwrap_err().contains("magic"));
        for cut in [4, 17, 40, img.len() - 1] {
            assert!(entries(&img[..cut]).is_err(), "cut at {cut}");
        }
        let mut odd = img.clone();
        odd[16] = 7;
        assert!(entries(&odd).unwrap_err().contains("unknown kind 7"));
    }

    /// The images built into this crate hold machine code for every shipped architecture
    /// (sm_80, sm_90 and CUDA_COMPUTE_CAP), as uncompressed ELF, and PTX of the newest one.
    #[cfg(feature = "cuda")]
    #[test]
    fn embedded_images_ship_sass_for_every_promised_arch() {
        use crate::kernels::{shipped_archs, Module};
        let archs = shipped_archs();
        assert!(archs.contains(&80) && archs.contains(&90), "{archs:?}");
        for m in Module::ALL {
            let (source, img) = m.image();
            let got = entries(img).unwrap_or_else(|e| panic!("{source}: {e}"));
            for &a in archs {
                assert!(
                    got.contains(&Code::Sass { arch: a, elf: true }),
                    "{source}: no sm_{a} machine code in {got:?}"
                );
            }
            let newest = *archs.iter().max().unwrap();
            assert!(
                got.contains(&Code::Ptx { arch: newest }),
                "{source}: no compute_{newest} PTX in {got:?}"
            );
        }
    }
}
