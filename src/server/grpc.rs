//! Thin AgentService adapter over the engine.

use std::pin::Pin;
use std::sync::Arc;

use futures::Stream;
use tonic::{Request, Response, Status};

use crate::agent::events::RunEvent;
use crate::auth::Principal;
use crate::engine::Engine;
use crate::engine::{gone_reason, CallerDeadline};
use crate::pb;
use crate::pb::agent_service_server::AgentService;
use crate::request::{CreateSession, ResolveApproval, RunRef, SessionRef, StartRun};
use crate::server::caller_deadline;
use crate::server::convert;
use crate::server::status::{self, no_principal};
use crate::store::SessionFilter;

pub struct AgentApi {
    pub engine: Arc<Engine>,
}

fn trace_headers<T>(req: &Request<T>) -> (String, String) {
    let get = |k: &str| {
        req.metadata()
            .get(k)
            .and_then(|v| v.to_str().ok())
            .unwrap_or_default()
            .to_string()
    };
    (get("traceparent"), get("tracestate"))
}

/// The caller, as the auth layer authenticated it. A call without one did
/// not pass the layer: refused, never served as nobody in particular.
fn principal<T>(req: &Request<T>) -> Result<Principal, Status> {
    req.extensions()
        .get::<Principal>()
        .cloned()
        .ok_or_else(no_principal)
}

/// The client's answer when a run's task ended without its report. The
/// task error's text can quote a panic's message (content): debug only.
/// Where a panic happened, the panic hook has logged already.
fn task_lost(run_id: &str, e: &tokio::task::JoinError) -> Status {
    tracing::error!(
        run_id,
        panicked = e.is_panic(),
        "a run's task ended without its report"
    );
    tracing::debug!(run_id, error = %e, "run task error");
    status::run_task_lost()
}

type RunStream = Pin<Box<dyn Stream<Item = Result<pb::RunEvent, Status>> + Send>>;

#[tonic::async_trait]
impl AgentService for AgentApi {
    async fn create_session(
        &self,
        req: Request<pb::CreateSessionRequest>,
    ) -> Result<Response<pb::Session>, Status> {
        let who = principal(&req)?;
        let r = CreateSession::try_from(req.into_inner())?;
        let s = self
            .engine
            .create_session(&who, &r.agent, r.extra_hooks, r.metadata)
            .await?;
        let hooks = self.engine.session_hook_names(&s);
        Ok(Response::new(convert::session(&s, hooks, true)))
    }

    async fn get_session(
        &self,
        req: Request<pb::GetSessionRequest>,
    ) -> Result<Response<pb::Session>, Status> {
        let who = principal(&req)?;
        let r = SessionRef::try_from(req.into_inner())?;
        let s = self.engine.get_session(&who, &r.session_id).await?;
        let hooks = self.engine.session_hook_names(&s);
        Ok(Response::new(convert::session(&s, hooks, true)))
    }

    async fn list_sessions(
        &self,
        req: Request<pb::ListSessionsRequest>,
    ) -> Result<Response<pb::ListSessionsResponse>, Status> {
        let who = principal(&req)?;
        let filter = SessionFilter::try_from(req.into_inner())?;
        let page = self.engine.list_sessions(&who, filter).await?;
        Ok(Response::new(pb::ListSessionsResponse {
            sessions: page
                .sessions
                .iter()
                .map(|s| convert::session(s, self.engine.session_hook_names(s), false))
                .collect(),
            next_page_token: page.next_page_token,
        }))
    }

    async fn delete_session(
        &self,
        req: Request<pb::DeleteSessionRequest>,
    ) -> Result<Response<pb::DeleteSessionResponse>, Status> {
        let who = principal(&req)?;
        let r = SessionRef::try_from(req.into_inner())?;
        self.engine.delete_session(&who, &r.session_id).await?;
        Ok(Response::new(pb::DeleteSessionResponse {}))
    }

    type RunStream = RunStream;

