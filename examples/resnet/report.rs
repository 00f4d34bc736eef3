//! What a run shows and leaves behind: a progress bar (`indicatif`), a CSV of the metrics and a
//! PNG chart of the loss and accuracy curves (`plotters`, bitmap backend; the PNG encoded by
//! `image`, which plotters' encoder uses too).

use std::path::{Path, PathBuf};
use std::sync::OnceLock;
use std::time::Instant;

use anyhow::{anyhow, Context, Result};
use image::ImageEncoder;
use indicatif::{ProgressBar, ProgressStyle};
use plotters::prelude::*;

/// One epoch's metrics (a row of `metrics.csv`, its columns named after the fields).
#[derive(Debug, Clone, Copy, serde::Serialize, serde::Deserialize)]
pub struct EpochMetrics {
    pub epoch: usize,
    pub train_loss: f64,
    pub train_acc: f64,
    pub val_loss: f64,
    pub val_acc: f64,
    pub images_per_sec: f64,
    pub seconds: f64,
}

/// An epoch's progress bar on stderr: steps, running loss and accuracy, images per second and the
/// time left. Drawn for one rank only (`visible`), and by indicatif only when stderr is a
/// terminal (hidden in logs and pipes).
pub struct Progress {
    bar: ProgressBar,
    start: Instant,
}

impl Progress {
    /// A bar of `steps` steps for `epoch` (1-based) of `epochs`.
    pub fn new(steps: usize, epoch: usize, epochs: usize, visible: bool) -> Result<Self> {
        let bar = if visible {
            ProgressBar::new(steps as u64)
        } else {
            ProgressBar::hidden()
        };
        bar.set_style(
            ProgressStyle::with_template(
                "epoch {prefix} [{bar:20.cyan/blue}] {pos}/{len} {msg} ETA {eta}",
            )?
            .progress_chars("=> "),
        );
        bar.set_prefix(format!("{epoch}/{epochs}"));
        Ok(Self {
            bar,
            start: Instant::now(),
        })
    }

    /// `done` steps taken, with the epoch's running loss and accuracy and the images seen.
    pub fn update(&self, done: usize, loss: f64, acc: f64, images: usize) {
        let rate = images as f64 / self.start.elapsed().as_secs_f64().max(1e-9);
        self.bar.set_message(format!(
            "loss {loss:.3} acc {:.1}% {rate:.0} img/s",
            100.0 * acc
        ));
        self.bar.set_position(done as u64);
    }

    /// Removes the bar (the epoch's summary line follows on stdout).
    pub fn finish(&self) {
        self.bar.finish_and_clear();
    }
}

/// Writes the metrics as CSV (`csv`: one header line of the field names, one line per epoch),
/// the values rounded for reading (losses and accuracies to 6 decimals, images/s to 1, seconds
/// to 2).
pub fn write_csv(path: &Path, rows: &[EpochMetrics]) -> Result<()> {
    let round = |x: f64, digits: i32| (x * 10f64.powi(digits)).round() / 10f64.powi(digits);
    let mut w = csv::Writer::from_writer(Vec::new());
    for r in rows {
        w.serialize(EpochMetrics {
            train_loss: round(r.train_loss, 6),
            train_acc: round(r.train_acc, 6),
            val_loss: round(r.val_loss, 6),
            val_acc: round(r.val_acc, 6),
            images_per_sec: round(r.images_per_sec, 1),
            seconds: round(r.seconds, 2),
            ..*r
        })?;
    }
    let bytes = w
        .into_inner()
        .map_err(|e| anyhow!("{}: {e}", path.display()))?;
    Ok(candle_distributed::checkpoint::write_atomic(path, &bytes)?)
}

/// Reads a CSV written by [`write_csv`] (missing file: no rows); a malformed one is an error
/// naming the file and the record.
pub fn read_csv(path: &Path) -> Result<Vec<EpochMetrics>> {
    let mut r = match csv::Reader::from_path(path) {
        Ok(r) => r,
        Err(e) if matches!(e.kind(), csv::ErrorKind::Io(io) if io.kind() == std::io::ErrorKind::NotFound) => {
            return Ok(Vec::new())
        }
        Err(e) => return Err(anyhow!("{}: {e}", path.display())),
    };
    r.deserialize()
        .collect::<std::result::Result<Vec<EpochMetrics>, _>>()
        .with_context(|| format!("{}: a malformed metrics file", path.display()))
}

/// Where [`write_plot`] looks for a TrueType font for its text, after `$RESNET_FONT`: DejaVu Sans
/// or Liberation Sans where Linux distributions put them, then macOS's and Windows' Arial.
const FONT_PATHS: &[&str] = &[
    "/usr/share/fonts/truetype/dejavu/DejaVuSans.ttf",
    "/usr/share/fonts/TTF/DejaVuSans.ttf",
    "/usr/share/fonts/dejavu-sans-fonts/DejaVuSans.ttf",
    "/usr/share/fonts/dejavu/DejaVuSans.ttf",
    "/usr/share/fonts/truetype/liberation/LiberationSans-Regular.ttf",
    "/Library/Fonts/Arial.ttf",
    "/System/Library/Fonts/Supplemental/Arial.ttf",
    "C:\\Windows\\Fonts\\arial.ttf",
];

