//! Launch configurations of the CUDA kernels in `kernels/*.cu`: one function per kernel family,
//! used by the CUDA path and by the emulation tests alike, so that both run the same grids.
//!
//! Every input is seen as `(n, c, hw)`: `N` batch entries, `C` channels and `HW` positions per
//! channel and entry (`(N, C, *)`, or `(N, *, C)` with `channels_last`, where the `N·HW` rows of
//! `C` channels are contiguous). Grids use ceiling divisions, never power-of-two rounding.
//! The [`Launch`] they return is named, with `Call`, `Arg` and `Buffer`, at one path:
//! `candle_distributed::args`.

use crate::device::Launch;

/// Threads per block of the channels-first kernels (`BN_THREADS` in `kernels/reduce.cuh`).
pub const THREADS: u32 = 256;
/// Rows per block of the channels-last kernels; blocks are 32 channels × `ROWS` rows
/// (`BN_ROWS` in `kernels/reduce.cuh`).
pub const ROWS: u32 = 8;
/// Blocks a reduction aims for, about two per SM of a large GPU (132 SMs on an H100).
const TARGET_BLOCKS: u64 = 264;
/// Largest number of blocks one channel's reduction is split over.
const MAX_SPLITS: u64 = 64;
/// Fewest elements per channel a split block reduces (channels-first).
const MIN_SPLIT_ELEMS: u64 = 4096;
/// Fewest rows a split block reduces (channels-last, 32 channels each).
const MIN_SPLIT_ROWS: u64 = 512;
/// Elements per thread the element-wise kernels aim for.
const ELEMS_PER_THREAD: u64 = 4;
/// Largest grid y and z dimension.
const MAX_GRID_Y: u64 = 65_535;

/// A per-channel reduction (`bn_stats_*`, `bn_backward_reduce_*`) and the scratch it needs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Reduction {
    /// The launch; `grid[1]` is the number of splits of each channel's reduction.
    pub launch: Launch,
    /// f64 values of the partial-sum workspace: `[splits, 2, C]` (0 without a split).
    pub work_len: usize,
    /// u32 arrival counters that must be zero before the first launch (the kernels reset them):
    /// one per channel (channels-first) or per 32 channels (channels-last).
    pub counters: usize,
}

fn clamp(v: u64, lo: u64, hi: u64) -> u64 {
    v.max(lo).min(hi)
}

/// Configuration of `bn_stats_{nchw,nhwc}_*` and `bn_backward_reduce_{nchw,nhwc}_*`.
///
/// Channels-first: grid `(C, splits)`, block `THREADS`. Channels-last: grid
/// `(ceil(C/32), splits)`, block `(32, ROWS)`. A channel is split over several blocks when there
/// are too few channels to fill the GPU and enough elements per channel; the last block of a
/// channel to finish sums the partials. `None` when `c` is 0 (nothing to launch).
pub fn reduction(n: usize, c: usize, hw: usize, channels_last: bool) -> Option<Reduction> {
    if c == 0 {
        return None;
    }
    let per_channel = (n as u64) * (hw as u64);
    let (gx, block, splits) = if channels_last {
        let gx = (c as u64).div_ceil(32);
        let by_size = per_channel / MIN_SPLIT_ROWS;
        let splits = clamp(TARGET_BLOCKS.div_ceil(gx).min(by_size), 1, MAX_SPLITS);
        (gx, [32, ROWS, 1], splits)
    } else {
        let gx = c as u64;
        let by_size = per_channel / MIN_SPLIT_ELEMS;
        let splits = clamp(TARGET_BLOCKS.div_ceil(gx).min(by_size), 1, MAX_SPLITS);
        (gx, [THREADS, 1, 1], splits)
    };
    Some(Reduction {
        launch: Launch {
            grid: [gx as u32, splits as u32, 1],
            block,
            shared_mem_bytes: 0,
        },
        work_len: if splits > 1 {
            2 * c * splits as usize
        } else {
            0
        },
        counters: gx as usize,
    })
}

