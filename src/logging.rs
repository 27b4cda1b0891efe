//! The `tracing` subscriber kolo installs when the application has none.

use std::io::Write;

use tracing_subscriber::fmt::MakeWriter;
use tracing_subscriber::EnvFilter;

use crate::config::Config;

/// Installs a stderr subscriber with the rank in every line, unless the application
/// already set one. `RUST_LOG` wins over `KOLO_LOG_LEVEL`; the default is `warn`.
pub(crate) fn install(config: &Config) {
    if tracing::dispatcher::has_been_set() {
        return;
    }
    let filter = std::env::var("RUST_LOG")
        .ok()
        .and_then(|v| EnvFilter::try_new(v).ok())
        .unwrap_or_else(|| EnvFilter::new(config.log_level.as_deref().unwrap_or("warn")));
    let _ = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(RankStderr {
            prefix: rank_prefix(),
        })
        .with_target(false)
        .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()))
        .with_thread_names(true)
        .try_init();
}

/// The launcher's rank variable is read because the subscriber exists before MPI does.
fn rank_prefix() -> String {
    ["OMPI_COMM_WORLD_RANK", "PMIX_RANK", "PMI_RANK"]
        .iter()
        .find_map(|v| std::env::var(v).ok())
        .map_or_else(|| "[kolo] ".to_string(), |r| format!("[kolo rank {r}] "))
}

struct RankStderr {
    prefix: String,
}

impl<'a> MakeWriter<'a> for RankStderr {
    type Writer = LineWriter;

    fn make_writer(&'a self) -> LineWriter {
        LineWriter {
            buf: self.prefix.as_bytes().to_vec(),
        }
    }
}

/// Buffers one event and writes it to stderr in one call, so that lines from the
/// engine and framework threads never interleave.
struct LineWriter {
    buf: Vec<u8>,
}

impl Write for LineWriter {
    fn write(&mut self, data: &[u8]) -> std::io::Result<usize> {
        self.buf.extend_from_slice(data);
        Ok(data.len())
    }

    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

impl Drop for LineWriter {
    fn drop(&mut self) {
        let _ = std::io::stderr().lock().write_all(&self.buf);
    }
}
