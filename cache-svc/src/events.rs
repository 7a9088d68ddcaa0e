//! The bounded stream of stored / removed block-hash events, and the index
//! events and tiers they are made of (a leaf: it imports no other module).

use std::collections::VecDeque;

/// Where a cached block's content lives.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub enum Tier {
    /// The worker's device arena (the pool proper).
    #[default]
    Device,
    /// The worker's host-memory arena (see `tier`).
    Host,
    /// The worker's block files below the host (see `tier`).
    Disk,
}

/// An event of the prefix index, for the event stream.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum IndexEvent {
    /// A block's hash became reusable in `tier`.
    Stored {
        /// The block's hash.
        hash: u64,
        /// Its parent's hash (0 for a root block).
        parent: u64,
        /// The tier it is now cached in.
        tier: Tier,
    },
    /// A hash left `tier`'s index (its block was evicted).
    Removed {
        /// The block's hash.
        hash: u64,
        /// The tier it left.
        tier: Tier,
    },
}

/// What happened to some block hashes of one pool.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum EventKind {
    /// Hashes now reusable, parent first; `parent` is the first one's parent.
    Stored {
        /// The hashes.
        hashes: Vec<u64>,
        /// Parent of `hashes[0]` (0 for a root block).
        parent: u64,
    },
    /// Hashes evicted.
    Removed {
        /// The hashes.
        hashes: Vec<u64>,
    },
}

/// One event.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Event {
    /// Monotonic id, from 1, without gaps.
    pub id: u64,
    /// The pool.
    pub pool_id: u32,
    /// The tier of the pool whose index changed.
    pub tier: Tier,
    /// What happened.
    pub kind: EventKind,
}

/// The last `capacity` events.
#[derive(Debug)]
pub(crate) struct EventLog {
    buf: VecDeque<Event>,
    capacity: usize,
    next_id: u64,
}

/// Events read after some id.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct EventsSince {
    /// The events, oldest first.
    pub events: Vec<Event>,
    /// Set when events after the asked id were already dropped: the oldest id
    /// still buffered.
    pub lost_before: Option<u64>,
}

impl EventLog {
    /// A log that keeps `capacity` events (at least 1).
    pub(crate) fn new(capacity: usize) -> Self {
        Self {
            buf: VecDeque::new(),
            capacity: capacity.max(1),
            next_id: 1,
        }
    }

    /// Id of the newest event (0 when none yet).
    pub(crate) fn last_id(&self) -> u64 {
        self.next_id - 1
    }

    /// Appends one event, dropping the oldest when the buffer is full.
    fn push(&mut self, pool_id: u32, tier: Tier, kind: EventKind) {
        if self.buf.len() == self.capacity {
            self.buf.pop_front();
        }
        self.buf.push_back(Event {
            id: self.next_id,
            pool_id,
            tier,
            kind,
        });
        self.next_id += 1;
    }

    /// Appends the events of one operation on one pool, coalescing runs of
    /// stored chains and of removals.
    pub(crate) fn push_batch(&mut self, pool_id: u32, tier: Tier, kinds: Vec<EventKind>) {
        let mut pending: Option<EventKind> = None;
        for kind in kinds {
            pending = match (pending, kind) {
                (
                    Some(EventKind::Stored { mut hashes, parent }),
                    EventKind::Stored {
                        hashes: next,
                        parent: next_parent,
                    },
                ) if hashes.last() == Some(&next_parent) => {
                    hashes.extend(next);
                    Some(EventKind::Stored { hashes, parent })
                }
                (Some(EventKind::Removed { mut hashes }), EventKind::Removed { hashes: next }) => {
                    hashes.extend(next);
                    Some(EventKind::Removed { hashes })
                }
                (Some(done), next) => {
                    self.push(pool_id, tier, done);
                    Some(next)
                }
                (None, next) => Some(next),
            };
        }
        if let Some(done) = pending {
            self.push(pool_id, tier, done);
        }
    }

    /// Up to `max` events with id > `after`.
    pub(crate) fn since(&self, after: u64, max: usize) -> EventsSince {
        let oldest = self.buf.front().map_or(self.next_id, |e| e.id);
        let lost_before = (after + 1 < oldest && after < self.last_id()).then_some(oldest);
        let start = (after + 1).max(oldest);
        let skip = (start - oldest) as usize;
        EventsSince {
            events: self.buf.iter().skip(skip).take(max).cloned().collect(),
            lost_before,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn stored(h: u64, parent: u64) -> EventKind {
        EventKind::Stored {
            hashes: vec![h],
            parent,
        }
    }

    #[test]
    fn ids_are_monotonic_and_chains_coalesce() {
        let mut log = EventLog::new(8);
        log.push_batch(
            1,
            Tier::Device,
            vec![stored(5, 0), stored(6, 5), stored(9, 0)],
        );
        log.push_batch(
            1,
            Tier::Device,
            vec![EventKind::Removed { hashes: vec![6] }],
        );
        let all = log.since(0, 100);
        assert_eq!(all.lost_before, None);
        let ids: Vec<u64> = all.events.iter().map(|e| e.id).collect();
        assert_eq!(ids, vec![1, 2, 3]);
        assert_eq!(
            all.events[0].kind,
            EventKind::Stored {
                hashes: vec![5, 6],
                parent: 0
            }
        );
        assert_eq!(log.since(2, 100).events.len(), 1);
    }

    #[test]
    fn the_buffer_is_bounded_and_says_what_was_lost() {
        let mut log = EventLog::new(2);
        for h in 1..=5 {
            log.push_batch(
                1,
                Tier::Device,
                vec![EventKind::Removed { hashes: vec![h] }],
            );
        }
        let read = log.since(0, 100);
        assert_eq!(read.lost_before, Some(4));
        assert_eq!(read.events.len(), 2);
        assert_eq!(log.since(5, 100).events.len(), 0);
        assert_eq!(log.since(5, 100).lost_before, None);
    }
}
