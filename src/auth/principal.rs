//! Who is calling: the authenticated principal every AgentService call
//! carries, from the auth layer to the engine and on to hooks.

use std::collections::{BTreeMap, BTreeSet};

use crate::config::{ROLE_ADMIN, ROLE_APPROVER};

/// The name sessions belong to when authentication is off.
pub const ANONYMOUS: &str = "anonymous";

#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Principal {
    /// Stable name: a token's `principal`, a certificate's SAN, a JWT's `sub`.
    pub name: String,
    pub roles: BTreeSet<String>,
    /// Claims hooks may see (already narrowed to `auth.forward_claims`).
    pub claims: BTreeMap<String, String>,
}

impl Principal {
    pub fn anonymous() -> Principal {
        Principal::new(ANONYMOUS, std::iter::empty::<String>())
    }

    pub fn new(
        name: impl Into<String>,
        roles: impl IntoIterator<Item = impl Into<String>>,
    ) -> Principal {
        Principal {
            name: name.into(),
            roles: roles.into_iter().map(Into::into).collect(),
            claims: BTreeMap::new(),
        }
    }

    pub fn has_role(&self, role: &str) -> bool {
        self.roles.contains(role)
    }

    pub fn is_admin(&self) -> bool {
        self.has_role(ROLE_ADMIN)
    }

    /// A bounded label for metrics: never the principal's name (unbounded),
    /// only which kind of caller it is.
    pub fn class(&self) -> &'static str {
        if self.is_admin() {
            "admin"
        } else if self.has_role(ROLE_APPROVER) {
            "approver"
        } else if self.name == ANONYMOUS {
            "anonymous"
        } else {
            "user"
        }
    }
}
