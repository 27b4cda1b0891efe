//! 8-bit quantisation with a scale per chunk (ByteGrad's): each chunk of
//! [`CHUNK`] values is sent as its minimum and step (two little-endian f32) and one
//! byte per value, `value ≈ min + code · step`, `step = (max − min) / 255`; the error
//! of a value is at most half its chunk's step. A chunk holding a NaN or an infinity
//! decodes to NaN throughout, so that an overflow is seen (a loss scaler skips the
//! step) rather than hidden.

/// Values per chunk: 1 KiB of f32 shares one minimum and one step.
pub const CHUNK: usize = 256;

/// Bytes of a chunk's header (minimum and step).
const HEADER: usize = 8;

/// Bytes `encode` makes of `n` values.
pub fn encoded_len(n: usize) -> usize {
    n + HEADER * n.div_ceil(CHUNK)
}

/// The quantisation step of each chunk of `x` (for error bounds in tests and notes).
pub fn steps(x: &[f32]) -> Vec<f32> {
    x.chunks(CHUNK).map(|c| range(c).1).collect()
}

/// The minimum and step of a chunk (NaN for both when it holds a non-finite value).
fn range(c: &[f32]) -> (f32, f32) {
    if c.is_empty() {
        return (0.0, 0.0);
    }
    // Branch-free, so that it vectorises: `v * 0` is NaN exactly for a non-finite v.
    let (mut lo, mut hi, mut bad) = (c[0], c[0], 0.0f32);
    for &v in c {
        lo = if v < lo { v } else { lo };
        hi = if v > hi { v } else { hi };
        bad += v * 0.0;
    }
    if bad.is_nan() {
        return (f32::NAN, f32::NAN);
    }
    (lo, (hi - lo) / 255.0)
}

/// Appends the encoding of `x` to `out`.
pub fn encode_into(x: &[f32], out: &mut Vec<u8>) {
    out.reserve(encoded_len(x.len()));
    for c in x.chunks(CHUNK) {
        let (lo, step) = range(c);
        out.extend_from_slice(&lo.to_le_bytes());
        out.extend_from_slice(&step.to_le_bytes());
        let inv = if step > 0.0 { 1.0 / step } else { 0.0 };
        // Rounded to nearest by adding a half and truncating (`as` saturates to
        // 0..=255, and makes NaN 0: a non-finite chunk has step NaN and codes 0).
        out.extend(c.iter().map(|&v| ((v - lo) * inv + 0.5) as u8));
    }
}

/// The encoding of `x`.
pub fn encode(x: &[f32]) -> Vec<u8> {
    let mut out = Vec::new();
    encode_into(x, &mut out);
    out
}

/// Adds the values `bytes` encodes to `acc` (`bytes` must hold `acc.len()` values);
/// `Err` with what is wrong when its length does not match.
pub fn decode_add(bytes: &[u8], acc: &mut [f32]) -> Result<(), String> {
    decode_with(bytes, acc, |a, v| *a += v)
}

/// Writes the values `bytes` encodes to `out`.
pub fn decode_into(bytes: &[u8], out: &mut [f32]) -> Result<(), String> {
    decode_with(bytes, out, |a, v| *a = v)
}

fn decode_with(bytes: &[u8], out: &mut [f32], f: impl Fn(&mut f32, f32)) -> Result<(), String> {
    let want = encoded_len(out.len());
    if bytes.len() != want {
        return Err(format!(
            "{} bytes for {} values, which take {want}",
            bytes.len(),
            out.len()
        ));
    }
    let mut at = 0;
    for c in out.chunks_mut(CHUNK) {
        let word =
            |i: usize| f32::from_le_bytes([bytes[i], bytes[i + 1], bytes[i + 2], bytes[i + 3]]);
        let (lo, step) = (word(at), word(at + 4));
        at += HEADER;
        let len = c.len();
        for (o, &q) in c.iter_mut().zip(&bytes[at..at + len]) {
            f(o, lo + f32::from(q) * step);
        }
        at += len;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn round_trip_within_half_a_step() {
        let x: Vec<f32> = (0..1000)
            .map(|i| ((i * 37 % 101) as f32 - 50.0) * 0.013)
            .collect();
        let bytes = encode(&x);
        assert_eq!(bytes.len(), encoded_len(x.len()));
        assert!(
            bytes.len() * 100 <= x.len() * 4 * 26,
            "about a quarter of f32's bytes"
        );
        let mut back = vec![0.0; x.len()];
        decode_into(&bytes, &mut back).unwrap();
        for (i, (c, s)) in x.chunks(CHUNK).zip(steps(&x)).enumerate() {
            for (j, &v) in c.iter().enumerate() {
                let err = (back[i * CHUNK + j] - v).abs();
                assert!(
                    err <= s / 2.0 + 1e-6,
                    "value {v}: error {err} > half step {s}"
                );
            }
        }
        // Each chunk's extremes are exact.
        assert_eq!(
            back[0..CHUNK].iter().copied().fold(f32::INFINITY, f32::min),
            x[0..CHUNK].iter().copied().fold(f32::INFINITY, f32::min)
        );
    }

    #[test]
    fn constant_and_non_finite_chunks() {
        let x = vec![2.5f32; 300];
        let mut back = vec![0.0; 300];
        decode_into(&encode(&x), &mut back).unwrap();
        assert!(back.iter().all(|&v| v == 2.5));
        let mut y = vec![1.0f32; 300];
        y[3] = f32::INFINITY;
        decode_into(&encode(&y), &mut back).unwrap();
        assert!(
            back[..CHUNK].iter().all(|v| v.is_nan()),
            "the overflowing chunk is NaN"
        );
        assert!(
            back[CHUNK..].iter().all(|&v| v == 1.0),
            "the next chunk is intact"
        );
        let err = decode_into(&encode(&y)[..10], &mut back).unwrap_err();
        assert!(err.contains("10 bytes for 300 values"), "{err}");
    }
}
