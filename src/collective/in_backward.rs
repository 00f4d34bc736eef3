//! Collectives issued inside a backward, announced to whoever schedules other collectives
//! around them.
//!
//! An overlapped data-parallel backward (`DataParallel::with_overlap`) starts gradient buckets
//! while candle's backward runs. Layers whose backward communicates too (`SyncBatchNorm`, the
//! differentiable collectives of `parallel`) issue their collectives at fixed points of the
//! graph; a bucket started between two of them on one rank and after them on another would
//! put the two ranks' collectives in different orders. So each such backward calls
//! [`announce`] just before its collectives, on the thread running the backward, and the
//! overlapped backward, which listens on that thread, starts buckets only at agreed places
//! between these announcements. Every rank announces the same collectives in the same order
//! (the model's own rule), so every rank counts the same places.
//!
//! A custom op whose backward issues a collective (on any communicator) calls [`announce`] too;
//! without a listener it does nothing and costs one thread-local read.

use std::cell::RefCell;
use std::sync::Arc;

/// What an overlapped backward runs at each announcement.
pub(crate) type Listener = Arc<dyn Fn() + Send + Sync>;

thread_local! {
    static LISTENER: RefCell<Option<Listener>> = const { RefCell::new(None) };
}

/// Tells the backward running on this thread that a collective follows: call it in a custom
/// op's backward right before the collectives it issues there (once per backward call, however
/// many collectives follow). Without an overlapped `DataParallel::backward` on this thread it
/// does nothing.
pub fn announce() {
    let listener = LISTENER.with(|l| l.borrow().clone());
    if let Some(f) = listener {
        f();
    }
}

/// Runs `f` at every [`announce`] of this thread until the returned guard is dropped.
pub(crate) fn listen(f: Listener) -> Listening {
    let previous = LISTENER.with(|l| l.borrow_mut().replace(f));
    Listening { previous }
}

/// Restores the listener that was there before [`listen`] when dropped.
pub(crate) struct Listening {
    previous: Option<Listener>,
}

impl Drop for Listening {
    fn drop(&mut self) {
        let previous = self.previous.take();
        LISTENER.with(|l| *l.borrow_mut() = previous);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::{AtomicUsize, Ordering};

    #[test]
    fn announcements_reach_the_listener_of_this_thread_only() {
        let heard = Arc::new(AtomicUsize::new(0));
        announce(); // nobody listens: nothing happens
        {
            let h = heard.clone();
            let _g = listen(Arc::new(move || {
                h.fetch_add(1, Ordering::SeqCst);
            }));
            announce();
            std::thread::spawn(announce).join().unwrap(); // another thread: not heard
            announce();
        }
        announce(); // the guard is gone
        assert_eq!(heard.load(Ordering::SeqCst), 2);
    }
}
