//! What the `share_cores` tests share: a logger that keeps the warnings for the test to read.

use std::sync::Mutex;

/// The warnings logged, in order.
pub struct Warnings(pub Mutex<Vec<String>>);

impl log::Log for Warnings {
    fn enabled(&self, m: &log::Metadata) -> bool {
        m.level() <= log::Level::Warn
    }
    fn log(&self, r: &log::Record) {
        if self.enabled(r.metadata()) {
            self.0.lock().unwrap().push(r.args().to_string());
        }
    }
    fn flush(&self) {}
}

/// Installs `w` as the process's logger, warnings and above (once per test binary).
pub fn capture(w: &'static Warnings) {
    log::set_logger(w).unwrap();
    log::set_max_level(log::LevelFilter::Warn);
}
