//! What a run shows and leaves behind: a progress line, per-epoch logs, a CSV of the metrics and
//! a PNG plot of the loss and accuracy curves (a small PNG writer of our own: stored deflate
//! blocks, no compression library; chunk CRCs by `crc32fast`).

use std::io::{IsTerminal, Write};
use std::path::Path;
use std::time::Instant;

use anyhow::Result;

/// One epoch's metrics.
#[derive(Debug, Clone, Copy)]
pub struct EpochMetrics {
    pub epoch: usize,
    pub train_loss: f64,
    pub train_acc: f64,
    pub val_loss: f64,
    pub val_acc: f64,
    pub images_per_sec: f64,
    pub seconds: f64,
}

/// A one-line progress bar on stderr (redrawn in place on a terminal, silent otherwise).
pub struct Progress {
    total: usize,
    start: Instant,
    tty: bool,
}

impl Progress {
    pub fn new(total: usize) -> Self {
        Self {
            total,
            start: Instant::now(),
            tty: std::io::stderr().is_terminal(),
        }
    }

    pub fn update(&self, done: usize, epoch: usize, loss: f64, acc: f64, images: usize) {
        if !self.tty {
            return;
        }
        let width = 30;
        let filled = (done * width) / self.total.max(1);
        let rate = images as f64 / self.start.elapsed().as_secs_f64().max(1e-9);
        eprint!(
            "\r[{}{}] epoch {epoch} step {done}/{} loss {loss:.3} acc {:.1}% {rate:.0} img/s ",
            "#".repeat(filled),
            ".".repeat(width - filled),
            self.total,
            100.0 * acc
        );
        let _ = std::io::stderr().flush();
    }

    pub fn finish(&self) {
        if self.tty {
            eprint!("\r{}\r", " ".repeat(90));
        }
    }
}

/// Writes the metrics as CSV (one header line, one line per epoch).
pub fn write_csv(path: &Path, rows: &[EpochMetrics]) -> Result<()> {
    let mut s =
        String::from("epoch,train_loss,train_acc,val_loss,val_acc,images_per_sec,seconds\n");
    for r in rows {
        s.push_str(&format!(
            "{},{:.6},{:.6},{:.6},{:.6},{:.1},{:.2}\n",
            r.epoch, r.train_loss, r.train_acc, r.val_loss, r.val_acc, r.images_per_sec, r.seconds
        ));
    }
    crate::checkpoint::write_atomic(path, s.as_bytes())
}

/// Reads a CSV written by [`write_csv`] (missing file: no rows).
pub fn read_csv(path: &Path) -> Result<Vec<EpochMetrics>> {
    let Ok(text) = std::fs::read_to_string(path) else {
        return Ok(Vec::new());
    };
    let mut rows = Vec::new();
    for line in text.lines().skip(1).filter(|l| !l.trim().is_empty()) {
        let v: Vec<f64> = line
            .split(',')
            .map(|f| f.trim().parse::<f64>())
            .collect::<std::result::Result<_, _>>()
            .map_err(|e| anyhow::anyhow!("{}: bad line {line:?}: {e}", path.display()))?;
        if v.len() != 7 {
            anyhow::bail!("{}: expected 7 columns in {line:?}", path.display());
        }
        rows.push(EpochMetrics {
            epoch: v[0] as usize,
            train_loss: v[1],
            train_acc: v[2],
            val_loss: v[3],
            val_acc: v[4],
            images_per_sec: v[5],
            seconds: v[6],
        });
    }
    Ok(rows)
}

