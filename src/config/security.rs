//! Security settings: TLS on hookwire's port and to hook servers, hook call
//! credentials, caller authentication, per-agent access and per-principal
//! quotas. The model only; loading certificates lives in `tls/`, checking
//! callers in `auth/`.

use std::collections::{BTreeMap, BTreeSet};
use std::path::PathBuf;
use std::time::Duration;

use serde::Deserialize;

/// TLS on hookwire's own gRPC port (`tls:` at the top level).
#[derive(Clone, Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ServerTls {
    /// PEM certificate chain (leaf first).
    pub cert_file: PathBuf,
    /// PEM private key (PKCS#8, PKCS#1 or SEC1).
    pub key_file: PathBuf,
    /// PEM CA bundle client certificates are verified against; required for
    /// `client_auth: optional|required`.
    pub client_ca_file: Option<PathBuf>,
    #[serde(default)]
    pub client_auth: ClientAuth,
}

/// Whether callers must present a client certificate.
#[derive(Clone, Copy, Debug, Deserialize, PartialEq, Eq, Default)]
#[serde(rename_all = "snake_case")]
pub enum ClientAuth {
    /// No client certificate is asked for.
    #[default]
    None,
    /// Asked for and verified when presented; connections without one are
    /// accepted (auth decides what they may do).
    Optional,
    /// Connections without a certificate from `client_ca_file` are refused
    /// in the handshake.
    Required,
}

/// TLS to one hook server (`hooks[].tls`), for `https://` endpoints.
#[derive(Clone, Debug, Deserialize, Default, PartialEq, Eq)]
#[serde(deny_unknown_fields)]
pub struct HookTls {
    /// PEM CA bundle the hook's certificate must chain to (like a webhook's
    /// caBundle); the webpki (Mozilla) roots when unset.
    pub ca_file: Option<PathBuf>,
    /// PEM client certificate chain for mTLS (with `key_file`).
    pub cert_file: Option<PathBuf>,
    pub key_file: Option<PathBuf>,
    /// Name to verify the certificate against and to send as SNI and
    /// `:authority`, instead of the endpoint's host.
    pub server_name: Option<String>,
}

/// Call credentials for one hook server (`hooks[].credentials`): a bearer
/// token sent as `authorization` metadata on Describe, Process and CallTool.
#[derive(Clone, Debug, Deserialize, Default, PartialEq, Eq)]
#[serde(deny_unknown_fields)]
pub struct HookCredentials {
    /// File holding the token (re-read when it changes: projected service
    /// account tokens and Secrets rotate).
    pub bearer_token_file: Option<PathBuf>,
    /// Environment variable holding the token (read at start-up).
    pub bearer_token_env: Option<String>,
}

/// How callers of AgentService authenticate (`auth:`).
#[derive(Clone, Copy, Debug, Deserialize, PartialEq, Eq, Default)]
#[serde(rename_all = "snake_case")]
pub enum AuthMode {
    /// Everyone is principal `anonymous`; only allowed when the gRPC port
    /// listens on a loopback address.
    #[default]
    None,
    /// Static bearer tokens, stored as SHA-256 hashes in `tokens_file`.
    Tokens,
    /// The client certificate's SAN (URI, e.g. a SPIFFE ID, else DNS name)
    /// is the principal; needs `tls.client_auth`.
    Mtls,
    /// OIDC/JWT bearer tokens verified against the keys in `jwks_file`.
    Jwt,
}

pub const DEFAULT_JWT_LEEWAY: Duration = Duration::from_secs(60);

#[derive(Clone, Debug, Deserialize, Default)]
#[serde(deny_unknown_fields)]
pub struct AuthConfig {
    #[serde(default)]
    pub mode: AuthMode,
    /// mode tokens: YAML `tokens: [{principal, sha256, roles, claims}]`.
    pub tokens_file: Option<PathBuf>,
    /// mode jwt: a JWKS (`{"keys": [...]}`), re-read when it changes.
    pub jwks_file: Option<PathBuf>,
    /// mode jwt: required `iss`.
    pub issuer: Option<String>,
    /// mode jwt: required `aud` (one of the token's audiences).
    pub audience: Option<String>,
    /// mode jwt: signature algorithms accepted (pinned; default RS256, ES256).
    #[serde(default)]
    pub algorithms: Vec<String>,
    /// mode jwt: allowed clock skew for exp/nbf (default 60s).
    #[serde(default, deserialize_with = "super::duration::option::deserialize")]
    pub leeway: Option<Duration>,
    /// mode jwt: claim naming the principal (default `sub`).
    pub principal_claim: Option<String>,
    /// mode jwt: claim holding the roles, a list or a space-separated string
    /// (default `roles`).
    pub roles_claim: Option<String>,
    /// mode mtls (and extra roles in any mode): roles per principal name.
    #[serde(default)]
    pub principal_roles: BTreeMap<String, Vec<String>>,
    /// Claims of the caller passed to hooks in `EventContext.principal_claims`
    /// (`roles` is the caller's roles, space-separated). Nothing else leaves
    /// hookwire. Default: `[roles]`.
    pub forward_claims: Option<Vec<String>>,
}

