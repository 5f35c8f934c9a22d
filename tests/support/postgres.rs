//! A real PostgreSQL server for a test binary: Debian's `postgresql`
//! package, started once per binary in a temporary directory on a free
//! port (as the `postgres` user when the tests run as root: initdb refuses
//! root), one database per test, stopped when the binary exits. A missing
//! installation FAILS the test; it is never skipped.

use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::OnceLock;

pub struct Postgres {
    bin: PathBuf,
    dir: PathBuf,
    pub port: u16,
    as_postgres: bool,
}

static SERVER: OnceLock<Postgres> = OnceLock::new();

/// The binary's server, started on first use.
pub fn server() -> &'static Postgres {
    SERVER.get_or_init(Postgres::start)
}

/// A fresh, empty database on the binary's server: its URL (no password;
/// the server trusts local connections).
pub fn database() -> String {
    let pg = server();
    let name = format!("t_{}", &uuid::Uuid::new_v4().simple().to_string()[..12]);
    pg.psql("postgres", &format!("CREATE DATABASE {name}"));
    format!("postgres://postgres@127.0.0.1:{}/{name}", pg.port)
}

fn bin_dir() -> PathBuf {
    let mut found: Vec<PathBuf> = std::fs::read_dir("/usr/lib/postgresql")
        .into_iter()
        .flatten()
        .flatten()
        .map(|e| e.path().join("bin"))
        .filter(|p| p.join("initdb").exists())
        .collect();
    found.sort();
    match found.pop() {
        Some(p) => p,
        None => panic!(
            "PostgreSQL is not installed (no /usr/lib/postgresql/*/bin/initdb): run \
             `make deps` (it installs Debian's postgresql package); \
             the store tests need a real server and never skip"
        ),
    }
}

fn run(cmd: &mut Command, what: &str) -> String {
    let out = cmd
        .output()
        .unwrap_or_else(|e| panic!("{what}: cannot run {cmd:?}: {e}"));
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(out.status.success(), "{what} failed: {text}");
    text
}

impl Postgres {
    fn start() -> Postgres {
        let bin = bin_dir();
        let root = run(Command::new("id").arg("-u"), "id -u").trim() == "0";
        let dir = tempfile::Builder::new()
            .prefix("hookwire-pg-")
            .tempdir()
            .expect("temp dir")
            .keep();
        if root {
            run(
                Command::new("chown").arg("-R").arg("postgres:").arg(&dir),
                "chown the data dir to postgres",
            );
        }
        let port = std::net::TcpListener::bind("127.0.0.1:0")
            .and_then(|l| l.local_addr())
            .expect("a free port")
            .port();
        let pg = Postgres {
            bin,
            dir,
            port,
            as_postgres: root,
        };
        let data = pg.dir.join("data");
        run(
            &mut pg.cmd(
                "initdb",
                &[
                    "-D",
                    path(&data),
                    "-U",
                    "postgres",
                    "--auth=trust",
                    "--no-sync",
                    "-E",
                    "UTF8",
                ],
            ),
            "initdb",
        );
        let opts = format!(
            "-k {} -p {port} -c listen_addresses=127.0.0.1 -c fsync=off -c synchronous_commit=off -c full_page_writes=off -c max_connections=300",
            path(&pg.dir)
        );
        let log = pg.dir.join("server.log");
        run(
            &mut pg.cmd(
                "pg_ctl",
                &[
                    "-D",
                    path(&data),
                    "-l",
                    path(&log),
                    "-w",
                    "-o",
                    &opts,
                    "start",
                ],
            ),
            "pg_ctl start",
        );
        // Stopped when this test binary exits, however it exits: a watcher
        // process waits for our pid, then stops the server and removes it.
        let pg_ctl = pg.bin.join("pg_ctl");
        let stop = if pg.as_postgres {
            format!(
                "runuser -u postgres -- {} -D {} stop -m immediate",
                path(&pg_ctl),
                path(&data)
            )
        } else {
            format!("{} -D {} stop -m immediate", path(&pg_ctl), path(&data))
        };
        let script = format!(
            "tail --pid={} -f /dev/null; {stop} >/dev/null 2>&1; rm -rf {}",
            std::process::id(),
            path(&pg.dir)
        );
        // Deliberately never waited for: it outlives this process.
        #[allow(clippy::zombie_processes)]
        Command::new("sh")
            .arg("-c")
            .arg(script)
            .stdin(std::process::Stdio::null())
            .stdout(std::process::Stdio::null())
            .stderr(std::process::Stdio::null())
            .spawn()
            .expect("spawn the postgres watcher");
        pg
    }

    fn cmd(&self, tool: &str, args: &[&str]) -> Command {
        let exe = self.bin.join(tool);
        let mut c = if self.as_postgres {
            let mut c = Command::new("runuser");
            c.args(["-u", "postgres", "--"]).arg(exe);
            c
        } else {
            Command::new(exe)
        };
        c.args(args).current_dir(&self.dir);
        c
    }

    /// Runs one SQL statement in `db`; its unaligned output.
    pub fn psql(&self, db: &str, sql: &str) -> String {
        let port = self.port.to_string();
        run(
            Command::new(self.bin.join("psql")).args([
                "-h",
                "127.0.0.1",
                "-p",
                &port,
                "-U",
                "postgres",
                "-d",
                db,
                "-v",
                "ON_ERROR_STOP=1",
                "-Atc",
                sql,
            ]),
            &format!("psql {sql}"),
        )
    }

    /// Runs one SQL statement in the database of `url`.
    pub fn query(&self, url: &str, sql: &str) -> String {
        let db = url.rsplit('/').next().unwrap_or("postgres");
        self.psql(db, sql).trim().to_string()
    }
}

fn path(p: &Path) -> &str {
    p.to_str().expect("utf-8 temp path")
}
