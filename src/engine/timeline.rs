//! The timeline: a Chrome Trace Event file (open it in Perfetto or chrome://tracing)
//! with one track per tensor and a span per phase of each op.
//!
//! The file is valid JSON after every event: it always ends with `\n]`, which the next
//! event overwrites. A crash therefore never leaves an unreadable trace.

use std::collections::HashMap;
use std::fs::File;
use std::io::{Seek, SeekFrom, Write};
use std::path::{Path, PathBuf};
use std::time::Instant;

use serde_json::{json, Value};

/// Writes the trace; disabled until [`Timeline::start`].
pub(crate) struct Timeline {
    file: Option<File>,
    path: Option<PathBuf>,
    t0: Instant,
    rank: usize,
    mark_cycles: bool,
    tracks: HashMap<String, usize>,
    empty: bool,
}

impl std::fmt::Debug for Timeline {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Timeline")
            .field("path", &self.path)
            .finish_non_exhaustive()
    }
}

/// The file this rank writes for a configured path: `{rank}` in the path is replaced by
/// the rank; without it only rank 0 writes (as with Horovod).
pub(crate) fn path_for_rank(path: &Path, rank: usize) -> Option<PathBuf> {
    let s = path.to_string_lossy();
    if s.contains("{rank}") {
        Some(PathBuf::from(s.replace("{rank}", &rank.to_string())))
    } else {
        (rank == 0).then(|| path.to_path_buf())
    }
}

impl Timeline {
    pub(crate) fn new(rank: usize, mark_cycles: bool) -> Self {
        Timeline {
            file: None,
            path: None,
            t0: Instant::now(),
            rank,
            mark_cycles,
            tracks: HashMap::new(),
            empty: true,
        }
    }

    pub(crate) fn enabled(&self) -> bool {
        self.file.is_some()
    }

    /// Starts writing to `path` (truncating it).
    pub(crate) fn start(&mut self, path: &Path) -> std::io::Result<()> {
        let mut file = File::create(path)?;
        file.write_all(b"[\n]")?;
        file.flush()?;
        self.file = Some(file);
        self.path = Some(path.to_path_buf());
        self.tracks.clear();
        self.empty = true;
        let process = json!({"name": "process_name", "ph": "M", "pid": self.rank, "tid": 0,
                             "args": {"name": format!("kolo rank {}", self.rank)}});
        self.write(&process);
        Ok(())
    }

    /// Stops writing; the file stays a complete trace.
    pub(crate) fn stop(&mut self) {
        self.file = None;
    }

    fn write(&mut self, event: &Value) {
        let Some(file) = self.file.as_mut() else {
            return;
        };
        let sep = if self.empty { "" } else { ",\n" };
        let result = file
            .seek(SeekFrom::End(-2))
            .and_then(|_| write!(file, "\n{sep}{event}\n]"))
            .and_then(|_| file.flush());
        match result {
            Ok(()) => self.empty = false,
            Err(e) => {
                tracing::warn!(path = ?self.path, error = %e, "timeline write failed; timeline stopped");
                self.file = None;
            }
        }
    }

    fn micros(&self, t: Instant) -> u64 {
        t.saturating_duration_since(self.t0).as_micros() as u64
    }

    /// The track (Chrome "thread") of a tensor, named after it on first use.
    fn track(&mut self, tensor: &str) -> usize {
        if let Some(&t) = self.tracks.get(tensor) {
            return t;
        }
        let t = self.tracks.len() + 1;
        self.tracks.insert(tensor.to_string(), t);
        let meta = json!({"name": "thread_name", "ph": "M", "pid": self.rank, "tid": t, "args": {"name": tensor}});
        self.write(&meta);
        t
    }

    /// A complete span of `phase` on `tensor`'s track.
    pub(crate) fn span(
        &mut self,
        tensor: &str,
        phase: &str,
        start: Instant,
        end: Instant,
        args: &Value,
    ) {
        if !self.enabled() {
            return;
        }
        let tid = self.track(tensor);
        let ts = self.micros(start);
        let dur = self.micros(end).saturating_sub(ts);
        let event = json!({"name": phase, "ph": "X", "pid": self.rank, "tid": tid, "ts": ts, "dur": dur, "args": args});
        self.write(&event);
    }

    /// A CYCLE_START mark, when enabled by `KOLO_TIMELINE_MARK_CYCLES`.
    pub(crate) fn cycle_start(&mut self, now: Instant) {
        if !self.enabled() || !self.mark_cycles {
            return;
        }
        let event = json!({"name": "CYCLE_START", "ph": "i", "s": "p", "pid": self.rank, "tid": 0, "ts": self.micros(now)});
        self.write(&event);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn valid_json_after_every_event() {
        let path =
            std::env::temp_dir().join(format!("kolo-timeline-unit-{}.json", std::process::id()));
        let mut t = Timeline::new(3, true);
        t.start(&path).unwrap();
        let parse = || {
            serde_json::from_str::<Vec<Value>>(&std::fs::read_to_string(&path).unwrap()).unwrap()
        };
        assert_eq!(parse().len(), 1);
        let now = Instant::now();
        t.span(
            "grad \"w\"",
            "ALLREDUCE",
            now,
            now,
            &json!({"dtype": "f32", "shape": [2, 3]}),
        );
        let events = parse();
        assert_eq!(events.len(), 3, "process name, track name, span");
        assert_eq!(events[1]["args"]["name"], "grad \"w\"");
        assert_eq!(events[2]["name"], "ALLREDUCE");
        assert_eq!(events[2]["tid"], events[1]["tid"]);
        t.cycle_start(now);
        t.span("grad \"w\"", "NEGOTIATE", now, now, &json!({}));
        assert_eq!(parse().len(), 5, "the track is named once");
        t.stop();
        t.span("x", "ALLREDUCE", now, now, &json!({}));
        assert_eq!(parse().len(), 5, "nothing after stop");
        std::fs::remove_file(&path).unwrap();
    }

    #[test]
    fn rank_paths() {
        assert_eq!(
            path_for_rank(Path::new("/t/{rank}.json"), 2),
            Some(PathBuf::from("/t/2.json"))
        );
        assert_eq!(
            path_for_rank(Path::new("/t/a.json"), 0),
            Some(PathBuf::from("/t/a.json"))
        );
        assert_eq!(path_for_rank(Path::new("/t/a.json"), 1), None);
    }
}
