//! Where the channel dimension of an input sits.

/// The memory layout of a batch-norm input: where its channel dimension `C` sits.
///
/// The ops and [`crate::SyncBatchNorm`] take inputs of rank 2 to 5; `*` below stands for the
/// spatial dimensions (none, `L`, `H, W` or `D, H, W`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub enum ChannelLayout {
    /// `(N, C, *)`: NCHW for images, PyTorch's default.
    #[default]
    ChannelsFirst,
    /// `(N, *, C)`: NHWC for images, the shape of PyTorch's `channels_last` memory format.
    ChannelsLast,
}

impl ChannelLayout {
    /// True for [`ChannelLayout::ChannelsLast`].
    pub fn is_channels_last(self) -> bool {
        self == ChannelLayout::ChannelsLast
    }

    /// The number of channels of an input of shape `dims` in this layout, or `None` unless
    /// its rank is 2 to 5.
    pub fn channels(self, dims: &[usize]) -> Option<usize> {
        if !(2..=5).contains(&dims.len()) {
            return None;
        }
        Some(match self {
            ChannelLayout::ChannelsFirst => dims[1],
            ChannelLayout::ChannelsLast => dims[dims.len() - 1],
        })
    }

    /// The shape in words, for error messages: `"(N, C, *)"` or `"(N, *, C)"`.
    pub fn describe(self) -> &'static str {
        match self {
            ChannelLayout::ChannelsFirst => "(N, C, *)",
            ChannelLayout::ChannelsLast => "(N, *, C)",
        }
    }
}
