//! NCCL's collectives on device memory, enqueued on the communicator's stream.

use super::*;

fn data_type(dtype: DType) -> sys::ncclDataType_t {
    use sys::ncclDataType_t as T;
    match dtype {
        DType::U8 => T::ncclUint8,
        DType::I8 => T::ncclInt8,
        DType::I32 => T::ncclInt32,
        DType::I64 => T::ncclInt64,
        DType::F16 => T::ncclFloat16,
        DType::BF16 => T::ncclBfloat16,
        DType::F32 => T::ncclFloat32,
        DType::F64 => T::ncclFloat64,
    }
}

fn red_op(op: ReduceOp) -> sys::ncclRedOp_t {
    use sys::ncclRedOp_t as O;
    match op {
        ReduceOp::Average | ReduceOp::Sum => O::ncclSum,
        ReduceOp::Min => O::ncclMin,
        ReduceOp::Max => O::ncclMax,
        ReduceOp::Product => O::ncclProd,
        // Never here: refused at submission (`validate`), run off the engine.
        ReduceOp::Adasum => O::ncclSum,
    }
}

/// Whether NCCL itself can apply a scale factor `f` to a reduction of `dtype` with
/// `op`: a sum of floats multiplied by `f` first (`ncclRedOpCreatePreMulSum`). Other
/// cases are scaled by the engine on the host.
pub(crate) fn can_scale(dtype: DType, op: ReduceOp, f: f64) -> bool {
    f == 1.0 || (dtype.is_float() && matches!(op, ReduceOp::Sum | ReduceOp::Average))
}

impl Nccl {
    /// A reduction op for `op` with every input multiplied by `f` first (NCCL's
    /// PreMulSum); `None` when no scaling is needed. Destroy with [`Self::release_op`].
    fn scaled_op(&self, dtype: DType, op: ReduceOp, f: f64) -> Result<Option<sys::ncclRedOp_t>> {
        self.usable()?;
        if f == 1.0 {
            return Ok(None);
        }
        if !can_scale(dtype, op, f) {
            return Err(Error::Internal(format!(
                "NCCL cannot scale {dtype} {op:?} by {f}"
            )));
        }
        let mut scalar = [0u8; 8];
        match dtype {
            DType::F16 => scalar[..2].copy_from_slice(&f16::from_f64(f).to_ne_bytes()),
            DType::BF16 => scalar[..2].copy_from_slice(&bf16::from_f64(f).to_ne_bytes()),
            DType::F32 => scalar[..4].copy_from_slice(&(f as f32).to_ne_bytes()),
            _ => scalar.copy_from_slice(&f.to_ne_bytes()),
        }
        let mut out = MaybeUninit::uninit();
        // SAFETY: the scalar is read immediately (host-immediate residence).
        unsafe {
            nccl::reduce_op_create_pre_mul_sum(
                out.as_mut_ptr(),
                scalar.as_mut_ptr().cast::<c_void>(),
                data_type(dtype),
                sys::ncclScalarResidence_t::ncclScalarHostImmediate,
                self.comm,
            )
            .map_err(nccl_err("ncclRedOpCreatePreMulSum"))?;
            Ok(Some(out.assume_init()))
        }
    }

    fn release_op(&self, op: Option<sys::ncclRedOp_t>) -> Result<()> {
        if self.is_aborted() {
            // The abort freed it with the communicator.
            return Ok(());
        }
        if let Some(op) = op {
            // SAFETY: `op` was created on this communicator and every call using it
            // has been enqueued, which is all NCCL requires before destroying it.
            unsafe { nccl::reduce_op_destroy(op, self.comm) }
                .map_err(nccl_err("ncclRedOpDestroy"))?;
        }
        Ok(())
    }

    /// In-place allreduce of `count` elements at `buf`, every input multiplied by
    /// `scale` first ([`can_scale`] must hold).
    ///
    /// # Safety
    /// `buf` must be a device allocation of at least `count` elements of `dtype` on
    /// this communicator's device, not freed before the stream has run the call.
    pub(crate) unsafe fn allreduce(
        &self,
        buf: DevicePtr,
        count: usize,
        dtype: DType,
        op: ReduceOp,
        scale: f64,
    ) -> Result<()> {
        let custom = self.scaled_op(dtype, op, scale)?;
        let ptr = buf as *mut c_void;
        // SAFETY: the caller's contract.
        let r = unsafe {
            nccl::all_reduce(
                ptr,
                ptr,
                count,
                data_type(dtype),
                custom.unwrap_or_else(|| red_op(op)),
                self.comm,
                self.cu_stream(),
            )
        };
        let settled = self.settle("ncclAllReduce", r);
        let released = self.release_op(custom);
        settled.and(released)
    }

    /// Broadcast of `count` elements at `buf` from `root`.
    ///
    /// # Safety
    /// As for [`Self::allreduce`].
    pub(crate) unsafe fn broadcast(
        &self,
        buf: DevicePtr,
        count: usize,
        dtype: DType,
        root: usize,
    ) -> Result<()> {
        self.usable()?;
        let ptr = buf as *mut c_void;
        let root = i32::try_from(root).map_err(|_| Error::Internal("root > i32".into()))?;
        // SAFETY: the caller's contract.
        let r = unsafe {
            nccl::broadcast(
                ptr,
                ptr,
                count,
                data_type(dtype),
                root,
                self.comm,
                self.cu_stream(),
            )
        };
        self.settle("ncclBroadcast", r)
    }

