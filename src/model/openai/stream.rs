//! Reading a streamed chat completion: the body is split into whole,
//! UTF-8-checked lines ([`Lines`]), SSE events are parsed from them (by
//! `eventsource-stream`), decoded into chunks and assembled into one
//! complete turn. Text deltas are passed on as they arrive; tool calls are
//! assembled by index (id and name first, argument fragments after).

use std::collections::BTreeMap;
use std::fmt::Display;
use std::time::Duration;

use eventsource_stream::{EventStream, EventStreamError};
use futures::{Stream, StreamExt};

use super::wire::{self, Chunk};
use crate::message::{Block, Message, Role, ToolCall, Usage};
use crate::model::DeltaSink;

/// Why a stream could not be read to the end.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum FailureKind {
    /// The connection broke or the body could not be read.
    Transport,
    /// No bytes arrived within the idle timeout.
    Stalled,
    /// The stream ended before a finish reason or `[DONE]`.
    Incomplete,
    /// Not SSE, not UTF-8, not JSON, or not a chat-completion chunk.
    Malformed,
    /// More SSE data than the configured bound.
    TooLarge,
    /// The provider reported an error inside the stream.
    Provider,
}

impl FailureKind {
    /// Failures a fresh attempt may fix (when nothing was emitted yet).
    pub fn transient(self) -> bool {
        matches!(self, Self::Transport | Self::Stalled | Self::Incomplete)
    }
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) struct StreamFailure {
    pub kind: FailureKind,
    pub message: String,
    /// Whether any text delta had been passed on before the failure.
    pub emitted: bool,
}

/// A complete turn as read from the stream.
#[derive(Debug, Clone, PartialEq)]
pub(super) struct Assembled {
    pub message: Message,
    pub finish_reason: String,
    /// Usage as reported by the server, if it sent any.
    pub usage: Option<Usage>,
    /// The model id the server reported.
    pub model: Option<String>,
    /// The completion id the server reported.
    pub id: Option<String>,
    /// Characters of generated output, for estimating usage.
    pub output_chars: usize,
}

#[derive(Debug, Default)]
struct PartialCall {
    id: String,
    name: String,
    arguments: String,
}

/// Folds chunks into a turn. Pure: it returns the text delta of each chunk
/// instead of emitting it, so it is tested without any IO.
#[derive(Debug, Default)]
pub(super) struct Assembler {
    text: String,
    reasoning: String,
    calls: BTreeMap<u32, PartialCall>,
    finish_reason: Option<String>,
    /// A finish reason was sent (kept in `finish_reason` only when short).
    finished: bool,
    usage: Option<wire::WireUsage>,
    model: Option<String>,
    id: Option<String>,
}

/// Longer ids, model names and finish reasons are not what they claim to
/// be: they are not kept (they reach clients, the store, hooks and span
/// attributes, and nothing else bounds them but the response's size).
const MAX_NAME_BYTES: usize = 256;

fn plausible(name: &str) -> bool {
    !name.is_empty() && name.len() <= MAX_NAME_BYTES
}

impl Assembler {
    /// Folds one `data:` payload in; returns the text to pass on, if any.
    pub fn push(&mut self, data: &str) -> Result<Option<String>, (FailureKind, String)> {
        let chunk: Chunk = serde_json::from_str(data).map_err(|e| {
            // serde's text quotes the offending value, which may be part of
            // the answer: the message gives the kind of fault and where.
            tracing::debug!(error = %e, "malformed chunk");
            (
                FailureKind::Malformed,
                format!("malformed chunk in the response stream: {}", json_fault(&e)),
            )
        })?;
        if let Some(err) = &chunk.error {
            let message = wire::error_value_message(err)
                .unwrap_or_else(|| "the provider reported an error".into());
            return Err((
                FailureKind::Provider,
                format!("error in the response stream: {message}"),
            ));
        }
        if let Some(m) = chunk.model.filter(|m| plausible(m)) {
            self.model = Some(m);
        }
        if self.id.is_none() {
            self.id = chunk.id.filter(|id| plausible(id));
        }
        // Usage a server got wrong is left out (the caller estimates it); it
        // does not replace counts an earlier chunk gave.
        if let Some(u) = chunk.usage.as_ref().and_then(wire::usage) {
            self.usage = Some(u);
        }
        let mut out = String::new();
        // One completion is requested (no `n`); other choices are ignored.
        let choices = chunk.choices.unwrap_or_default();
        for choice in choices.into_iter().filter(|c| c.index.unwrap_or(0) == 0) {
            for delta in [choice.delta, choice.message].into_iter().flatten() {
                for piece in [delta.content, delta.refusal].into_iter().flatten() {
                    out.push_str(&piece);
                }
                if let Some(r) = delta.reasoning_content {
                    self.reasoning.push_str(&r);
                }
                for (pos, call) in delta.tool_calls.into_iter().flatten().enumerate() {
                    let index = match call.index {
                        Some(i) => i,
                        // A server that sends whole calls without an index:
                        // each one is a new call, after the last one.
                        None => match self.calls.keys().next_back() {
                            None => u32::try_from(pos).unwrap_or(u32::MAX),
                            Some(last) => last.checked_add(1).ok_or_else(|| {
                                (
                                    FailureKind::Malformed,
                                    format!("a tool call without an index follows one at index {last}, the largest there is"),
                                )
                            })?,
                        },
                    };
                    let slot = self.calls.entry(index).or_default();
                    if let Some(id) = call.id.filter(|s| !s.is_empty()) {
                        if slot.id.is_empty() {
                            slot.id = id;
                        }
                    }
                    if let Some(f) = call.function {
                        if let Some(name) = f.name.filter(|s| !s.is_empty()) {
                            if slot.name.is_empty() {
                                slot.name = name;
                            }
                        }
                        if let Some(args) = f.arguments {
                            slot.arguments.push_str(&args);
                        }
                    }
                }
            }
            if let Some(reason) = choice.finish_reason.filter(|r| !r.is_empty()) {
                // Even an overlong reason says the model finished; it is
                // then inferred, as when none is sent.
                self.finished = true;
                if plausible(&reason) {
                    self.finish_reason = Some(reason);
                }
            }
        }
        self.text.push_str(&out);
        Ok((!out.is_empty()).then_some(out))
    }

