//! `--network-interface`: Open MPI takes interface names or subnets, NCCL's
//! `NCCL_SOCKET_IFNAME` only names (prefixes of them). A subnet is resolved to the
//! name of this machine's interface in it for NCCL.

use std::ffi::CStr;
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr};

/// What NCCL is given for a `--network-interface` list.
#[derive(Debug, PartialEq, Eq)]
pub(crate) struct NcclInterfaces {
    /// The value of `NCCL_SOCKET_IFNAME`; `None` when no entry gave a name.
    pub(crate) ifname: Option<String>,
    /// What kolorun decided, for the user (subnets resolved or not).
    pub(crate) notes: Vec<String>,
}

/// Maps each entry of `nics` (comma-separated interface names and subnets such as
/// `10.0.0.0/24`) to interface names for NCCL: a name stays as it is, a subnet becomes
/// the names of the interfaces in `local` (this machine's, see [`local_addresses`])
/// with an address in it. A subnet with none is left out, with a note saying how to
/// name the interface for NCCL instead.
///
/// # Errors
/// An entry with `/` that is not a subnet (`10.0.0.0/33`, `eth0/24`), or one that is
/// not an interface name (`eth0;rm`, `-x`), naming it.
pub(crate) fn nccl_interfaces(
    nics: &str,
    local: &[(String, IpAddr)],
) -> Result<NcclInterfaces, String> {
    let mut names: Vec<String> = Vec::new();
    let mut notes = Vec::new();
    for entry in nics.split(',').filter(|e| !e.is_empty()) {
        let Some((addr, prefix)) = entry.split_once('/') else {
            // An interface name as Linux allows it (at most 15 bytes, no `/`, space or
            // shell character): it reaches mpirun's and the remote ranks' command lines.
            let ok = entry.len() <= 15
                && entry
                    .chars()
                    .all(|c| c.is_ascii_alphanumeric() || "-_.:@".contains(c))
                && !entry.starts_with('-');
            if !ok {
                return Err(format!(
                    "--network-interface entry {entry:?}: not an interface name (letters, \
                     digits, -, _, ., :, @; at most 15 characters) nor a subnet (e.g. \
                     10.0.0.0/24)"
                ));
            }
            if !names.iter().any(|n| n == entry) {
                names.push(entry.to_string());
            }
            continue;
        };
        let bad = |why: &str| format!("--network-interface entry {entry:?}: {why}");
        let addr: IpAddr = addr
            .parse()
            .map_err(|_| bad("not a subnet (want an address/prefix length, e.g. 10.0.0.0/24)"))?;
        let bits = if addr.is_ipv4() { 32 } else { 128 };
        let prefix: u32 = match prefix.parse() {
            Ok(p) if p <= bits && prefix.bytes().all(|b| b.is_ascii_digit()) => p,
            _ => return Err(bad(&format!("the prefix length must be 0 to {bits}"))),
        };
        let here: Vec<&str> = local
            .iter()
            .filter(|(_, a)| in_subnet(*a, addr, prefix))
            .map(|(n, _)| n.as_str())
            .collect();
        if here.is_empty() {
            notes.push(format!(
                "kolorun: no interface of this machine has an address in {entry}, and NCCL's \
                 NCCL_SOCKET_IFNAME takes interface names, so NCCL is not told about it; name \
                 the interface for NCCL (e.g. --mpi-args \"-x NCCL_SOCKET_IFNAME=eth0\")"
            ));
            continue;
        }
        for n in &here {
            if !names.iter().any(|x| x == n) {
                names.push(n.to_string());
            }
        }
        notes.push(format!(
            "kolorun: NCCL_SOCKET_IFNAME gets {} for {entry} (this machine's interface \
             there; NCCL on every host looks for an interface of that name)",
            here.join(",")
        ));
    }
    Ok(NcclInterfaces {
        ifname: (!names.is_empty()).then(|| names.join(",")),
        notes,
    })
}

/// Whether `a` lies in the subnet `net`/`prefix` (of the same family).
fn in_subnet(a: IpAddr, net: IpAddr, prefix: u32) -> bool {
    match (a, net) {
        (IpAddr::V4(a), IpAddr::V4(net)) => {
            let mask = u32::MAX.checked_shl(32 - prefix).unwrap_or(0);
            u32::from(a) & mask == u32::from(net) & mask
        }
        (IpAddr::V6(a), IpAddr::V6(net)) => {
            let mask = u128::MAX.checked_shl(128 - prefix).unwrap_or(0);
            u128::from(a) & mask == u128::from(net) & mask
        }
        _ => false,
    }
}

