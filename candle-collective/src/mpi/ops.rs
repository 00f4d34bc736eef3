//! The `Collective` interface of MPI ranks: argument checks agreed on by every rank, then the
//! MPI collective on host buffers.

use std::sync::Arc;

use candle_core::{DType, Device, Result, Tensor};
use mpi::datatype::PartitionMut;
use mpi::traits::*;

use super::*;

impl Collective for MpiCollective {
    fn rank(&self) -> usize {
        self.rank
    }

    fn world_size(&self) -> usize {
        self.world
    }

    fn recorder(&self) -> Option<&super::super::recorder::FlightRecorder> {
        Some(&self.recorder)
    }

    /// One tensor is reduced on the host after the ranks agree on the call; on a wire of f16
    /// or bf16, an f32 tensor's values are rounded in the host buffer instead of cast. Host
    /// parts of f32 or f64 without a wire are reduced where they lie (see
    /// `MpiCollective::reduce_parts`). `in_place` changes nothing: the result is made on the host.
    ///
    /// # Errors
    ///
    /// As [`Collective::all_reduce_with`]; also when a tensor cannot be copied to the host or the
    /// result back to its device. A timeout aborts the MPI job instead of returning.
    fn all_reduce_with(&self, parts: &[Tensor], options: AllReduce) -> Result<Tensor> {
        match (parts, options.wire) {
            ([t], None) => self.reduce_one(t, options.op),
            ([t], Some(w)) => self.reduce_wire(t, options.op, w),
            _ => self.reduce_parts(parts, options.op, options.wire),
        }
    }

    /// All-reduce on the host, after the ranks agree on the call, then this rank's rows.
    ///
    /// # Errors
    ///
    /// As [`Collective::reduce_scatter`]; also when the tensor cannot be copied to the host or the
    /// result back to its device. A timeout aborts the MPI job instead of returning.
    fn reduce_scatter(&self, t: &Tensor, op: ReduceOp) -> Result<Tensor> {
        const OP: &str = "reduce_scatter";
        let desc = Self::descriptor(Op::ReduceScatter(op), t, t.dims(), 0);
        let local = avg_dtype(t, op).and_then(|()| {
            scatter_rows(t, self.rank, self.world)
                .map(|_| ())
                .map_err(|e| e.to_string())
        });
        let send = HostBuf::staged_source(t);
        self.agree(OP, desc, input_of(t), send.verdict(local))?;
        let full = self.reduce(OP, send.take(OP)?, t, op, None)?;
        scatter_rows(&full, self.rank, self.world)
    }

    /// Variable-count all-gather on the host, after the ranks agree on the call and exchange their
    /// row counts.
    ///
    /// # Errors
    ///
    /// As [`Collective::all_gather`]; also when the tensor cannot be copied to the host or the
    /// result back to its device. A timeout aborts the MPI job instead of returning.
    fn all_gather(&self, t: &Tensor) -> Result<Tensor> {
        const OP: &str = "all_gather";
        let rest = t.dims().get(1..).unwrap_or(&[]);
        let local = if t.rank() == 0 {
            Err("expected a tensor of rank ≥ 1".to_string())
        } else {
            Ok(())
        };
        let desc = Self::descriptor(Op::AllGather, t, rest, t.rank() as i64);
        let send = HostBuf::staged(t);
        self.agree(OP, desc, input_of(t), send.verdict(local))?;
        let send = send.take(OP)?;
        let row: usize = rest.iter().product();
        let mut rows = vec![0i64; self.world];
        let mine = [t.dims()[0] as i64];
        mpi::request::scope(|scope| {
            let req = locked(|| {
                self.comm
                    .immediate_all_gather_into(scope, &mine[..], &mut rows[..])
            });
            self.wait(OP, req);
        });
        // MPI counts and displacements are i32: the same verdict on every rank (same `rows`).
        let total_elems: i64 = rows.iter().sum::<i64>() * row as i64;
        if total_elems > i32::MAX as i64 {
            return Err(invalid(
                OP,
                format!(
                    "{total_elems} gathered elements exceed MPI's i32 counts (row counts {rows:?})"
                ),
            ));
        }
        let counts: Vec<i32> = rows.iter().map(|&n| (n as usize * row) as i32).collect();
        let displs: Vec<i32> = counts
            .iter()
            .scan(0i32, |acc, &c| {
                let d = *acc;
                *acc += c;
                Some(d)
            })
            .collect();
        let total: usize = counts.iter().map(|&c| c as usize).sum();
        // Every value is written: the ranks' parts tile the buffer (`displs` are the counts'
        // running sums).
        macro_rules! gather {
            ($s:expr) => {
                received(total, |r| {
                    let mut part = PartitionMut::new(r, &counts[..], &displs[..]);
                    mpi::request::scope(|scope| {
                        let req = locked(|| {
                            self.comm
                                .immediate_all_gather_varcount_into(scope, &$s[..], &mut part)
                        });
                        self.wait(OP, req);
                    });
                })
            };
        }
        let recv = match &send {
            HostBuf::F32(s) => HostBuf::F32(gather!(s)),
            HostBuf::F64(s) => HostBuf::F64(gather!(s)),
            HostBuf::I64(s) => HostBuf::I64(gather!(s)),
            HostBuf::U32(s) => HostBuf::U32(gather!(s)),
            HostBuf::U8(s) => HostBuf::U8(gather!(s)),
        };
        let mut dims = t.dims().to_vec();
        dims[0] = rows.iter().sum::<i64>() as usize;
        recv.into_tensor(&dims, t.dtype(), t.device())
    }

