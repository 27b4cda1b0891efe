//! Cases that must end the whole job: the harness checks the exit status, the time it
//! took and the message (see `FAULTS` in main.rs).

use std::time::Duration;

use anyhow::Result;
use kolo::{DType, Kolo, Tensor};

/// The last rank panics on a helper thread while its main thread is busy and the other
/// ranks wait for it in a collective.
pub(crate) fn panic_on_thread(k: &Kolo) -> Result<()> {
    if k.rank() == k.size() - 1 {
        std::thread::spawn(|| {
            std::thread::sleep(Duration::from_millis(300));
            panic!("injected fault on a helper thread");
        });
        std::thread::sleep(Duration::from_secs(60));
        return Ok(());
    }
    k.allreduce("never", Tensor::zeros(DType::F32, &[4]))
        .wait()?;
    Ok(())
}

/// The last rank panics on its main thread before a collective the others wait in.
pub(crate) fn panic_before_collective(k: &Kolo) -> Result<()> {
    if k.rank() == k.size() - 1 {
        panic!("injected fault before the collective");
    }
    k.allreduce("never", Tensor::zeros(DType::F32, &[4]))
        .wait()?;
    Ok(())
}
