//! `hookwire config check` and `hookwire serve` (the real binary) agree: on
//! every bad config, both refuse with the same error; on a good one the
//! check passes and says what it found. The cases are what `serve` checks
//! before listening beyond the file's own validation: the trace exporter,
//! models (base URL, headers, API key variable), hook endpoints, the store
//! setting, and tool ownership across the hook servers that answer
//! Describe. Every process gets a data directory of its own (the SQLite
//! default lives there).

mod support;

use std::time::Duration;

use support::*;

const BIN: &str = env!("CARGO_BIN_EXE_hookwire");
/// A variable no environment sets.
const UNSET_KEY: &str = "HOOKWIRE_CONFIG_CHECK_TEST_SURELY_UNSET";

/// Exit status and stderr of the binary with `args`.
async fn hookwire(args: &[&str]) -> (bool, String) {
    hookwire_with(args, &[]).await
}

/// [`hookwire`] with `env` set as well.
async fn hookwire_with(args: &[&str], env: &[(&str, &str)]) -> (bool, String) {
    let data = tempfile::tempdir().unwrap();
    let child = tokio::process::Command::new(BIN)
        .args(args)
        .env_remove("HOOKWIRE_LISTEN")
        .envs(env.iter().copied())
        .env("HOOKWIRE_DATA_DIR", data.path())
        .env_remove("HOOKWIRE_STORE")
        .env_remove(UNSET_KEY)
        .env_remove("OTEL_EXPORTER_OTLP_ENDPOINT")
        .env_remove("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT")
        .stdin(std::process::Stdio::null())
        .kill_on_drop(true)
        .output();
    // Only a serve that accepted a bad config would get near this: it
    // would serve forever.
    let out = tokio::time::timeout(Duration::from_secs(60), child)
        .await
        .unwrap_or_else(|_| panic!("`hookwire {}` did not exit", args.join(" ")))
        .expect("hookwire runs");
    (
        out.status.success(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

/// The `error: …` line of stderr (serve logs other lines to stdout).
fn error_line(stderr: &str) -> String {
    stderr
        .lines()
        .find(|l| l.starts_with("error: "))
        .unwrap_or_else(|| panic!("no error line in:\n{stderr}"))
        .to_string()
}

/// What an operator might paste into the file by mistake: never repeated.
const SECRET: &str = "SECRET4711";

const SCRIPTED: &str = "models: [{name: s, provider: scripted}]\n";
const AGENT: &str = "agents: [{name: a, model: s}]\n";

#[tokio::test]
async fn check_and_serve_refuse_the_same_bad_configs_with_the_same_error() {
    let owner = weather_owner().start().await;
    let blocker = tempfile::NamedTempFile::new().unwrap();
    let under_a_file = blocker.path().join("sub/hookwire.db");
    let cases: Vec<(&str, String, &str)> = vec![
        (
            "a Postgres password variable that is not set",
            format!(
                "{SCRIPTED}{AGENT}store: {{url: 'postgres://hookwire@127.0.0.1:9/h', password_env: {UNSET_KEY}}}\n"
            ),
            "store.password_env names `HOOKWIRE_CONFIG_CHECK_TEST_SURELY_UNSET`, which is not set",
        ),
        (
            "a Postgres URL that cannot be read",
            format!("{SCRIPTED}{AGENT}store: 'postgres://hookwire@db:port/h'\n"),
            "the postgres URL cannot be read (invalid port number)",
        ),
        (
            "a Postgres password in the URL's parameters",
            format!(
                "{SCRIPTED}{AGENT}store: 'postgres://hookwire@127.0.0.1:9/h?password={SECRET}'\n"
            ),
            "the URL carries a password",
        ),
        (
            "an API key pasted where its variable's name goes",
            format!(
                "models: [{{name: s, provider: openai, base_url: 'http://127.0.0.1:9/v1', model: x, api_key_env: 'sk-proj-{SECRET}'}}]\n{AGENT}"
            ),
            "models[0].api_key_env: must name an environment variable",
        ),
        (
            "a hook token pasted where its variable's name goes",
            format!(
                "{SCRIPTED}{AGENT}hooks: [{{name: h, endpoint: 'http://127.0.0.1:9', credentials: {{bearer_token_env: 'eyJ.{SECRET}.x'}}}}]\n"
            ),
            "hooks[0].credentials.bearer_token_env: must name an environment variable",
        ),
        (
            "a hook token of letters and digits pasted where its variable's name goes",
            format!(
                "{SCRIPTED}{AGENT}hooks: [{{name: h, endpoint: 'http://127.0.0.1:9', credentials: {{bearer_token_env: 'Zm9v{SECRET}YmFy'}}}}]\n"
            ),
            "hooks[0] (h) credentials.bearer_token_env: environment variable (name not shown",
        ),
        (
            "a hook's CA file that cannot be read (named by its place in the file)",
            format!(
                "{SCRIPTED}{AGENT}hooks:\n  - {{name: first, endpoint: 'http://127.0.0.1:9'}}\n  - {{name: py-guard, endpoint: 'https://127.0.0.1:9', tls: {{ca_file: /nonexistent/hook-ca.pem}}}}\n"
            ),
            "hooks[1] (py-guard) tls: cannot read /nonexistent/hook-ca.pem",
        ),
        (
            "a hook's token file that cannot be read",
            format!(
                "{SCRIPTED}{AGENT}hooks: [{{name: h, endpoint: 'http://127.0.0.1:9', credentials: {{bearer_token_file: /nonexistent/hook-token}}}}]\n"
            ),
            "hooks[0] (h) credentials.bearer_token_file: cannot read /nonexistent/hook-token",
        ),
        (
            "a SQLite file whose directory cannot be made",
            format!("{SCRIPTED}{AGENT}store: 'sqlite://{}'\n", under_a_file.display()),
            "is not a directory",
        ),
        (
            "two hook entries at one server own its tool twice",
            format!(
                "{SCRIPTED}{AGENT}hooks:\n  - {{name: first, endpoint: '{0}'}}\n  - {{name: second, endpoint: '{0}'}}\n",
                owner.addr
            ),
            "tool `get_weather` is owned by two hook servers: `first` and `second`",
        ),
        (
            "an API key variable that is not set",
            format!(
                "models: [{{name: s, provider: openai, base_url: 'http://127.0.0.1:9/v1', model: x, api_key_env: {UNSET_KEY}}}]\n{AGENT}"
            ),
            "(api_key_env) is not set",
        ),
        (
            "a header name HTTP cannot carry",
            format!(
                "models: [{{name: s, provider: openai, base_url: 'http://127.0.0.1:9/v1', model: x, headers: {{'bad name': v}}}}]\n{AGENT}"
            ),
            "header `bad name` has an invalid name",
        ),
        (
            "a base URL without a host",
            format!("models: [{{name: s, provider: openai, base_url: 'http://', model: x}}]\n{AGENT}"),
            "base_url `http://` is not usable",
        ),
        (
            "a hook endpoint that is not a URI",
            format!("{SCRIPTED}{AGENT}hooks: [{{name: h, endpoint: 'http://bad host:1'}}]\n"),
            "bad host",
        ),
        (
            "a trace endpoint that is not a URI",
            format!("{SCRIPTED}{AGENT}telemetry: {{otlp_endpoint: 'http://bad host:4317'}}\n"),
            "cannot build the OTLP exporter",
        ),
        (
            "a trace endpoint with a password that is not a URI",
            format!(
                "{SCRIPTED}{AGENT}telemetry: {{otlp_endpoint: 'http://u:{SECRET}@bad host:4317'}}\n"
            ),
            "cannot build the OTLP exporter",
        ),
        (
            "a hook endpoint with a password",
            format!("{SCRIPTED}{AGENT}hooks: [{{name: h, endpoint: 'http://u:{SECRET}@127.0.0.1:9'}}]\n"),
            "hooks[0].endpoint: must not carry user info",
        ),
        (
            "an unknown field (the file's own validation)",
            format!("{SCRIPTED}{AGENT}nonsense: 1\n"),
            "unknown field `nonsense`",
        ),
    ];
    let dir = tempfile::tempdir().unwrap();
    for (i, (what, yaml, expected)) in cases.iter().enumerate() {
        let file = dir.path().join(format!("case{i}.yaml"));
        std::fs::write(&file, yaml).unwrap();
        let file = file.to_str().unwrap();
        let (checked, check_err) = hookwire(&["config", "check", file]).await;
        let (served, serve_err) = hookwire(&[
            "serve",
            "--config",
            file,
            "--listen",
            "127.0.0.1:0",
            "--admin-listen",
            "127.0.0.1:0",
        ])
        .await;
        assert!(!served, "{what}: serve accepted it:\n{serve_err}");
        assert!(!checked, "{what}: config check accepted it:\n{check_err}");
        assert!(
            !check_err.contains(SECRET) && !serve_err.contains(SECRET),
            "{what}: a secret repeated:\n{check_err}\n{serve_err}"
        );
        let (check_line, serve_line) = (error_line(&check_err), error_line(&serve_err));
        assert!(check_line.contains(expected), "{what}: {check_line}");
        assert_eq!(check_line, serve_line, "{what}: both say the same");
    }
}

/// Without authentication a server must listen on loopback only. The
/// check judged the file's `listen:` and ignored HOOKWIRE_LISTEN (the
/// image sets it to 0.0.0.0), and with --skip-files it judged nothing:
/// both passed a config serve refuses.
#[tokio::test]
async fn check_refuses_no_authentication_off_loopback_where_serve_would_listen() {
    let dir = tempfile::tempdir().unwrap();
    let open = dir.path().join("open.yaml");
    std::fs::write(&open, format!("{SCRIPTED}{AGENT}")).unwrap();
    let open = open.to_str().unwrap();
    let on_network = [("HOOKWIRE_LISTEN", "0.0.0.0:50051")];
    for args in [
        vec!["config", "check", "--offline", open],
        vec!["config", "check", "--offline", "--skip-files", open],
    ] {
        let (ok, stderr) = hookwire_with(&args, &on_network).await;
        assert!(!ok, "{args:?} passed:\n{stderr}");
        assert!(error_line(&stderr).contains("0.0.0.0:50051"), "{stderr}");
    }
    let (ok, stderr) = hookwire(&["config", "check", "--offline", open]).await;
    assert!(ok, "on loopback (the file's default):\n{stderr}");
    let in_file = dir.path().join("in-file.yaml");
    std::fs::write(&in_file, format!("{SCRIPTED}{AGENT}listen: 0.0.0.0:1\n")).unwrap();
    let (ok, stderr) = hookwire(&[
        "config",
        "check",
        "--offline",
        "--skip-files",
        in_file.to_str().unwrap(),
    ])
    .await;
    assert!(!ok, "the file's listen: with --skip-files:\n{stderr}");
}

#[tokio::test]
async fn a_good_config_passes_and_the_check_reports_each_hook() {
    let owner = weather_owner().start().await;
    let dead = {
        let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        format!("http://{}", l.local_addr().unwrap())
    };
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("good.yaml");
    std::fs::write(
        &file,
        format!(
            "{SCRIPTED}agents: [{{name: a, model: s, hooks: [owner, gone], tools: [get_weather]}}]\nhooks:\n  - {{name: owner, endpoint: '{}'}}\n  - {{name: gone, endpoint: '{dead}'}}\n",
            owner.addr
        ),
    )
    .unwrap();
    let file = file.to_str().unwrap();
    let data = tempfile::tempdir().unwrap();
    let out = tokio::process::Command::new(BIN)
        .args(["config", "check", file])
        .env("HOOKWIRE_DATA_DIR", data.path())
        .env_remove("HOOKWIRE_STORE")
        .output()
        .await
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{stdout}{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(
        stdout.contains("ok (1 models, 2 hooks, 1 agents)"),
        "{stdout}"
    );
    assert!(
        stdout.contains("hook owner at") && stdout.contains("tools: get_weather"),
        "{stdout}"
    );
    assert!(
        stdout.contains("hook gone at") && stdout.contains("not reachable now"),
        "an unreachable hook is reported, not an error, as serve starts anyway:\n{stdout}"
    );
    let db = data.path().join("hookwire.db");
    assert!(
        stdout.contains(&format!(
            "store sqlite://{}: setting checked, not opened",
            db.display()
        )),
        "the store serve would use, from HOOKWIRE_DATA_DIR:\n{stdout}"
    );
    assert!(!db.exists(), "config check never creates the database");
    let out = tokio::process::Command::new(BIN)
        .args(["config", "check", "--offline", file])
        .output()
        .await
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success());
    assert!(stdout.contains("not contacted (--offline)"), "{stdout}");
}