impl AuthConfig {
    pub fn forwarded_claims(&self) -> Vec<String> {
        self.forward_claims
            .clone()
            .unwrap_or_else(|| vec!["roles".to_string()])
    }
}

/// Who may use an agent (`agents[].allow`): any of the principals, or any
/// principal holding one of the roles. Absent: every authenticated caller.
#[derive(Clone, Debug, Deserialize, Default, PartialEq, Eq)]
#[serde(deny_unknown_fields)]
pub struct AgentAllow {
    #[serde(default)]
    pub principals: BTreeSet<String>,
    #[serde(default)]
    pub roles: BTreeSet<String>,
}

/// Limits per principal (`quotas:`); each absent limit is unlimited.
#[derive(Clone, Debug, Deserialize, Default, PartialEq, Eq)]
#[serde(deny_unknown_fields)]
pub struct Quotas {
    /// Sessions a principal may own at once.
    pub max_sessions: Option<u32>,
    /// Runs of one principal in flight at once.
    pub max_concurrent_runs: Option<u32>,
    /// Runs a principal may start in any 60-second window.
    pub runs_per_minute: Option<u32>,
}

/// The built-in roles.
pub const ROLE_ADMIN: &str = "admin";
pub const ROLE_APPROVER: &str = "approver";

/// JWT algorithms hookwire accepts in `auth.algorithms` (asymmetric only:
/// a shared HMAC secret in a JWKS file would be a password on disk).
pub const JWT_ALGORITHMS: [&str; 8] = [
    "RS256", "RS384", "RS512", "PS256", "PS384", "PS512", "ES256", "ES384",
];

impl super::Config {
    /// Structural checks of the security settings; files are read (and
    /// their errors reported with these same paths) at start-up.
    pub(super) fn validate_security(&self) -> Vec<(String, String)> {
        let mut errs = Vec::new();
        for (i, h) in self.hooks.iter().enumerate() {
            let p = format!("hooks[{i}]");
            let https = h.endpoint.starts_with("https://");
            if !https && h.tls != HookTls::default() {
                errs.push((
                    format!("{p}.tls"),
                    "only applies to https:// endpoints; change the endpoint to https:// or remove `tls`".into(),
                ));
            }
            if h.tls.cert_file.is_some() != h.tls.key_file.is_some() {
                errs.push((
                    format!("{p}.tls"),
                    "cert_file and key_file go together (the client certificate and its key)"
                        .into(),
                ));
            }
            if matches!(&h.tls.server_name, Some(n) if n.is_empty() || n.contains(['/', ' ', ':']))
            {
                errs.push((
                    format!("{p}.tls.server_name"),
                    "must be a DNS name or IP address, without scheme or port".into(),
                ));
            }
            let c = &h.credentials;
            if c.bearer_token_file.is_some() && c.bearer_token_env.is_some() {
                errs.push((
                    format!("{p}.credentials"),
                    "set one of bearer_token_file or bearer_token_env, not both".into(),
                ));
            }
            if let Some(why) = c
                .bearer_token_env
                .as_deref()
                .and_then(|v| super::secret_env::refused(v, "token"))
            {
                errs.push((format!("{p}.credentials.bearer_token_env"), why));
            }
        }

        if let Some(t) = &self.tls {
            match (t.client_auth, &t.client_ca_file) {
                (ClientAuth::None, Some(_)) => errs.push((
                    "tls.client_auth".into(),
                    "client_ca_file is set but client_auth is none; set client_auth: optional or required".into(),
                )),
                (ClientAuth::Optional | ClientAuth::Required, None) => errs.push((
                    "tls.client_ca_file".into(),
                    "required when client_auth is optional or required (the CA client certificates must chain to)".into(),
                )),
                _ => {}
            }
        }

        let a = &self.auth;
        let need = |errs: &mut Vec<(String, String)>, set: bool, field: &str, why: &str| {
            if !set {
                errs.push((format!("auth.{field}"), why.to_string()));
            }
        };
        let forbid = |errs: &mut Vec<(String, String)>, set: bool, field: &str, mode: &str| {
            if set {
                errs.push((
                    format!("auth.{field}"),
                    format!("only used with auth.mode: {mode}; remove it or change the mode"),
                ));
            }
        };
        let jwt = a.mode == AuthMode::Jwt;
        match a.mode {
            AuthMode::None | AuthMode::Mtls => {}
            AuthMode::Tokens => need(
                &mut errs,
                a.tokens_file.is_some(),
                "tokens_file",
                "required for auth.mode: tokens (a YAML file `tokens: [{principal, sha256, roles}]`, e.g. from a Secret)",
            ),
            AuthMode::Jwt => {
                need(&mut errs, a.jwks_file.is_some(), "jwks_file", "required for auth.mode: jwt (the issuer's JWKS as a file)");
                need(&mut errs, a.issuer.is_some(), "issuer", "required for auth.mode: jwt (tokens must name their issuer)");
                need(&mut errs, a.audience.is_some(), "audience", "required for auth.mode: jwt (tokens must be meant for hookwire)");
            }
        }
        if a.mode != AuthMode::Tokens {
            forbid(&mut errs, a.tokens_file.is_some(), "tokens_file", "tokens");
        }
        if !jwt {
            for (set, field) in [
                (a.jwks_file.is_some(), "jwks_file"),
                (a.issuer.is_some(), "issuer"),
                (a.audience.is_some(), "audience"),
                (!a.algorithms.is_empty(), "algorithms"),
                (a.leeway.is_some(), "leeway"),
                (a.principal_claim.is_some(), "principal_claim"),
                (a.roles_claim.is_some(), "roles_claim"),
            ] {
                forbid(&mut errs, set, field, "jwt");
            }
        }
        for (j, alg) in a.algorithms.iter().enumerate() {
            if !JWT_ALGORITHMS.contains(&alg.as_str()) {
                errs.push((
                    format!("auth.algorithms[{j}]"),
                    format!(
                        "unsupported algorithm `{alg}`; use one of {}",
                        JWT_ALGORITHMS.join(", ")
                    ),
                ));
            }
        }
        if a.mode == AuthMode::Mtls
            && !matches!(&self.tls, Some(t) if t.client_auth != ClientAuth::None)
        {
            errs.push((
                "auth.mode".into(),
                "mtls needs client certificates: set tls.client_auth: required (and tls.client_ca_file)".into(),
            ));
        }

        for (field, v) in [
            ("max_sessions", self.quotas.max_sessions),
            ("max_concurrent_runs", self.quotas.max_concurrent_runs),
            ("runs_per_minute", self.quotas.runs_per_minute),
        ] {
            if v == Some(0) {
                errs.push((
                    format!("quotas.{field}"),
                    "must be at least 1 (leave it out for no limit)".into(),
                ));
            }
        }
        errs
    }
}

