//! Collectives issued inside a backward, announced to whoever schedules other collectives
//! around them.
//!
//! An overlapped data-parallel backward (`candle-distributed`'s `DataParallel::with_overlap`,
//! which hears them through [`listen`]) starts gradient buckets
//! while candle's backward runs. Layers whose backward communicates too (`SyncBatchNorm`, the
//! differentiable collectives of `parallel`) issue their collectives at fixed points of the
//! graph; a bucket started between two of them on one rank and after them on another would
//! put the two ranks' collectives in different orders. So each such backward issues its
//! collectives through [`collective`], on the thread running the backward, which tells the
//! overlapped backward listening on that thread before (it starts the buckets due there) and
//! after (it counts the collective as done). Every rank issues the same collectives in the same
//! order (the model's own rule), so every rank counts the same places.
//!
//! A custom op whose backward issues a collective (on any communicator) does the same; without
//! a listener it costs one thread-local read.

use std::cell::RefCell;
use std::sync::Arc;

use candle_core::Result;

/// What a listener hears.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Event {
    /// Collectives of the backward follow.
    Before,
    /// They were issued and returned.
    After,
}

/// What an overlapped backward runs at each event.
pub type Listener = Arc<dyn Fn(Event) + Send + Sync>;

thread_local! {
    static LISTENER: RefCell<Option<Listener>> = const { RefCell::new(None) };
}

fn tell(e: Event) {
    let listener = LISTENER.with(|l| l.borrow().clone());
    if let Some(f) = listener {
        f(e);
    }
}

/// Runs `f`, which issues collectives inside a backward (a custom op's `bwd`), told to the
/// overlapped `DataParallel::backward` running on this thread, if any: before `f` (buckets due
/// there start first), and after it returns `Ok` (so that a rank whose backward fails later
/// knows it took part). Call it once per backward call, around every collective the call issues.
///
/// # Errors
///
/// `f`'s.
pub fn collective<R>(f: impl FnOnce() -> Result<R>) -> Result<R> {
    tell(Event::Before);
    let out = f()?;
    tell(Event::After);
    Ok(out)
}

/// Runs `f` at every event of this thread until the returned guard is dropped: what an
/// overlapped backward installs on the thread running candle's backward. A listener installed
/// while another listens replaces it until the guard is dropped.
pub fn listen(f: Listener) -> Listening {
    let previous = LISTENER.with(|l| l.borrow_mut().replace(f));
    Listening { previous }
}

/// Restores the listener that was there before [`listen`] when dropped.
#[must_use = "the listener is removed when this guard is dropped"]
pub struct Listening {
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
    use std::sync::Mutex;

    #[test]
    fn events_reach_the_listener_of_this_thread_only() {
        let heard = Arc::new(Mutex::new(Vec::new()));
        collective(|| Ok(())).unwrap(); // nobody listens: nothing happens
        {
            let h = heard.clone();
            let _g = listen(Arc::new(move |e| h.lock().unwrap().push(e)));
            collective(|| Ok(())).unwrap();
            // Another thread: not heard.
            std::thread::spawn(|| collective(|| Ok(())).unwrap())
                .join()
                .unwrap();
            // A failed collective is announced, never done.
            let failed: Result<()> = collective(|| candle_core::bail!("lost"));
            assert!(failed.is_err());
        }
        collective(|| Ok(())).unwrap(); // the guard is gone
        use Event::*;
        assert_eq!(*heard.lock().unwrap(), [Before, After, Before]);
    }
}
