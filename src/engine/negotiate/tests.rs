use super::*;
use crate::engine::request::TensorMeta;
use crate::tensor::DType;
use crate::vocab::ReduceOp;

fn req(key: &str, kind: OpKind, shape: &[usize]) -> RequestMeta {
    RequestMeta::for_test(key, kind, DType::F32, shape, ReduceOp::Sum)
}

fn cycle(per_rank: Vec<Vec<RequestMeta>>) -> Vec<CycleMsg> {
    per_rank
        .into_iter()
        .map(|requests| CycleMsg {
            requests,
            ..CycleMsg::default()
        })
        .collect()
}

fn responses(o: Outcome) -> Vec<Response> {
    match o {
        Outcome::Responses(r) => r,
        Outcome::RankLeft(r) => panic!("rank {r} left"),
        Outcome::Stalled(r) => panic!("stalled: {r}"),
    }
}

fn keys(rs: &[Response]) -> Vec<String> {
    rs.iter()
        .map(|r| match r {
            Response::Run(ready) => ready.key.to_string(),
            Response::Reduced { ready, .. } => format!("reduced:{}", ready.key),
            Response::Fail { key, .. } => format!("fail:{key}"),
            Response::JoinDone { last } => format!("join:{last}"),
        })
        .collect()
}

#[test]
fn ready_only_when_every_rank_submitted_in_first_submission_order() {
    let now = Instant::now();
    let mut n = Negotiator::new(2);
    let a = req("a", OpKind::Allreduce, &[4]);
    let b = req("b", OpKind::Allreduce, &[4]);
    let r = responses(n.handle(
        &cycle(vec![vec![a.clone(), b.clone()], vec![b.clone()]]),
        now,
    ));
    assert_eq!(keys(&r), ["b"]);
    assert!(n.has_pending());
    let r = responses(n.handle(&cycle(vec![vec![], vec![a]]), now));
    assert_eq!(keys(&r), ["a"]);
    assert!(!n.has_pending());
}

#[test]
fn same_order_whatever_order_ranks_submit_in() {
    let now = Instant::now();
    let names = ["x", "y", "z"];
    let reqs: Vec<_> = names
        .iter()
        .map(|k| req(k, OpKind::Allreduce, &[1]))
        .collect();
    let mut rev = reqs.clone();
    rev.reverse();
    let mut n = Negotiator::new(2);
    let r = responses(n.handle(&cycle(vec![reqs, rev]), now));
    assert_eq!(keys(&r), ["x", "y", "z"]);
}

#[test]
fn shape_mismatch_names_each_rank() {
    let mut n = Negotiator::new(3);
    let r = responses(n.handle(
        &cycle(vec![
            vec![req("g.w", OpKind::Allreduce, &[17, 17])],
            vec![req("g.w", OpKind::Allreduce, &[18, 18])],
            vec![req("g.w", OpKind::Allreduce, &[17, 17])],
        ]),
        Instant::now(),
    ));
    let Response::Fail { error, .. } = &r[0] else {
        panic!("{r:?}")
    };
    assert_eq!(
        error.to_string(),
        "allreduce \"g.w\": shape mismatch: ranks 0, 2 sent [17, 17], rank 1 sent [18, 18]"
    );
}

#[test]
fn cpu_and_cuda_tensors_under_one_name_are_a_device_mismatch() {
    let mut n = Negotiator::new(2);
    let mut gpu = req("g.b", OpKind::Allreduce, &[3]);
    gpu.device = crate::engine::request::Device::Cuda;
    let r = responses(n.handle(
        &cycle(vec![vec![req("g.b", OpKind::Allreduce, &[3])], vec![gpu]]),
        Instant::now(),
    ));
    let Response::Fail { error, .. } = &r[0] else {
        panic!("{r:?}")
    };
    assert_eq!(
        error.to_string(),
        "allreduce \"g.b\": device mismatch: rank 0 sent cpu, rank 1 sent cuda"
    );
}

#[test]
fn allgather_allows_different_first_dims_only() {
    let mut n = Negotiator::new(2);
    let r = responses(n.handle(
        &cycle(vec![
            vec![req("g", OpKind::Allgather, &[1, 3])],
            vec![req("g", OpKind::Allgather, &[2, 3])],
        ]),
        Instant::now(),
    ));
    assert!(matches!(r[0], Response::Run(_)));
    let r = responses(n.handle(
        &cycle(vec![
            vec![req("h", OpKind::Allgather, &[1, 3])],
            vec![req("h", OpKind::Allgather, &[1, 4])],
        ]),
        Instant::now(),
    ));
    let Response::Fail { error, .. } = &r[0] else {
        panic!("{r:?}")
    };
    assert_eq!(
            error.to_string(),
            "allgather \"h\": shape mismatch: rank 0 sent [1, 3], rank 1 sent [1, 4] (all dims but the first must match)"
        );
}