#[cfg(test)]
mod tests {
    use crate::config::Config;

    const BASE: &str = "models: [{name: m, provider: scripted}]\nagents: [{name: a, model: m}]\n";

    fn err(extra: &str) -> (Option<String>, String) {
        let e = Config::parse(&format!("{BASE}{extra}"), "t.yaml").unwrap_err();
        (e.path().map(str::to_string), e.to_string())
    }

    #[test]
    fn security_settings_are_checked_with_their_paths() {
        for (yaml, path, words) in [
            ("auth: {mode: tokens}\n", "auth.tokens_file", "required for auth.mode: tokens"),
            ("auth: {mode: jwt, jwks_file: /k, issuer: i}\n", "auth.audience", "required for auth.mode: jwt"),
            ("auth: {mode: tokens, tokens_file: /t, issuer: i}\n", "auth.issuer", "only used with auth.mode: jwt"),
            ("auth: {mode: jwt, jwks_file: /k, issuer: i, audience: a, algorithms: [HS256]}\n", "auth.algorithms[0]", "unsupported algorithm `HS256`"),
            ("auth: {mode: mtls}\n", "auth.mode", "set tls.client_auth: required"),
            ("auth: {mode: basic}\n", "auth.mode", "unknown variant `basic`"),
            ("tls: {cert_file: c, key_file: k, client_auth: required}\n", "tls.client_ca_file", "required when client_auth"),
            ("tls: {cert_file: c, key_file: k, client_ca_file: ca}\n", "tls.client_auth", "set client_auth: optional or required"),
            ("hooks: [{name: h, endpoint: 'http://x:1', tls: {ca_file: ca}}]\n", "hooks[0].tls", "only applies to https://"),
            ("hooks: [{name: h, endpoint: 'https://x:1', tls: {cert_file: c}}]\n", "hooks[0].tls", "cert_file and key_file go together"),
            ("hooks: [{name: h, endpoint: 'https://x:1', credentials: {bearer_token_file: f, bearer_token_env: E}}]\n", "hooks[0].credentials", "not both"),
            ("quotas: {max_sessions: 0}\n", "quotas.max_sessions", "at least 1"),
        ] {
            let (p, msg) = err(yaml);
            assert_eq!(p.as_deref(), Some(path), "{yaml}: {msg}");
            assert!(msg.contains(words), "{yaml}: {msg}");
        }
    }

    #[test]
    fn a_full_security_config_parses() {
        let c = Config::parse(
            &format!(
                "{BASE}tls: {{cert_file: /c, key_file: /k, client_ca_file: /ca, client_auth: optional}}\n\
                 auth: {{mode: jwt, jwks_file: /j, issuer: https://i, audience: hookwire, leeway: 30s, algorithms: [ES256]}}\n\
                 quotas: {{max_sessions: 10, max_concurrent_runs: 2, runs_per_minute: 30}}\n\
                 hooks: [{{name: h, endpoint: 'https://h:1', tls: {{ca_file: /ca, cert_file: /c, key_file: /k, server_name: h.svc}}, credentials: {{bearer_token_env: HOOK_TOKEN}}}}]\n"
            ),
            "t",
        )
        .unwrap();
        assert_eq!(c.auth.leeway, Some(std::time::Duration::from_secs(30)));
        assert_eq!(c.agents[0].approver_roles, vec!["approver".to_string()]);
        assert_eq!(c.auth.forwarded_claims(), vec!["roles".to_string()]);
    }
}
