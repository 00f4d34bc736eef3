//! Images: CIFAR-10 in its binary layout, or a built-in synthetic set; batches with random crop
//! and flip.

use std::path::Path;

use anyhow::{bail, Context, Result};
use candle_core::{Device, Tensor};
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

/// Images as `u8` `[N, 3, S, S]` (channel planes, as CIFAR stores them) and labels.
pub struct Dataset {
    pub images: Vec<u8>,
    pub labels: Vec<u8>,
    pub size: usize,
    pub classes: usize,
}

impl Dataset {
    pub fn len(&self) -> usize {
        self.labels.len()
    }

    fn image(&self, i: usize) -> &[u8] {
        let n = 3 * self.size * self.size;
        &self.images[i * n..(i + 1) * n]
    }
}

/// CIFAR-10 from `dir`: `data_batch_1.bin` … `data_batch_5.bin` (train) and `test_batch.bin`
/// (validation); each record is one label byte and 3×32×32 pixel bytes.
pub fn cifar10(dir: &Path) -> Result<(Dataset, Dataset)> {
    let read = |names: &[String]| -> Result<Dataset> {
        let (mut images, mut labels) = (Vec::new(), Vec::new());
        for name in names {
            let path = dir.join(name);
            let bytes =
                std::fs::read(&path).with_context(|| format!("reading {}", path.display()))?;
            if bytes.len() % 3073 != 0 {
                bail!(
                    "{}: {} bytes is not a whole number of 3073-byte CIFAR-10 records",
                    path.display(),
                    bytes.len()
                );
            }
            for rec in bytes.chunks_exact(3073) {
                if rec[0] > 9 {
                    bail!("{}: label {} out of range", path.display(), rec[0]);
                }
                labels.push(rec[0]);
                images.extend_from_slice(&rec[1..]);
            }
        }
        Ok(Dataset {
            images,
            labels,
            size: 32,
            classes: 10,
        })
    };
    let train: Vec<String> = (1..=5).map(|i| format!("data_batch_{i}.bin")).collect();
    Ok((read(&train)?, read(&["test_batch.bin".to_string()])?))
}

/// The synthetic set: 10 shapes (disk, ring, square, frame, triangle, cross, X, diamond,
/// horizontal bar pair, vertical bar pair) at random position and scale, in a random colour on
/// a random background of at least some contrast, with Gaussian pixel noise and a random
/// brightness ramp. Colour says nothing about the class; the shape does. Deterministic in `seed`.
pub fn synthetic(n: usize, size: usize, seed: u64) -> Dataset {
    let mut rng = StdRng::seed_from_u64(seed);
    let mut images = Vec::with_capacity(n * 3 * size * size);
    let mut labels = Vec::with_capacity(n);
    let s = size as f32;
    for i in 0..n {
        let class = (i % 10) as u8;
        let (cx, cy) = (s * rng.gen_range(0.35..0.65), s * rng.gen_range(0.35..0.65));
        let r = s * rng.gen_range(0.22..0.34);
        let fg: [f32; 3] = [rng.gen(), rng.gen(), rng.gen()];
        let mut bg: [f32; 3] = [rng.gen(), rng.gen(), rng.gen()];
        // At least 0.35 of contrast in the mean intensity.
        let mean = |c: &[f32; 3]| (c[0] + c[1] + c[2]) / 3.0;
        if (mean(&fg) - mean(&bg)).abs() < 0.35 {
            let shift = if mean(&fg) > 0.5 { -0.45 } else { 0.45 };
            bg = bg.map(|v| (v + shift).clamp(0.0, 1.0));
        }
        let ramp = (rng.gen_range(-0.15..0.15f32), rng.gen_range(-0.15..0.15f32));
        let mut img = vec![0u8; 3 * size * size];
        for y in 0..size {
            for x in 0..size {
                let (dx, dy) = ((x as f32 + 0.5 - cx) / r, (y as f32 + 0.5 - cy) / r);
                let inside = shape(class, dx, dy);
                let light = ramp.0 * (x as f32 / s - 0.5) + ramp.1 * (y as f32 / s - 0.5);
                for c in 0..3 {
                    let base = if inside { fg[c] } else { bg[c] };
                    let noise: f32 =
                        (rng.gen::<f32>() + rng.gen::<f32>() + rng.gen::<f32>() - 1.5) * 0.2;
                    let v = (base + light + noise).clamp(0.0, 1.0);
                    img[(c * size + y) * size + x] = (v * 255.0).round() as u8;
                }
            }
        }
        images.extend_from_slice(&img);
        labels.push(class);
    }
    Dataset {
        images,
        labels,
        size,
        classes: 10,
    }
}

