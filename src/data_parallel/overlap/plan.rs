//! The buckets of one overlapped step and where each starts.

use candle_core::Var;

use super::Learned;

/// The buckets of one step, as indices into the trainable variables: first the hooked ones in
/// the order their gradients arrive (learned on the first backward; before it, the reverse of
/// the order the model took them), then the trainable variables the model does not take through
/// the hooks, in name order.
#[derive(Debug)]
pub(in crate::data_parallel) struct Plan {
    pub buckets: Vec<Vec<usize>>,
    /// Trainable index of each hooked variable (by hook index; `None`: not trainable).
    pub of_hook: Vec<Option<usize>>,
    /// Whether each trainable variable is hooked.
    pub hooked: Vec<bool>,
    /// The bucket of each trainable variable.
    pub bucket_of: Vec<usize>,
    /// Where each bucket starts: after this many announced collectives of the backward (see
    /// the module's documentation); `None` on the first step (every bucket after the backward).
    pub at: Option<Vec<usize>>,
}

impl Plan {
    /// `params`: the trainable variables; `hooked`: the hooked variables in the order the model
    /// took them; `learned`: what the previous overlapped backward agreed, if any. Buckets of
    /// at most `bucket_bytes` (or one variable) of one dtype and device.
    pub fn new(
        params: &[(String, Var)],
        hooked: &[Var],
        bucket_bytes: usize,
        learned: Option<&Learned>,
    ) -> Self {
        let index: std::collections::HashMap<candle_core::TensorId, usize> = (params.iter())
            .enumerate()
            .map(|(i, (_, v))| (v.as_tensor().id(), i))
            .collect();
        let of_hook: Vec<Option<usize>> = (hooked.iter())
            .map(|v| index.get(&v.as_tensor().id()).copied())
            .collect();
        let mut is_hooked = vec![false; params.len()];
        for &p in of_hook.iter().flatten() {
            is_hooked[p] = true;
        }
        let mut placed = vec![false; params.len()];
        let mut order = Vec::with_capacity(params.len());
        let learned_order = learned.map_or(&[][..], |l| &l.order).iter().copied();
        let built = of_hook.iter().rev().flatten().copied();
        for p in learned_order
            .filter(|&p| p < params.len() && is_hooked[p])
            .chain(built)
        {
            if !std::mem::replace(&mut placed[p], true) {
                order.push(p);
            }
        }
        order.extend((0..params.len()).filter(|&p| !is_hooked[p]));
        let mut buckets: Vec<Vec<usize>> = Vec::new();
        let mut bucket_of = vec![0; params.len()];
        let mut bytes = 0;
        for p in order {
            let v = &params[p].1;
            let size = v.elem_count() * v.dtype().size_in_bytes();
            let fits = buckets.last().is_some_and(|b| {
                let first = &params[b[0]].1;
                // A bucket never mixes hooked and plain variables: a plain one would hold
                // the hooked ones back until the backward ends.
                is_hooked[b[0]] == is_hooked[p]
                    && first.dtype() == v.dtype()
                    && first.device().same_device(v.device())
                    && bytes + size <= bucket_bytes
            });
            if !fits {
                buckets.push(Vec::new());
                bytes = 0;
            }
            buckets.last_mut().unwrap().push(p);
            bucket_of[p] = buckets.len() - 1;
            bytes += size;
        }
        let at = learned.map(|l| places(&buckets, &is_hooked, l));
        Self {
            buckets,
            of_hook,
            hooked: is_hooked,
            bucket_of,
            at,
        }
    }
}

/// Each bucket's place: the latest arrival of its variables on the last step, never before an
/// earlier bucket's; a bucket of variables the model does not take through the hooks gets
/// `usize::MAX` (their gradients exist only once the backward returned).
fn places(buckets: &[Vec<usize>], hooked: &[bool], learned: &Learned) -> Vec<usize> {
    let mut at = Vec::with_capacity(buckets.len());
    let mut floor = 0;
    for b in buckets {
        let place = if hooked[b[0]] {
            let arrived = b
                .iter()
                .filter_map(|&p| learned.arrived.get(p).copied().flatten());
            arrived.max().unwrap_or(0).max(floor)
        } else {
            usize::MAX
        };
        floor = place;
        at.push(place);
    }
    at
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Places never go back, a bucket's place is its latest variable's, a bucket whose
    /// variables arrived nowhere takes the place before it, plain buckets come last.
    #[test]
    fn places_follow_the_latest_arrival() {
        let learned = Learned {
            order: vec![],
            arrived: vec![Some(0), Some(2), Some(1), None, Some(3), None],
            announced: 3,
        };
        let buckets = vec![vec![0], vec![1, 2], vec![2], vec![3], vec![4], vec![5]];
        let hooked = [true, true, true, true, true, false];
        assert_eq!(
            places(&buckets, &hooked, &learned),
            vec![0, 2, 2, 2, 3, usize::MAX]
        );
    }
}