/// This machine's interfaces and their IPv4 and IPv6 addresses (`getifaddrs`); empty
/// if they cannot be listed.
pub(crate) fn local_addresses() -> Vec<(String, IpAddr)> {
    let mut list = Vec::new();
    let mut head: *mut libc::ifaddrs = std::ptr::null_mut();
    // SAFETY: getifaddrs writes a list it allocates to `head`, freed below.
    if unsafe { libc::getifaddrs(&mut head) } != 0 {
        return list;
    }
    let mut cur = head;
    while !cur.is_null() {
        // SAFETY: `cur` is a node of the list getifaddrs made, alive until freeifaddrs.
        let ifa = unsafe { &*cur };
        // SAFETY: ifa_addr, when not null, points to a sockaddr whose family says
        // which sockaddr_* it is; ifa_name is a NUL-terminated string.
        let addr = unsafe {
            match ifa.ifa_addr.as_ref().map(|a| i32::from(a.sa_family)) {
                Some(libc::AF_INET) => {
                    let sin = &*(ifa.ifa_addr as *const libc::sockaddr_in);
                    Some(IpAddr::V4(Ipv4Addr::from(u32::from_be(
                        sin.sin_addr.s_addr,
                    ))))
                }
                Some(libc::AF_INET6) => {
                    let sin6 = &*(ifa.ifa_addr as *const libc::sockaddr_in6);
                    Some(IpAddr::V6(Ipv6Addr::from(sin6.sin6_addr.s6_addr)))
                }
                _ => None,
            }
        };
        if let Some(addr) = addr {
            // SAFETY: as above.
            let name = unsafe { CStr::from_ptr(ifa.ifa_name) };
            list.push((name.to_string_lossy().into_owned(), addr));
        }
        cur = ifa.ifa_next;
    }
    // SAFETY: `head` came from getifaddrs and is freed once.
    unsafe { libc::freeifaddrs(head) };
    list
}

#[cfg(test)]
mod tests {
    use super::*;

    fn local() -> Vec<(String, IpAddr)> {
        [
            ("lo", "127.0.0.1"),
            ("eth0", "172.17.0.2"),
            ("eth1", "10.0.0.5"),
            ("eth1", "fd00::5"),
        ]
        .iter()
        .map(|(n, a)| (n.to_string(), a.parse().unwrap()))
        .collect()
    }

    #[test]
    fn issue31_a_subnet_becomes_this_machines_interface_for_nccl() {
        // Issue 53 item 17: names that are no interface never reach a command line.
        for bad in ["eth0;rm", "-x", "eth 0", "a$(b)", "averyveryverylongname0"] {
            let e = nccl_interfaces(bad, &local()).map(|_| ()).unwrap_err();
            assert!(e.contains("not an interface name"), "{bad}: {e}");
        }
        assert!(nccl_interfaces("eth0,ib0.8001,enp3s0f1", &local()).is_ok());
        let n = nccl_interfaces("10.0.0.0/24", &local()).unwrap();
        assert_eq!(n.ifname.as_deref(), Some("eth1"));
        assert!(
            n.notes[0].contains("gets eth1 for 10.0.0.0/24"),
            "{:?}",
            n.notes
        );
        let n = nccl_interfaces("eth0,fd00::/64", &local()).unwrap();
        assert_eq!(n.ifname.as_deref(), Some("eth0,eth1"));
        let n = nccl_interfaces("eth0,eth1", &local()).unwrap();
        assert_eq!((n.ifname.as_deref(), n.notes.len()), (Some("eth0,eth1"), 0));
        // A subnet this machine is not on is not given to NCCL, with a note.
        let n = nccl_interfaces("192.168.9.0/24", &local()).unwrap();
        assert_eq!(n.ifname, None);
        assert!(
            n.notes[0].contains("no interface of this machine"),
            "{:?}",
            n.notes
        );
        for (bad, want) in [
            ("10.0.0.0/33", "the prefix length must be 0 to 32"),
            ("eth0/24", "not a subnet"),
            ("10.0.0.0/+8", "the prefix length"),
        ] {
            let e = nccl_interfaces(bad, &local()).unwrap_err();
            assert!(
                e.starts_with(&format!("--network-interface entry {bad:?}: {want}")),
                "{e}"
            );
        }
        assert!(in_subnet(
            "10.1.2.3".parse().unwrap(),
            "0.0.0.0".parse().unwrap(),
            0
        ));
        // This machine's loopback is found by getifaddrs.
        let here = local_addresses();
        let n = nccl_interfaces("127.0.0.0/8", &here).unwrap();
        assert_eq!(n.ifname.as_deref(), Some("lo"), "{here:?}");
    }
}
