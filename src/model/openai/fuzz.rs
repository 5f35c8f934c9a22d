//! Property-based fuzzing of what an OpenAI-compatible endpoint sends:
//! arbitrary SSE byte streams (valid chunks with hostile numbers and
//! strings, garbage, broken framing, cut anywhere, failing mid-way) through
//! the stream reader, error bodies through the message extractor, and
//! arbitrary `Retry-After` headers through the retry logic. Nothing may
//! panic; a stream either assembles or fails with a typed `StreamFailure`.
//!
//! `make test` runs a few dozen cases; `make fuzz` sets `PROPTEST_CASES`.

use crate::lock::LockExt;
use std::sync::Mutex;
use std::time::Duration;

use proptest::collection::vec;
use proptest::option;
use proptest::prelude::*;
use proptest::test_runner::{Config, TestCaseError, TestRunner};
use reqwest::header::{HeaderMap, HeaderValue};
use serde_json::{json, Value};

use super::retry::{retry_after, Backoff, MAX_RETRY_AFTER};
use super::stream::{read, Assembler, Limits};
use super::wire;
use crate::message::Block;

fn cases(default: u32) -> Config {
    let cases = std::env::var("PROPTEST_CASES")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(default);
    Config {
        cases,
        failure_persistence: None,
        ..Config::default()
    }
}

fn text() -> BoxedStrategy<String> {
    prop_oneof![
        Just(String::new()),
        "[a-z ]{1,10}",
        any::<String>(),
        Just("{\"city\":".to_string()),
        Just("\"Paris\"}".to_string()),
        Just("ü€😀".to_string()),
    ]
    .boxed()
}

/// Numbers as a hostile server might send them: any JSON value where a
/// count or an index belongs.
fn number() -> BoxedStrategy<Value> {
    prop_oneof![
        (0u64..100).prop_map(Value::from),
        any::<u64>().prop_map(Value::from),
        Just(Value::from(u32::MAX)),
        Just(Value::from(u32::MAX as u64 + 1)),
        Just(Value::from(u64::MAX)),
        any::<i64>().prop_map(Value::from),
        any::<f64>().prop_map(|f| json!(f)),
        text().prop_map(Value::from),
        Just(Value::Null),
    ]
    .boxed()
}

fn tool_call_delta() -> BoxedStrategy<Value> {
    (
        option::of(number()),
        option::of(text()),
        option::of((option::of(text()), option::of(text()))),
    )
        .prop_map(|(index, id, function)| {
            let mut m = serde_json::Map::new();
            if let Some(i) = index {
                m.insert("index".into(), i);
            }
            if let Some(id) = id {
                m.insert("id".into(), id.into());
            }
            if let Some((name, args)) = function {
                m.insert("function".into(), json!({"name": name, "arguments": args}));
            }
            Value::Object(m)
        })
        .boxed()
}

fn chunk() -> BoxedStrategy<Value> {
    let delta = (
        option::of(text()),
        option::of(text()),
        option::of(text()),
        option::of(vec(tool_call_delta(), 0..3)),
    )
        .prop_map(|(content, refusal, reasoning, calls)| {
            json!({"content": content, "refusal": refusal, "reasoning_content": reasoning, "tool_calls": calls})
        });
    let choice = (option::of(number()), option::of(delta), option::of(text())).prop_map(
        |(index, delta, finish)| json!({"index": index, "delta": delta, "finish_reason": finish}),
    );
    (
        option::of(vec(choice, 0..3)),
        option::of((number(), number())),
        option::of(text()),
        prop_oneof![4 => Just(None), 1 => option::of(text().prop_map(|m| json!({"message": m})))],
    )
        .prop_map(|(choices, usage, model, error)| {
            let mut m = serde_json::Map::new();
            m.insert("choices".into(), json!(choices));
            if let Some((p, c)) = usage {
                m.insert(
                    "usage".into(),
                    json!({"prompt_tokens": p, "completion_tokens": c}),
                );
            }
            if let Some(model) = model {
                m.insert("model".into(), model.into());
            }
            if let Some(e) = error {
                m.insert("error".into(), e);
            }
            Value::Object(m)
        })
        .boxed()
}

