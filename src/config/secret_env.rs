//! Settings that name the environment variable holding a secret
//! (`api_key_env`, `bearer_token_env`, `password_env`).
//!
//! The file never holds the secret, but an operator may paste it into such
//! a setting by mistake. The name is then quoted by later errors ("`…` is
//! not set", on stderr and in `config check`), so a value that cannot be a
//! variable's name is refused here without being repeated. API keys, JWTs
//! and base64 tokens hold `-`, `.`, `+`, `/` or `=`, which names do not.

/// Why `value` cannot name an environment variable, or `None` when it can:
/// letters, digits and `_`, not starting with a digit (POSIX's portable
/// names, what every shell and Kubernetes accept). The message does not
/// quote the value.
pub(super) fn refused(value: &str, what: &str) -> Option<String> {
    let mut chars = value.chars();
    let ok = chars
        .next()
        .is_some_and(|c| c.is_ascii_alphabetic() || c == '_')
        && chars.all(|c| c.is_ascii_alphanumeric() || c == '_');
    (!ok).then(|| {
        format!(
            "must name an environment variable (letters, digits and _, not starting with a digit), e.g. MY_APP_TOKEN; the value is not shown: if it is the {what} itself, remove it from the file (it never goes there)"
        )
    })
}

/// `var` as later errors may quote it ("… is not set"): a conventional
/// name (capitals, digits and `_`) as it is; any other name passes
/// [`refused`] too, a secret of letters and digits among them (a token made
/// with `base64 | tr -d '/+='` is one), so it is not repeated.
pub fn shown(var: &str) -> String {
    let conventional = var
        .chars()
        .all(|c| c.is_ascii_uppercase() || c.is_ascii_digit() || c == '_');
    if conventional {
        format!("`{var}`")
    } else {
        "(name not shown: it has lower-case letters, as a pasted secret would)".into()
    }
}

#[cfg(test)]
mod tests {
    use super::{refused, shown};

    #[test]
    fn conventional_names_are_shown_and_others_are_not() {
        assert_eq!(shown("HOOKWIRE_HOOK_TOKEN"), "`HOOKWIRE_HOOK_TOKEN`");
        assert!(!shown("Zm9vYmFyYmF6cXV4SECRET").contains("SECRET"));
        assert!(!shown("pg_password2").contains("pg_password2"));
    }

    #[test]
    fn names_pass_and_secrets_are_refused_without_being_quoted() {
        for name in ["OPENAI_API_KEY", "_X", "pg_password2"] {
            assert_eq!(refused(name, "key"), None, "{name}");
        }
        for value in [
            "",
            " ",
            "2FA",
            "sk-proj-SECRET123",
            "eyJhbGciOi.eyJzdWIiOi.SECRET",
            "c2VjcmV0+/SECRET==",
            "hunter 2",
        ] {
            let e = refused(value, "key").expect(value);
            assert!(e.contains("the key itself"), "{e}");
            assert!(!e.contains("SECRET") && !e.contains("hunter"), "{e}");
        }
    }
}
