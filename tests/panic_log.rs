//! A panic's message stays out of the log above debug: hookwire's panic
//! hook (installed by `telemetry::init`, as `hookwire serve` does) logs the
//! place at error and the formatted message at debug, where Rust's default
//! hook printed the message on stderr whatever the level.
//!
//! The process's panic hook and global subscriber are the point, so the
//! test runs itself again as a child process that installs them and
//! panics; the parent reads everything the child wrote.

use std::process::Command;

const CHILD: &str = "HOOKWIRE_PANIC_LOG_CHILD";
const SECRET: &str = "the-users-prompt-4711";

#[test]
fn a_panics_message_is_logged_at_debug_only() {
    if std::env::var_os(CHILD).is_some() {
        return child();
    }
    let run = |level: &str| {
        let out = Command::new(std::env::current_exe().unwrap())
            .args([
                "a_panics_message_is_logged_at_debug_only",
                "--exact",
                "--nocapture",
            ])
            .env(CHILD, "1")
            .env("RUST_LOG", level)
            .env_remove("OTEL_EXPORTER_OTLP_ENDPOINT")
            .env_remove("RUST_BACKTRACE")
            .output()
            .unwrap();
        assert!(out.status.success(), "{out:?}");
        format!(
            "{}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        )
    };

    let info = run("info");
    let errors: Vec<&str> = info
        .lines()
        .filter(|l| l.contains("ERROR") && l.contains("panicked"))
        .collect();
    assert_eq!(errors.len(), 2, "both panics at error:\n{info}");
    assert!(
        errors.iter().all(|l| l.contains("tests/panic_log.rs:")),
        "with their place:\n{info}"
    );
    assert!(
        !info.contains(SECRET),
        "the formatted message leaked:\n{info}"
    );
    assert!(
        info.contains("a literal from the source"),
        "a literal message quotes nothing and stays:\n{info}"
    );

    let debug = run("debug");
    assert!(
        debug
            .lines()
            .any(|l| l.contains("DEBUG") && l.contains(SECRET)),
        "at debug the message is there:\n{debug}"
    );
}

fn child() {
    let rt = tokio::runtime::Runtime::new().unwrap();
    let _telemetry = rt.block_on(async {
        hookwire::telemetry::init(
            &hookwire::config::TelemetryConfig::default(),
            hookwire::telemetry::LogFormat::Text,
        )
        .unwrap()
    });
    let formatted = std::thread::spawn(|| {
        let content = SECRET.to_string();
        panic!("a bug while holding {content}");
    })
    .join();
    assert!(formatted.is_err());
    let literal = std::thread::spawn(|| panic!("a literal from the source")).join();
    assert!(literal.is_err());
}