#[test]
fn kind_op_scale_and_root_mismatches() {
    let now = Instant::now();
    let mut n = Negotiator::new(2);
    let mut b = req("t", OpKind::Allreduce, &[2]);
    b.kind = OpKind::Allgather;
    let r = responses(n.handle(
        &cycle(vec![vec![req("t", OpKind::Allreduce, &[2])], vec![b]]),
        now,
    ));
    let Response::Fail { error, .. } = &r[0] else {
        panic!()
    };
    assert_eq!(
        error.to_string(),
        "allreduce \"t\": op mismatch: rank 0 sent allreduce, rank 1 sent allgather"
    );

    let mut b = req("t", OpKind::Allreduce, &[2]);
    b.op = ReduceOp::Max;
    let r = responses(n.handle(
        &cycle(vec![vec![req("t", OpKind::Allreduce, &[2])], vec![b]]),
        now,
    ));
    let Response::Fail { error, .. } = &r[0] else {
        panic!()
    };
    assert!(
        error
            .to_string()
            .contains("reduce op mismatch: rank 0 sent Sum, rank 1 sent Max"),
        "{error}"
    );

    let mut b = req("t", OpKind::Allreduce, &[2]);
    b.prescale = 0.5;
    let r = responses(n.handle(
        &cycle(vec![vec![req("t", OpKind::Allreduce, &[2])], vec![b]]),
        now,
    ));
    let Response::Fail { error, .. } = &r[0] else {
        panic!()
    };
    assert!(
        error
            .to_string()
            .contains("prescale mismatch: rank 0 sent 1, rank 1 sent 0.5"),
        "{error}"
    );

    let mut a = req("t", OpKind::Broadcast, &[2]);
    let mut b = a.clone();
    a.root = 0;
    b.root = 1;
    let r = responses(n.handle(&cycle(vec![vec![a], vec![b]]), now));
    let Response::Fail { error, .. } = &r[0] else {
        panic!()
    };
    assert_eq!(
        error.to_string(),
        "broadcast \"t\": root mismatch: rank 0 sent root 0, rank 1 sent root 1"
    );

    let mut b = req("t", OpKind::Allreduce, &[2]);
    b.tensors[0].dtype = DType::I32;
    let r = responses(n.handle(
        &cycle(vec![vec![req("t", OpKind::Allreduce, &[2])], vec![b]]),
        now,
    ));
    let Response::Fail { error, .. } = &r[0] else {
        panic!()
    };
    assert!(
        error
            .to_string()
            .contains("dtype mismatch: rank 0 sent f32, rank 1 sent i32"),
        "{error}"
    );
}

#[test]
fn joined_ranks_count_as_ready_and_join_reports_the_last() {
    let now = Instant::now();
    let mut n = Negotiator::new(3);
    let join = req("join", OpKind::Join, &[]);
    let r = responses(n.handle(&cycle(vec![vec![], vec![join.clone()], vec![]]), now));
    assert!(r.is_empty());
    let a = req("a", OpKind::Allreduce, &[3]);
    let g = req("g", OpKind::Allgather, &[3]);
    let r = responses(n.handle(
        &cycle(vec![vec![a.clone(), g.clone()], vec![], vec![a, g]]),
        now,
    ));
    assert_eq!(keys(&r), ["a", "fail:g"]);
    let Response::Run(ready) = &r[0] else {
        panic!()
    };
    assert!(ready.metas[1].is_none());
    let Response::Fail { error, .. } = &r[1] else {
        panic!()
    };
    assert!(matches!(error, Error::Joined { ranks, .. } if ranks == &[1]));
    let r = responses(n.handle(&cycle(vec![vec![join.clone()], vec![], vec![join]]), now));
    assert_eq!(keys(&r), ["join:2"]);
    assert!(!n.has_pending());
}

#[test]
fn a_rank_leaving_ends_everything() {
    let mut n = Negotiator::new(2);
    let _ = n.handle(
        &cycle(vec![vec![req("a", OpKind::Allreduce, &[1])], vec![]]),
        Instant::now(),
    );
    let mut msgs = cycle(vec![vec![], vec![]]);
    msgs[1].shutdown = true;
    assert!(matches!(
        n.handle(&msgs, Instant::now()),
        Outcome::RankLeft(1)
    ));
    assert!(!n.has_pending());
}

#[test]
fn a_stall_abort_reports_missing_ranks_everywhere() {
    let mut n = Negotiator::new(3);
    let _ = n.handle(
        &cycle(vec![
            vec![req("a", OpKind::Allreduce, &[1])],
            vec![],
            vec![req("a", OpKind::Allreduce, &[1])],
        ]),
        Instant::now(),
    );
    let mut msgs = cycle(vec![vec![], vec![], vec![]]);
    msgs[2].stall_abort = true;
    match n.handle(&msgs, Instant::now()) {
        Outcome::Stalled(report) => assert_eq!(
            report,
            "stalled: \"a\" is missing from ranks [1] (rank 2 reached the stall shutdown time)"
        ),
        other => panic!("{other:?}"),
    }
}