    /// The complete turn. `done` says whether `[DONE]` arrived; a stream
    /// without it is still complete once a finish reason was sent.
    pub fn finish(self, done: bool) -> Result<Assembled, (FailureKind, String)> {
        if !done && !self.finished {
            return Err((
                FailureKind::Incomplete,
                "the response stream ended before the model finished".into(),
            ));
        }
        let mut blocks = Vec::new();
        let mut output_chars = self.text.chars().count() + self.reasoning.chars().count();
        if !self.reasoning.is_empty() {
            blocks.push(Block::Reasoning {
                text: self.reasoning,
            });
        }
        if !self.text.is_empty() {
            blocks.push(Block::Text { text: self.text });
        }
        let has_calls = !self.calls.is_empty();
        for (index, call) in self.calls {
            if call.name.is_empty() {
                return Err((
                    FailureKind::Malformed,
                    format!("tool call at index {index} has no function name"),
                ));
            }
            output_chars += call.name.chars().count() + call.arguments.chars().count();
            let id = if call.id.is_empty() {
                // A few servers omit ids; history needs one to pair results.
                format!("call_{}", uuid::Uuid::new_v4().simple())
            } else {
                call.id
            };
            let arguments_json = if call.arguments.trim().is_empty() {
                "{}".to_string()
            } else {
                call.arguments
            };
            blocks.push(Block::ToolCall(ToolCall {
                id,
                name: call.name,
                arguments_json,
            }));
        }
        let finish_reason = self
            .finish_reason
            .unwrap_or_else(|| if has_calls { "tool_calls" } else { "stop" }.to_string());
        Ok(Assembled {
            message: Message {
                role: Role::Assistant,
                blocks,
            },
            finish_reason,
            usage: self.usage.map(|u| Usage {
                input_tokens: u.prompt_tokens,
                output_tokens: u.completion_tokens,
                estimated: false,
            }),
            model: self.model,
            id: self.id,
            output_chars,
        })
    }
}

/// What is wrong with a JSON text, without quoting it.
fn json_fault(e: &serde_json::Error) -> String {
    use serde_json::error::Category;
    let what = match e.classify() {
        Category::Syntax | Category::Eof => "not valid JSON",
        Category::Data => "JSON of the wrong shape",
        Category::Io => "unreadable",
    };
    format!("{what} (line {}, column {})", e.line(), e.column())
}

/// A whole, non-streamed chat completion (`stream: false`), assembled the
/// same way as a stream; also returns its text, to pass on as one delta.
pub(super) fn whole(body: &[u8]) -> Result<(Assembled, Option<String>), (FailureKind, String)> {
    let text = std::str::from_utf8(body).map_err(|e| {
        (
            FailureKind::Malformed,
            format!("the response is not UTF-8: {e}"),
        )
    })?;
    let mut asm = Assembler::default();
    let delta = asm.push(text.trim()).map_err(|(kind, message)| {
        let message = message.replace("chunk in the response stream", "response body");
        (kind, message)
    })?;
    if !asm.finished && asm.text.is_empty() && asm.calls.is_empty() {
        return Err((
            FailureKind::Malformed,
            "the response has no choices[0].message".into(),
        ));
    }
    Ok((asm.finish(true)?, delta))
}

/// Bounds on reading one response stream.
#[derive(Debug, Clone, Copy)]
pub(super) struct Limits {
    /// Total bytes of SSE data accepted.
    pub max_bytes: usize,
    /// Longest wait for the next piece of the stream (any bytes).
    pub idle_timeout: Duration,
}