    /// Rank `r` contributes `counts[r]` elements (`send`); `recv` gets them
    /// concatenated. NCCL has no allgatherv: one broadcast per rank, in one group.
    ///
    /// # Safety
    /// `send` holds `counts[rank]` and `recv` the sum of `counts` elements of `dtype`,
    /// as for [`Self::allreduce`].
    pub(crate) unsafe fn allgatherv(
        &self,
        send: DevicePtr,
        recv: DevicePtr,
        counts: &[usize],
        dtype: DType,
    ) -> Result<()> {
        let width = dtype.size_of() as u64;
        self.group(|| {
            let mut at = 0u64;
            for (r, &n) in counts.iter().enumerate() {
                let dst = recv + at * width;
                let src = if r == self.rank { send } else { dst };
                // SAFETY: the caller's contract; offsets stay inside `recv`.
                unsafe {
                    nccl::broadcast(
                        src as *const c_void,
                        dst as *mut c_void,
                        n,
                        data_type(dtype),
                        r as i32,
                        self.comm,
                        self.cu_stream(),
                    )
                }
                .map_err(nccl_err("ncclBroadcast"))?;
                at += n as u64;
            }
            Ok(())
        })
    }

    /// Sends `send_counts[r]` elements to rank `r` and receives `recv_counts[r]` from
    /// it: grouped point-to-point calls.
    ///
    /// # Safety
    /// `send` and `recv` hold the sums of their counts, as for [`Self::allreduce`].
    pub(crate) unsafe fn alltoallv(
        &self,
        send: DevicePtr,
        send_counts: &[usize],
        recv: DevicePtr,
        recv_counts: &[usize],
        dtype: DType,
    ) -> Result<()> {
        let width = dtype.size_of() as u64;
        self.group(|| {
            let (mut s, mut r) = (0u64, 0u64);
            for peer in 0..self.size {
                let (ns, nr) = (send_counts[peer], recv_counts[peer]);
                // SAFETY: the caller's contract; offsets stay inside the buffers.
                unsafe {
                    if ns > 0 {
                        nccl::send(
                            (send + s * width) as *const c_void,
                            ns,
                            data_type(dtype),
                            peer as i32,
                            self.comm,
                            self.cu_stream(),
                        )
                        .map_err(nccl_err("ncclSend"))?;
                    }
                    if nr > 0 {
                        nccl::recv(
                            (recv + r * width) as *mut c_void,
                            nr,
                            data_type(dtype),
                            peer as i32,
                            self.comm,
                            self.cu_stream(),
                        )
                        .map_err(nccl_err("ncclRecv"))?;
                    }
                }
                s += ns as u64;
                r += nr as u64;
            }
            Ok(())
        })
    }

    /// Reduces `send` over all ranks (each input multiplied by `scale` first) and
    /// leaves block `r` (`counts[r]` elements) in rank `r`'s `recv`: one reduce per
    /// block rooted at its owner, in one group (NCCL's reduce-scatter needs equal
    /// blocks).
    ///
    /// # Safety
    /// `send` holds the sum of `counts`, `recv` `counts[rank]` elements, as for
    /// [`Self::allreduce`].
    pub(crate) unsafe fn reduce_scatter(
        &self,
        send: DevicePtr,
        recv: DevicePtr,
        counts: &[usize],
        dtype: DType,
        op: ReduceOp,
        scale: f64,
    ) -> Result<()> {
        let width = dtype.size_of() as u64;
        let custom = self.scaled_op(dtype, op, scale)?;
        let nccl_op = custom.unwrap_or_else(|| red_op(op));
        let r = self.group(|| {
            let mut at = 0u64;
            for (root, &n) in counts.iter().enumerate() {
                let dst = if root == self.rank { recv } else { 0 };
                // SAFETY: the caller's contract; `recvbuff` is only used on the root.
                unsafe {
                    nccl::reduce(
                        (send + at * width) as *const c_void,
                        dst as *mut c_void,
                        n,
                        data_type(dtype),
                        nccl_op,
                        root as i32,
                        self.comm,
                        self.cu_stream(),
                    )
                }
                .map_err(nccl_err("ncclReduce"))?;
                at += n as u64;
            }
            Ok(())
        });
        let released = self.release_op(custom);
        r.and(released)
    }

    /// Runs `calls` between ncclGroupStart and ncclGroupEnd (the group is closed also
    /// when a call fails). No stream synchronisation may happen inside.
    pub(crate) fn group(&self, calls: impl FnOnce() -> Result<()>) -> Result<()> {
        self.usable()?;
        nccl::group_start().map_err(nccl_err("ncclGroupStart"))?;
        let r = calls();
        let end = nccl::group_end();
        match r {
            // The group is closed first; what it had enqueued is abandoned with the
            // communicator.
            Err(e) => Err(self.abort(e)),
            Ok(()) => self.settle("ncclGroupEnd", end),
        }
    }

    /// The outcome of a call on this (non-blocking) communicator: a call that returned
    /// `ncclInProgress` is polled until it has finished, for at most the timeout. A
    /// call that failed or did not finish aborts the communicator: its kernels may
    /// still be enqueued on the stream, waiting for a peer that will not come, and
    /// only the abort lets them end before the op's buffers are freed.
    fn settle(&self, call: &'static str, r: NcclResult) -> Result<()> {
        if self.is_aborted() {
            // An earlier call in this group aborted it already.
            return self.usable();
        }
        let outcome = match r {
            Ok(nccl::NcclStatus::InProgress) => wait_for(self.comm, call, self.timeout),
            Ok(_) => Ok(()),
            Err(e) => Err(nccl_err(call)(e)),
        };
        outcome.map_err(|e| self.abort(e))
    }
}

/// What cudarc's NCCL calls return.
type NcclResult = std::result::Result<nccl::NcclStatus, nccl::NcclError>;