/// Configuration of `bn_apply_{nchw,nhwc}_*` and `bn_backward_elemt_{nchw,nhwc}_*`.
///
/// Channels-first: grid `(N·C, chunks of HW)`, block `THREADS`. Channels-last: grid
/// `(ceil(C/32), row chunks)`, block `(32, ROWS)`. `None` for an empty input.
pub fn elementwise(n: usize, c: usize, hw: usize, channels_last: bool) -> Option<Launch> {
    if n == 0 || c == 0 || hw == 0 {
        return None;
    }
    let (grid, block) = if channels_last {
        let rows = (n as u64) * (hw as u64);
        let per_block = u64::from(ROWS) * ELEMS_PER_THREAD;
        let gy = clamp(rows.div_ceil(per_block), 1, MAX_GRID_Y);
        ([(c as u64).div_ceil(32), gy], [32, ROWS, 1])
    } else {
        let per_block = u64::from(THREADS) * ELEMS_PER_THREAD;
        let gy = clamp((hw as u64).div_ceil(per_block), 1, MAX_GRID_Y);
        ([(n as u64) * (c as u64), gy], [THREADS, 1, 1])
    };
    Some(Launch {
        grid: [grid[0] as u32, grid[1] as u32, 1],
        block,
        shared_mem_bytes: 0,
    })
}

/// Configuration of `bn_finalize_*`: one thread per channel. `None` when `c` is 0.
pub fn finalize(c: usize) -> Option<Launch> {
    (c > 0).then(|| Launch {
        grid: [(c as u64).div_ceil(u64::from(THREADS)) as u32, 1, 1],
        block: [THREADS, 1, 1],
        shared_mem_bytes: 0,
    })
}

/// Largest grid of a grid-stride launch: enough blocks to fill any GPU many times over.
const MAX_GRID_STRIDE_BLOCKS: u64 = 1 << 16;

/// Configuration of a one-thread-per-element kernel with a grid-stride loop
/// (`max_pool2d_{fwd,bwd}_*`): block `THREADS`, `ceil(total / THREADS)` blocks, at most
/// 65536. `None` when `total` is 0.
pub fn grid_stride(total: usize) -> Option<Launch> {
    (total > 0).then(|| Launch {
        grid: [
            (total as u64)
                .div_ceil(u64::from(THREADS))
                .min(MAX_GRID_STRIDE_BLOCKS) as u32,
            1,
            1,
        ],
        block: [THREADS, 1, 1],
        shared_mem_bytes: 0,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn grids_cover_every_channel_by_ceiling_division() {
        let r = reduction(2, 65, 3, true).unwrap();
        assert_eq!(r.launch.grid[0], 3, "65 channels need 3 groups of 32");
        assert_eq!(r.counters, 3);
        let r = reduction(2, 65, 3, false).unwrap();
        assert_eq!(r.launch.grid[0], 65);
        let e = elementwise(3, 65, 5, true).unwrap();
        assert_eq!(e.grid[0], 3);
        assert_eq!(finalize(257).unwrap().grid[0], 2);
        assert_eq!(grid_stride(257).unwrap().grid[0], 2);
        assert_eq!(grid_stride(usize::MAX >> 8).unwrap().grid[0], 1 << 16);
        assert!(grid_stride(0).is_none());
    }

    #[test]
    fn small_channel_counts_with_large_batches_split() {
        let r = reduction(64, 1, 128 * 128, false).unwrap();
        assert!(r.launch.grid[1] > 1);
        assert_eq!(r.work_len, 2 * r.launch.grid[1] as usize);
        let r = reduction(2, 2048, 4, false).unwrap();
        assert_eq!(r.launch.grid[1], 1, "enough channels: no split");
        assert_eq!(r.work_len, 0);
        assert!(
            reduction(0, 4, 4, true).is_some(),
            "an empty batch still writes zeros"
        );
        assert!(elementwise(0, 4, 4, true).is_none());
    }
}
