//! The checker's result: one row per check, rendered as a table for people
//! or as JSON for scripts and CI.

use std::fmt::Write as _;

use serde::Serialize;

use crate::event::EventKind;

#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "UPPERCASE")]
pub enum Status {
    Pass,
    Fail,
    /// Could not be judged (nothing to judge, or not served); never fails
    /// the check on its own.
    Skip,
}

impl Status {
    pub fn label(self) -> &'static str {
        match self {
            Status::Pass => "PASS",
            Status::Fail => "FAIL",
            Status::Skip => "SKIP",
        }
    }
}

#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct Row {
    /// What was checked: `describe`, `tool get_weather`, `tool_call get_weather`...
    pub subject: String,
    pub check: String,
    pub status: Status,
    /// Why, precisely enough to fix the server without reading the checker.
    pub reason: String,
}

impl Row {
    pub fn new(
        subject: impl Into<String>,
        check: impl Into<String>,
        status: Status,
        reason: impl Into<String>,
    ) -> Row {
        Row {
            subject: subject.into(),
            check: check.into(),
            status,
            reason: reason.into(),
        }
    }

    pub fn pass(
        subject: impl Into<String>,
        check: impl Into<String>,
        reason: impl Into<String>,
    ) -> Row {
        Row::new(subject, check, Status::Pass, reason)
    }

    pub fn fail(
        subject: impl Into<String>,
        check: impl Into<String>,
        reason: impl Into<String>,
    ) -> Row {
        Row::new(subject, check, Status::Fail, reason)
    }

    pub fn skip(
        subject: impl Into<String>,
        check: impl Into<String>,
        reason: impl Into<String>,
    ) -> Row {
        Row::new(subject, check, Status::Skip, reason)
    }
}

/// Who answered `Describe`.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize)]
pub struct ServerInfo {
    pub name: String,
    pub version: String,
    /// Events the script exercised (Describe's list narrowed by `--events`).
    pub events: Vec<EventKind>,
    pub tools: Vec<String>,
}

#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Report {
    pub endpoint: String,
    /// None when Describe failed.
    pub server: Option<ServerInfo>,
    pub rows: Vec<Row>,
}

impl Report {
    /// True when no check failed.
    pub fn passed(&self) -> bool {
        !self.rows.iter().any(|r| r.status == Status::Fail)
    }

    pub fn count(&self, status: Status) -> usize {
        self.rows.iter().filter(|r| r.status == status).count()
    }

    pub fn failures(&self) -> impl Iterator<Item = &Row> {
        self.rows.iter().filter(|r| r.status == Status::Fail)
    }

    /// The first row about `subject` and `check`, for tests and scripts.
    pub fn row(&self, subject: &str, check: &str) -> Option<&Row> {
        self.rows
            .iter()
            .find(|r| r.subject == subject && r.check == check)
    }

    pub fn summary(&self) -> String {
        format!(
            "{} checks: {} passed, {} failed, {} skipped",
            self.rows.len(),
            self.count(Status::Pass),
            self.count(Status::Fail),
            self.count(Status::Skip)
        )
    }

    /// The report as an aligned text table with a header and a summary.
    pub fn table(&self) -> String {
        let mut out = String::new();
        let _ = write!(out, "hook server {}", self.endpoint);
        if let Some(s) = &self.server {
            let _ = write!(out, " — {} {}", s.name, s.version);
        }
        out.push('\n');
        if let Some(s) = &self.server {
            let events = if s.events.is_empty() {
                "none".to_string()
            } else {
                s.events
                    .iter()
                    .map(|e| e.name())
                    .collect::<Vec<_>>()
                    .join(", ")
            };
            let tools = if s.tools.is_empty() {
                "none".to_string()
            } else {
                s.tools.join(", ")
            };
            let _ = writeln!(out, "events checked: {events}; tools: {tools}");
        }
        out.push('\n');
        let headers = ["SUBJECT", "CHECK", "RESULT", "DETAIL"];
        let w_subject = self
            .rows
            .iter()
            .map(|r| r.subject.chars().count())
            .chain([headers[0].len()])
            .max()
            .unwrap_or(0);
        let w_check = self
            .rows
            .iter()
            .map(|r| r.check.chars().count())
            .chain([headers[1].len()])
            .max()
            .unwrap_or(0);
        let line = |out: &mut String, a: &str, b: &str, c: &str, d: &str| {
            let _ = writeln!(out, "{a:<w_subject$}  {b:<w_check$}  {c:<6}  {d}");
        };
        line(&mut out, headers[0], headers[1], headers[2], headers[3]);
        for r in &self.rows {
            line(&mut out, &r.subject, &r.check, r.status.label(), &r.reason);
        }
        out.push('\n');
        out.push_str(&self.summary());
        out.push('\n');
        out
    }

    /// The report as pretty JSON: `endpoint`, `passed`, `counts`, `server`,
    /// `rows`.
    pub fn to_json(&self) -> String {
        #[derive(Serialize)]
        struct Counts {
            pass: usize,
            fail: usize,
            skip: usize,
        }
        #[derive(Serialize)]
        struct Json<'a> {
            endpoint: &'a str,
            passed: bool,
            counts: Counts,
            server: &'a Option<ServerInfo>,
            rows: &'a [Row],
        }
        let json = Json {
            endpoint: &self.endpoint,
            passed: self.passed(),
            counts: Counts {
                pass: self.count(Status::Pass),
                fail: self.count(Status::Fail),
                skip: self.count(Status::Skip),
            },
            server: &self.server,
            rows: &self.rows,
        };
        serde_json::to_string_pretty(&json).unwrap_or_default()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn report() -> Report {
        Report {
            endpoint: "http://127.0.0.1:1".into(),
            server: Some(ServerInfo {
                name: "s".into(),
                version: "1".into(),
                events: vec![EventKind::RunStart],
                tools: vec![],
            }),
            rows: vec![
                Row::pass("describe", "answers", "in 1 ms"),
                Row::fail(
                    "run_start",
                    "verdict",
                    "wrong_kind: answered a tool_call verdict",
                ),
                Row::skip("health", "\"\"", "not served"),
            ],
        }
    }

    #[test]
    fn table_aligns_columns_and_counts() {
        let r = report();
        assert!(!r.passed());
        let t = r.table();
        assert!(t.contains("describe   answers  PASS    in 1 ms"), "{t}");
        assert!(t.contains("run_start  verdict  FAIL    wrong_kind"), "{t}");
        assert!(
            t.ends_with("3 checks: 1 passed, 1 failed, 1 skipped\n"),
            "{t}"
        );
        assert!(t.contains("events checked: run_start; tools: none"), "{t}");
    }

    #[test]
    fn json_carries_rows_and_verdict() {
        let v: serde_json::Value = serde_json::from_str(&report().to_json()).unwrap();
        assert_eq!(v["passed"], false);
        assert_eq!(v["counts"]["fail"], 1);
        assert_eq!(v["rows"][1]["status"], "FAIL");
        assert_eq!(v["server"]["events"][0], "run_start");
    }

    #[test]
    fn skips_do_not_fail() {
        let mut r = report();
        r.rows.remove(1);
        assert!(r.passed());
    }
}