/// Reads an SSE body to the end of the turn, passing text deltas to
/// `on_delta`. Stops at `[DONE]` without waiting for the connection to close.
pub(super) async fn read<S, B, E>(
    body: S,
    limits: Limits,
    on_delta: DeltaSink<'_>,
) -> Result<Assembled, StreamFailure>
where
    S: Stream<Item = Result<B, E>> + Unpin,
    B: AsRef<[u8]>,
    E: Display,
{
    let lines = futures::stream::unfold(Lines::new(body, limits), |mut lines| async move {
        let item = lines.next().await?;
        Some((item, lines))
    });
    let events = EventStream::new(lines);
    let mut events = std::pin::pin!(events);
    let mut asm = Assembler::default();
    let mut emitted = false;
    let fail = |kind, message, emitted| StreamFailure {
        kind,
        message,
        emitted,
    };
    let mut done = false;
    loop {
        // Lines bounds each wait for the body, so this wait is bounded too.
        let next = events.next().await;
        let event = match next {
            None => break,
            Some(Ok(event)) => event,
            Some(Err(EventStreamError::Transport(BodyError::TooLarge(max)))) => {
                return Err(fail(
                    FailureKind::TooLarge,
                    format!("the response stream exceeded {max} bytes"),
                    emitted,
                ))
            }
            // After a finish reason the answer is complete: what broke or
            // stalled was only the usage chunk or `[DONE]`, and usage is
            // estimated without them.
            Some(Err(EventStreamError::Transport(
                e @ (BodyError::Transport(_) | BodyError::Stalled(_)),
            ))) if asm.finished => {
                tracing::debug!(error = %e, "response stream ended early after the model finished");
                break;
            }
            Some(Err(EventStreamError::Transport(BodyError::Transport(e)))) => {
                return Err(fail(
                    FailureKind::Transport,
                    format!("the response stream broke: {e}"),
                    emitted,
                ))
            }
            Some(Err(EventStreamError::Transport(BodyError::Stalled(idle)))) => {
                return Err(fail(
                    FailureKind::Stalled,
                    format!("the response stream stalled: nothing received for {idle:?}"),
                    emitted,
                ))
            }
            Some(Err(EventStreamError::Transport(BodyError::NotUtf8))) => {
                return Err(fail(
                    FailureKind::Malformed,
                    "the response stream is not UTF-8".into(),
                    emitted,
                ))
            }
            // Not `{e}`: a parse error quotes the rest of the stream.
            Some(Err(_)) => {
                return Err(fail(
                    FailureKind::Malformed,
                    "the response is not a valid event stream".into(),
                    emitted,
                ))
            }
        };
        let data = event.data.trim();
        if data == "[DONE]" {
            done = true;
            break;
        }
        if data.is_empty() {
            continue;
        }
        match asm.push(data) {
            Ok(Some(text)) => {
                emitted = true;
                on_delta(&text);
            }
            Ok(None) => {}
            Err((kind, message)) => return Err(fail(kind, message, emitted)),
        }
    }
    asm.finish(done)
        .map_err(|(kind, message)| fail(kind, message, emitted))
}

/// Why the body could not be handed on to the SSE parser.
#[derive(Debug, thiserror::Error)]
enum BodyError {
    #[error("{0}")]
    Transport(String),
    #[error("more than {0} bytes")]
    TooLarge(usize),
    #[error("not UTF-8")]
    NotUtf8,
    #[error("nothing received for {0:?}")]
    Stalled(Duration),
}

/// The response body as the SSE parser gets it: one line per item, each
/// whole, with its line end (LF, CRLF or CR).
///
/// `EventStream` given the body's pieces as they come re-parses all it
/// holds on every piece until a line ends (quadratic in the length of a
/// line that arrives in many pieces), copies the rest of its buffer after
/// each line it takes (quadratic in the lines of one piece), and its UTF-8
/// decoder keeps and re-checks every byte after an invalid one until the
/// body ends. Here each byte is checked for UTF-8 once as it arrives (an
/// invalid sequence fails the stream at once), only new bytes are searched
/// for line ends, and each line is handed on once, so the parser reads it
/// once.
///
/// A line may be as long as the response bound (`max_bytes`, which also
/// bounds it): read once, its length costs memory that bound already
/// caps, not repeated work.
///
/// Each wait for a piece of the body is bounded by `idle_timeout`: any
/// bytes show the server is alive, keep-alive comments included, which
/// never make an event (a bound on waiting for events cut off a slow
/// answer behind `: PROCESSING` comments).
struct Lines<S> {
    body: S,
    limits: Limits,
    /// Bytes received so far.
    received: usize,
    buf: Vec<u8>,
    /// `buf[..start]` has been handed on.
    start: usize,
    /// `buf[start..searched]` has no line end.
    searched: usize,
    /// `buf[..valid]` is UTF-8; after it come at most 3 bytes of a
    /// sequence the next piece completes.
    valid: usize,
    /// Bytes looked at for line ends and UTF-8: a bounded multiple of the
    /// bytes received (tests check it).
    scanned: usize,
    ended: bool,
}