/// Registers the first font found as plotters' "sans-serif" (once per process) and says which.
pub fn font() -> Result<&'static Path> {
    static FONT: OnceLock<std::result::Result<PathBuf, String>> = OnceLock::new();
    let found = FONT.get_or_init(|| {
        let candidates: Vec<PathBuf> = std::env::var_os("RESNET_FONT")
            .map(PathBuf::from)
            .into_iter()
            .chain(FONT_PATHS.iter().map(PathBuf::from))
            .collect();
        for path in &candidates {
            let Ok(bytes) = std::fs::read(path) else {
                continue;
            };
            // The registry keeps `&'static` font data: one font per process, leaked once.
            let bytes: &'static [u8] = Box::leak(bytes.into_boxed_slice());
            match plotters::style::register_font("sans-serif", FontStyle::Normal, bytes) {
                Ok(()) => return Ok(path.clone()),
                Err(_) => log::warn!("{}: not a TrueType font, skipped", path.display()),
            }
        }
        Err(format!(
            "no TrueType font for the chart's text: set RESNET_FONT to a .ttf file, or install \
             one (Debian and Ubuntu: fonts-dejavu-core); looked in {}",
            candidates
                .iter()
                .map(|p| p.display().to_string())
                .collect::<Vec<_>>()
                .join(", ")
        ))
    });
    found.as_deref().map_err(|e| anyhow!("{e}"))
}

/// Chart size in pixels.
pub const PLOT_SIZE: (u32, u32) = (1000, 420);
/// The training curve's colour, then the validation curve's.
pub const TRAIN_COLOUR: RGBColor = RGBColor(31, 119, 180);
pub const VAL_COLOUR: RGBColor = RGBColor(230, 100, 0);

/// Draws the loss (left) and accuracy (right) per epoch, training and validation, under `title`,
/// and writes it as a PNG (atomically, [`candle_distributed::checkpoint::write_atomic`]).
pub fn write_plot(path: &Path, title: &str, rows: &[EpochMetrics]) -> Result<()> {
    font()?;
    let (w, h) = PLOT_SIZE;
    let mut rgb = vec![0u8; 3 * (w * h) as usize];
    {
        let root = BitMapBackend::with_buffer(&mut rgb, (w, h)).into_drawing_area();
        root.fill(&WHITE)?;
        let root = root.titled(title, ("sans-serif", 22))?;
        let (left, right) = root.split_horizontally(w / 2);
        let loss_top = rows
            .iter()
            .flat_map(|m| [m.train_loss, m.val_loss])
            .filter(|v| v.is_finite())
            .fold(0.0, f64::max);
        panel(&left, "loss", 1.05 * loss_top.max(1e-3), rows, |m| {
            (m.train_loss, m.val_loss)
        })?;
        panel(&right, "accuracy (%)", 100.0, rows, |m| {
            (100.0 * m.train_acc, 100.0 * m.val_acc)
        })?;
        root.present()?;
    }
    let mut png = Vec::new();
    image::codecs::png::PngEncoder::new(&mut png)
        .write_image(&rgb, w, h, image::ColorType::Rgb8)
        .context("encoding the chart as PNG")?;
    Ok(candle_distributed::checkpoint::write_atomic(path, &png)?)
}

/// One panel: `what` of the training and validation sets (`pick`) per epoch, from 0 to `top`,
/// with its legend in the right-hand corner the curves end away from.
fn panel<DB: DrawingBackend>(
    area: &DrawingArea<DB, plotters::coord::Shift>,
    what: &str,
    top: f64,
    rows: &[EpochMetrics],
    pick: impl Fn(&EpochMetrics) -> (f64, f64),
) -> Result<()> {
    // Integer epochs: ticks fall on whole epochs.
    let last = rows.iter().map(|m| m.epoch).max().unwrap_or(1).max(2) as u32;
    let mut chart = ChartBuilder::on(area)
        .caption(what, ("sans-serif", 18))
        .margin(12)
        .x_label_area_size(40)
        .y_label_area_size(55)
        .build_cartesian_2d(1..last, 0.0..top)
        .map_err(|e| anyhow!("{what} panel: {e}"))?;
    chart
        .configure_mesh()
        .x_desc("epoch")
        .y_desc(what)
        .light_line_style(BLACK.mix(0.05))
        .y_label_formatter(&|y| {
            if top >= 10.0 {
                format!("{y:.0}")
            } else {
                format!("{y:.1}")
            }
        })
        .draw()
        .map_err(|e| anyhow!("{what} panel: {e}"))?;
    for (name, colour, train) in [
        ("training", TRAIN_COLOUR, true),
        ("validation", VAL_COLOUR, false),
    ] {
        let points = rows.iter().map(|m| {
            let (t, v) = pick(m);
            (m.epoch as u32, if train { t } else { v })
        });
        chart
            .draw_series(LineSeries::new(points.clone(), colour.stroke_width(2)))
            .map_err(|e| anyhow!("{what} panel: {e}"))?
            .label(name)
            .legend(move |(x, y)| PathElement::new([(x, y), (x + 20, y)], colour.stroke_width(2)));
        chart
            .draw_series(points.map(|p| Circle::new(p, 3, colour.filled())))
            .map_err(|e| anyhow!("{what} panel: {e}"))?;
    }
    let ends_high = rows.last().is_some_and(|m| {
        let (t, v) = pick(m);
        t.max(v) > top / 2.0
    });
    let legend = if ends_high {
        SeriesLabelPosition::LowerRight
    } else {
        SeriesLabelPosition::UpperRight
    };
    chart
        .configure_series_labels()
        .position(legend)
        .background_style(WHITE.mix(0.85))
        .border_style(BLACK)
        .draw()
        .map_err(|e| anyhow!("{what} panel: {e}"))?;
    Ok(())
}
