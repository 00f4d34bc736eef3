//! The one shape every batch-norm path sees: an input as `n` batch entries × `c` channels × `s`
//! positions, channels-first or channels-last.

use candle_core::{bail, Result};

use crate::layout::ChannelLayout;

/// An input seen as `n` batch entries × `c` channels × `s` positions.
///
/// Channels-first `(N, C, *)`: planes of `s` contiguous values, plane `p` is channel `p % c`.
/// Channels-last `(N, *, C)`: rows of `c` contiguous channels, `n · s` rows. The CPU paths
/// and the CUDA kernels' argument lists (`candle_distributed::args`) take this type.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Geometry {
    /// Batch entries.
    pub n: usize,
    /// Channels.
    pub c: usize,
    /// Positions per channel and entry (the product of the spatial dimensions).
    pub s: usize,
    /// Where the channels sit.
    pub layout: ChannelLayout,
}

impl Geometry {
    /// Reads the geometry of a shape of rank 2 to 5; another rank is an error naming `op`.
    ///
    /// # Errors
    ///
    /// When `dims` is not of rank 2 to 5.
    pub fn of(op: &str, dims: &[usize], layout: ChannelLayout) -> Result<Self> {
        let Some(c) = layout.channels(dims) else {
            let shape = layout.describe();
            bail!("{op}: expected an input of rank 2 to 5 {shape}, got shape {dims:?}")
        };
        let spatial = match layout {
            ChannelLayout::ChannelsFirst => &dims[2..],
            ChannelLayout::ChannelsLast => &dims[1..dims.len() - 1],
        };
        Ok(Self {
            n: dims[0],
            c,
            s: spatial.iter().product(),
            layout,
        })
    }

    /// Values per channel on this rank (`N · S`).
    pub fn count(&self) -> usize {
        self.n * self.s
    }

    /// Total number of elements.
    pub fn len(&self) -> usize {
        self.n * self.c * self.s
    }

    /// True for an input without elements.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// True when the channels are the contiguous dimension (channels-last, or `S = 1`).
    pub fn rows(&self) -> bool {
        self.layout.is_channels_last() || self.s == 1
    }

    /// The same input as rows of channels whenever its channels are contiguous ([`Self::rows`]):
    /// the form the CUDA path launches its kernels for (the row kernels serve `S = 1`).
    pub fn contiguous_channels_as_rows(&self) -> Self {
        let layout = if self.rows() {
            ChannelLayout::ChannelsLast
        } else {
            ChannelLayout::ChannelsFirst
        };
        Self { layout, ..*self }
    }
}
