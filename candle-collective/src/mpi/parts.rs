//! An all-reduce of several parts on MPI without the concatenation: large parts are reduced
//! where they lie, each into its place in the result, and the smaller parts between them are
//! copied end to end and reduced together.

use candle_core::{DType, Result, Storage, Tensor, WithDType};
use mpi::traits::Equivalence;

use super::host::{avg_dtype, invalid, shape_code, HostBuf};
use super::{all_reduce_as_one, mpi_op, received, AllReduce, MpiCollective, Op, ReduceOp};

/// Parts of at least this many elements are read in place, one MPI call each; smaller ones are
/// copied into the run they belong to, so that a bucket of many small parts (biases, batch-norm
/// weights) does not make as many calls. Chosen, not tuned: only a 25 MiB part was timed.
const IN_PLACE_PART: usize = 1 << 16;

/// The input of one MPI call of an all-reduce of several parts.
enum Run<T> {
    /// A contiguous host part of at least [`IN_PLACE_PART`] elements.
    InPlace(Tensor),
    /// A strided part of at least [`IN_PLACE_PART`] elements, copied; or consecutive smaller
    /// parts, copied end to end.
    Copied(Vec<T>),
}

/// `parts` cut into runs, in order. Where a run ends depends on the element counts alone
/// (which the ranks agree on): a part of at least [`IN_PLACE_PART`] elements is a run of its
/// own, read in place when contiguous and copied when not, so that ranks whose parts differ
/// only in layout make the same MPI calls.
fn runs<T: WithDType>(parts: &[Tensor]) -> Result<Vec<Run<T>>> {
    let mut runs = Vec::new();
    let mut copied: Vec<T> = Vec::new();
    for p in parts {
        if p.elem_count() >= IN_PLACE_PART {
            if !copied.is_empty() {
                runs.push(Run::Copied(std::mem::take(&mut copied)));
            }
            runs.push(match p.is_contiguous() {
                true => Run::InPlace(p.clone()),
                false => Run::Copied(p.flatten_all()?.to_vec1::<T>()?),
            });
        } else {
            copied.extend(p.flatten_all()?.to_vec1::<T>()?);
        }
    }
    if !copied.is_empty() {
        runs.push(Run::Copied(copied));
    }
    Ok(runs)
}

impl MpiCollective {
    /// [`crate::Collective::all_reduce_with`] of checked `parts` (at least one,
    /// one dtype and device): host parts of f32 or f64 without a wire by runs, into a `[Σ nᵢ]`
    /// result; anything else by the concatenation. The ranks agree on a call by runs with the
    /// parts' element counts in its descriptor, since the runs decide which MPI calls follow:
    /// parts that differ between ranks are a mismatch, not a hang.
    pub(super) fn all_reduce_parts_in_place(
        &self,
        parts: &[Tensor],
        rop: ReduceOp,
        wire: Option<DType>,
    ) -> Result<Tensor> {
        let first = &parts[0];
        let n: usize = parts.iter().map(Tensor::elem_count).sum();
        let counts: Vec<usize> = parts.iter().map(Tensor::elem_count).collect();
        // Negative: no other call's argument (0, or a wire's code plus 1) takes that range.
        let desc = Self::descriptor(Op::AllReduce(rop), first, &[n], -1 - shape_code(&counts));
        let recv = match (wire, first.device().is_cpu(), first.dtype()) {
            (None, true, DType::F32) => HostBuf::F32(self.reduce_runs(parts, rop, n, desc)?),
            (None, true, DType::F64) => HostBuf::F64(self.reduce_runs(parts, rop, n, desc)?),
            _ => {
                let options = AllReduce { wire, ..rop.into() };
                return all_reduce_as_one(self, parts, options);
            }
        };
        self.finish(recv, &[n], first.dtype(), first.device(), rop, None)
    }

    /// The sum (or maximum, minimum) of the runs of `parts`, one MPI call per run, each into
    /// its place in the `n` values of the result.
    fn reduce_runs<T: WithDType + Equivalence>(
        &self,
        parts: &[Tensor],
        rop: ReduceOp,
        n: usize,
        desc: [i64; 4],
    ) -> Result<Vec<T>> {
        // Everything that can fail happens before the ranks agree, as this rank's verdict: once
        // they have, every rank makes every MPI call of the runs.
        let runs = runs::<T>(parts).map_err(|e| format!("copying the parts failed: {e}"));
        let guards: Vec<_> = match &runs {
            Ok(runs) => runs
                .iter()
                .map(|r| match r {
                    Run::InPlace(t) => Some(t.storage_and_layout()),
                    Run::Copied(_) => None,
                })
                .collect(),
            Err(_) => Vec::new(),
        };
        let slices = runs.as_ref().map_err(Clone::clone).and_then(|runs| {
            runs.iter()
                .zip(&guards)
                .map(|(run, guard)| match (run, guard) {
                    (Run::Copied(v), _) => Ok(v.as_slice()),
                    (Run::InPlace(_), Some((storage, layout))) => {
                        let values = match &**storage {
                            Storage::Cpu(c) => c.as_slice::<T>().map_err(|e| e.to_string())?,
                            _ => return Err("a part is not on the host".to_string()),
                        };
                        let (a, b) = layout
                            .contiguous_offsets()
                            .ok_or_else(|| "a part is not contiguous".to_string())?;
                        Ok(&values[a..b])
                    }
                    (Run::InPlace(_), None) => {
                        unreachable!("every part read in place has its guard")
                    }
                })
                .collect::<std::result::Result<Vec<&[T]>, String>>()
        });
        let local = avg_dtype(&parts[0], rop)
            .and_then(|()| slices.as_ref().map(|_| ()).map_err(Clone::clone));
        self.agree(OP, desc, Some((parts[0].dtype(), n)), local)?;
        let slices = slices.map_err(|e| invalid(OP, e))?;
        let mpi_op = mpi_op(rop);
        Ok(received(n, |r| {
            let mut at = 0;
            for s in &slices {
                self.all_reduce_into(OP, s, &mut r[at..at + s.len()], mpi_op);
                at += s.len();
            }
        }))
    }
}

const OP: &str = "all_reduce";
