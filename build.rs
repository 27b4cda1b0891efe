//! Compiles the small C shim in `src/transport/shim.c`: it exports the MPI constants
//! (such as `MPI_IN_PLACE`) that the `mpi` crate does not, using the same MPI the
//! `mpi` crate links against.

fn main() {
    println!("cargo:rerun-if-changed=src/transport/shim.c");
    let lib = match build_probe_mpi::probe() {
        Ok(lib) => lib,
        Err(errs) => {
            for err in errs {
                println!("cargo:warning=MPI probe: {err}");
            }
            panic!(
                "kolo needs an MPI library: install OpenMPI (`apt-get install openmpi-bin libopenmpi-dev`) \
                 or run the README's set-up command"
            );
        }
    };
    println!("cargo:rustc-env=KOLO_MPI_LIBRARY={}", mpi_version(&lib));
    let mut build = cc::Build::new();
    build.file("src/transport/shim.c");
    if let Some(mpicc) = lib.mpicc {
        build.compiler(mpicc);
    } else {
        for inc in &lib.include_paths {
            build.include(inc);
        }
    }
    build.compile("kolo_mpi_shim");
}

/// A one-line description of the MPI library, for `kolo::build_info`.
fn mpi_version(lib: &build_probe_mpi::Library) -> String {
    let probed = lib.version.lines().next().unwrap_or("").trim().to_string();
    if !probed.is_empty() && !probed.eq_ignore_ascii_case("unknown") {
        return probed;
    }
    // Open MPI's wrapper says e.g. "mpicc: Open MPI 4.1.4 (Language: C)".
    let wrapper = lib.mpicc.clone().unwrap_or_else(|| "mpicc".into());
    std::process::Command::new(wrapper)
        .arg("--showme:version")
        .output()
        .ok()
        .and_then(|o| String::from_utf8(o.stdout).ok())
        .and_then(|s| {
            s.lines()
                .next()
                .map(|l| l.trim_start_matches("mpicc:").trim().to_string())
        })
        .filter(|s| !s.is_empty())
        .unwrap_or_else(|| "unknown MPI library".into())
}