    /// Broadcast on the host, after the ranks agree on the call.
    ///
    /// # Errors
    ///
    /// As [`Collective::broadcast`]; also when the tensor cannot be copied to the host or the
    /// result back to its device. A timeout aborts the MPI job instead of returning.
    fn broadcast(&self, t: &Tensor, root: usize) -> Result<Tensor> {
        const OP: &str = "broadcast";
        let local = if root >= self.world {
            Err(format!(
                "root {root} out of range for world size {}",
                self.world
            ))
        } else {
            Ok(())
        };
        let send = HostBuf::staged(t);
        self.agree(
            OP,
            Self::descriptor(Op::Broadcast(root), t, t.dims(), root as i64),
            input_of(t),
            send.verdict(local),
        )?;
        let mut buf = send.take(OP)?;
        let root_proc = self.comm.process_at_rank(root as i32);
        with_buf!(&mut buf, v => mpi::request::scope(|scope| {
            let req = locked(|| root_proc.immediate_broadcast_into(scope, &mut v[..]));
            self.wait(OP, req);
        }));
        buf.into_tensor(t.dims(), t.dtype(), t.device())
    }

    /// Barrier, after the ranks agree on the call.
    ///
    /// # Errors
    ///
    /// As [`Collective::barrier`]. A timeout aborts the MPI job instead of returning.
    fn barrier(&self) -> Result<()> {
        let token = Tensor::zeros(1, DType::U8, &Device::Cpu)?;
        self.agree(
            "barrier",
            Self::descriptor(Op::Barrier, &token, token.dims(), 0),
            None,
            Ok(()),
        )?;
        let req = locked(|| self.comm.immediate_barrier());
        self.wait("barrier", req);
        Ok(())
    }

    /// `MPI_Comm_split`, after the ranks agree on the call and on the validity of their arguments.
    ///
    /// # Errors
    ///
    /// As [`Collective::split`]. A timeout aborts the MPI job instead of returning.
    fn split(&self, color: Option<u32>, key: u32) -> Result<Option<Arc<dyn Collective>>> {
        const OP: &str = "split";
        let as_i32 =
            |what: &str, v: u32| i32::try_from(v).map_err(|_| format!("{what} {v} exceeds i32"));
        let checked = color
            .map(|c| as_i32("color", c))
            .transpose()
            .and_then(|c| Ok((c, as_i32("key", key)?)));
        let token = Tensor::zeros(1, DType::U8, &Device::Cpu)?;
        // MPI_Comm_split blocks while holding the process's MPI lock (MPI has no nonblocking
        // split): the agreement first (a polled all-gather, the lock released between polls, so
        // this process's communication thread keeps progressing), after which every rank's
        // split returns promptly unless a rank dies in between (then mpirun ends the job, its
        // default). The duplicate of the new communicator is polled (`duplicate`).
        self.agree(
            OP,
            Self::descriptor(Op::Split, &token, token.dims(), 0),
            None,
            checked.as_ref().map(|_| ()).map_err(Clone::clone),
        )?;
        let (color, key) = checked.expect("agreed above: every rank's arguments are valid");
        let color = color.map_or(Color::undefined(), Color::with_value);
        let sub = locked(|| self.comm.split_by_color_with_key(color, key));
        Ok(sub.map(|c| {
            Arc::new(MpiCollective::new(c, self._env.clone(), self.timeout, true))
                as Arc<dyn Collective>
        }))
    }

    /// [`Collective::all_reduce_with`] on a duplicate of the communicator, run by this rank's
    /// communication thread on copies of the parts (a wire rounded on the host, as the blocking
    /// call rounds it).
    ///
    /// # Errors
    ///
    /// As [`Collective::start_all_reduce`]: only a communication thread that cannot be started or
    /// has stopped fails here; the failures of [`Collective::all_reduce_with`] come from
    /// [`Pending::wait`].
    fn start_all_reduce(&self, parts: &[Tensor], options: AllReduce) -> Result<Pending> {
        check_parts(parts)?;
        let input = parts
            .iter()
            .map(super::own_copy)
            .collect::<Result<Vec<_>>>()?;
        // Every copy is queued before the hand-off's mark: the first part's stream orders them.
        let first = input[0].clone();
        self.start(&first, move |c| c.all_reduce_with(&input, options))
    }

