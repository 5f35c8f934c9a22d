//! The minimal Rust hook server from docs/writing-hooks.md: masks a password
//! in the user input and denies the `shell` tool.
//!
//! Run: `cargo run --example guard_hook` (listens on 127.0.0.1:50061).

use hookwire::hook_server::{self, Ctx, Hook, Reply};
use hookwire::pb;

struct Guard;

#[tonic::async_trait]
impl Hook for Guard {
    fn describe(&self) -> pb::DescribeResponse {
        hook_server::describe("guard", &[pb::EventKind::RunStart, pb::EventKind::ToolCall])
    }

    async fn run_start(&self, _ctx: &Ctx, ev: pb::RunStartEvent) -> Reply<pb::RunStartVerdict> {
        let masked = ev.input.replace("hunter2", "[redacted]");
        Reply::new(hook_server::rewrite_input(masked)).reason("masked a password")
    }

    async fn tool_call(&self, ctx: &Ctx, ev: pb::ToolCallEvent) -> Reply<pb::ToolCallVerdict> {
        let call = ev.call.unwrap_or_default();
        if call.name == "shell" {
            return Reply::new(hook_server::skip_tool("shell is not allowed here", true))
                .set("denied", call.name.as_bytes().to_vec()); // scratchpad
        }
        let _ = ctx; // ctx.run_id, ctx.scratchpad, ctx.deadline_remaining_ms, ctx.traceparent
        Reply::new(pb::ToolCallVerdict {
            action: Some(pb::tool_call_verdict::Action::Proceed(pb::Continue {})),
        })
    }
}

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:50061").await?;
    println!("listening on {}", listener.local_addr()?.port());
    hook_server::serve(Guard, listener, async {
        let _ = tokio::signal::ctrl_c().await;
    })
    .await?;
    Ok(())
}