/// One SSE line (or group of lines) of a stream.
fn sse_event() -> BoxedStrategy<String> {
    prop_oneof![
        8 => chunk().prop_map(|c| format!("data: {c}\n\n")),
        1 => Just("data: [DONE]\n\n".to_string()),
        1 => text().prop_map(|t| format!("data: {t}\n\n")),
        1 => chunk().prop_map(|c| {
            // One event's data split over several `data:` lines.
            let s = c.to_string();
            let mid = s.len() / 2;
            let mid = (0..=mid).rev().find(|i| s.is_char_boundary(*i)).unwrap_or(0);
            format!("data: {}\ndata: {}\n\n", &s[..mid], &s[mid..])
        }),
        1 => text().prop_map(|t| format!(": {t}\n")),
        1 => text().prop_map(|t| format!("event: {t}\nid: {t}\nretry: 99999999999999999999\n")),
        1 => Just("\n".to_string()),
    ]
    .boxed()
}

fn line_endings(s: &str, style: u8) -> String {
    match style % 3 {
        0 => s.to_string(),
        1 => s.replace('\n', "\r\n"),
        _ => s.replace('\n', "\r"),
    }
}

/// Runs the reader over `pieces`; returns its result and the deltas passed on.
fn run(
    rt: &tokio::runtime::Runtime,
    pieces: Vec<Result<Vec<u8>, String>>,
    max_bytes: usize,
) -> (
    Result<super::stream::Assembled, super::stream::StreamFailure>,
    Vec<String>,
) {
    let deltas = Mutex::new(Vec::new());
    let sink = |t: &str| deltas.locked().push(t.to_string());
    let limits = Limits {
        max_bytes,
        idle_timeout: Duration::from_secs(5),
    };
    let result = rt.block_on(read(futures::stream::iter(pieces), limits, &sink));
    (result, deltas.into_inner().unwrap())
}

fn check(
    result: &Result<super::stream::Assembled, super::stream::StreamFailure>,
    deltas: &[String],
) -> Result<(), TestCaseError> {
    match result {
        Ok(a) => {
            let text: String = a
                .message
                .blocks
                .iter()
                .filter_map(|b| match b {
                    Block::Text { text } => Some(text.as_str()),
                    _ => None,
                })
                .collect();
            prop_assert_eq!(text, deltas.concat(), "the answer is what was streamed");
            for b in &a.message.blocks {
                if let Block::ToolCall(c) = b {
                    prop_assert!(!c.id.is_empty() && !c.name.is_empty());
                }
            }
        }
        Err(f) => prop_assert_eq!(f.emitted, !deltas.is_empty()),
    }
    Ok(())
}

fn runtime() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_current_thread()
        .enable_time()
        .build()
        .unwrap()
}

#[test]
fn fuzz_sse_streams_assemble_or_fail_typed() {
    let rt = runtime();
    let strategy = (
        vec(sse_event(), 0..12),
        any::<u8>(),
        vec(any::<prop::sample::Index>(), 0..6),
        option::of(any::<prop::sample::Index>()),
        prop_oneof![Just(1usize << 20), 0usize..512],
    );
    TestRunner::new(cases(256))
        .run(&strategy, |(events, style, cuts, fail_at, max_bytes)| {
            let body = line_endings(&events.concat(), style).into_bytes();
            // Cut anywhere, UTF-8 sequences and lines included.
            let mut at: Vec<usize> = cuts.iter().map(|i| i.index(body.len() + 1)).collect();
            at.sort_unstable();
            at.dedup();
            let mut pieces: Vec<Result<Vec<u8>, String>> = Vec::new();
            let mut from = 0;
            for to in at.into_iter().chain([body.len()]) {
                pieces.push(Ok(body[from..to].to_vec()));
                from = to;
            }
            if let Some(i) = fail_at {
                let i = i.index(pieces.len() + 1);
                pieces.insert(i, Err("connection reset".into()));
            }
            let (result, deltas) = run(&rt, pieces, max_bytes);
            check(&result, &deltas)
        })
        .unwrap();
}

#[test]
fn fuzz_arbitrary_bytes_as_an_event_stream() {
    let rt = runtime();
    TestRunner::new(cases(256))
        .run(&vec(vec(any::<u8>(), 0..64), 0..6), |pieces| {
            let pieces = pieces.into_iter().map(Ok).collect();
            let (result, deltas) = run(&rt, pieces, 1 << 20);
            check(&result, &deltas)
        })
        .unwrap();
}