    /// [`Collective::all_gather`] on a duplicate of the communicator, run by this rank's
    /// communication thread.
    ///
    /// # Errors
    ///
    /// As [`Collective::all_gather_async`]: only a communication thread that cannot be started or
    /// has stopped fails here; the failures of [`Collective::all_gather`] come from
    /// [`Pending::wait`].
    fn all_gather_async(&self, t: &Tensor) -> Result<Pending> {
        let input = super::own_copy(t)?;
        self.start(&input.clone(), move |c| c.all_gather(&input))
    }

    /// [`Collective::reduce_scatter`] on a duplicate of the communicator, run by this rank's
    /// communication thread.
    ///
    /// # Errors
    ///
    /// As [`Collective::reduce_scatter_async`]: only a communication thread that cannot be started
    /// or has stopped fails here; the failures of [`Collective::reduce_scatter`] come from
    /// [`Pending::wait`].
    fn reduce_scatter_async(&self, t: &Tensor, op: ReduceOp) -> Result<Pending> {
        let input = super::own_copy(t)?;
        self.start(&input.clone(), move |c| c.reduce_scatter(&input, op))
    }
}

/// The all-reduce's forms on MPI ranks, behind [`Collective::all_reduce_with`].
impl MpiCollective {
    /// All-reduce on the host, after the ranks agree on the call.
    ///
    /// # Errors
    ///
    /// As [`Collective::all_reduce`]; also when the tensor cannot be copied to the host or the
    /// result back to its device. A timeout aborts the MPI job instead of returning.
    fn reduce_one(&self, t: &Tensor, op: ReduceOp) -> Result<Tensor> {
        const OP: &str = "all_reduce";
        let desc = Self::descriptor(Op::AllReduce(op), t, t.dims(), 0);
        let send = HostBuf::staged_source(t);
        self.agree(OP, desc, input_of(t), send.verdict(avg_dtype(t, op)))?;
        self.reduce(OP, send.take(OP)?, t, op, None)
    }

    /// The all-reduce of host parts of f32 or f64, without a wire, reads every contiguous part
    /// of at least 64 Ki elements where it lies and reduces it into its place in the result
    /// (one MPI call each); the parts between those are copied end to end and reduced with
    /// one call per run. This saves the concatenation's copy of the large parts, which
    /// `DataParallel::sync_gradients` sends. Other parts (f16, bf16, integers, not on the host)
    /// and a wire take the default: the concatenation, all-reduced.
    ///
    /// # Errors
    ///
    /// As [`Collective::all_reduce_with`] of several parts; ranks whose parts differ in number or element counts
    /// make a mismatch on every rank, parts refused on one rank (none, mixed dtypes or devices)
    /// an invalid argument on every rank, and parts that differ only in layout (contiguous on
    /// one rank, strided on another) the same MPI calls. A timeout aborts the MPI job instead
    /// of returning.
    fn reduce_parts(&self, parts: &[Tensor], op: ReduceOp, wire: Option<DType>) -> Result<Tensor> {
        if let Err(e) = check_parts(parts) {
            // This rank's refusal is its verdict in the agreement the other ranks make for
            // their call: the call fails on every rank, with the reason, and no rank waits.
            let desc = [Op::AllReduce(op).code(), -1, -1, -1];
            self.agree("all_reduce", desc, None, Err(e.to_string()))?;
            return Err(e);
        }
        self.all_reduce_parts_in_place(parts, op, wire)
    }

    /// All-reduce of an f32 tensor on an f16 or bf16 wire: each value rounded to the wire dtype
    /// in the host buffer, summed in f32 by MPI (which has no 16-bit float type, so the values
    /// travel as f32 whatever the wire), averaged, rounded again: the default's result (cast,
    /// reduce, cast back), without its two casts. Other dtypes and wires take the default.
    ///
    /// # Errors
    ///
    /// As [`Collective::all_reduce_with`] with a wire; also when the tensor cannot be copied to the host or
    /// the result back to its device. A timeout aborts the MPI job instead of returning.
    fn reduce_wire(&self, t: &Tensor, op: ReduceOp, wire: DType) -> Result<Tensor> {
        const OP: &str = "all_reduce";
        check_wire(t, wire)?;
        if t.dtype() != DType::F32 || !matches!(wire, DType::F16 | DType::BF16) {
            return all_reduce_as_one(self, std::slice::from_ref(t), AllReduce::new(op).wire(wire));
        }
        // The wire rides in the descriptor: a rank calling `all_reduce` meanwhile is a mismatch.
        let desc = Self::descriptor(Op::AllReduce(op), t, t.dims(), 1 + dtype_code(wire));
        let send = HostBuf::staged_source(t);
        self.agree(OP, desc, input_of(t), send.verdict(avg_dtype(t, op)))?;
        let rounded = send.take(OP)?.with_slice(|s| match s {
            HostSlice::F32(v) => {
                let mut out = vec![0f32; v.len()];
                Wire::to(Some(wire)).round_from(v, &mut out);
                Ok(out)
            }
            _ => Err(invalid(OP, "an f32 input staged as another type".into())),
        })??;
        self.reduce(
            OP,
            host::Source::Copy(HostBuf::F32(rounded)),
            t,
            op,
            Some(wire),
        )
    }
}
