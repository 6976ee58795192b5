//! A rank's process lifecycle: it dies with its parent, and SIGINT or
//! SIGTERM ask it to stop (the work in flight drains, the offloader shuts
//! down, the rank still reports what it measured).
//!
//! The parent's side (forwarding SIGTERM, the deadline, SIGKILL) is in the
//! CLI's `run` command.

use std::sync::atomic::{AtomicBool, Ordering};

/// Set by the SIGINT/SIGTERM handlers; the handler does nothing else (the
/// one thing a signal handler can do safely). Statics are the handlers'
/// data: signal-hook takes a `&'static AtomicBool`.
static STOP: AtomicBool = AtomicBool::new(false);

/// Whether the rank was asked to stop (made once the handlers are in place).
#[derive(Copy, Clone, Debug)]
pub struct Stop {
    _installed: (),
}

impl Stop {
    /// Installs handlers for SIGINT and SIGTERM that only set the flag
    /// (SIGTERM also comes from the kernel when the parent dies, see
    /// [`die_with_parent`]).
    pub fn install() -> std::io::Result<Stop> {
        for sig in [signal_hook::consts::SIGINT, signal_hook::consts::SIGTERM] {
            signal_hook::flag::register(sig, &STOP)?;
        }
        Ok(Stop { _installed: () })
    }

    /// True once SIGINT or SIGTERM arrived.
    pub fn requested(self) -> bool {
        STOP.load(Ordering::SeqCst)
    }
}

/// Asks the kernel for SIGTERM when the parent dies (`prctl(PR_SET_PDEATHSIG)`;
/// the parent spawns every rank from its main thread, which lives until the
/// parent exits), then checks that the parent is still `parent`: if it died
/// before the prctl, this process was already reparented and no signal
/// would come, so the rank refuses to start.
pub fn die_with_parent(parent: u32) -> Result<(), String> {
    use rustix::process::{getppid, set_parent_process_death_signal, Signal};
    set_parent_process_death_signal(Some(Signal::TERM)).map_err(|e| format!("prctl(PR_SET_PDEATHSIG): {e}"))?;
    let now = getppid().map_or(0, |p| p.as_raw_nonzero().get() as u32);
    if now != parent {
        return Err(format!("the parent (pid {parent}) is gone (parent now {now}); not starting"));
    }
    Ok(())
}
