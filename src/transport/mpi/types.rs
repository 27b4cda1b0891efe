//! MPI's vocabulary for kolo's: datatypes, reduce ops (with user ops for f16 and
//! bf16 sums), counts converted to `c_int` with errors that name the call, and the
//! buffer-size checks every collective makes before it hands pointers to MPI.

use std::ffi::{c_int, c_void};

use mpi::ffi;

use crate::error::{Error, Result};
use crate::tensor::DType;
use crate::vocab::ReduceOp;

pub(super) fn null_request() -> ffi::MPI_Request {
    // SAFETY: reading MPI's constant null request handle.
    unsafe { ffi::RSMPI_REQUEST_NULL }
}

pub(super) fn to_c_int(v: usize) -> c_int {
    c_int::try_from(v).unwrap_or(c_int::MAX)
}

pub(super) fn to_usize(v: c_int) -> usize {
    usize::try_from(v).unwrap_or(0)
}

/// The most elements one MPI call of kolo's takes where it splits a buffer into
/// several calls: MPI counts are C ints (2^31 - 1); a power of two keeps chunks of
/// every dtype aligned.
pub(super) const MAX_ELEMS_PER_CALL: usize = 1 << 30;

pub(super) fn count(call: &'static str, n: usize) -> Result<c_int> {
    c_int::try_from(n).map_err(|_| Error::Transport {
        call,
        message: format!("{n} elements exceed MPI's count limit of {}", c_int::MAX),
    })
}

pub(super) fn counts(call: &'static str, counts: &[usize]) -> Result<(Vec<c_int>, Vec<c_int>)> {
    let mut c = Vec::with_capacity(counts.len());
    let mut displs = Vec::with_capacity(counts.len());
    let mut at = 0usize;
    for &n in counts {
        c.push(count(call, n)?);
        displs.push(count(call, at)?);
        at += n;
    }
    Ok((c, displs))
}

/// Checks that a buffer of `len` bytes holds exactly `elems` elements of `dtype`
/// before MPI reads or writes it through a raw pointer sized by counts.
pub(super) fn sized(
    call: &'static str,
    what: &str,
    len: usize,
    elems: usize,
    dtype: DType,
) -> Result<()> {
    let want = elems.checked_mul(dtype.size_of());
    if want == Some(len) {
        return Ok(());
    }
    Err(Error::Internal(format!(
        "{call}: the {what} buffer holds {len} bytes, but the counts need {elems} {dtype:?} \
         elements ({} bytes)",
        want.map_or_else(|| "too many".to_string(), |w| w.to_string())
    )))
}

/// Checks that `counts` has one entry per rank.
pub(super) fn per_rank(call: &'static str, counts: &[usize], size: usize) -> Result<()> {
    if counts.len() == size {
        return Ok(());
    }
    Err(Error::Internal(format!(
        "{call}: {} counts for {size} ranks",
        counts.len()
    )))
}

pub(super) fn check(call: &'static str, rc: c_int) -> Result<()> {
    if rc == 0 {
        return Ok(());
    }
    let mut buf = vec![0u8; 512];
    let mut len: c_int = 0;
    // SAFETY: MPI_MAX_ERROR_STRING is 256 in Open MPI and MPICH; the buffer is larger.
    unsafe { ffi::MPI_Error_string(rc, buf.as_mut_ptr().cast(), &mut len) };
    buf.truncate(to_usize(len));
    Err(Error::Transport {
        call,
        message: String::from_utf8_lossy(&buf).into_owned(),
    })
}

/// The MPI datatype used to move and reduce `dtype`.
pub(super) fn datatype(dtype: DType) -> ffi::MPI_Datatype {
    // SAFETY: reading MPI's predefined datatype handles, constant after MPI_Init.
    unsafe {
        match dtype {
            DType::U8 => ffi::RSMPI_UINT8_T,
            DType::I8 => ffi::RSMPI_INT8_T,
            DType::I32 => ffi::RSMPI_INT32_T,
            DType::I64 => ffi::RSMPI_INT64_T,
            // 16-bit words, reduced by kolo's own ops (see `HalfOps`).
            DType::F16 | DType::BF16 => ffi::RSMPI_UINT16_T,
            DType::F32 => ffi::RSMPI_FLOAT,
            DType::F64 => ffi::RSMPI_DOUBLE,
        }
    }
}

/// MPI's predefined op for `op` (for every dtype but f16/bf16).
pub(super) fn predefined_op(op: ReduceOp) -> ffi::MPI_Op {
    // SAFETY: reading MPI's predefined op handles, constant after MPI_Init.
    unsafe {
        match op {
            // Average is a sum followed by a postscale in the engine.
            ReduceOp::Sum | ReduceOp::Average => ffi::RSMPI_SUM,
            ReduceOp::Min => ffi::RSMPI_MIN,
            ReduceOp::Max => ffi::RSMPI_MAX,
            ReduceOp::Product => ffi::RSMPI_PROD,
            // Never here: refused at submission (`validate`), run off the engine.
            ReduceOp::Adasum => ffi::RSMPI_SUM,
        }
    }
}

/// User-defined MPI ops reducing f16 or bf16 words: each pairwise combine widens to
/// f32, combines, and rounds back, so the wire carries 2 bytes per element (what
/// gradient compression is for) while every step is computed in f32.
pub(super) struct HalfOps {
    /// [sum, min, max, product] for f16, then for bf16.
    pub(super) ops: [ffi::MPI_Op; 8],
}

