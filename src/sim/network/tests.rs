use super::{Algorithm, Link, Network};

/// A flat network (one host) or hosts of `l` ranks with distinct links.
fn net(l: usize) -> Network {
    Network {
        ranks_per_host: l,
        intra: Link {
            latency: 1e-6,
            bandwidth: 100e9,
        },
        inter: Link {
            latency: 5e-6,
            bandwidth: 25e9,
        },
        nics_per_host: 1,
        oversubscription: 1.0,
        copy_bandwidth: 10e9,
        cpu_scale: 1.0,
    }
}

fn close(a: f64, b: f64, rel: f64) -> bool {
    (a - b).abs() <= rel * b.abs()
}

#[test]
fn a_ring_costs_two_n_minus_one_steps_of_a_chunk() {
    for (l, n, s) in [(1, 8, 1e6), (8, 64, 64e6), (8, 4096, 4.0), (4, 3, 1e3)] {
        let net = net(l);
        let hop = if n > l { net.inter } else { net.intra };
        let want = 2.0 * (n - 1) as f64 * (hop.latency + s / (n as f64 * hop.bandwidth));
        let got = net.allreduce(Algorithm::Ring, n, s);
        assert!(close(got, want, 0.01), "n {n} l {l} s {s}: {got} vs {want}");
    }
}

#[test]
fn the_agreement_takes_one_latency_per_doubling_step() {
    let net = net(1);
    for n in [2usize, 4, 64, 4096] {
        let want = f64::from(n.trailing_zeros()) * net.inter.latency;
        let got = net.agreement(n, 0.0);
        assert!(close(got, want, 1e-9), "n {n}: {got} vs {want}");
    }
    // Not a power of two: the extra ranks fold in and out (two more messages).
    let got = net.agreement(4097, 0.0);
    assert!(close(got, 14.0 * net.inter.latency, 1e-9), "{got}");
    // Inside a host of 8 the first three steps take the host's latency.
    let net8 = net_l(8);
    let got = net8.agreement(64, 0.0);
    assert!(close(got, 3.0 * 1e-6 + 3.0 * 5e-6, 1e-9), "{got}");
}

fn net_l(l: usize) -> Network {
    net(l)
}

#[test]
fn no_algorithm_beats_the_lower_bound_and_auto_is_the_cheapest() {
    for l in [1, 8] {
        let net = net(l);
        for n in [2usize, 3, 8, 12, 64, 512, 4096] {
            for s in [4.0, 1e3, 1e5, 4e6, 256e6] {
                let bound = net.lower_bound(n, s);
                let auto = net.allreduce(Algorithm::Auto, n, s);
                for a in Algorithm::ALL {
                    let t = net.allreduce(a, n, s);
                    assert!(
                        t >= bound * 0.999,
                        "{} n {n} l {l} s {s}: {t} < {bound}",
                        a.name()
                    );
                    if !matches!(a, Algorithm::Kolo | Algorithm::KoloBefore) {
                        assert!(auto <= t, "auto {auto} > {} {t}", a.name());
                    }
                }
            }
        }
    }
}

#[test]
fn halving_doubling_moves_twice_the_buffer_once() {
    // One host, a power of two: 2 log2 N latencies and 2(N-1)/N of the buffer.
    let net = net(64);
    let (n, s) = (64usize, 64e6);
    let want =
        2.0 * 6.0 * net.intra.latency + 2.0 * (n - 1) as f64 / n as f64 * s / net.intra.bandwidth;
    let got = net.allreduce(Algorithm::HalvingDoubling, n, s);
    assert!(close(got, want, 1e-9), "{got} vs {want}");
}

#[test]
fn sharing_a_nic_divides_its_bandwidth() {
    let mut one = net(8);
    let s = 256e6;
    let shared = one.allreduce(Algorithm::RecursiveDoubling, 64, s);
    one.nics_per_host = 8;
    let own = one.allreduce(Algorithm::RecursiveDoubling, 64, s);
    assert!(shared > 4.0 * own, "{shared} vs {own}");
}
