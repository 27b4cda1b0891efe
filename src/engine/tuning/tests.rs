use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use super::super::agree::Agreed;
use super::super::autotune::{AutotuneState, Tuner};
use super::super::control::Control;
use super::super::inbox::Inbox;
use super::super::queue::Queue;
use super::super::request::Settings;
use super::Tuning;
use crate::config::Config;
use crate::transport::Topology;

fn settings(threshold: usize, cache: bool, last: bool) -> Settings {
    Settings {
        fusion_threshold: threshold,
        fusion_max_tensor: crate::config::MAX_FUSED_TENSOR_BYTES,
        cycle_time_us: 500,
        cache,
        hierarchical: false,
        hierarchical_allgather: false,
        last,
    }
}

fn tuning(tuner: Option<Tuner>) -> Tuning {
    Tuning {
        tuner,
        pending: None,
        cache_capacity_on: 16,
        state: Arc::new(Mutex::new(AutotuneState::default())),
    }
}

#[test]
fn every_switch_is_recorded_with_its_cycle_and_the_last_one_finishes() {
    let t = tuning(None);
    t.record(&settings(1 << 20, false, false), 7);
    t.record(&settings(4 << 20, true, true), 12);
    let state = t.state.lock().unwrap();
    assert_eq!(
        (state.fusion_threshold, state.cache_enabled, state.finished),
        (4 << 20, true, true)
    );
    assert_eq!(state.cycle_time, Duration::from_micros(500));
    let cycles: Vec<(u64, usize, bool)> = state
        .changes
        .iter()
        .map(|c| (c.cycle, c.fusion_threshold, c.last))
        .collect();
    assert_eq!(cycles, [(7, 1 << 20, false), (12, 4 << 20, true)]);
    assert_eq!(t.cache_capacity(&settings(0, true, false)), 16);
    assert_eq!(t.cache_capacity(&settings(0, false, false)), 0);
}

#[test]
fn only_a_tuner_proposes_and_its_proposal_waits_for_the_next_cycle() {
    let start = Instant::now();
    let mut idle = tuning(None);
    for i in 0..100 {
        idle.observe(1 << 20, start, start + Duration::from_millis(i + 1));
    }
    assert!(idle.pending.is_none(), "no tuner, nothing to send");

    let mut config = Config::default().autotune(true);
    config.autotune_warmup_samples = 0;
    config.autotune_steps_per_sample = 1;
    let mut tuned = tuning(Tuner::new(
        &config,
        settings(64 << 20, true, false),
        false,
        false,
    ));
    let mut cycles = 0;
    while tuned.pending.is_none() && cycles < 100 {
        cycles += 1;
        let begin = start + Duration::from_millis(cycles);
        tuned.observe(1 << 20, begin, begin + Duration::from_millis(1));
    }
    // A configuration is scored over three samples before the next is proposed.
    assert_eq!(cycles, 3);
    // A cycle that reduced nothing is not a sample.
    let mut quiet = tuning(Tuner::new(
        &config,
        settings(64 << 20, true, false),
        false,
        false,
    ));
    for i in 0..10 {
        quiet.observe(0, start, start + Duration::from_millis(i + 1));
    }
    assert!(quiet.pending.is_none());
}

#[test]
fn switching_the_cache_sends_slot_announced_requests_in_full_again() {
    let topology = Topology {
        rank: 0,
        size: 2,
        local_rank: 0,
        local_size: 2,
        cross_rank: 0,
        cross_size: 1,
    };
    let agreed = Agreed {
        autotune: true,
        ..Agreed::plain(1 << 20, 8)
    };
    let mut control = Control::new(&Config::default(), topology, agreed);
    let mut inbox = Inbox::new(Arc::new(Queue::default()), 0);
    // A request announced by slot 3 (its request is pending).
    let (_handle, done) = crate::handle::pair(
        smallvec::smallvec!["w".into()],
        inbox.queue.clone(),
        ("allreduce", 0),
        crate::handle::to_unit,
    );
    let meta = super::request::RequestMeta::for_test(
        "w",
        super::request::OpKind::Allreduce,
        crate::tensor::DType::F32,
        &[1],
        crate::vocab::ReduceOp::Sum,
    );
    inbox.pending.insert(
        "w".into(),
        Box::new(super::request::Request {
            meta,
            tensors: smallvec::smallvec![],
            done,
            submitted: Instant::now(),
        }),
    );
    inbox.announced.insert(3, "w".into());

    control.apply(&settings(2 << 20, true, false), 16, &mut inbox);
    assert_eq!(control.agreed.fusion_threshold, 2 << 20);
    assert_eq!(
        inbox.announced.len(),
        1,
        "the cache stays: slots stay valid"
    );

    control.apply(&settings(2 << 20, false, false), 0, &mut inbox);
    assert!(!control.cache.enabled());
    assert!(inbox.announced.is_empty());
    assert_eq!(inbox.outgoing, ["w".into()], "announced in full next cycle");

    control.apply(&settings(2 << 20, true, false), 16, &mut inbox);
    assert!(control.cache.enabled());
    assert_eq!(control.cache.words(), 1, "16 slots fit one word");
}
