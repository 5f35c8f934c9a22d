//! Who may do what with a session. One decision, made here, for every
//! AgentService method; the engine acts on a session only with the
//! [`SessionGrant`] it returns (its constructor is private to this module,
//! so a call that skipped the check does not compile).
//!
//! - The principal that created a session owns it: Get, Run, Invoke,
//!   CancelRun, Delete and ResolveApproval on it.
//! - `admin` may do all of that on every session, and List shows it all.
//! - A principal holding one of the agent's `approver_roles` may resolve
//!   approvals of that agent's runs without owning the session.
//! - `agents[].allow` restricts who may create sessions on an agent and
//!   run in them.
//! - Anything else is [`Denied::Hidden`]: the caller is told exactly what it
//!   would be told if the session did not exist.

use crate::config::AgentConfig;

use super::principal::Principal;

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Action {
    Read,
    Run,
    Cancel,
    Delete,
    ResolveApproval,
}

/// Why access was refused.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Denied {
    /// Not the caller's session: answer as for a missing one.
    Hidden,
    /// The agent is not open to this principal (agents are configuration,
    /// not secrets, so this may be said).
    Agent { principal: String, agent: String },
}

/// Proof that `principal` may act on `session_id`.
#[derive(Debug)]
pub struct SessionGrant {
    session_id: String,
}

impl SessionGrant {
    pub fn session_id(&self) -> &str {
        &self.session_id
    }
}

/// What a principal sees of the session list.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum ListScope {
    All,
    OwnedBy(String),
}

pub fn list_scope(p: &Principal) -> ListScope {
    if p.is_admin() {
        ListScope::All
    } else {
        ListScope::OwnedBy(p.name.clone())
    }
}

/// Whether `p` may create sessions on, and run, `agent`.
pub fn may_use_agent(p: &Principal, agent: &AgentConfig) -> Result<(), Denied> {
    let Some(allow) = &agent.allow else {
        return Ok(());
    };
    if p.is_admin()
        || allow.principals.contains(&p.name)
        || p.roles.iter().any(|r| allow.roles.contains(r))
    {
        Ok(())
    } else {
        Err(Denied::Agent {
            principal: p.name.clone(),
            agent: agent.name.clone(),
        })
    }
}

/// The one access decision for acting on an existing session.
pub fn authorize(
    p: &Principal,
    action: Action,
    session_id: &str,
    owner: &str,
    agent: Option<&AgentConfig>,
) -> Result<SessionGrant, Denied> {
    let owns = p.name == owner;
    let allowed = p.is_admin()
        || owns
        || (action == Action::ResolveApproval
            && agent.is_some_and(|a| a.approver_roles.iter().any(|r| p.has_role(r))));
    if !allowed {
        return Err(Denied::Hidden);
    }
    if action == Action::Run {
        if let Some(a) = agent {
            may_use_agent(p, a)?;
        }
    }
    Ok(SessionGrant {
        session_id: session_id.to_string(),
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::{AgentAllow, Config};

    fn agent(allow: Option<AgentAllow>) -> AgentConfig {
        let mut c = Config::embedded_default().agents[0].clone();
        c.allow = allow;
        c
    }

    #[test]
    fn owner_admin_and_approver() {
        let a = agent(None);
        let alice = Principal::new("alice", ["user"]);
        let bob = Principal::new("bob", Vec::<String>::new());
        let root = Principal::new("root", ["admin"]);
        let appr = Principal::new("carol", ["approver"]);
        for act in [
            Action::Read,
            Action::Run,
            Action::Cancel,
            Action::Delete,
            Action::ResolveApproval,
        ] {
            assert!(authorize(&alice, act, "s", "alice", Some(&a)).is_ok());
            assert!(authorize(&root, act, "s", "alice", Some(&a)).is_ok());
            assert_eq!(
                authorize(&bob, act, "s", "alice", Some(&a)).unwrap_err(),
                Denied::Hidden
            );
            let approver = authorize(&appr, act, "s", "alice", Some(&a));
            assert_eq!(approver.is_ok(), act == Action::ResolveApproval, "{act:?}");
        }
        assert_eq!(list_scope(&root), ListScope::All);
        assert_eq!(list_scope(&bob), ListScope::OwnedBy("bob".into()));
    }

    #[test]
    fn approver_roles_are_per_agent() {
        let mut a = agent(None);
        a.approver_roles = vec!["oncall".into()];
        let appr = Principal::new("carol", ["approver"]);
        let oncall = Principal::new("dave", ["oncall"]);
        assert!(authorize(&appr, Action::ResolveApproval, "s", "alice", Some(&a)).is_err());
        assert!(authorize(&oncall, Action::ResolveApproval, "s", "alice", Some(&a)).is_ok());
    }

    #[test]
    fn agent_allow_lists() {
        let a = agent(Some(AgentAllow {
            principals: ["alice".to_string()].into(),
            roles: ["support".to_string()].into(),
        }));
        assert!(may_use_agent(&Principal::new("alice", Vec::<String>::new()), &a).is_ok());
        assert!(may_use_agent(&Principal::new("x", ["support"]), &a).is_ok());
        assert!(may_use_agent(&Principal::new("root", ["admin"]), &a).is_ok());
        assert!(matches!(
            may_use_agent(&Principal::new("bob", Vec::<String>::new()), &a),
            Err(Denied::Agent { .. })
        ));
        // Owning a session does not keep an agent open to someone removed
        // from its allow list.
        assert!(authorize(
            &Principal::new("bob", Vec::<String>::new()),
            Action::Run,
            "s",
            "bob",
            Some(&a)
        )
        .is_err());
        assert!(authorize(
            &Principal::new("bob", Vec::<String>::new()),
            Action::Read,
            "s",
            "bob",
            Some(&a)
        )
        .is_ok());
    }
}
