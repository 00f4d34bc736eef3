//! Which collective a call is: one vocabulary for every backend's errors and cross-rank checks.

use super::ReduceOp;

/// A collective operation with the arguments that every rank must pass alike (new operations
/// may be added in a minor release).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum Op {
    /// [`super::Collective::all_reduce`] with its reduction.
    AllReduce(ReduceOp),
    /// [`super::Collective::reduce_scatter`] with its reduction.
    ReduceScatter(ReduceOp),
    /// [`super::Collective::all_gather`].
    AllGather,
    /// [`super::Collective::broadcast`] from the root rank.
    Broadcast(usize),
    /// [`super::Collective::barrier`].
    Barrier,
    /// [`super::Collective::split`].
    Split,
}

impl Op {
    /// The operation's name, as in the `Collective` method (`"all_reduce"`, …).
    pub fn name(self) -> &'static str {
        match self {
            Op::AllReduce(_) => "all_reduce",
            Op::ReduceScatter(_) => "reduce_scatter",
            Op::AllGather => "all_gather",
            Op::Broadcast(_) => "broadcast",
            Op::Barrier => "barrier",
            Op::Split => "split",
        }
    }

    /// A number that differs between operations and between their reductions (not the root,
    /// which backends compare separately), stable across processes and versions of one build.
    pub fn code(self) -> i64 {
        let reduction = |op: ReduceOp| match op {
            ReduceOp::Sum => 1,
            ReduceOp::Avg => 2,
            ReduceOp::Max => 3,
            ReduceOp::Min => 4,
        };
        match self {
            Op::AllReduce(r) => 10 + reduction(r),
            Op::ReduceScatter(r) => 20 + reduction(r),
            Op::AllGather => 30,
            Op::Broadcast(_) => 40,
            Op::Barrier => 50,
            Op::Split => 60,
        }
    }
}

impl std::fmt::Display for Op {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Op::AllReduce(r) | Op::ReduceScatter(r) => write!(f, "{}({r:?})", self.name()),
            Op::Broadcast(root) => write!(f, "broadcast(root={root})"),
            _ => f.write_str(self.name()),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_codes_and_display() {
        let all = [
            Op::AllReduce(ReduceOp::Sum),
            Op::AllReduce(ReduceOp::Avg),
            Op::AllReduce(ReduceOp::Max),
            Op::AllReduce(ReduceOp::Min),
            Op::ReduceScatter(ReduceOp::Sum),
            Op::AllGather,
            Op::Broadcast(2),
            Op::Barrier,
            Op::Split,
        ];
        let codes: std::collections::HashSet<i64> = all.iter().map(|o| o.code()).collect();
        assert_eq!(codes.len(), all.len(), "every operation has its own code");
        assert_eq!(Op::Broadcast(3).to_string(), "broadcast(root=3)");
        assert_eq!(Op::AllReduce(ReduceOp::Avg).to_string(), "all_reduce(Avg)");
        assert_eq!(Op::Split.to_string(), "split");
    }
}