    async fn run(&self, req: Request<pb::RunRequest>) -> Result<Response<RunStream>, Status> {
        let who = principal(&req)?;
        let trace = trace_headers(&req);
        let deadline = caller_deadline::of(req.metadata());
        let r = StartRun::try_from(req.into_inner())?;
        let session = self.engine.session_info(&who, &r.session_id).await?;
        let mut handle = self
            .engine
            .start_run(&who, &r.session_id, r.input, true, trace, deadline)
            .await?;
        let run_id = handle.run_id.clone();
        let engine = self.engine.clone();
        let stream = async_stream(move |tx| async move {
            // The client gone (its stream reset, its connection closed):
            // the run is stopped now. It would otherwise notice only at
            // its next event, and a run waiting for an approval has none
            // to send: an answer given meanwhile still ran the tool.
            // Registered once for the stream's life. Every way out before
            // the run's end (the client gone while we wait for an event or
            // while we send one) goes through `left`.
            let mut left = ClientGone(Some((engine, run_id.clone(), deadline)));
            let gone = tx.closed();
            tokio::pin!(gone);
            let mut seq = 0;
            loop {
                let ev = tokio::select! {
                    biased;
                    ev = handle.events.recv() => ev,
                    () = &mut gone => return,
                };
                let Some(ev) = ev else { break };
                seq += 1;
                let last = matches!(*ev, RunEvent::Finished(_));
                let msg = convert::run_event(&run_id, seq, &ev, &session.id, &session.agent);
                if last {
                    left.0 = None;
                }
                if tx.send(Ok(msg)).await.is_err() {
                    return;
                }
                if last {
                    return;
                }
            }
            left.0 = None;
            // The run ended while its event queue stayed full (the client
            // stalled), so `Finished` could not be queued: the report is the
            // task's result.
            let last = match handle.task.await {
                Ok(report) => Ok(convert::run_event(
                    &run_id,
                    seq + 1,
                    &RunEvent::Finished(report),
                    &session.id,
                    &session.agent,
                )),
                Err(e) => Err(task_lost(&run_id, &e)),
            };
            let _ = tx.send(last).await;
        });
        Ok(Response::new(stream))
    }

    async fn invoke(
        &self,
        req: Request<pb::RunRequest>,
    ) -> Result<Response<pb::RunResult>, Status> {
        let who = principal(&req)?;
        let trace = trace_headers(&req);
        let deadline = caller_deadline::of(req.metadata());
        let r = StartRun::try_from(req.into_inner())?;
        let mut handle = self
            .engine
            .start_run(&who, &r.session_id, r.input, false, trace, deadline)
            .await?;
        // A caller that leaves (tonic drops this handler) stops the run at
        // once, not at its next event.
        let mut left = ClientGone(Some((self.engine.clone(), handle.run_id.clone(), deadline)));
        // Same drive loop as Run; the events are consumed (and dropped) here.
        while let Some(ev) = handle.events.recv().await {
            if let RunEvent::Finished(report) = *ev {
                left.0 = None;
                return Ok(Response::new(convert::report(&report)));
            }
        }
        left.0 = None;
        let run_id = handle.run_id;
        let report = handle.task.await.map_err(|e| task_lost(&run_id, &e))?;
        Ok(Response::new(convert::report(&report)))
    }

    async fn cancel_run(
        &self,
        req: Request<pb::CancelRunRequest>,
    ) -> Result<Response<pb::CancelRunResponse>, Status> {
        let who = principal(&req)?;
        let r = RunRef::try_from(req.into_inner())?;
        self.engine.cancel_run(&who, &r.run_id).await?;
        Ok(Response::new(pb::CancelRunResponse {}))
    }

    async fn resolve_approval(
        &self,
        req: Request<pb::ResolveApprovalRequest>,
    ) -> Result<Response<pb::ResolveApprovalResponse>, Status> {
        let who = principal(&req)?;
        let r = ResolveApproval::try_from(req.into_inner())?;
        self.engine
            .resolve_approval(&who, &r.run_id, &r.call_id, r.approve, r.note)
            .await?;
        Ok(Response::new(pb::ResolveApprovalResponse {}))
    }

    async fn list_hooks(
        &self,
        req: Request<pb::ListHooksRequest>,
    ) -> Result<Response<pb::ListHooksResponse>, Status> {
        principal(&req)?;
        Ok(Response::new(pb::ListHooksResponse {
            hooks: self.engine.hooks().iter().map(convert::hook_info).collect(),
        }))
    }
}

/// A response stream fed by a producer task through a small channel, so a
/// slow client applies backpressure instead of buffering without bound.
/// Stops the run when dropped while armed: an `Invoke` handler dropped
/// before its run reported (the caller left), or a `Run` stream whose
/// client went away; the reason says whether it left at its own deadline.
struct ClientGone(Option<(Arc<Engine>, String, Option<CallerDeadline>)>);

impl Drop for ClientGone {
    fn drop(&mut self) {
        if let Some((engine, run_id, deadline)) = self.0.take() {
            engine.client_gone(&run_id, &gone_reason(deadline));
        }
    }
}

fn async_stream<F, Fut>(produce: F) -> RunStream
where
    F: FnOnce(tokio::sync::mpsc::Sender<Result<pb::RunEvent, Status>>) -> Fut,
    Fut: std::future::Future<Output = ()> + Send + 'static,
{
    let (tx, rx) = tokio::sync::mpsc::channel(64);
    tokio::spawn(produce(tx));
    Box::pin(tokio_stream::wrappers::ReceiverStream::new(rx))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn a_lost_run_task_answers_internal_without_the_panic_message() {
        let e = tokio::spawn(async { panic!("the user's secret") })
            .await
            .unwrap_err();
        assert!(e.to_string().contains("the user's secret"), "{e}");
        let s = task_lost("r1", &e);
        assert_eq!(s.code(), tonic::Code::Internal);
        assert_eq!(s.message(), crate::agent::contain::INTERNAL_ERROR);
    }
}
