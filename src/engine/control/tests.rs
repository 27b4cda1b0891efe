use std::sync::Arc;
use std::time::Instant;

use super::{Control, Negotiation};
use crate::config::Config;
use crate::engine::negotiate::Response;
use crate::engine::queue::Queue;
use crate::engine::request::{Command, OpKind, Request, RequestMeta};
use crate::engine::{Agreed, Inbox};
use crate::error::Error;
use crate::handle::Handle;
use crate::tensor::{DType, Tensor};
use crate::transport::loopback::on_loopback_ranks;
use crate::transport::loopback::Loopback;
use crate::transport::Transport;
use crate::vocab::ReduceOp;

/// One rank's negotiation state over its end of an in-process job.
struct Rank {
    control: Control,
    inbox: Inbox,
    t: Loopback,
}

impl Rank {
    fn new(t: Loopback, cache_capacity: usize) -> Self {
        let topology = t.topology();
        let agreed = Agreed::plain(1 << 20, cache_capacity);
        let control = Control::new(&Config::default(), topology, agreed);
        let inbox = Inbox::new(Arc::new(Queue::default()), topology.rank);
        Rank { control, inbox, t }
    }

    /// Submits an f32 allreduce of `shape` under `key`.
    fn submit(&mut self, key: &str, shape: &[usize]) -> Handle<Tensor> {
        let n = shape.iter().product();
        self.submit_values(key, shape, vec![0.0; n])
    }

    /// Submits an f32 allreduce of `values` with `shape` under `key`.
    fn submit_values(&mut self, key: &str, shape: &[usize], values: Vec<f32>) -> Handle<Tensor> {
        let meta = RequestMeta::for_test(key, OpKind::Allreduce, DType::F32, shape, ReduceOp::Sum);
        let n = values.len();
        let tensor = Tensor::from_vec(values, &[n]).unwrap();
        let (h, request) =
            Request::with_handle(meta, tensor, self.inbox.queue.clone(), self.inbox.rank);
        self.inbox.accept(Command::Submit(Box::new(request)));
        h
    }

    /// One negotiation: the keys ready to run (their requests leave the inbox, as
    /// the executor would take them), with the shape agreed for each.
    /// A speculated op's key reads `<key> (summed)`.
    fn cycle(&mut self) -> Result<Vec<(String, Vec<usize>)>, Negotiation> {
        Ok(self
            .responses()?
            .into_iter()
            .map(|r| match r {
                Response::Run(ready) => {
                    let shape = ready.first().tensors[0].shape.to_vec();
                    (ready.key.to_string(), shape)
                }
                Response::Reduced { ready, .. } => {
                    let shape = ready.first().tensors[0].shape.to_vec();
                    (format!("{} (summed)", ready.key), shape)
                }
                other => panic!("unexpected response {other:?}"),
            })
            .collect())
    }

    /// One negotiation's responses (their requests leave the inbox).
    fn responses(&mut self) -> Result<Vec<Response>, Negotiation> {
        let negotiated = self
            .control
            .negotiate(
                &mut self.t,
                &mut self.inbox,
                &mut None,
                &mut |_| std::time::Duration::MAX,
                Instant::now(),
            )
            .unwrap();
        let responses = match negotiated {
            Negotiation::Ready { responses, .. } => responses,
            left => return Err(left),
        };
        for r in &responses {
            if let Response::Run(ready) | Response::Reduced { ready, .. } = r {
                self.inbox.pending.remove(&*ready.key);
            }
        }
        Ok(responses)
    }
}

/// Runs `script` on each rank of an in-process job of two, each with its own
/// negotiation state.
fn two_ranks<T: Send>(cache: usize, script: impl Fn(&mut Rank) -> T + Sync) -> Vec<T> {
    on_loopback_ranks(2, |_, t| script(&mut Rank::new(t, cache)))
}

fn keys(ready: &[(String, Vec<usize>)]) -> Vec<&str> {
    ready.iter().map(|(k, _)| k.as_str()).collect()
}

#[test]
fn a_request_runs_once_every_rank_has_it_in_one_order_everywhere() {
    let out = two_ranks(0, |r| {
        let mine: &[&str] = if r.inbox.rank == 0 {
            &["a", "b", "c"]
        } else {
            &["c", "a"]
        };
        for k in mine {
            r.submit(k, &[2]);
        }
        let first = r.cycle().unwrap();
        if r.inbox.rank == 1 {
            r.submit("b", &[2]);
        }
        let second = r.cycle().unwrap();
        (first, second)
    });
    assert_eq!(
        out[0], out[1],
        "both ranks run the same responses in the same order"
    );
    let (first, second) = &out[0];
    let mut first = keys(first);
    first.sort_unstable();
    assert_eq!(first, ["a", "c"]);
    assert_eq!(keys(second), ["b"]);
}

