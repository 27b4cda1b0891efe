use super::setup::ConfigV217;
use super::*;

fn ready(id: Option<Vec<u8>>) -> Setup {
    Setup { ready: Ok(()), id }
}

#[test]
fn every_rank_ready_gives_rank_0s_id() {
    let id: Vec<u8> = (0..128).map(|i| i as u8).collect();
    let setups = vec![ready(Some(id.clone())), ready(None), ready(None)];
    assert_eq!(decide(&setups).unwrap().to_vec(), id);
}

#[test]
fn a_rank_without_a_gpu_fails_everyone_naming_it() {
    let setups = vec![
        ready(Some(vec![7; 128])),
        Setup {
            ready: Err("no CUDA device".into()),
            id: None,
        },
        ready(None),
        Setup {
            ready: Err("NCCL library not found".into()),
            id: None,
        },
    ];
    let err = decide(&setups).unwrap_err().to_string();
    assert_eq!(
            err,
            "CUDA is not available: cannot start NCCL: rank 1: no CUDA device; rank 3: NCCL library not found"
        );
}

#[test]
fn a_short_id_is_an_error_not_a_panic() {
    let err = decide(&[ready(Some(vec![1; 5]))]).unwrap_err().to_string();
    assert!(err.contains("has 5 bytes"), "{err}");
}

#[test]
fn setup_survives_the_wire() {
    let s = Setup {
        ready: Err("x".into()),
        id: None,
    };
    let bytes = postcard::to_stdvec(&s).unwrap();
    assert_eq!(postcard::from_bytes::<Setup>(&bytes).unwrap(), s);
}

#[test]
fn the_config_is_a_prefix_of_nccls() {
    use std::mem::offset_of;
    type Full = sys::ncclConfig_t;
    let ours = [
        offset_of!(ConfigV217, magic),
        offset_of!(ConfigV217, version),
        offset_of!(ConfigV217, blocking),
        offset_of!(ConfigV217, cga_cluster_size),
        offset_of!(ConfigV217, min_ctas),
        offset_of!(ConfigV217, max_ctas),
        offset_of!(ConfigV217, net_name),
        offset_of!(ConfigV217, split_share),
    ];
    let theirs = [
        offset_of!(Full, magic),
        offset_of!(Full, version),
        offset_of!(Full, blocking),
        offset_of!(Full, cgaClusterSize),
        offset_of!(Full, minCTAs),
        offset_of!(Full, maxCTAs),
        offset_of!(Full, netName),
        offset_of!(Full, splitShare),
    ];
    assert_eq!(ours, theirs);
    let c = ConfigV217::non_blocking();
    assert_eq!(
        (c.size, c.magic, c.version, c.blocking),
        (48, 0xcafe_beef, 21_700, 0)
    );
    assert!(c.size < std::mem::size_of::<Full>());
}

#[test]
fn a_failed_init_is_named_on_every_rank() {
    let ok: std::result::Result<(), String> = Ok(());
    assert!(init_verdict(&[ok.clone(), ok.clone()]).is_ok());
    let waited = || {
        Err(Error::Cuda {
            call: "ncclCommInitRankConfig",
            message: "still in progress after 2.5 s: another rank's NCCL did not come up".into(),
        }
        .to_string())
    };
    let outcomes = [
        waited(),
        Err("ncclCommInitRankConfig failed: ncclSystemError".into()),
        waited(),
        ok,
    ];
    let err = init_verdict(&outcomes).unwrap_err().to_string();
    assert_eq!(
        err,
        "CUDA is not available: creating the NCCL communicator failed: rank 1: \
             ncclCommInitRankConfig failed: ncclSystemError; ranks 0, 2 timed out waiting for \
             the others"
    );
}

#[test]
fn nccl_scales_only_float_sums() {
    assert!(can_scale(DType::F32, ReduceOp::Average, 0.5));
    assert!(can_scale(DType::BF16, ReduceOp::Sum, 2.0));
    assert!(!can_scale(DType::I32, ReduceOp::Average, 0.5));
    assert!(!can_scale(DType::F32, ReduceOp::Max, 2.0));
    assert!(can_scale(DType::I32, ReduceOp::Max, 1.0));
}
