//! The emulated gradient-packing kernel (`pack_*`) against the concatenation it replaces.

use candle_core::{Device, Tensor};
use candle_distributed::args::{Call, Pack, Segment, PACK_SEGS};

use crate::harness::*;

/// `pack_*` writes each gradient's values bit for bit, zeros for a missing one, and a 1 or 0
/// flag per gradient: the same buffer as `Tensor::cat` of the gradients, zeros and flags, for
/// segments of every length (empty, one value, more than a grid-stride sweep), a full launch of
/// [`PACK_SEGS`] segments followed by a second launch at an offset, in one block and as built.
#[test]
fn pack_matches_the_concatenation() {
    // (length, has a gradient) per variable.
    let vars: Vec<(usize, bool)> = (0..PACK_SEGS + 5)
        .map(|i| match i % 7 {
            0 => (70_000 + i, true),
            1 => (1, true),
            2 => (0, true),
            3 => (13 + i, false),
            4 => (0, false),
            _ => (5 * i + 3, true),
        })
        .collect();
    for (dtype, _) in DTYPES {
        let grads: Vec<Option<Tensor>> = (vars.iter().enumerate())
            .map(|(i, &(n, has))| {
                has.then(|| {
                    let v: Vec<f64> = (0..n)
                        .map(|j| ((i * 131 + j * 17) % 97) as f64 - 48.5)
                        .collect();
                    Tensor::from_vec(v, n, &Device::Cpu)
                        .unwrap()
                        .to_dtype(dtype)
                        .unwrap()
                })
            })
            .collect();
        let total: usize = vars.iter().map(|v| v.0).sum();
        let mut parts: Vec<Tensor> = (grads.iter().zip(&vars))
            .map(|(g, &(n, _))| {
                g.clone()
                    .unwrap_or_else(|| Tensor::zeros(n, dtype, &Device::Cpu).unwrap())
            })
            .collect();
        let flags: Vec<f64> = vars.iter().map(|v| f64::from(u8::from(v.1))).collect();
        parts.push(
            Tensor::new(flags, &Device::Cpu)
                .unwrap()
                .to_dtype(dtype)
                .unwrap(),
        );
        let want = Tensor::cat(&parts, 0).unwrap();
        for sched in SCHEDULES {
            for one_block in [false, true] {
                let mut srcs: Vec<Option<Buf>> =
                    grads.iter().map(|g| g.as_ref().map(Buf::of)).collect();
                let mut out = Buf::poisoned(dtype, &[total + vars.len()]);
                let (mut at, mut first) = (0, 0);
                for chunk in srcs.chunks_mut(PACK_SEGS) {
                    let segments: Vec<Segment> = (chunk.iter_mut().zip(&vars[first..]))
                        .map(|(b, &(len, present))| Segment {
                            src: b.as_mut().map(Buf::buffer),
                            len,
                            present,
                        })
                        .collect();
                    let pack = Pack {
                        out: out.buffer(),
                        at,
                        segments,
                        flags_at: Some(total + first),
                    };
                    let mut call: Call = pack.call("test", dtype).unwrap().unwrap();
                    if one_block {
                        call.launch.grid = [1, 1, 1];
                    }
                    run(&call, sched);
                    at += vars[first..first + chunk.len()]
                        .iter()
                        .map(|v| v.0)
                        .sum::<usize>();
                    first += chunk.len();
                }
                assert!(
                    out.bytes == Buf::of(&want).bytes,
                    "{dtype:?} {sched}, one block: {one_block}: the packed bytes differ"
                );
            }
        }
    }
}