#[test]
fn fuzz_chunks_fold_without_panics() {
    TestRunner::new(cases(256))
        .run(&(vec(chunk(), 0..8), any::<bool>()), |(chunks, done)| {
            let mut asm = Assembler::default();
            for c in chunks {
                if asm.push(&c.to_string()).is_err() {
                    return Ok(());
                }
            }
            let _ = asm.finish(done);
            Ok(())
        })
        .unwrap();
}

#[test]
fn fuzz_error_bodies_yield_a_message_or_none() {
    TestRunner::new(cases(256))
        .run(
            &prop_oneof![
                vec(any::<u8>(), 0..128),
                (text(), number()).prop_map(|(m, c)| {
                    json!({"error": {"message": m, "code": c}})
                        .to_string()
                        .into_bytes()
                }),
                text().prop_map(|m| json!({"error": m}).to_string().into_bytes()),
            ],
            |body| {
                let _ = wire::error_message(&body);
                Ok(())
            },
        )
        .unwrap();
}

/// What servers put in `Retry-After` / `retry-after-ms`, hostile included.
fn header_number() -> BoxedStrategy<String> {
    prop_oneof![
        any::<f64>().prop_map(|f| f.to_string()),
        any::<f64>().prop_map(|f| format!("{f:e}")),
        any::<u64>().prop_map(|n| n.to_string()),
        any::<i64>().prop_map(|n| n.to_string()),
        Just("1e30".to_string()),
        Just("1e308".to_string()),
        Just("18446744073709551616000".to_string()),
        Just("NaN".to_string()),
        Just("inf".to_string()),
        Just("-0".to_string()),
        Just(" 7 ".to_string()),
        Just("Wed, 21 Oct 2015 07:28:00 GMT".to_string()),
        "[ -~]{0,12}",
    ]
    .boxed()
}

#[test]
fn fuzz_retry_after_headers_and_backoff() {
    let strategy = (
        option::of(header_number()),
        option::of(header_number()),
        any::<u32>(),
        any::<f64>(),
        any::<u64>(),
        any::<u64>(),
    );
    TestRunner::new(cases(512))
        .run(&strategy, |(ms, secs, retry, jitter, base, max)| {
            let mut h = HeaderMap::new();
            for (name, v) in [("retry-after-ms", ms), ("retry-after", secs)] {
                if let Some(v) = v.and_then(|v| HeaderValue::from_str(&v).ok()) {
                    h.insert(name, v);
                }
            }
            // Whatever was asked, the answer is a duration the retry loop
            // can compare with its limit.
            if let Some(d) = retry_after(&h) {
                let _ = d > MAX_RETRY_AFTER;
            }
            let b = Backoff {
                base: Duration::from_millis(base),
                max: Duration::from_millis(max),
            };
            let d = b.delay(retry, jitter);
            prop_assert!(d <= b.max, "{:?} over the cap {:?}", d, b.max);
            Ok(())
        })
        .unwrap();
}

/// Regressions the fuzzers found.
mod found {
    use super::*;

    #[test]
    fn a_huge_retry_after_ms_fails_the_call_instead_of_panicking() {
        let mut h = HeaderMap::new();
        h.insert("retry-after-ms", HeaderValue::from_static("1e30"));
        let d = retry_after(&h).expect("a number");
        assert!(d > MAX_RETRY_AFTER, "longer than hookwire waits: {d:?}");
    }

    #[test]
    fn a_nan_jitter_stays_within_the_backoff() {
        let b = Backoff::default();
        assert!(b.delay(3, f64::NAN) <= b.max);
    }

    #[test]
    fn a_call_after_index_u32_max_without_an_index_does_not_overflow() {
        let mut asm = Assembler::default();
        let c = |calls: Value| {
            json!({"choices": [{"index": 0, "delta": {"tool_calls": calls}}]}).to_string()
        };
        asm.push(&c(
            json!([{"index": u32::MAX, "id": "a", "function": {"name": "f"}}]),
        ))
        .unwrap();
        let (kind, _) = asm
            .push(&c(json!([{"id": "b", "function": {"name": "g"}}])))
            .unwrap_err();
        assert_eq!(kind, super::super::stream::FailureKind::Malformed);
    }
}
