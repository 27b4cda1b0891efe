//! Build script of kolo-burn. Only the `cuda` and `cpu` features need it: the
//! CubeCL LLVM bundler turns `llvm-config --system-libs`'s
//! `/usr/lib/x86_64-linux-gnu/libz3.so` into `-llibz3`, which no linker finds. A
//! directory holding `liblibz3.so -> libz3.so`, put on the link search path here,
//! makes that name resolve (with `--as-needed` the binary does not end up needing
//! z3). Done here rather than through `RUSTFLAGS`, which would rebuild every crate.

use std::path::{Path, PathBuf};

fn main() {
    println!("cargo:rerun-if-changed=build.rs");
    let cube = std::env::var_os("CARGO_FEATURE_CUDA").is_some()
        || std::env::var_os("CARGO_FEATURE_CPU").is_some();
    if !cube {
        return;
    }
    let Some(z3) = find_z3() else {
        // No system z3: the bundler then does not ask for it either.
        return;
    };
    let out = PathBuf::from(std::env::var_os("OUT_DIR").expect("cargo sets OUT_DIR"));
    let dir = out.join("libz3-alias");
    std::fs::create_dir_all(&dir).expect("creating the libz3 alias directory");
    let link = dir.join("liblibz3.so");
    let _ = std::fs::remove_file(&link);
    std::os::unix::fs::symlink(&z3, &link).expect("linking liblibz3.so to the system libz3.so");
    println!("cargo:rustc-link-search=native={}", dir.display());
}

/// The system's `libz3.so`, where `llvm-config --system-libs` names it.
fn find_z3() -> Option<PathBuf> {
    [
        "/usr/lib/x86_64-linux-gnu/libz3.so",
        "/usr/lib/aarch64-linux-gnu/libz3.so",
        "/usr/lib64/libz3.so",
        "/usr/lib/libz3.so",
    ]
    .iter()
    .map(Path::new)
    .find(|p| p.exists())
    .map(Path::to_path_buf)
}
