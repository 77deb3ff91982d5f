//! Unit tests of the descriptor budget.

use super::*;

fn budget(max_connections: usize, descriptors: usize, max_tunnels: usize) -> Arc<Budget> {
    let metrics = Metrics::new(Box::new(|| None));
    Budget::new(
        BudgetLimits {
            max_connections,
            max_connections_per_ip: 2,
            descriptor_share_per_ip: 50,
            descriptors: Some(descriptors),
            max_tunnels,
            tunnel_idle_timeout: Duration::from_secs(1),
        },
        &metrics,
    )
}

#[test]
fn clients_and_upstream_sockets_share_the_descriptors() {
    let b = budget(2, 3, 1);
    let c1 = b.client(None).unwrap();
    let u1 = b.upstream().unwrap();
    let c2 = b.client(None).unwrap();
    // max_connections first, then the descriptors.
    assert_eq!(b.client(None).unwrap_err(), Refused::MaxConnections);
    assert!(b.upstream().is_none(), "3 descriptors held");
    drop(c1);
    assert!(
        b.upstream().is_some(),
        "a closed client gives its descriptor back"
    );
    drop((u1, c2));
    assert!(b.client(None).is_ok());
}

#[test]
fn connections_are_bounded_per_address() {
    let b = budget(10, 10, 1);
    let (one, two): (IpAddr, IpAddr) =
        ("192.0.2.1".parse().unwrap(), "2001:db8::".parse().unwrap());
    let held = [b.client(Some(one)).unwrap(), b.client(Some(one)).unwrap()];
    assert_eq!(
        b.client(Some(one)).unwrap_err(),
        Refused::MaxConnectionsPerIp
    );
    assert!(b.client(Some(two)).is_ok(), "another address");
    assert!(b.client(None).is_ok(), "not counted per address");
    drop(held);
    let again = [b.client(Some(one)).unwrap(), b.client(Some(one)).unwrap()];
    drop(again);
    assert!(
        b.per_address.open().is_empty(),
        "no entry for an address with none open"
    );
}

#[test]
fn one_address_holds_at_most_its_share_of_the_descriptors() {
    // 10 descriptors, 50 %: 5 per address, connections and requests together.
    let b = budget(10, 10, 1);
    let (one, two): (IpAddr, IpAddr) =
        ("192.0.2.1".parse().unwrap(), "192.0.2.2".parse().unwrap());
    let conn = b.client(Some(one)).unwrap();
    let requests: Vec<_> = (0..4).map(|_| b.share(one).unwrap()).collect();
    assert!(b.share(one).is_none(), "5 held");
    assert_eq!(b.client(Some(one)).unwrap_err(), Refused::DescriptorShare);
    assert!(b.share(two).is_some(), "another address");
    drop(requests);
    assert!(b.share(one).is_some());
    drop(conn);
    assert!(b.per_address.open().is_empty());
}

#[test]
fn tunnels_are_bounded() {
    let b = budget(10, 10, 1);
    let mut t = b.tunnel().unwrap();
    t.open();
    assert!(b.tunnel().is_none());
    drop(t);
    assert!(b.tunnel().is_some());
}
