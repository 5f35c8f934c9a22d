//! What `hookwire serve` runs without a config: the demo agent on the
//! scripted model, with a small built-in hook server ([`guard`]) so the first
//! run shows hooks at work. The hook server listens on a loopback port of
//! its own and hookwire calls it over gRPC like any remote hook (Describe,
//! one Process stream per run, CallTool); nothing takes an in-process
//! shortcut. `hookwire serve --no-demo-hooks`, or any `--config`, leaves it
//! out.

pub mod guard;

use tokio::net::TcpListener;
use tokio::sync::oneshot;

use crate::config::{Config, ConfigError};

/// The demo configuration; `{endpoint}` is the guard's address.
const DEMO_CONFIG: &str = r#"
models:
  - name: scripted
    provider: scripted
    rules:
      - when: { last_tool_result_contains: "" }
        text: "The tool said: {{last_tool_result}}"
      - when: { last_user_contains: "weather" }
        tool_calls: [ { name: get_weather, arguments: { city: "Paris" } } ]
      - when: { last_user_contains: "delete" }
        tool_calls: [ { name: delete_file, arguments: { path: "notes.txt" } } ]
      - text: "Hello from hookwire's scripted demo model. You said: {{last_user}}"
hooks:
  - name: demo-guard
    endpoint: "{endpoint}"
agents:
  - name: demo
    model: scripted
    system_prompt: "You are hookwire's demo agent."
    hooks: [demo-guard]
    tools: [get_weather, delete_file]
"#;

/// The running demo hook server.
pub struct DemoHooks {
    endpoint: String,
    stop: Option<oneshot::Sender<()>>,
    task: tokio::task::JoinHandle<Result<(), tonic::transport::Error>>,
}

impl DemoHooks {
    /// Starts the guard on 127.0.0.1, on a free port.
    pub async fn start() -> std::io::Result<DemoHooks> {
        let listener = TcpListener::bind("127.0.0.1:0").await?;
        let endpoint = format!("http://{}", listener.local_addr()?);
        let (stop, stopped) = oneshot::channel::<()>();
        let task = tokio::spawn(crate::hook_server::serve(
            guard::DemoGuard,
            listener,
            async {
                let _ = stopped.await;
            },
        ));
        Ok(DemoHooks {
            endpoint,
            stop: Some(stop),
            task,
        })
    }

    pub fn endpoint(&self) -> &str {
        &self.endpoint
    }

    /// The demo configuration pointing at this server.
    pub fn config(&self) -> Result<Config, ConfigError> {
        Config::parse(
            &DEMO_CONFIG.replace("{endpoint}", &self.endpoint),
            "embedded demo",
        )
    }

    /// Stops the server once hookwire stopped calling it.
    pub async fn stop(mut self) {
        if let Some(stop) = self.stop.take() {
            let _ = stop.send(());
        }
        let _ = (&mut self.task).await;
    }
}

impl Drop for DemoHooks {
    fn drop(&mut self) {
        self.task.abort();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn the_demo_config_is_valid_and_points_at_the_guard() {
        let demo = DemoHooks::start().await.unwrap();
        let cfg = demo.config().unwrap();
        assert_eq!(cfg.hooks[0].name, guard::NAME);
        assert_eq!(cfg.hooks[0].endpoint, demo.endpoint());
        assert_eq!(cfg.agents[0].hooks, [guard::NAME]);
        demo.stop().await;
    }
}