/// Plots train/val loss (left panel) and accuracy (right panel) per epoch as a PNG.
pub fn write_plot(path: &Path, rows: &[EpochMetrics]) -> Result<()> {
    const W: usize = 640;
    const H: usize = 280;
    let mut px = vec![[255u8; 3]; W * H];
    let panels = [(0usize, "loss"), (W / 2, "accuracy")];
    let epochs = rows.len().max(2);
    for (p, (x0, what)) in panels.iter().enumerate() {
        let (l, r, t, b) = (x0 + 30, x0 + W / 2 - 10, 15usize, H - 25);
        for x in l..=r {
            px[b * W + x] = [0, 0, 0];
        }
        for y in t..=b {
            px[y * W + l] = [0, 0, 0];
        }
        let series: [(Vec<f64>, [u8; 3]); 2] = if *what == "loss" {
            [
                (rows.iter().map(|m| m.train_loss).collect(), [31, 119, 180]),
                (rows.iter().map(|m| m.val_loss).collect(), [255, 127, 14]),
            ]
        } else {
            [
                (rows.iter().map(|m| m.train_acc).collect(), [31, 119, 180]),
                (rows.iter().map(|m| m.val_acc).collect(), [255, 127, 14]),
            ]
        };
        let max = if p == 1 {
            1.0
        } else {
            series
                .iter()
                .flat_map(|s| s.0.iter().copied())
                .fold(1e-9, f64::max)
        };
        for (vals, colour) in &series {
            let point = |i: usize, v: f64| {
                let x = l as f64 + (r - l) as f64 * i as f64 / (epochs - 1) as f64;
                let y = b as f64 - (b - t) as f64 * (v / max).clamp(0.0, 1.0);
                (x, y)
            };
            for i in 1..vals.len() {
                let (a, c) = (point(i - 1, vals[i - 1]), point(i, vals[i]));
                let steps = ((c.0 - a.0).abs().max((c.1 - a.1).abs()) as usize).max(1);
                for k in 0..=steps {
                    let f = k as f64 / steps as f64;
                    let (x, y) = (a.0 + (c.0 - a.0) * f, a.1 + (c.1 - a.1) * f);
                    for (ox, oy) in [(0, 0), (1, 0), (0, 1)] {
                        let (xi, yi) = (x as usize + ox, y as usize + oy);
                        if xi < W && yi < H {
                            px[yi * W + xi] = *colour;
                        }
                    }
                }
            }
        }
    }
    crate::checkpoint::write_atomic(path, &png(W, H, &px))?;
    Ok(())
}

/// An RGB8 PNG with stored (uncompressed) deflate blocks.
fn png(w: usize, h: usize, px: &[[u8; 3]]) -> Vec<u8> {
    let mut raw = Vec::with_capacity(h * (1 + 3 * w));
    for y in 0..h {
        raw.push(0); // filter: none
        for p in &px[y * w..(y + 1) * w] {
            raw.extend_from_slice(p);
        }
    }
    let mut z = vec![0x78, 0x01];
    let blocks: Vec<&[u8]> = raw.chunks(65_535).collect();
    for (i, block) in blocks.iter().enumerate() {
        z.push(u8::from(i + 1 == blocks.len()));
        let n = block.len() as u16;
        z.extend_from_slice(&n.to_le_bytes());
        z.extend_from_slice(&(!n).to_le_bytes());
        z.extend_from_slice(block);
    }
    let (mut a, mut b) = (1u32, 0u32);
    for &v in &raw {
        a = (a + v as u32) % 65_521;
        b = (b + a) % 65_521;
    }
    z.extend_from_slice(&((b << 16) | a).to_be_bytes());
    let mut out = b"\x89PNG\r\n\x1a\n".to_vec();
    let mut ihdr = Vec::new();
    ihdr.extend_from_slice(&(w as u32).to_be_bytes());
    ihdr.extend_from_slice(&(h as u32).to_be_bytes());
    ihdr.extend_from_slice(&[8, 2, 0, 0, 0]);
    for (kind, data) in [(b"IHDR", ihdr), (b"IDAT", z), (b"IEND", Vec::new())] {
        out.extend_from_slice(&(data.len() as u32).to_be_bytes());
        let mut chunk = kind.to_vec();
        chunk.extend_from_slice(&data);
        out.extend_from_slice(&chunk);
        out.extend_from_slice(&crc32fast::hash(&chunk).to_be_bytes());
    }
    out
}