impl<S, B, E> Lines<S>
where
    S: Stream<Item = Result<B, E>> + Unpin,
    B: AsRef<[u8]>,
    E: Display,
{
    fn new(body: S, limits: Limits) -> Self {
        Lines {
            body,
            limits,
            received: 0,
            buf: Vec::new(),
            start: 0,
            searched: 0,
            valid: 0,
            scanned: 0,
            ended: false,
        }
    }

    /// The next line; `None` at the end of the body, where a line without
    /// its end is dropped (the parser would drop it too). After an error,
    /// nothing more.
    async fn next(&mut self) -> Option<Result<Vec<u8>, BodyError>> {
        loop {
            if let Some(end) = self.line_end() {
                let line = self.buf[self.start..end].to_vec();
                self.start = end;
                return Some(Ok(line));
            }
            if self.ended {
                return None;
            }
            match self.fill().await {
                Ok(true) => {}
                Ok(false) => {
                    self.ended = true;
                    return None;
                }
                Err(e) => {
                    self.ended = true;
                    self.buf = Vec::new();
                    self.start = 0;
                    self.searched = 0;
                    self.valid = 0;
                    return Some(Err(e));
                }
            }
        }
    }

    /// Where the next complete line ends, searching only bytes not
    /// searched before.
    fn line_end(&mut self) -> Option<usize> {
        let from = self.searched;
        let Some(i) = self.buf[from..self.valid]
            .iter()
            .position(|&b| b == b'\n' || b == b'\r')
        else {
            self.scanned += self.valid - from;
            self.searched = self.valid;
            return None;
        };
        self.scanned += i + 1;
        let mut end = from + i + 1;
        // CRLF ends one line. A CR last in what arrived goes on alone: the
        // parser waits for the next byte to tell CRLF from CR.
        if self.buf[end - 1] == b'\r' && self.buf.get(end) == Some(&b'\n') {
            end += 1;
        }
        self.searched = end;
        Some(end)
    }

    /// Reads the next piece of the body into `buf`; `false` at its end.
    async fn fill(&mut self) -> Result<bool, BodyError> {
        let piece = match tokio::time::timeout(self.limits.idle_timeout, self.body.next()).await {
            Err(_) => return Err(BodyError::Stalled(self.limits.idle_timeout)),
            Ok(piece) => piece,
        };
        let piece = match piece {
            None => return Ok(false),
            Some(Err(e)) => return Err(BodyError::Transport(e.to_string())),
            Some(Ok(piece)) => piece,
        };
        let piece = piece.as_ref();
        self.received = self.received.saturating_add(piece.len());
        if self.received > self.limits.max_bytes {
            return Err(BodyError::TooLarge(self.limits.max_bytes));
        }
        // Drop the lines handed on; what is left is the line still coming.
        // Each byte is moved at most once: the next drop follows a line
        // handed on, which takes these bytes with it.
        if self.start > 0 {
            self.buf.drain(..self.start);
            self.searched -= self.start;
            self.valid -= self.start;
            self.start = 0;
        }
        self.buf.extend_from_slice(piece);
        let unchecked = &self.buf[self.valid..];
        self.scanned += unchecked.len();
        match std::str::from_utf8(unchecked) {
            Ok(_) => self.valid = self.buf.len(),
            // A sequence cut at the end of the piece: the next one ends it.
            Err(e) if e.error_len().is_none() => self.valid += e.valid_up_to(),
            Err(_) => return Err(BodyError::NotUtf8),
        }
        Ok(true)
    }
}

#[cfg(test)]
mod tests {
    use std::sync::Mutex;

    use super::*;
    use crate::lock::LockExt;
    use serde_json::json;