/// Whether `(dx, dy)` (in units of the shape's radius, from its centre) is inside shape `class`.
fn shape(class: u8, dx: f32, dy: f32) -> bool {
    let (ax, ay) = (dx.abs(), dy.abs());
    let d = (dx * dx + dy * dy).sqrt();
    match class {
        0 => d <= 1.0,                                                         // disk
        1 => (0.6..=1.0).contains(&d),                                         // ring
        2 => ax <= 0.85 && ay <= 0.85,                                         // square
        3 => ax <= 0.9 && ay <= 0.9 && (ax >= 0.55 || ay >= 0.55),             // frame
        4 => (-0.9..=0.8).contains(&dy) && ax <= (dy + 0.9) * 0.55,            // triangle
        5 => (ax <= 0.3 && ay <= 1.0) || (ay <= 0.3 && ax <= 1.0),             // cross
        6 => ax <= 0.95 && ((dx - dy).abs() <= 0.4 || (dx + dy).abs() <= 0.4), // X
        7 => ax + ay <= 1.0,                                                   // diamond
        8 => ax <= 1.0 && (0.25..=0.7).contains(&ay), // two horizontal bars
        _ => ay <= 1.0 && (0.25..=0.7).contains(&ax), // two vertical bars
    }
}

/// Per-channel mean and std of the pixels in [0, 1] (for normalisation).
pub fn channel_stats(d: &Dataset) -> ([f32; 3], [f32; 3]) {
    let plane = d.size * d.size;
    let (mut sum, mut sq) = ([0f64; 3], [0f64; 3]);
    for i in 0..d.len() {
        let img = d.image(i);
        for c in 0..3 {
            for &p in &img[c * plane..(c + 1) * plane] {
                let v = p as f64 / 255.0;
                sum[c] += v;
                sq[c] += v * v;
            }
        }
    }
    let n = (d.len() * plane) as f64;
    let mean = sum.map(|s| s / n);
    let std = [0, 1, 2].map(|c| ((sq[c] / n - mean[c] * mean[c]).max(1e-12)).sqrt() as f32);
    (mean.map(|m| m as f32), std)
}

/// Images `indices` of `d` as a normalised `(n, 3, S, S)` f32 tensor and their labels `(n)`
/// u32; with `augment`, each image is shifted by up to `pad` pixels (zero fill, as a padded
/// random crop) and flipped horizontally with probability 1/2, drawn from `(seed, pad)`'s seed
/// and the sample's index.
pub fn batch(
    d: &Dataset,
    indices: &[usize],
    stats: &([f32; 3], [f32; 3]),
    augment: Option<(u64, usize)>,
    device: &Device,
) -> Result<(Tensor, Tensor)> {
    let s = d.size;
    let mut out = vec![0f32; indices.len() * 3 * s * s];
    for (k, &i) in indices.iter().enumerate() {
        let img = d.image(i);
        let (ox, oy, flip) = match augment {
            Some((seed, pad)) => {
                // Each sample's own draw, from (seed, sample): the same whichever rank or
                // micro-batch it falls in, so a run's augmentation does not depend on the world
                // size.
                let rng = &mut StdRng::seed_from_u64(
                    seed ^ (i as u64 + 1).wrapping_mul(0x9e37_79b9_7f4a_7c15),
                );
                let p = pad as i64;
                (
                    rng.gen_range(-p..=p),
                    rng.gen_range(-p..=p),
                    rng.gen_bool(0.5),
                )
            }
            None => (0, 0, false),
        };
        for c in 0..3 {
            let (m, sd) = (stats.0[c], stats.1[c]);
            for y in 0..s {
                for x in 0..s {
                    let sx = x as i64 + ox;
                    let sx = if flip { s as i64 - 1 - sx } else { sx };
                    let sy = y as i64 + oy;
                    let v = if sx < 0 || sy < 0 || sx >= s as i64 || sy >= s as i64 {
                        0.0
                    } else {
                        let p = img[(c * s + sy as usize) * s + sx as usize] as f32 / 255.0;
                        (p - m) / sd
                    };
                    out[((k * 3 + c) * s + y) * s + x] = v;
                }
            }
        }
    }
    let labels: Vec<u32> = indices.iter().map(|&i| d.labels[i] as u32).collect();
    Ok((
        Tensor::from_vec(out, (indices.len(), 3, s, s), device)?,
        Tensor::new(labels.as_slice(), device)?,
    ))
}
