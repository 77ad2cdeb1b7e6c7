//! The `outbox-relay` binary: parses the command line, sets up logging, and runs the
//! library. Exit status: 0 after a clean shutdown, 1 on a runtime error that needs an
//! operator, 2 on invalid configuration.

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::process::ExitCode;

use clap::{Arg, ArgAction, Command};
use outbox_relay::config::{opt, Config, LogFormat, RawConfig};
use tokio_util::sync::CancellationToken;
use tracing::{error, info};

/// mimalloc: the hot path allocates small strings and maps per event (async-nats' header
/// maps); the profile showed glibc malloc at 29 % of the relay's instructions.
#[global_allocator]
static ALLOCATOR: mimalloc::MiMalloc = mimalloc::MiMalloc;

fn cli() -> Command {
    let mut command = Command::new("outbox-relay")
        .version(env!("CARGO_PKG_VERSION"))
        .about("Relays a Postgres transactional-outbox table into NATS JetStream through logical replication")
        .subcommand_required(true)
        .arg_required_else_help(true)
        .arg(
            Arg::new("config")
                .long("config")
                .value_name("FILE")
                .global(true)
                .help("TOML file with any of the options below (keys as the flags, with underscores) [env: OUTBOX_RELAY_CONFIG]"),
        )
        .subcommand(
            Command::new("run").about("Check and create what is missing, then relay events until SIGTERM/SIGINT").arg(
                Arg::new("no-create")
                    .long("no-create")
                    .action(ArgAction::SetTrue)
                    .help("Do not create the publication, slot or stream: fail if one is missing"),
            ),
        )
        .subcommand(Command::new("init").about("Check the database and create the publication, slot and stream, then exit"));
    for spec in opt::ALL {
        let flag: &'static str = Box::leak(spec.key.replace('_', "-").into_boxed_str());
        let mut help = format!("{} [env: {}]", spec.help, spec.env);
        if let Some(default) = spec.default {
            help.push_str(&format!(" [default: {default}]"));
        }
        command = command.arg(
            Arg::new(spec.key)
                .long(flag)
                .value_name("VALUE")
                .global(true)
                .help(help),
        );
    }
    command
}

fn main() -> ExitCode {
    let matches = cli().get_matches();
    let (subcommand, sub_matches) = matches.subcommand().expect("a subcommand is required");
    let mut flags = BTreeMap::new();
    for spec in opt::ALL {
        if let Some(value) = sub_matches
            .get_one::<String>(spec.key)
            .or_else(|| matches.get_one::<String>(spec.key))
        {
            flags.insert(spec.key, value.clone());
        }
    }
    let file = sub_matches
        .get_one::<String>("config")
        .or_else(|| matches.get_one::<String>("config"))
        .cloned()
        .or_else(|| std::env::var("OUTBOX_RELAY_CONFIG").ok())
        .map(PathBuf::from);
    let env_keys: Vec<String> = std::env::vars_os()
        .filter_map(|(k, _)| k.into_string().ok())
        .collect();
    let config = RawConfig::load(
        &flags,
        &|key| std::env::var(key).ok(),
        &env_keys,
        file.as_deref(),
    )
    .and_then(|raw| Config::from_sources(&raw));
    let mut config = match config {
        Ok(config) => config,
        Err(error) => {
            eprintln!("outbox-relay: configuration error: {error}");
            return ExitCode::from(2);
        }
    };
    if subcommand == "run" && sub_matches.get_flag("no-create") {
        config.create = false;
    }
    init_logging(config.log_format);
    // One TLS crypto provider for the whole process (Postgres and NATS connections alike).
    let _ = rustls::crypto::ring::default_provider().install_default();

    // One thread by default: the profile showed the relay's CPU per event dominated by
    // cross-thread hand-offs when Postgres and nats-server share the machine's cores.
    let runtime = if config.worker_threads == 1 {
        tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
    } else {
        tokio::runtime::Builder::new_multi_thread()
            .worker_threads(config.worker_threads)
            .enable_all()
            .build()
    };
    let runtime = match runtime {
        Ok(runtime) => runtime,
        Err(e) => {
            eprintln!("outbox-relay: cannot start the async runtime: {e}");
            return ExitCode::FAILURE;
        }
    };
    let result = runtime.block_on(async move {
        match subcommand {
            "init" => outbox_relay::pipeline::init(&config, false).await.map(|slot| {
                info!(confirmed_flush_lsn = %slot.confirmed_flush_lsn, "publication, slot and stream are ready");
            }),
            _ => {
                let shutdown = CancellationToken::new();
                let trigger = shutdown.clone();
                tokio::spawn(async move {
                    outbox_relay::pipeline::shutdown_signal().await;
                    trigger.cancel();
                });
                outbox_relay::run(config, shutdown).await
            }
        }
    });
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            error!(error = %e, "outbox-relay stopped");
            eprintln!("outbox-relay: {e}");
            ExitCode::from(e.exit_code())
        }
    }
}

fn init_logging(format: LogFormat) {
    let filter = tracing_subscriber::EnvFilter::try_from_default_env()
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info"));
    let builder = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr);
    match format {
        LogFormat::Text => builder.init(),
        LogFormat::Json => builder.json().init(),
    }
}