    #[test]
    fn a_whole_answer_assembles_like_a_stream() {
        let body = json!({"model": "m1", "choices": [{"index": 0, "finish_reason": "length",
            "message": {"role": "assistant", "content": "Half an ans", "reasoning_content": "hmm",
                "tool_calls": [{"id": "c1", "type": "function",
                    "function": {"name": "t", "arguments": "{}"}}]}}],
            "usage": {"prompt_tokens": 3, "completion_tokens": 2}})
        .to_string();
        let (done, text) = whole(body.as_bytes()).unwrap();
        assert_eq!(text.as_deref(), Some("Half an ans"));
        assert_eq!(done.finish_reason, "length");
        assert_eq!(done.model.as_deref(), Some("m1"));
        assert_eq!(done.usage.map(|u| u.output_tokens), Some(2));
        assert_eq!(done.message.blocks.len(), 3, "reasoning, text, call");
        let (kind, message) = whole(br#"{"object": "error"}"#).unwrap_err();
        assert_eq!(kind, FailureKind::Malformed);
        assert!(message.contains("no choices[0].message"), "{message}");
        assert!(whole(b"<html>").is_err());
    }

    fn chunk(delta: serde_json::Value, finish: Option<&str>) -> String {
        json!({
            "id": "chatcmpl-1", "object": "chat.completion.chunk", "model": "gpt-test",
            "choices": [{"index": 0, "delta": delta, "finish_reason": finish}],
        })
        .to_string()
    }

    fn sse(payloads: &[String]) -> String {
        payloads.iter().map(|p| format!("data: {p}\n\n")).collect()
    }

    /// Runs `read` over `body` split into pieces of `piece` bytes.
    fn run(
        body: &str,
        piece: usize,
        limits: Limits,
    ) -> (Result<Assembled, StreamFailure>, Vec<String>) {
        let pieces: Vec<Result<Vec<u8>, String>> = body
            .as_bytes()
            .chunks(piece)
            .map(|c| Ok(c.to_vec()))
            .collect();
        run_pieces(pieces, limits)
    }

    fn run_pieces(
        pieces: Vec<Result<Vec<u8>, String>>,
        limits: Limits,
    ) -> (Result<Assembled, StreamFailure>, Vec<String>) {
        let deltas = Mutex::new(Vec::new());
        let sink = |t: &str| deltas.locked().push(t.to_string());
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_time()
            .build()
            .unwrap();
        let result = rt.block_on(read(futures::stream::iter(pieces), limits, &sink));
        (result, deltas.into_inner().unwrap())
    }

    /// Runs `f` on a current-thread runtime whose clock only moves when
    /// every task waits, so idle bounds pass at once and exactly.
    fn on_paused_clock<T>(f: impl std::future::Future<Output = T>) -> T {
        tokio::runtime::Builder::new_current_thread()
            .enable_time()
            .start_paused(true)
            .build()
            .unwrap()
            .block_on(f)
    }

    fn limits() -> Limits {
        Limits {
            max_bytes: 1 << 20,
            idle_timeout: Duration::from_secs(5),
        }
    }

    #[test]
    fn text_deltas_are_passed_on_and_usage_taken_from_the_final_chunk() {
        let mut body = sse(&[
            chunk(json!({"role": "assistant", "content": ""}), None),
            chunk(json!({"content": "Hello"}), None),
            chunk(json!({"content": ", wörld"}), None),
            chunk(json!({}), Some("stop")),
            json!({"choices": null, "model": "gpt-test-2024",
                   "usage": {"prompt_tokens": 11, "completion_tokens": 3, "total_tokens": 14}})
            .to_string(),
        ]);
        body.push_str("data: [DONE]\n\n");
        // Split into 3-byte pieces: events and UTF-8 sequences straddle reads.
        let (r, deltas) = run(&body, 3, limits());
        let a = r.unwrap();
        assert_eq!(deltas, vec!["Hello", ", wörld"]);
        assert_eq!(a.message, Message::assistant_text("Hello, wörld"));
        assert_eq!(a.finish_reason, "stop");
        assert_eq!(a.id.as_deref(), Some("chatcmpl-1"));
        assert_eq!(
            a.usage,
            Some(Usage {
                input_tokens: 11,
                output_tokens: 3,
                estimated: false
            })
        );
        assert_eq!(a.model.as_deref(), Some("gpt-test-2024"));
    }

    /// A usage chunk a server got wrong (`null`, `5.0`) used to fail the
    /// whole chunk as malformed, and so the turn; now the answer stands and
    /// the caller estimates usage.
    #[test]
    fn odd_usage_counts_leave_usage_to_the_estimate() {
        for usage in [
            json!({"prompt_tokens": 11, "completion_tokens": null}),
            json!({"prompt_tokens": 11, "completion_tokens": 5.0}),
            json!({}),
        ] {
            let mut body = sse(&[
                chunk(json!({"content": "Hello"}), Some("stop")),
                json!({"choices": [], "usage": usage}).to_string(),
            ]);
            body.push_str("data: [DONE]\n\n");
            let a = run(&body, 1000, limits()).0.unwrap();
            assert_eq!(a.message.text(), "Hello");
            assert_eq!(a.usage, None, "{usage}");
        }
        let a = run(
            &sse(&[
                json!({"choices": [{"index": 0, "delta": {}, "finish_reason": "stop"}],
                "usage": {"prompt_tokens": u64::MAX, "completion_tokens": 2}})
                .to_string(),
            ]),
            1000,
            limits(),
        )
        .0
        .unwrap();
        assert_eq!(a.usage.map(|u| u.input_tokens), Some(wire::MAX_TOKEN_COUNT));
    }

    #[test]
    fn interleaved_tool_call_deltas_assemble_by_index() {
        let tc = |v: serde_json::Value| chunk(json!({"tool_calls": v}), None);
        let mut body = sse(&[
            chunk(json!({"role": "assistant", "content": null}), None),
            tc(json!([{"index": 0, "id": "call_a", "type": "function",
                       "function": {"name": "get_weather", "arguments": ""}}])),
            tc(json!([{"index": 1, "id": "call_b", "type": "function",
                       "function": {"name": "get_time", "arguments": "{\"tz\""}}])),
            tc(json!([{"index": 0, "function": {"arguments": "{\"city\":"}}])),
            // Two fragments for different calls in one chunk.
            tc(json!([{"index": 1, "function": {"arguments": ":\"CET\"}"}},
                      {"index": 0, "function": {"arguments": "\"Paris\"}"}}])),
            // A third call whose arguments never come (no-argument tool).
            tc(json!([{"index": 2, "id": "call_c", "function": {"name": "ping"}}])),
            chunk(json!({}), Some("tool_calls")),
        ]);
        body.push_str("data: [DONE]\n\n");
        let (r, deltas) = run(&body, 7, limits());
        let a = r.unwrap();
        assert!(deltas.is_empty());
        let calls: Vec<_> = a.message.tool_calls().cloned().collect();
        assert_eq!(
            calls,
            vec![
                ToolCall {
                    id: "call_a".into(),
                    name: "get_weather".into(),
                    arguments_json: r#"{"city":"Paris"}"#.into()
                },
                ToolCall {
                    id: "call_b".into(),
                    name: "get_time".into(),
                    arguments_json: r#"{"tz":"CET"}"#.into()
                },
                ToolCall {
                    id: "call_c".into(),
                    name: "ping".into(),
                    arguments_json: "{}".into()
                },
            ]
        );
        assert_eq!(a.finish_reason, "tool_calls");
        assert_eq!(a.usage, None, "no usage chunk: the caller estimates");
        assert!(a.output_chars > 0);
    }

    #[test]
    fn text_then_tool_call_and_reasoning_keep_block_order() {
        let mut asm = Assembler::default();
        asm.push(&chunk(json!({"reasoning_content": "think"}), None))
            .unwrap();
        assert_eq!(
            asm.push(&chunk(json!({"content": "Checking."}), None))
                .unwrap(),
            Some("Checking.".into())
        );
        asm.push(&chunk(
            json!({"tool_calls": [{"index": 0, "id": "x", "function": {"name": "f", "arguments": "{}"}}]}),
            Some("tool_calls"),
        ))
        .unwrap();
        let a = asm.finish(false).unwrap();
        assert_eq!(
            a.message.blocks,
            vec![
                Block::Reasoning {
                    text: "think".into()
                },
                Block::Text {
                    text: "Checking.".into()
                },
                Block::ToolCall(ToolCall {
                    id: "x".into(),
                    name: "f".into(),
                    arguments_json: "{}".into()
                }),
            ]
        );
    }

    #[test]
    fn calls_without_index_or_id_are_kept_apart_and_given_ids() {
        let mut asm = Assembler::default();
        asm.push(&chunk(
            json!({"tool_calls": [{"function": {"name": "a", "arguments": "{}"}},
                                  {"function": {"name": "b", "arguments": "{}"}}]}),
            Some("tool_calls"),
        ))
        .unwrap();
        let a = asm.finish(true).unwrap();
        let calls: Vec<_> = a.message.tool_calls().collect();
        assert_eq!(calls.len(), 2);
        assert_eq!((calls[0].name.as_str(), calls[1].name.as_str()), ("a", "b"));
        assert!(calls[0].id.starts_with("call_") && calls[0].id != calls[1].id);
    }

    #[test]
    fn a_tool_call_without_a_name_is_malformed() {
        let mut asm = Assembler::default();
        asm.push(&chunk(
            json!({"tool_calls": [{"index": 0, "function": {"arguments": "{}"}}]}),
            Some("tool_calls"),
        ))
        .unwrap();
        assert_eq!(asm.finish(true).unwrap_err().0, FailureKind::Malformed);
    }

    #[test]
    fn end_without_finish_or_done_is_incomplete_and_notes_emitted_output() {
        let body = sse(&[chunk(json!({"content": "partial"}), None)]);
        let (r, deltas) = run(&body, 1000, limits());
        let f = r.unwrap_err();
        assert_eq!(f.kind, FailureKind::Incomplete);
        assert!(f.emitted);
        assert_eq!(deltas, vec!["partial"]);
        // A finish reason without [DONE] is complete (some servers omit it).
        let body = sse(&[chunk(json!({"content": "ok"}), Some("length"))]);
        let a = run(&body, 1000, limits()).0.unwrap();
        assert_eq!(a.finish_reason, "length");
    }

    #[test]
    fn malformed_json_is_an_error_not_a_panic() {
        let body = format!(
            "{}data: {{\"choices\": [oops\n\n",
            sse(&[chunk(json!({"content": "a"}), None)])
        );
        let (r, _) = run(&body, 1000, limits());
        let f = r.unwrap_err();
        assert_eq!(f.kind, FailureKind::Malformed);
        assert!(f.message.contains("malformed chunk"), "{}", f.message);
        assert!(f.emitted);
        let (r, _) = run("data: [1, 2]\n\n", 1000, limits());
        assert_eq!(r.unwrap_err().kind, FailureKind::Malformed);
    }

    /// serde quotes a string where another type belongs; that string may
    /// be the answer, and the message becomes the run's reason.
    #[test]
    fn a_malformed_chunk_is_described_without_its_text() {
        let body = sse(&[json!({"choices": [{"index": 0,
            "delta": {"content": "fine", "tool_calls": "the SECRET answer"}}]})
        .to_string()]);
        let f = run(&body, 1000, limits()).0.unwrap_err();
        assert_eq!(f.kind, FailureKind::Malformed);
        assert!(
            f.message.starts_with(
                "malformed chunk in the response stream: JSON of the wrong shape (line 1, column"
            ),
            "{}",
            f.message
        );
        assert!(!f.message.contains("SECRET"), "{}", f.message);
        let (_, message) = whole(br#"{"choices": [{"index": "SECRET"}]}"#).unwrap_err();
        assert!(
            message.starts_with("malformed response body: JSON of the wrong shape"),
            "{message}"
        );
        assert!(!message.contains("SECRET"), "{message}");
    }

    #[test]
    fn an_error_inside_the_stream_carries_the_provider_message() {
        let body =
            sse(&[json!({"error": {"message": "overloaded", "type": "server_error"}}).to_string()]);
        let f = run(&body, 1000, limits()).0.unwrap_err();
        assert_eq!(f.kind, FailureKind::Provider);
        assert!(f.message.contains("overloaded"));
        assert!(!f.emitted);
    }

    #[test]
    fn transport_errors_and_size_bound() {
        let pieces = vec![
            Ok(sse(&[chunk(json!({"content": "a"}), None)]).into_bytes()),
            Err("connection reset".to_string()),
        ];
        let f = run_pieces(pieces, limits()).0.unwrap_err();
        assert_eq!(f.kind, FailureKind::Transport);
        assert!(f.message.contains("connection reset") && f.emitted);

        let body = sse(&vec![chunk(json!({"content": "xxxxxxxx"}), None); 50]);
        let small = Limits {
            max_bytes: 1000,
            ..limits()
        };
        let (r, _) = run(&body, 64, small);
        let f = r.unwrap_err();
        assert_eq!(f.kind, FailureKind::TooLarge);
        assert!(f.message.contains("1000 bytes"));
    }

    /// Runs [`Lines`] over `pieces`: what it handed on, the bytes it
    /// scanned and the bytes it received.
    fn lines_of(
        pieces: Vec<Vec<u8>>,
        limits: Limits,
    ) -> (Vec<Result<Vec<u8>, String>>, usize, usize) {
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_time()
            .build()
            .unwrap();
        rt.block_on(async {
            let body = futures::stream::iter(pieces.into_iter().map(Ok::<_, String>));
            let mut lines = Lines::new(body, limits);
            let mut out = Vec::new();
            while let Some(item) = lines.next().await {
                out.push(item.map_err(|e| e.to_string()));
            }
            (out, lines.scanned, lines.received)
        })
    }

    /// The SSE parser given the body's pieces as they came re-parsed a
    /// line arriving in many pieces on each of them, and copied the rest of
    /// a piece after each of its lines: work quadratic in a line's length
    /// or a piece's size. Now each line reaches it once, whole, and each
    /// byte is looked at a bounded number of times.
    #[test]
    fn lines_reach_the_parser_once_and_whole() {
        let long = format!("data: {}\n", "x".repeat(64 * 1024));
        // The long line one byte per piece, then many lines in one piece.
        let mut pieces: Vec<Vec<u8>> = long.bytes().map(|b| vec![b]).collect();
        pieces.push(b"\n".to_vec());
        pieces.push(": keep-alive\n".repeat(10_000).into_bytes());
        // CR and CRLF line ends, a CRLF split between pieces.
        pieces.push(b"data: a\r".to_vec());
        pieces.push(b"\ndata: b\rdata: c\r\n".to_vec());
        let (items, scanned, received) = lines_of(pieces, limits());
        let items: Vec<Vec<u8>> = items.into_iter().map(Result::unwrap).collect();
        assert_eq!(items.len(), 2 + 10_000 + 4);
        assert_eq!(items[0], long.as_bytes());
        assert_eq!(items[1], b"\n");
        assert!(items[2..10_002].iter().all(|l| l == b": keep-alive\n"));
        let tail: Vec<&[u8]> = items[10_002..].iter().map(Vec::as_slice).collect();
        assert_eq!(
            tail,
            [&b"data: a\r"[..], b"\n", b"data: b\r", b"data: c\r\n"]
        );
        assert!(
            scanned <= 2 * received,
            "scanned {scanned} of {received} bytes"
        );
    }

    #[test]
    fn a_line_is_bounded_by_the_response_bound() {
        let pieces = vec![b"data: ".to_vec(); 100];
        let small = Limits {
            max_bytes: 300,
            ..limits()
        };
        let (items, _, received) = lines_of(pieces, small);
        assert_eq!(items, vec![Err("more than 300 bytes".to_string())]);
        assert_eq!(received, 306, "stopped at the first piece past the bound");
    }

    /// An invalid byte sat in the parser's UTF-8 decoder, which re-checked
    /// it and everything after it on every piece until the body ended; now
    /// the stream fails at once.
    #[test]
    fn invalid_utf8_fails_the_stream_at_once() {
        use std::sync::atomic::{AtomicUsize, Ordering};
        let pulled = AtomicUsize::new(0);
        let mut pieces = vec![
            sse(&[chunk(json!({"content": "a"}), None)]).into_bytes(),
            b"data: \xff".to_vec(),
        ];
        pieces.extend(std::iter::repeat_n(b"x".to_vec(), 1000));
        let body = futures::stream::iter(pieces)
            .inspect(|_| {
                pulled.fetch_add(1, Ordering::Relaxed);
            })
            .map(Ok::<_, String>);
        let f = on_paused_clock(read(body, limits(), &|_| {})).unwrap_err();
        assert_eq!(f.kind, FailureKind::Malformed);
        assert_eq!(f.message, "the response stream is not UTF-8");
        assert_eq!(
            pulled.load(Ordering::Relaxed),
            2,
            "no piece after the bad one"
        );
    }

    /// A connection that broke or stalled after the finish reason lost a
    /// complete answer (only the usage chunk or `[DONE]` was missing).
    #[test]
    fn a_stream_that_breaks_or_stalls_after_the_finish_keeps_its_answer() {
        let answer = sse(&[
            chunk(json!({"content": "all of it"}), None),
            chunk(json!({}), Some("stop")),
        ])
        .into_bytes();
        let broken = vec![Ok(answer.clone()), Err("connection reset".to_string())];
        let (r, deltas) = run_pieces(broken, limits());
        let a = r.unwrap();
        assert_eq!(
            (a.message.text(), a.finish_reason.as_str()),
            ("all of it".to_string(), "stop")
        );
        assert_eq!(a.usage, None, "estimated by the caller");
        assert_eq!(deltas, vec!["all of it"]);

        let stalled =
            futures::stream::iter(vec![Ok::<_, String>(answer)]).chain(futures::stream::pending());
        let a = on_paused_clock(read(stalled, limits(), &|_| {})).unwrap();
        assert_eq!(a.message.text(), "all of it");

        // Without a finish reason, a break is still a failure.
        let cut = vec![
            Ok(sse(&[chunk(json!({"content": "half"}), None)]).into_bytes()),
            Err("connection reset".to_string()),
        ];
        assert_eq!(
            run_pieces(cut, limits()).0.unwrap_err().kind,
            FailureKind::Transport
        );
    }

    #[test]
    fn a_stalled_stream_times_out() {
        let first = sse(&[chunk(json!({"content": "a"}), None)]).into_bytes();
        let body =
            futures::stream::iter(vec![Ok::<_, String>(first)]).chain(futures::stream::pending());
        let f = on_paused_clock(read(body, limits(), &|_| {})).unwrap_err();
        assert_eq!(f.kind, FailureKind::Stalled);
        assert!(f.message.contains("5s") && f.emitted, "{}", f.message);
    }

    /// A server that sends `: PROCESSING` every few seconds while a slow
    /// answer is prepared: the comments never make an event, so a bound on
    /// waiting for events cut the answer off. The bound is on bytes now.
    #[test]
    fn keep_alive_comments_keep_a_slow_stream_alive() {
        let answer = sse(&[chunk(json!({"content": "late"}), Some("stop"))]);
        let body = futures::stream::unfold(0u32, move |n| {
            let answer = answer.clone();
            async move {
                // A comment a second for 30 s (idle bound: 5 s), then the answer.
                tokio::time::sleep(Duration::from_secs(1)).await;
                match n {
                    0..30 => Some((Ok::<_, String>(b": PROCESSING\n\n".to_vec()), n + 1)),
                    30 => Some((Ok(answer.into_bytes()), n + 1)),
                    _ => None,
                }
            }
        });
        let body = std::pin::pin!(body);
        let a = on_paused_clock(read(body, limits(), &|_| {})).unwrap();
        assert_eq!(a.message.text(), "late");
    }

    #[test]
    fn comments_event_names_and_crlf_are_tolerated() {
        let body = format!(
            ": keep-alive\r\n\r\nevent: message\r\ndata: {}\r\n\r\ndata: [DONE]\r\n\r\n",
            chunk(json!({"content": "hi"}), Some("stop"))
        );
        let (r, deltas) = run(&body, 5, limits());
        assert_eq!(r.unwrap().message.text(), "hi");
        assert_eq!(deltas, vec!["hi"]);
    }

    /// A model name or finish reason of a megabyte was kept whole (only ids
    /// were bounded); they reach clients, the store, hooks and spans.
    #[test]
    fn overlong_model_names_and_finish_reasons_are_not_kept() {
        let huge = "m".repeat(1 << 20);
        let body = sse(&[
            json!({"model": "served", "choices": [{"index": 0, "delta": {"content": "hi"}}]})
                .to_string(),
            json!({"model": huge, "choices": [{"index": 0, "delta": {}, "finish_reason": huge}]})
                .to_string(),
        ]);
        // No [DONE]: the overlong reason still ends the turn.
        let a = run(
            &body,
            1 << 16,
            Limits {
                max_bytes: 4 << 20,
                ..limits()
            },
        )
        .0
        .unwrap();
        assert_eq!(a.model.as_deref(), Some("served"), "the last plausible one");
        assert_eq!(a.finish_reason, "stop", "inferred, as when none is sent");
        assert_eq!(a.message.text(), "hi");

        let mut only_huge = Assembler::default();
        only_huge
            .push(
                &json!({"model": huge, "choices": [{"index": 0, "delta": {"content": "x"}}]})
                    .to_string(),
            )
            .unwrap();
        assert_eq!(only_huge.finish(true).unwrap().model, None);
    }

    #[test]
    fn the_first_plausible_response_id_is_kept() {
        let mut a = Assembler::default();
        let with_id = |id: serde_json::Value| {
            json!({"id": id, "choices": [{"index": 0, "delta": {"content": "x"}}]}).to_string()
        };
        a.push(&with_id(json!(""))).unwrap();
        a.push(&with_id(json!("x".repeat(MAX_NAME_BYTES + 1))))
            .unwrap();
        a.push(&with_id(json!("resp-7"))).unwrap();
        a.push(&with_id(json!("resp-8"))).unwrap();
        assert_eq!(a.finish(true).unwrap().id.as_deref(), Some("resp-7"));

        let mut none = Assembler::default();
        none.push(&json!({"choices": [{"index": 0, "delta": {"content": "x"}}]}).to_string())
            .unwrap();
        assert_eq!(none.finish(true).unwrap().id, None);
    }
}
