//! Shared by the benchmarks: the ResNet-50 gradient set and time formatting.

/// Every ResNet-50 parameter size (torchvision layout): 161 tensors, 25.56 M elements.
pub(crate) fn resnet50_sizes() -> Vec<usize> {
    let mut sizes = vec![64 * 3 * 7 * 7, 64, 64];
    let mut inp = 64;
    for (blocks, width) in [(3, 64), (4, 128), (6, 256), (3, 512)] {
        for b in 0..blocks {
            sizes.extend([
                inp * width,
                width,
                width,
                width * width * 9,
                width,
                width,
                width * 4 * width,
                4 * width,
                4 * width,
            ]);
            if b == 0 {
                sizes.extend([inp * 4 * width, 4 * width, 4 * width]);
            }
            inp = 4 * width;
        }
    }
    sizes.extend([2048 * 1000, 1000]);
    sizes
}

/// Seconds as "12.3 us" or "4.56 ms".
pub(crate) fn fmt_time(s: f64) -> String {
    if s < 1e-3 {
        format!("{:.1} us", s * 1e6)
    } else {
        format!("{:.2} ms", s * 1e3)
    }
}
