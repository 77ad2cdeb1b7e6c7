//! A NATS operator set-up for the tests (decentralised JWT authentication): JWTs signed
//! with nkeys, an account's limits, a `.creds` file, and the server configuration that
//! preloads the accounts.

use std::time::{SystemTime, UNIX_EPOCH};

use base64::engine::general_purpose::URL_SAFE_NO_PAD;
use base64::Engine;
use nkeys::KeyPair;

/// A JWT of `nats` claims about `subject`, signed by `signer`.
pub fn jwt(signer: &KeyPair, subject: &str, name: &str, nats: serde_json::Value) -> String {
    static JTI: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
    let now = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .unwrap()
        .as_secs();
    let claims = serde_json::json!({
        "jti": format!("TESTJTI{}{}", std::process::id(), JTI.fetch_add(1, std::sync::atomic::Ordering::Relaxed)),
        "iat": now,
        "iss": signer.public_key(),
        "sub": subject,
        "name": name,
        "nats": nats,
    });
    let header = URL_SAFE_NO_PAD.encode(r#"{"typ":"JWT","alg":"ed25519-nkey"}"#);
    let payload = URL_SAFE_NO_PAD.encode(claims.to_string());
    let signed = format!("{header}.{payload}");
    let signature = signer.sign(signed.as_bytes()).unwrap();
    format!("{signed}.{}", URL_SAFE_NO_PAD.encode(signature))
}

/// An account JWT with everything unlimited but `payload` (the account's `max_payload`, -1:
/// none), JetStream too if `jetstream` (never for the system account).
pub fn account_jwt(
    operator: &KeyPair,
    account: &KeyPair,
    name: &str,
    jetstream: bool,
    payload: i64,
) -> String {
    let mut limits = serde_json::json!({
        "subs": -1, "data": -1, "payload": payload, "imports": -1, "exports": -1,
        "wildcards": true, "conn": -1, "leaf": -1
    });
    if jetstream {
        for key in ["mem_storage", "disk_storage", "streams", "consumer"] {
            limits[key] = (-1).into();
        }
    }
    jwt(
        operator,
        &account.public_key(),
        name,
        serde_json::json!({ "type": "account", "version": 2, "limits": limits }),
    )
}

/// A `.creds` file's text: the user's JWT (signed by `account`) and seed.
pub fn creds(account: &KeyPair, user: &KeyPair) -> String {
    let user_jwt = jwt(
        account,
        &user.public_key(),
        "relay",
        serde_json::json!({ "type": "user", "version": 2, "pub": {}, "sub": {}, "subs": -1, "data": -1, "payload": -1 }),
    );
    format!(
        "-----BEGIN NATS USER JWT-----\n{user_jwt}\n------END NATS USER JWT------\n\n\
         ************************* IMPORTANT *************************\n\
         NKEY Seed printed below can be used to sign and prove identity.\n\n\
         -----BEGIN USER NKEY SEED-----\n{}\n------END USER NKEY SEED------\n",
        user.seed().unwrap()
    )
}

/// An operator with a JetStream account (`max_payload` `payload`, -1: none) and a system
/// account: the server configuration (the operator JWT written to `dir`), and the account.
pub fn operator_config(dir: &std::path::Path, payload: i64) -> (String, KeyPair) {
    let operator = KeyPair::new_operator();
    let account = KeyPair::new_account();
    let system = KeyPair::new_account();
    let operator_jwt = jwt(
        &operator,
        &operator.public_key(),
        "test-operator",
        serde_json::json!({ "type": "operator", "version": 2, "system_account": system.public_key() }),
    );
    let operator_file = dir.join("operator.jwt");
    std::fs::write(&operator_file, operator_jwt).unwrap();
    let config = format!(
        "operator: {operator_file:?}\nsystem_account: {sys}\nresolver: MEMORY\nresolver_preload: {{\n  {acc}: {acc_jwt:?}\n  {sys}: {sys_jwt:?}\n}}\n",
        sys = system.public_key(),
        acc = account.public_key(),
        acc_jwt = account_jwt(&operator, &account, "APP", true, payload),
        sys_jwt = account_jwt(&operator, &system, "SYS", false, -1),
    );
    (config, account)
}
