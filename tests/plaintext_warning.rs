//! Issue 16: a hook reached over plaintext on the network is warned about
//! at start-up (its events carry prompts and tool arguments); a loopback
//! endpoint, where plaintext is fine, and an https one are not.

use std::io::Write;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use hookwire::config::Config;
use hookwire::hooks::client::HookClient;

const WARNING: &str = "hook reached over plaintext on the network";

#[derive(Clone, Default)]
struct Lines(Arc<Mutex<Vec<u8>>>);

impl Write for Lines {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        self.0.lock().unwrap().extend_from_slice(buf);
        Ok(buf.len())
    }
    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

/// The log lines (at warn and above) written while a client for
/// `endpoint` is built.
fn warnings_for(endpoint: &str) -> String {
    let lines = Lines::default();
    let writer = lines.clone();
    let subscriber = tracing_subscriber::fmt()
        .with_max_level(tracing::Level::WARN)
        .with_ansi(false)
        .with_writer(move || writer.clone())
        .finish();
    let yaml = format!(
        "hooks:\n  - name: h\n    endpoint: {endpoint}\nagents: [{{name: a, model: m}}]\nmodels: [{{name: m, provider: scripted}}]\n"
    );
    let cfg = Config::parse(&yaml, "test").unwrap();
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    // Connections are lazy: building the client dials nothing, so the
    // documentation addresses below are never contacted.
    tracing::subscriber::with_default(subscriber, || {
        rt.block_on(async {
            HookClient::new(0, cfg.hooks[0].clone(), Duration::from_secs(5)).unwrap();
        })
    });
    let bytes = lines.0.lock().unwrap().clone();
    String::from_utf8(bytes).unwrap()
}

#[test]
fn plaintext_to_a_network_hook_is_warned_about_once_naming_the_hook() {
    for endpoint in ["http://192.0.2.10:50051", "http://hooks.example:50051"] {
        let log = warnings_for(endpoint);
        assert_eq!(log.matches(WARNING).count(), 1, "{endpoint}: {log}");
        assert!(log.contains("WARN"), "{log}");
        assert!(log.contains("hook=h"), "names the hook: {log}");
        assert!(log.contains(endpoint), "names the endpoint: {log}");
    }
}

#[test]
fn plaintext_to_loopback_and_tls_anywhere_are_not_warned_about() {
    for endpoint in [
        "http://127.0.0.1:50051",
        "http://localhost:50051",
        "http://[::1]:50051",
        "https://192.0.2.10:50051",
    ] {
        let log = warnings_for(endpoint);
        assert!(!log.contains(WARNING), "{endpoint}: {log}");
    }
}
