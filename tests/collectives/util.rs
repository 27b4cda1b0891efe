//! Helpers for worker cases: seeded values, conversions between dtypes, comparisons.

use anyhow::{ensure, Result};
use kolo::half::{bf16, f16};
use kolo::{DType, Tensor};

pub(crate) const DTYPES: [DType; 8] = DType::ALL;

/// A small seeded generator (splitmix64) so every rank can build the same values.
pub(crate) struct Rng(u64);

impl Rng {
    pub(crate) fn new(seed: u64) -> Self {
        Rng(seed)
    }

    pub(crate) fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    /// An integer in `[lo, hi)`.
    pub(crate) fn int(&mut self, lo: i64, hi: i64) -> i64 {
        lo + (self.next_u64() % (hi - lo) as u64) as i64
    }

    pub(crate) fn shuffle<T>(&mut self, v: &mut [T]) {
        for i in (1..v.len()).rev() {
            let j = (self.next_u64() % (i as u64 + 1)) as usize;
            v.swap(i, j);
        }
    }
}

/// Integer values in a range whose sums over `size` ranks stay exact in `dtype`.
pub(crate) fn values(dtype: DType, n: usize, size: usize, rng: &mut Rng) -> Vec<f64> {
    let (lo, hi) = match dtype {
        DType::U8 => (0, 250 / size as i64),
        DType::I8 => (-120 / size as i64, 120 / size as i64),
        DType::BF16 => (-32, 32),
        _ => (-100, 100),
    };
    (0..n).map(|_| rng.int(lo, hi) as f64).collect()
}

pub(crate) fn tensor(dtype: DType, v: &[f64], shape: &[usize]) -> Result<Tensor> {
    Ok(match dtype {
        DType::U8 => Tensor::from_vec(v.iter().map(|&x| x as u8).collect(), shape)?,
        DType::I8 => Tensor::from_vec(v.iter().map(|&x| x as i8).collect(), shape)?,
        DType::I32 => Tensor::from_vec(v.iter().map(|&x| x as i32).collect(), shape)?,
        DType::I64 => Tensor::from_vec(v.iter().map(|&x| x as i64).collect(), shape)?,
        DType::F16 => Tensor::from_vec(v.iter().map(|&x| f16::from_f64(x)).collect(), shape)?,
        DType::BF16 => Tensor::from_vec(v.iter().map(|&x| bf16::from_f64(x)).collect(), shape)?,
        DType::F32 => Tensor::from_vec(v.iter().map(|&x| x as f32).collect(), shape)?,
        DType::F64 => Tensor::from_vec(v.to_vec(), shape)?,
        other => anyhow::bail!("no test conversion for {other:?}"),
    })
}

pub(crate) fn to_f64(t: &Tensor) -> Result<Vec<f64>> {
    Ok(match t.dtype() {
        DType::U8 => t.as_slice::<u8>()?.iter().map(|&x| f64::from(x)).collect(),
        DType::I8 => t.as_slice::<i8>()?.iter().map(|&x| f64::from(x)).collect(),
        DType::I32 => t.as_slice::<i32>()?.iter().map(|&x| f64::from(x)).collect(),
        DType::I64 => t.as_slice::<i64>()?.iter().map(|&x| x as f64).collect(),
        DType::F16 => t.as_slice::<f16>()?.iter().map(|x| x.to_f64()).collect(),
        DType::BF16 => t.as_slice::<bf16>()?.iter().map(|x| x.to_f64()).collect(),
        DType::F32 => t.as_slice::<f32>()?.iter().map(|&x| f64::from(x)).collect(),
        DType::F64 => t.as_slice::<f64>()?.to_vec(),
        other => anyhow::bail!("no test conversion for {other:?}"),
    })
}

/// Horovod's tolerances: exact for integers; relative 1e-4 for floats (looser for
/// the 16-bit floats, whose results are rounded to 8 or 11 significant bits).
pub(crate) fn assert_close(what: &str, dtype: DType, got: &[f64], want: &[f64]) -> Result<()> {
    ensure!(
        got.len() == want.len(),
        "{what}: {} values, expected {}",
        got.len(),
        want.len()
    );
    let rtol = match dtype {
        DType::F16 => 2e-3,
        DType::BF16 => 1e-2,
        DType::F32 | DType::F64 => 1e-4,
        _ => 0.0,
    };
    for (i, (g, w)) in got.iter().zip(want).enumerate() {
        let ok = if rtol == 0.0 {
            g == w
        } else {
            (g - w).abs() <= rtol * w.abs().max(1.0)
        };
        ensure!(ok, "{what} ({dtype:?}): element {i} is {g}, expected {w}");
    }
    Ok(())
}

/// Shapes with side 17 for dims 1..=3, as in Horovod's tests.
pub(crate) fn shapes() -> Vec<Vec<usize>> {
    vec![vec![17], vec![17, 17], vec![17, 17, 17]]
}

/// Checks that `result` failed and that its message contains every `parts`.
pub(crate) fn expect_err<T: std::fmt::Debug, E: std::fmt::Display>(
    what: &str,
    result: std::result::Result<T, E>,
    parts: &[&str],
) -> Result<String> {
    match result {
        Ok(v) => anyhow::bail!("{what}: expected an error, got {v:?}"),
        Err(e) => {
            let msg = e.to_string();
            for p in parts {
                ensure!(
                    msg.contains(p),
                    "{what}: error {msg:?} does not contain {p:?}"
                );
            }
            Ok(msg)
        }
    }
}
