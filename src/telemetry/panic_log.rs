//! A panic is logged like everything else: through tracing, its place at
//! error and its message at debug.
//!
//! Rust's default hook printed `thread '…' panicked at …: <message>` on
//! stderr whatever the log level. A run's panic is contained (the run ends
//! `failed`), but its message may quote anything the code held when it
//! formatted it, a prompt or a tool result included, and logs carry no
//! content above debug. A message written as a literal in hookwire's
//! source (`panic!("…")` with nothing formatted in) quotes nothing from a
//! run, so it stays at error with the place.

use std::panic::PanicHookInfo;

/// Replaces the process's panic hook. Called by [`super::init`], once the
/// subscriber is installed; a panic before that prints as Rust's default
/// hook does.
pub fn install() {
    std::panic::set_hook(Box::new(report));
}

fn report(info: &PanicHookInfo<'_>) {
    let location = info
        .location()
        .map(|l| format!("{}:{}", l.file(), l.line()))
        .unwrap_or_default();
    let thread = std::thread::current();
    let thread = thread.name().unwrap_or("unnamed");
    let payload = info.payload();
    if let Some(literal) = payload.downcast_ref::<&'static str>() {
        tracing::error!(%location, thread, panic = %literal, "panicked");
        return;
    }
    tracing::error!(
        %location,
        thread,
        "panicked; the panic message is logged at debug (it may quote content)"
    );
    if let Some(formatted) = payload.downcast_ref::<String>() {
        tracing::debug!(%location, panic = %formatted, "panic message");
    }
}
