//! The benchmarks' fixed synthetic batches (no dependency: the plain programs include
//! it too). Included by `#[path]`.

/// `rows` samples of `inputs` values in [0, 1) and their classes below `classes`,
/// drawn by xorshift from `seed`: the same every step, different per `seed`.
pub(crate) fn batch(
    seed: usize,
    inputs: usize,
    classes: usize,
    rows: usize,
) -> (Vec<f32>, Vec<u64>) {
    let mut s = seed as u64 * 0x9E37_79B9_7F4A_7C15 + 1;
    let mut next = || {
        s ^= s << 13;
        s ^= s >> 7;
        s ^= s << 17;
        s
    };
    let x = (0..rows * inputs)
        .map(|_| (next() % 1000) as f32 / 1000.0)
        .collect();
    let y = (0..rows).map(|_| next() % classes as u64).collect();
    (x, y)
}
