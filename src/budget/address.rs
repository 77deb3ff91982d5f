//! What each client address holds of the connections and of the descriptor budget
//! (`server.max_connections_per_ip`, `server.descriptor_share_per_ip`).

use super::Refused;
use std::collections::HashMap;
use std::net::IpAddr;
use std::sync::{Arc, Mutex};

/// What one client address holds: its connections (at most `max`) and its
/// connections plus requests in flight (at most `share`).
#[derive(Debug)]
pub(super) struct PerAddress {
    /// Connections per address at most.
    pub(super) max: usize,
    /// Connections and requests per address at most.
    pub(super) share: usize,
    /// Addresses with at least one connection or request (so the map holds at most
    /// `server.max_connections` entries plus one per request in flight); SipHash with a
    /// random key, as the addresses are the clients' choice.
    open: Mutex<HashMap<IpAddr, Held>>,
}

/// What one address holds (see [`PerAddress`]).
#[derive(Debug, Default)]
pub(super) struct Held {
    connections: usize,
    /// Connections and requests in flight.
    descriptors: usize,
}

impl PerAddress {
    /// At most `max` connections per address, and `share` connections plus requests.
    pub(super) fn new(max: usize, share: usize) -> Self {
        Self {
            max,
            share,
            open: Mutex::default(),
        }
    }

    pub(super) fn open(&self) -> std::sync::MutexGuard<'_, HashMap<IpAddr, Held>> {
        // A panic while the lock is held leaves consistent counts (one `+= 1` or `-= 1`).
        self.open.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// One more connection (`connection`) or request from `address`.
    ///
    /// Errors: [`Refused::MaxConnectionsPerIp`] when a connection would be one past
    /// `max`, [`Refused::DescriptorShare`] when the address holds `share`.
    pub(super) fn take(
        self: &Arc<Self>,
        address: IpAddr,
        connection: bool,
    ) -> Result<AddressSlot, Refused> {
        let mut open = self.open();
        let held = open.entry(address).or_default();
        let refused = if connection && held.connections >= self.max {
            Some(Refused::MaxConnectionsPerIp)
        } else if held.descriptors >= self.share {
            Some(Refused::DescriptorShare)
        } else {
            None
        };
        if let Some(why) = refused {
            if held.descriptors == 0 {
                open.remove(&address);
            }
            return Err(why);
        }
        held.descriptors += 1;
        if connection {
            held.connections += 1;
        }
        Ok(AddressSlot {
            table: self.clone(),
            address,
            connection,
        })
    }
}

/// A client connection's place among `server.max_connections_per_ip` for its address,
/// or a request's, and either's in the address's share of the descriptor budget; given
/// back when dropped.
#[derive(Debug)]
pub(super) struct AddressSlot {
    table: Arc<PerAddress>,
    address: IpAddr,
    connection: bool,
}

impl Drop for AddressSlot {
    fn drop(&mut self) {
        let mut open = self.table.open();
        if let Some(held) = open.get_mut(&self.address) {
            held.descriptors = held.descriptors.saturating_sub(1);
            if self.connection {
                held.connections = held.connections.saturating_sub(1);
            }
            if held.descriptors == 0 {
                open.remove(&self.address);
            }
        }
    }
}

/// A request's place in its client address's share of the descriptor budget
/// ([`Budget::share`]); given back when dropped.
#[derive(Debug)]
pub struct ShareSlot(#[allow(dead_code)] AddressSlot);

impl ShareSlot {
    pub(super) fn new(slot: AddressSlot) -> Self {
        Self(slot)
    }
}
