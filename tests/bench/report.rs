//! The results: one row per figure, printed as a table and written as
//! `target/bench/results.json`.

use std::path::PathBuf;

use serde::Serialize;

use crate::stats::Spread;

/// A target on a row's ratio (or, for absolute targets, its value).
#[derive(Clone, Debug, Serialize)]
pub struct Target {
    pub on: Measure,
    pub bound: Bound,
    pub limit: f64,
}

#[derive(Clone, Copy, Debug, Serialize, PartialEq)]
#[serde(rename_all = "snake_case")]
pub enum Measure {
    Value,
    Ratio,
}

#[derive(Clone, Copy, Debug, Serialize, PartialEq)]
#[serde(rename_all = "snake_case")]
pub enum Bound {
    AtMost,
    AtLeast,
}

impl Target {
    pub fn ratio_at_most(limit: f64) -> Target {
        Target {
            on: Measure::Ratio,
            bound: Bound::AtMost,
            limit,
        }
    }
    pub fn ratio_at_least(limit: f64) -> Target {
        Target {
            on: Measure::Ratio,
            bound: Bound::AtLeast,
            limit,
        }
    }
    pub fn value_at_most(limit: f64) -> Target {
        Target {
            on: Measure::Value,
            bound: Bound::AtMost,
            limit,
        }
    }

    fn text(&self, unit: &str) -> String {
        let op = match self.bound {
            Bound::AtMost => "<=",
            Bound::AtLeast => ">=",
        };
        match self.on {
            Measure::Ratio => format!("{op} {}x", self.limit),
            Measure::Value => format!("{op} {} {unit}", self.limit),
        }
    }
}

#[derive(Clone, Debug, Serialize)]
pub struct Row {
    /// The figure number (1 floor .. 7 Python hook, 8 in-flight runs).
    pub figure: u8,
    pub name: String,
    pub unit: &'static str,
    pub value: Spread,
    /// What the ratio divides by, measured in the same run.
    pub baseline_name: String,
    pub baseline: Option<Spread>,
    pub ratio: Option<Spread>,
    pub target: Option<Target>,
    /// Whether the median meets the target.
    pub pass: Option<bool>,
}

impl Row {
    pub fn new(figure: u8, name: impl Into<String>, unit: &'static str, value: Spread) -> Row {
        Row {
            figure,
            name: name.into(),
            unit,
            value,
            baseline_name: String::new(),
            baseline: None,
            ratio: None,
            target: None,
            pass: None,
        }
    }

    /// The per-round ratios to a baseline measured in the same rounds.
    pub fn against(mut self, name: impl Into<String>, baseline: Spread, ratios: &[f64]) -> Row {
        self.baseline_name = name.into();
        self.baseline = Some(baseline);
        self.ratio = Some(Spread::of(ratios));
        self
    }

    pub fn target(mut self, t: Target) -> Row {
        let measured = match t.on {
            Measure::Value => Some(self.value.median),
            Measure::Ratio => self.ratio.map(|r| r.median),
        };
        self.pass = measured.map(|m| match t.bound {
            Bound::AtMost => m <= t.limit,
            Bound::AtLeast => m >= t.limit,
        });
        self.target = Some(t);
        self
    }
}

fn num(x: f64) -> String {
    let a = x.abs();
    if a >= 100.0 {
        format!("{x:.0}")
    } else if a >= 10.0 {
        format!("{x:.1}")
    } else {
        format!("{x:.2}")
    }
}

fn spread(s: &Spread) -> String {
    format!("{} [{}-{}]", num(s.median), num(s.min), num(s.max))
}

/// The table as printed by `make bench`.
pub fn table(rows: &[Row]) -> String {
    let header = [
        "#",
        "figure",
        "median [min-max of rounds]",
        "baseline (same run)",
        "ratio [min-max]",
        "target",
        "result",
    ];
    let cells: Vec<[String; 7]> = rows
        .iter()
        .map(|r| {
            [
                r.figure.to_string(),
                r.name.clone(),
                format!("{} {}", spread(&r.value), r.unit),
                match &r.baseline {
                    Some(b) => format!("{} {}", r.baseline_name, num(b.median)),
                    None => r.baseline_name.clone(),
                },
                r.ratio.as_ref().map(spread).unwrap_or_default(),
                r.target
                    .as_ref()
                    .map(|t| t.text(r.unit))
                    .unwrap_or_default(),
                match r.pass {
                    Some(true) => "met".into(),
                    Some(false) => "MISSED".into(),
                    None => String::new(),
                },
            ]
        })
        .collect();
    let mut widths = header.map(str::len);
    for row in &cells {
        for (w, c) in widths.iter_mut().zip(row) {
            *w = (*w).max(c.chars().count());
        }
    }
    let line = |row: &[String]| {
        row.iter()
            .zip(widths)
            .map(|(c, w)| format!("{c:<w$}"))
            .collect::<Vec<_>>()
            .join(" | ")
            .trim_end()
            .to_string()
    };
    let mut out = line(&header.map(String::from));
    out.push('\n');
    out.push_str(
        &widths
            .iter()
            .map(|w| "-".repeat(*w))
            .collect::<Vec<_>>()
            .join("-|-"),
    );
    out.push('\n');
    for row in &cells {
        out.push_str(&line(row));
        out.push('\n');
    }
    out
}

/// Where the JSON goes: `target/bench/FILE` of this package (the smoke
/// pass writes its own file, so tests never overwrite real results).
pub fn json_path(file: &str) -> PathBuf {
    let target = std::env::var_os("CARGO_TARGET_DIR")
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("target"));
    target.join("bench").join(file)
}

#[derive(Serialize)]
pub struct Results<'a> {
    pub machine: serde_json::Value,
    /// The hook event the floor pings with.
    pub floor_message: serde_json::Value,
    pub plan: serde_json::Value,
    pub elapsed_s: f64,
    pub rows: &'a [Row],
}

pub fn write_json(results: &Results, file: &str) -> std::io::Result<PathBuf> {
    let path = json_path(file);
    std::fs::create_dir_all(path.parent().unwrap())?;
    std::fs::write(&path, serde_json::to_string_pretty(results)?)?;
    Ok(path)
}