#[test]
fn stalled_lists_missing_ranks() {
    let t0 = Instant::now();
    let mut n = Negotiator::new(3);
    let _ = n.handle(
        &cycle(vec![
            vec![req("a", OpKind::Allreduce, &[1])],
            vec![],
            vec![],
        ]),
        t0,
    );
    assert!(n.stalled(t0, Duration::from_secs(1)).is_empty());
    let later = t0 + Duration::from_secs(2);
    assert_eq!(
        n.stalled(later, Duration::from_secs(1)),
        vec![("a".to_string(), vec![1, 2])]
    );
}

/// Issue 31, item 21: a process set's device turn is ready once the set's ranks
/// submitted it, whatever the other ranks do; a stall names only the set's missing
/// rank; the set's ranks must agree on the set.
#[test]
fn a_device_turn_needs_its_set_only() {
    let now = Instant::now();
    let mut n = Negotiator::new(3);
    let mut turn = req("turn#1", OpKind::DeviceTurn, &[]);
    turn.tensors.clear();
    turn.splits = Some(vec![0, 2]);
    let r = responses(n.handle(&cycle(vec![vec![], vec![], vec![turn.clone()]]), now));
    assert!(r.is_empty());
    let stalled = n.stalled(now, Duration::ZERO);
    assert_eq!(stalled, [("turn#1".to_string(), vec![0])]);
    let r = responses(n.handle(&cycle(vec![vec![turn.clone()], vec![], vec![]]), now));
    assert_eq!(keys(&r), ["turn#1"]);
    // Another set under the same key (a bug) fails instead of running.
    let mut other = turn.clone();
    other.splits = Some(vec![0, 1, 2]);
    let r = responses(n.handle(&cycle(vec![vec![turn], vec![], vec![other]]), now));
    assert_eq!(keys(&r), ["fail:turn#1"]);
}

/// A group request keyed `key` with `members` (each a 4-float tensor).
fn group(key: &str, members: &[&str]) -> RequestMeta {
    let mut m = req(key, OpKind::GroupedAllgather, &[4]);
    let t = m.tensors[0].clone();
    m.tensors = members
        .iter()
        .map(|n| TensorMeta {
            name: (*n).into(),
            ..t.clone()
        })
        .collect();
    m
}

#[test]
fn groups_with_different_member_lists_fail_on_every_rank_naming_a_member() {
    let now = Instant::now();
    let mut n = Negotiator::new(3);
    let ab = group("@group[a,b]", &["a", "b"]);
    let abc = group("@group[a,b,c]", &["a", "b", "c"]);
    // Ranks 0 and 2 sent {a, b}, rank 1 {a, b, c}: neither group can become ready.
    let r = responses(n.handle(
        &cycle(vec![vec![ab.clone()], vec![abc.clone()], vec![]]),
        now,
    ));
    assert!(
        r.is_empty(),
        "judged before rank 2 sent anything: {:?}",
        keys(&r)
    );
    let r = responses(n.handle(&cycle(vec![vec![], vec![], vec![ab.clone()]]), now));
    assert_eq!(keys(&r), ["fail:@group[a,b]", "fail:@group[a,b,c]"]);
    let Response::Fail { error, .. } = &r[0] else {
        panic!("not a failure");
    };
    let text = error.to_string();
    assert!(
        text.contains(
            "member \"a\" is in different groups: ranks 0, 2 sent [\"a\", \"b\"], rank 1 sent [\"a\", \"b\", \"c\"]"
        ),
        "{text}"
    );
    assert!(!n.has_pending(), "the failed groups stay in the table");
}

#[test]
fn a_member_in_two_pending_groups_of_one_rank_is_not_judged() {
    // Rank 0 has {a, b} and {b, c} pending; rank 1 sent {b, c}, rank 2 {a, b}: each
    // group waits for one rank, which may be submitting in another order.
    let now = Instant::now();
    let mut n = Negotiator::new(3);
    let ab = group("@group[a,b]", &["a", "b"]);
    let bc = group("@group[b,c]", &["b", "c"]);
    let r = responses(n.handle(
        &cycle(vec![
            vec![ab.clone(), bc.clone()],
            vec![bc.clone()],
            vec![ab.clone()],
        ]),
        now,
    ));
    assert!(r.is_empty(), "{:?}", keys(&r));
    let r = responses(n.handle(&cycle(vec![vec![], vec![ab], vec![bc]]), now));
    assert_eq!(keys(&r), ["@group[a,b]", "@group[b,c]"]);
}
