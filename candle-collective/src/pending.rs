//! Collectives in flight: [`Pending`] handles and the communication thread that backends
//! without device streams use to make progress while the caller computes.

use std::sync::mpsc;
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;

use candle_core::{Result, Tensor};

use crate::device::Handoff;

/// A started collective. [`Pending::wait`] returns its result (blocking until it is there).
///
/// Dropping a handle without waiting does not cancel the collective: it completes, and its
/// result is discarded. Dropping does not wait for it either; on a backend with a
/// communication thread, the handle's reference to the input is released on that thread once
/// the collective is done with it, so that a GPU tensor is never freed on the caller's stream
/// while the communication thread's stream may still read it.
#[must_use = "a pending collective's result is only available through wait()"]
pub struct Pending {
    finish: Option<Box<dyn FnOnce() -> Result<Tensor> + Send>>,
    /// Run when the handle is dropped without a wait.
    abandon: Option<Box<dyn FnOnce() + Send>>,
}

impl Drop for Pending {
    fn drop(&mut self) {
        if self.finish.is_some() {
            if let Some(abandon) = self.abandon.take() {
                abandon();
            }
        }
    }
}

impl std::fmt::Debug for Pending {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Pending")
    }
}

impl Pending {
    /// A handle whose `wait` runs `finish`.
    pub fn new(finish: impl FnOnce() -> Result<Tensor> + Send + 'static) -> Self {
        Self {
            finish: Some(Box::new(finish)),
            abandon: None,
        }
    }

    /// The handle, running `abandon` when it is dropped without a wait.
    pub(crate) fn on_abandon(mut self, abandon: impl FnOnce() + Send + 'static) -> Self {
        self.abandon = Some(Box::new(abandon));
        self
    }

    /// Waits for the collective and returns its result.
    ///
    /// # Errors
    ///
    /// Whatever `finish` returns. For a handle from a `*_async` method of
    /// [`crate::Collective`], the failures of the corresponding blocking collective
    /// that were not reported when it started, or, on backends with a communication thread
    /// (`ThreadGroup`, MPI), an error when that thread stopped before finishing the collective.
    pub fn wait(mut self) -> Result<Tensor> {
        self.abandon = None;
        match self.finish.take() {
            Some(finish) => finish(),
            None => unreachable!("a handle is waited for once: wait takes it"),
        }
    }
}

type Job = Box<dyn FnOnce() + Send>;

/// One thread that runs submitted collectives in submission order (so the ranks' call orders
/// stay aligned), started on first use and stopped when dropped.
#[derive(Default)]
pub(crate) struct Worker {
    inner: Mutex<Option<(mpsc::Sender<Job>, JoinHandle<()>)>>,
}

impl std::fmt::Debug for Worker {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Worker")
    }
}

impl Worker {
    /// Runs `job`, which reads `input`, on the communication thread; the returned handle waits
    /// for its result. On a GPU the communication thread's stream first waits for the work
    /// the caller enqueued before this call, and the caller's stream, in [`Pending::wait`],
    /// for the work that made the result (see `device::Handoff`); the host waits for neither.
    pub fn submit(
        &self,
        name: &str,
        input: &Tensor,
        job: impl FnOnce() -> Result<Tensor> + Send + 'static,
    ) -> Result<Pending> {
        // The communication thread reads `input` and the caller's thread the result: on a GPU
        // their streams are not ordered, so each side waits for the other's mark.
        let ready = Handoff::mark(input)?;
        let (tx, rx) = mpsc::channel();
        let boxed: Job = Box::new(move || {
            let out = ready.wait().and_then(|()| job()).and_then(|t| {
                let back = Handoff::mark(&t)?;
                Ok((t, back))
            });
            let _ = tx.send(out);
        });
        let mut inner = self.inner.lock().unwrap_or_else(|e| e.into_inner());
        if inner.is_none() {
            let (jtx, jrx) = mpsc::channel::<Job>();
            let handle = std::thread::Builder::new()
                .name(format!("{name}-comm"))
                .spawn(move || {
                    for job in jrx {
                        job();
                    }
                })?;
            *inner = Some((jtx, handle));
        }
        let (jtx, _) = inner.as_ref().expect("started above");
        jtx.send(boxed).map_err(|_| {
            candle_core::Error::Msg(format!("{name}: the communication thread has stopped"))
        })?;
        // The caller keeps the input alive until it has waited for the communication thread's
        // mark: a caller that drops its own reference early (and a communication thread that
        // dropped its clone already) would otherwise free the input on the caller's stream,
        // unordered with the communication thread's read of it. A handle dropped without a
        // wait hands its reference to the input, and the result waiting for it (written on the
        // communication thread's stream), to the communication thread instead, behind the job:
        // both are released there, in that thread's stream order.
        let slot = Arc::new(Mutex::new(Some((input.clone(), rx))));
        let (kept, handed) = (slot.clone(), slot);
        let thread = jtx.clone();
        let pending = Pending::new(move || {
            let taken = kept.lock().unwrap_or_else(|e| e.into_inner()).take();
            let Some((keep, rx)) = taken else {
                candle_core::bail!("a collective's handle was already given up")
            };
            let (t, back) = rx.recv().map_err(|_| {
                candle_core::Error::Msg(
                    "the communication thread stopped before finishing a collective".into(),
                )
            })??;
            back.wait()?;
            drop(keep);
            Ok(t)
        });
        Ok(pending.on_abandon(move || {
            let taken = handed.lock().unwrap_or_else(|e| e.into_inner()).take();
            if let Some((input, rx)) = taken {
                // Queued behind the collective's job, so its result is there to be dropped. A
                // stopped thread already finished the job: then they go here.
                let _ = thread.send(Box::new(move || {
                    drop(rx.recv());
                    drop(input);
                }));
            }
        }))
    }
}

impl Worker {
    /// Lets the submitted jobs finish and stops the thread (a later submit starts a new one).
    pub fn shutdown(&self) {
        let inner = self.inner.lock().unwrap_or_else(|e| e.into_inner()).take();
        if let Some((tx, handle)) = inner {
            drop(tx);
            let _ = handle.join();
        }
    }
}

impl Worker {
    /// Lets the submitted jobs finish on the thread, then `last`, without waiting for them (a
    /// later submit starts a new thread). `last` runs at once when there is no thread; when
    /// the thread has died it is dropped unrun, with the rest of the queue.
    pub fn detach_then(&self, last: impl FnOnce() + Send + 'static) {
        let inner = self.inner.lock().unwrap_or_else(|e| e.into_inner()).take();
        match inner {
            // Dropping the sender ends the thread's loop after the queued jobs; dropping the
            // join handle detaches the thread.
            Some((tx, _detached)) => {
                let _ = tx.send(Box::new(last));
            }
            None => last(),
        }
    }
}

impl Drop for Worker {
    fn drop(&mut self) {
        self.shutdown();
    }
}
