//! The client IP of a request: the socket peer, or from `X-Forwarded-For` when the peer
//! is a trusted proxy.

use http::HeaderMap;
use ipnet::IpNet;
use std::net::IpAddr;

/// The client IP for limiting and logging.
///
/// When `peer` is not in `trusted`, `X-Forwarded-For` is ignored (anyone can write it)
/// and the answer is `peer`. When it is, the hops of every `X-Forwarded-For` header are
/// walked from the right: the first hop that is not itself a trusted proxy is the client.
/// A hop that does not parse as an IP stops the walk (the last trusted hop is used);
/// if every hop is trusted, the left-most one is the client.
pub fn client_ip(headers: &HeaderMap, peer: IpAddr, trusted: &[IpNet]) -> IpAddr {
    let peer = canonical(peer);
    if !is_trusted(peer, trusted) {
        return peer;
    }
    let mut client = peer;
    // By bytes: a value with a non-ASCII byte somewhere still has valid hops to its
    // right (the bad hop only stops the walk when it is reached).
    let hops = headers
        .get_all("x-forwarded-for")
        .iter()
        .flat_map(|v| v.as_bytes().split(|b| *b == b','));
    for hop in hops.rev() {
        let Some(ip) = std::str::from_utf8(hop).ok().and_then(parse_hop) else {
            break;
        };
        client = ip;
        if !is_trusted(ip, trusted) {
            break;
        }
    }
    client
}

pub(super) fn is_trusted(ip: IpAddr, trusted: &[IpNet]) -> bool {
    trusted.iter().any(|net| net.contains(&ip))
}

/// IPv4-mapped IPv6 addresses (`::ffff:1.2.3.4`) are treated as the IPv4 address.
pub(super) fn canonical(ip: IpAddr) -> IpAddr {
    match ip {
        IpAddr::V6(v6) => v6.to_ipv4_mapped().map(IpAddr::V4).unwrap_or(ip),
        v4 => v4,
    }
}

/// The address that keys `ip` in per-IP counts: an IPv4 address (or an IPv4-mapped
/// IPv6 one, as IPv4) is itself; an IPv6 address is its network of `ipv6_prefix_len`
/// bits (1 to 128; larger values are 128), the host bits zeroed: `2001:db8:1:2::7` with
/// 64 is `2001:db8:1:2::`.
pub fn network(ip: IpAddr, ipv6_prefix_len: u8) -> IpAddr {
    match canonical(ip) {
        IpAddr::V6(v6) => {
            let bits = u32::from(ipv6_prefix_len.min(128));
            let mask = u128::MAX.checked_shl(128 - bits).unwrap_or(0);
            IpAddr::V6((u128::from(v6) & mask).into())
        }
        v4 => v4,
    }
}

/// A hop is an IP, possibly with a port (`1.2.3.4:5678`, `[::1]:80`).
fn parse_hop(hop: &str) -> Option<IpAddr> {
    let hop = hop.trim();
    if let Ok(ip) = hop.parse::<IpAddr>() {
        return Some(canonical(ip));
    }
    hop.parse::<std::net::SocketAddr>()
        .ok()
        .map(|s| canonical(s.ip()))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn xff(v: &str) -> HeaderMap {
        let mut h = HeaderMap::new();
        h.insert("x-forwarded-for", v.parse().unwrap());
        h
    }

    fn nets(v: &[&str]) -> Vec<IpNet> {
        v.iter().map(|s| s.parse().unwrap()).collect()
    }

    #[test]
    fn untrusted_peer_is_the_client() {
        let ip = client_ip(
            &xff("1.1.1.1"),
            "9.9.9.9".parse().unwrap(),
            &nets(&["10.0.0.0/8"]),
        );
        assert_eq!(ip.to_string(), "9.9.9.9");
    }

    #[test]
    fn trusted_peer_yields_rightmost_untrusted_hop() {
        let trusted = nets(&["10.0.0.0/8"]);
        let ip = client_ip(
            &xff("6.6.6.6, 1.1.1.1, 10.0.0.7"),
            "10.0.0.1".parse().unwrap(),
            &trusted,
        );
        assert_eq!(ip.to_string(), "1.1.1.1");
        let ip = client_ip(
            &xff("10.0.0.9, 10.0.0.7"),
            "10.0.0.1".parse().unwrap(),
            &trusted,
        );
        assert_eq!(ip.to_string(), "10.0.0.9");
        let ip = client_ip(
            &xff("garbage, 10.0.0.7"),
            "10.0.0.1".parse().unwrap(),
            &trusted,
        );
        assert_eq!(ip.to_string(), "10.0.0.7");
        let ip = client_ip(&HeaderMap::new(), "10.0.0.1".parse().unwrap(), &trusted);
        assert_eq!(ip.to_string(), "10.0.0.1");
        let ip = client_ip(
            &xff("[2001:db8::1]:443"),
            "10.0.0.1".parse().unwrap(),
            &trusted,
        );
        assert_eq!(ip.to_string(), "2001:db8::1");
    }

    #[test]
    fn an_ipv6_address_is_keyed_by_its_network_and_ipv4_by_itself() {
        let ip = |s: &str| s.parse::<IpAddr>().unwrap();
        assert_eq!(
            network(ip("2001:db8:1:2:3:4:5:6"), 64),
            ip("2001:db8:1:2::")
        );
        assert_eq!(network(ip("2001:db8:1:2:3:4:5:6"), 56), ip("2001:db8:1::"));
        assert_eq!(
            network(ip("2001:db8:1:2ff:3::"), 56),
            ip("2001:db8:1:200::")
        );
        assert_eq!(network(ip("2001:db8::1"), 128), ip("2001:db8::1"));
        assert_eq!(network(ip("2001:db8::1"), 200), ip("2001:db8::1"));
        assert_eq!(network(ip("ffff::1"), 1), ip("8000::"));
        assert_eq!(network(ip("ffff::1"), 0), ip("::"));
        assert_eq!(network(ip("203.0.113.9"), 64), ip("203.0.113.9"));
        assert_eq!(network(ip("::ffff:203.0.113.9"), 64), ip("203.0.113.9"));
    }

    #[test]
    fn a_non_ascii_hop_leaves_the_valid_hops_to_its_right() {
        let mut h = HeaderMap::new();
        h.insert(
            "x-forwarded-for",
            http::HeaderValue::from_bytes(b"1.1.1.1, caf\xe9, 203.0.113.9").unwrap(),
        );
        let peer: IpAddr = "10.0.0.1".parse().unwrap();
        let ip = client_ip(&h, peer, &nets(&["10.0.0.0/8"]));
        assert_eq!(ip, "203.0.113.9".parse::<IpAddr>().unwrap());
    }
}