macro_rules! half_op {
    ($name:ident, $t:ty, |$a:ident, $b:ident| $body:expr) => {
        unsafe extern "C" fn $name(
            invec: *mut c_void,
            inoutvec: *mut c_void,
            len: *mut c_int,
            _datatype: *mut ffi::MPI_Datatype,
        ) {
            use half::slice::HalfFloatSliceExt;
            // SAFETY: MPI passes `*len` elements of the 16-bit datatype the op was used
            // with (kolo only uses these ops on f16/bf16 buffers), both aligned for u16.
            let (input, inout) = unsafe {
                let n = usize::try_from(*len).unwrap_or(0);
                (
                    std::slice::from_raw_parts(invec as *const $t, n),
                    std::slice::from_raw_parts_mut(inoutvec as *mut $t, n),
                )
            };
            // Blocks through f32 scratch, so that half's vectorised conversions (F16C
            // where the CPU has it) do the widening and rounding.
            const BLOCK: usize = 1024;
            let (mut x, mut y) = ([0f32; BLOCK], [0f32; BLOCK]);
            for (o, i) in inout.chunks_mut(BLOCK).zip(input.chunks(BLOCK)) {
                let n = o.len();
                i.convert_to_f32_slice(&mut x[..n]);
                o.convert_to_f32_slice(&mut y[..n]);
                for (yv, &xv) in y[..n].iter_mut().zip(&x[..n]) {
                    let ($a, $b) = (xv, *yv);
                    *yv = $body;
                }
                o.convert_from_f32_slice(&y[..n]);
            }
        }
    };
}

half_op!(f16_sum, half::f16, |a, b| a + b);
half_op!(f16_min, half::f16, |a, b| a.min(b));
half_op!(f16_max, half::f16, |a, b| a.max(b));
half_op!(f16_prod, half::f16, |a, b| a * b);
half_op!(bf16_sum, half::bf16, |a, b| a + b);
half_op!(bf16_min, half::bf16, |a, b| a.min(b));
half_op!(bf16_max, half::bf16, |a, b| a.max(b));
half_op!(bf16_prod, half::bf16, |a, b| a * b);

impl HalfOps {
    pub(super) fn create() -> Result<Self> {
        let fns: [ffi::MPI_User_function; 8] = [
            Some(f16_sum),
            Some(f16_min),
            Some(f16_max),
            Some(f16_prod),
            Some(bf16_sum),
            Some(bf16_min),
            Some(bf16_max),
            Some(bf16_prod),
        ];
        // Placeholders, each overwritten by MPI_Op_create below (rsmpi exports no
        // MPI_OP_NULL). SAFETY: reading a constant handle.
        let mut ops = [unsafe { ffi::RSMPI_SUM }; 8];
        for (op, f) in ops.iter_mut().zip(fns) {
            // SAFETY: `f` is a valid MPI user function; commutative (1).
            check("MPI_Op_create", unsafe { ffi::MPI_Op_create(f, 1, op) })?;
        }
        Ok(HalfOps { ops })
    }

    pub(super) fn get(&self, dtype: DType, op: ReduceOp) -> Option<ffi::MPI_Op> {
        let base = match dtype {
            DType::F16 => 0,
            DType::BF16 => 4,
            _ => return None,
        };
        let i = match op {
            ReduceOp::Sum | ReduceOp::Average => 0,
            ReduceOp::Min => 1,
            ReduceOp::Max => 2,
            ReduceOp::Product => 3,
            // Never here: refused at submission (`validate`).
            ReduceOp::Adasum => 0,
        };
        Some(self.ops[base + i])
    }
}

/// A never-written stand-in address for empty buffers (see [`addr`]).
static EMPTY: u64 = 0;

/// The address MPI is given for a send buffer. An empty slice's pointer is dangling —
/// `0x1` for bytes, which is Open MPI's `MPI_IN_PLACE` — so a rank with nothing to
/// send or receive (an alltoall that sends it no rows, a reducescatter block of none)
/// made MPI read it as "in place" and fail with `MPI_ERR_ARG` on that rank alone,
/// while the others waited in the collective. Empty buffers get a real address
/// instead; with a count of zero MPI never touches it.
pub(super) fn addr<T>(buf: &[T]) -> *const std::ffi::c_void {
    if buf.is_empty() {
        std::ptr::addr_of!(EMPTY).cast()
    } else {
        buf.as_ptr().cast()
    }
}

/// [`addr`] for a receive buffer.
pub(super) fn addr_mut<T>(buf: &mut [T]) -> *mut std::ffi::c_void {
    if buf.is_empty() {
        // Never written: MPI is told it receives zero elements there.
        std::ptr::addr_of!(EMPTY).cast_mut().cast()
    } else {
        buf.as_mut_ptr().cast()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::error::err_text;

    #[test]
    fn buffers_must_match_their_counts() {
        assert!(sized("MPI_Allgatherv", "receive", 12, 3, DType::F32).is_ok());
        let e = err_text(sized("MPI_Allgatherv", "receive", 8, 3, DType::F32));
        assert!(
            e.contains("MPI_Allgatherv: the receive buffer holds 8 bytes, but the counts need 3 F32 elements (12 bytes)"),
            "{e}"
        );
        assert!(sized("x", "send", 0, usize::MAX, DType::F64).is_err());
        assert!(per_rank("MPI_Alltoallv", &[1, 2], 2).is_ok());
        let e = err_text(per_rank("MPI_Alltoallv", &[1], 2));
        assert!(e.contains("MPI_Alltoallv: 1 counts for 2 ranks"), "{e}");
    }
}