#[test]
fn a_repeated_request_is_agreed_by_its_cache_bit_and_a_new_shape_goes_out_in_full() {
    let out = two_ranks(8, |r| {
        let mut calls = Vec::new();
        let mut cycle = |r: &mut Rank| {
            let before = r.t.calls();
            let ready = r.cycle().unwrap();
            calls.push(r.t.calls() - before);
            ready
        };
        r.submit("x", &[4]);
        let first = cycle(r);
        r.submit("x", &[4]);
        let cached = cycle(r);
        // Only rank 0 asks again: the bit is not set everywhere, nothing runs.
        if r.inbox.rank == 0 {
            r.submit("x", &[4]);
        }
        let waiting = cycle(r);
        if r.inbox.rank == 1 {
            r.submit("x", &[4]);
        }
        let late = cycle(r);
        r.submit("x", &[5]);
        let reshaped = cycle(r);
        (vec![first, cached, waiting, late, reshaped], calls)
    });
    assert_eq!(out[0], out[1]);
    let (ready, calls) = &out[0];
    let x = |n: usize| vec![("x".to_string(), vec![n])];
    // Once cached, the small f32 sum is reduced within the agreement itself.
    let summed = vec![("x (summed)".to_string(), vec![4])];
    assert_eq!(ready, &[x(4), summed.clone(), vec![], summed, x(5)]);
    // A cycle is the bit agreement, plus the full exchange when some rank has a
    // request the cache cannot name.
    assert_eq!(calls, &[2, 1, 1, 1, 2]);
}

#[test]
fn small_cached_sums_are_reduced_in_the_agreement_only_when_every_rank_packed_the_same() {
    let out = two_ranks(8, |r| {
        let me = r.inbox.rank as f32;
        let values = |k: f32| vec![1.0 + me, k * (1.0 + me), 0.1 * me];
        r.submit_values("g", &[3], values(1.0));
        r.submit_values("h", &[3], values(2.0));
        r.cycle().unwrap(); // learns both in full
        r.submit_values("g", &[3], values(3.0));
        r.submit_values("h", &[3], values(4.0));
        let both = r.responses().unwrap();
        // Rank 0 has g and h ready, rank 1 only g: their packings differ, so
        // nothing is speculated; g runs as usual.
        r.submit_values("g", &[3], values(5.0));
        if r.inbox.rank == 0 {
            r.submit_values("h", &[3], values(6.0));
        }
        let differ = r.cycle().unwrap();
        (both, differ)
    });
    let sums = |rs: &[Response]| -> Vec<(String, Vec<f32>)> {
        rs.iter()
            .map(|r| match r {
                Response::Reduced { ready, sum } => (ready.key.to_string(), sum.to_vec()),
                other => panic!("expected a speculated sum, got {other:?}"),
            })
            .collect()
    };
    let rank0 = sums(&out[0].0);
    assert_eq!(rank0, sums(&out[1].0), "every rank has the same sums");
    assert_eq!(
        rank0,
        vec![
            ("g".to_string(), vec![3.0, 9.0, 0.1]),
            ("h".to_string(), vec![3.0, 12.0, 0.1])
        ]
    );
    for (_, differ) in &out {
        assert_eq!(differ, &vec![("g".to_string(), vec![3])]);
    }
}

#[test]
fn a_rank_that_shuts_down_is_named_and_pending_requests_fail_with_its_rank() {
    let out = two_ranks(8, |r| {
        let h = r.submit("y", &[1]);
        if r.inbox.rank == 1 {
            r.inbox.shutting_down = true;
        }
        let left = match r.cycle() {
            Err(Negotiation::RankLeft(left)) => left,
            Err(_) => panic!("expected RankLeft"),
            Ok(ready) => panic!("ran {ready:?} although rank 1 left"),
        };
        (left, h.wait().map(|_| ()))
    });
    assert_eq!(out[0].0, 1);
    match &out[0].1 {
        Err(Error::RankLeft { rank: 1, name, .. }) => assert_eq!(name, "y"),
        other => panic!("expected rank 1 named, got {other:?}"),
    }
}
