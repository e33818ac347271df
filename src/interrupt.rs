//! SIGINT (ctrl-c) as a flag that long loops poll: the first ctrl-c asks `sample` and
//! `perplexity` to stop after the current token and print what they have (exit 130); a
//! second one exits at once with 130.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, OnceLock};

fn flag() -> &'static Arc<AtomicBool> {
    static FLAG: OnceLock<Arc<AtomicBool>> = OnceLock::new();
    FLAG.get_or_init(|| Arc::new(AtomicBool::new(false)))
}

/// Installs the SIGINT handler. Only commands that poll [`requested`] call this; the others
/// keep the default (ctrl-c kills them at once).
pub fn install() -> std::io::Result<()> {
    use signal_hook::consts::SIGINT;
    // The second SIGINT finds the flag already set and exits with 128 + 2.
    signal_hook::flag::register_conditional_shutdown(SIGINT, 130, flag().clone())?;
    signal_hook::flag::register(SIGINT, flag().clone())?;
    Ok(())
}

/// True once SIGINT has been received (never, when [`install`] was not called).
pub fn requested() -> bool {
    flag().load(Ordering::Relaxed)
}
