//! The `outbox-relay` binary: parses the command line, sets up logging, and runs the
//! library. Exit status: 0 after a clean shutdown, 1 on a runtime error that needs an
//! operator, 2 on invalid configuration. `outbox-relay config` prints the effective
//! configuration and where each value came from, secrets redacted, and exits.
//! `outbox-relay status` prints the state of the slot, publication, lease and stream
//! (`outbox_relay::commands::status`) and exits 0 healthy, 3 lagging, 4 broken, or 1 when it cannot
//! read the state (1 and 2 keep their meaning for every command). `outbox-relay verify`
//! reconciles the table with the stream (`outbox_relay::commands::verify`) and exits 0 when they
//! agree, 5 when it found discrepancies, 1 when it cannot read either side.
//! `outbox-relay probe [PATH]` asks a running relay's health endpoint (`--metrics-addr`)
//! and exits 0 on 200 OK, 1 otherwise (a container's HEALTHCHECK has no curl).

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::process::ExitCode;

use clap::{Arg, ArgAction, Command};
use outbox_relay::config::{self, opt, Config, MetricsConfig, RawConfig};
use outbox_relay::observe::logging;
use tokio_util::sync::CancellationToken;
use tracing::{error, info, warn};

/// mimalloc: the hot path allocates small strings and maps per event (async-nats' header
/// maps); the profile showed glibc malloc at 29 % of the relay's instructions.
#[global_allocator]
static ALLOCATOR: mimalloc::MiMalloc = mimalloc::MiMalloc;

/// Transparent huge pages off for this process. With them, each 2 MiB region mimalloc
/// touches again after returning it is faulted in whole and zeroed by the kernel: on the
/// drain with ~250-byte payloads that zeroing was 6 % of the relay's samples (1.5 % without
/// them), and its peak RSS is 24 MiB without them against 38 with; its CPU per event did not
/// move measurably (docs/performance.md, "Transparent huge pages"). The relay's heap is tens
/// of MiB: huge pages' TLB gain does not pay for that. A kernel without the setting (before
/// 3.15) refuses it, and the relay runs as before.
fn no_transparent_huge_pages() {
    #[cfg(target_os = "linux")]
    let _ = rustix::thread::disable_transparent_huge_pages(true);
}

/// `outbox-relay status --help`: what each exit status means.
const STATUS_EXIT_CODES: &str = "\
Exit status:
  0  healthy (warnings may be listed)
  3  lagging: slot lag above --max-lag-bytes, the slot's WAL beyond max_wal_size (wal_status
     extended or unreserved), no relay holds the lease, the relay holding it is not streaming,
     or with --failover-slot no standby holds a copy of the slot a promotion would keep
  4  broken: slot, publication or stream missing; slot lost; the start-up checks refuse the
     table, publication, slot or stream; a discard-new stream that is full; the slot read by a
     program that holds no lease
  1  the state could not be read (Postgres or NATS unreachable, a query failed) and nothing
     read is broken
  2  invalid configuration";

/// `outbox-relay verify --help`: what each exit status means.
const VERIFY_EXIT_CODES: &str = "\
Exit status:
  0  every row in range has exactly one matching message, in commit order (dead-lettered rows,
     listed, do not count as discrepancies; rows left out by design when the slot was created,
     with --backfill pending those already published, are counted on one line, not checked)
  5  discrepancies: missing, duplicated, mismatched, out-of-order, unexpected or unpublishable
     events, each listed by outbox id
  1  the table or the stream could not be read
  2  invalid arguments or configuration";

fn id_arg(name: &'static str, help: &'static str) -> Arg {
    Arg::new(name).long(name).value_name("ID").help(help)
}

fn time_arg(name: &'static str, help: &'static str) -> Arg {
    Arg::new(name).long(name).value_name("TIME").help(help)
}

/// The range flags of `verify` and `replay`.
fn range_args(command: Command) -> Command {
    command
        .arg(id_arg("from-id", "Rows with id >= ID"))
        .arg(id_arg("to-id", "Rows with id <= ID"))
        .arg(time_arg(
            "since",
            "Rows with created_at >= TIME (a timestamp, or a duration ago: 6h)",
        ))
        .arg(time_arg(
            "until",
            "Rows with created_at < TIME (a timestamp, or a duration ago)",
        ))
        .arg(
            Arg::new("entity")
                .long("entity")
                .value_name("ENTITY_ID")
                .help("Rows of this entity_id only"),
        )
}

fn range_of(matches: &clap::ArgMatches) -> outbox_relay::commands::verify::Range {
    outbox_relay::commands::verify::Range {
        from_id: matches.get_one::<String>("from-id").cloned(),
        to_id: matches.get_one::<String>("to-id").cloned(),
        since: matches.get_one::<String>("since").cloned(),
        until: matches.get_one::<String>("until").cloned(),
        entity: matches.get_one::<String>("entity").cloned(),
    }
}

fn cli() -> Command {
    with_options(commands(), false)
}

/// The command line with every option (`config::opt`) on the top level and each command;
/// `root_options_shown`: the top level's help lists them all (the man page's), else it lists
/// the commands and says where each one's options are.
fn with_options(mut command: Command, root_options_shown: bool) -> Command {
    let names: Vec<String> = command
        .get_subcommands()
        .map(|sub| sub.get_name().to_owned())
        .collect();
    for name in names {
        command = command.mut_subcommand(&name, |mut sub| {
            for spec in opt::ALL {
                sub = sub.arg(option_arg(spec).hide(!shows(&name, spec.key)));
            }
            sub
        });
    }
    // Before the command too (`outbox-relay --config f --stream S run`), as before; the
    // command's own help lists them.
    for spec in opt::ALL {
        command = command.arg(option_arg(spec).hide(!root_options_shown));
    }
    command
}

/// The commands and their own flags: the declarative table of the command line.
fn commands() -> Command {
    Command::new("outbox-relay")
        .version(env!("CARGO_PKG_VERSION"))
        // Help wraps at the terminal's width, and at 100 columns at most (or when piped).
        .max_term_width(HELP_WIDTH)
        .about("Relays a Postgres transactional-outbox table into NATS JetStream through logical replication")
        .subcommand_required(true)
        .arg_required_else_help(true)
        .after_help(
            "Each command's options: outbox-relay <COMMAND> --help. Every option, with its \
             environment variable and file key: docs/configuration.md, or outbox-relay man.",
        )
        .arg(
            Arg::new("config")
                .long("config")
                .value_name("FILE")
                .global(true)
                .help("TOML file with any option by its file key (docs/configuration.md) [env: OUTBOX_RELAY_CONFIG]"),
        )
        .subcommand(
            Command::new("run").about("Check and create what is missing, then relay events until SIGTERM/SIGINT").arg(
                Arg::new("no-create")
                    .long("no-create")
                    .action(ArgAction::SetTrue)
                    .help("Do not create the publication, slot or stream: fail if one is missing"),
            ),
        )
        .subcommand(Command::new("init").about("Check the database and create the publication, slot and stream (creating the slot, backfill as --backfill says: pending rows by default), then exit"))
        .subcommand(
            Command::new("backfill")
                .about("Publish the rows of the current table in an id or time range, with the same keys as streamed events, on an existing slot and stream; JetStream drops a row it holds within the duplicate window; refused into a strict stream without --force (docs/migration.md)")
                .arg(id_arg("from-id", "Rows with id >= ID"))
                .arg(id_arg("to-id", "Rows with id <= ID"))
                .arg(Arg::new("since").long("since").value_name("TIME").help("Rows with created_at >= TIME (a timestamp, e.g. 2026-01-31T00:00:00Z, or a duration ago: 6h)"))
                .arg(Arg::new("until").long("until").value_name("TIME").help("Rows with created_at < TIME"))
                .arg(Arg::new("force").long("force").action(ArgAction::SetTrue).help("Publish into a strict stream too (appends old rows after newer events)")),
        )
        .subcommand(
            Command::new("status")
                .about("Print the state of the slot, publication, lease, stream and its last event, and what is wrong; exit 0 healthy, 3 lagging, 4 broken, 1 cannot read the state")
                .after_help(STATUS_EXIT_CODES)
                .arg(
                    Arg::new("json")
                        .long("json")
                        .action(ArgAction::SetTrue)
                        .help("Print JSON for scripts instead of the table"),
                ),
        )
        .subcommand(
            range_args(Command::new("verify")
                .about("Reconcile the outbox table with the stream: list missing, duplicated, mismatched and out-of-order events by outbox id; exit 0 consistent, 5 discrepancies, 1 cannot read")
                .after_help(VERIFY_EXIT_CODES))
                .arg(
                    Arg::new("max-listed")
                        .long("max-listed")
                        .value_name("N")
                        .value_parser(clap::value_parser!(usize))
                        .default_value("100")
                        .help("List at most N problems of each kind (the summary counts them all)"),
                ),
        )
        .subcommand(
            range_args(Command::new("replay").about(
                "Re-publish a range of outbox rows with the relay's subjects, keys and headers, and say what the stream stored (copies inside its duplicate window are not stored again); refuses a strict-mode stream without --force",
            ))
            .arg(
                Arg::new("force")
                    .long("force")
                    .action(ArgAction::SetTrue)
                    .help("Replay into a strict-mode stream: copies past the duplicate window are stored again, out of commit order, and a running relay re-syncs"),
            ),
        )
        .subcommand(
            Command::new("probe")
                .about("Ask the running relay's health endpoint on --metrics-addr (for a container HEALTHCHECK): print the answer, exit 0 on 200 OK, 1 otherwise")
                .arg(
                    Arg::new("path")
                        .default_value("/readyz")
                        .help("/readyz (holds the lease, streams, NATS connected, lag under --max-lag-bytes), /healthz (the process serves) or /metrics"),
                ),
        )
        .subcommand(Command::new("config").about("Print the effective configuration and where each value came from (flag, environment, file, default), secrets as <redacted>, then exit"))
        .subcommand(
            Command::new("completions")
                .about("Print a shell completion script (e.g. outbox-relay completions bash > /etc/bash_completion.d/outbox-relay)")
                .arg(
                    Arg::new("shell")
                        .required(true)
                        .value_parser(clap::value_parser!(clap_complete::Shell))
                        .help("bash, zsh, fish, elvish or powershell"),
                ),
        )
        .subcommand(Command::new("man").about("Print the man page (roff), e.g. outbox-relay man > /usr/share/man/man1/outbox-relay.1"))
}

/// The flag of an option: its help says its environment variable and default.
fn option_arg(spec: &outbox_relay::config::OptionSpec) -> Arg {
    let flag: &'static str = Box::leak(spec.long().into_boxed_str());
    let mut help = format!("{} [env: {}]", spec.help, spec.env);
    if let Some(default) = spec.default {
        help.push_str(&format!(" [default: {default}]"));
    }
    let arg = Arg::new(spec.key)
        .long(flag)
        .value_name("VALUE")
        .help_heading(heading(spec.key))
        .help(help);
    if spec.is_switch() {
        // `--mark-published` alone means true; `--mark-published false` still parses.
        arg.num_args(0..=1).default_missing_value("true")
    } else {
        arg
    }
}

/// Whether `subcommand`'s help lists the option `key`: the options it reads. Every command
/// accepts every option (a script's flags keep parsing; a config file or the environment
/// sets them all anyway); the others are left out of its help.
fn shows(subcommand: &str, key: &str) -> bool {
    let connects = matches!(
        heading(key),
        "Servers"
            | "NATS authentication and TLS"
            | "The outbox table"
            | "Slot, publication and stream"
    );
    match subcommand {
        "run" | "init" | "config" => true,
        "backfill" | "replay" => connects || heading(key) == "Publishing" || key == "log_format",
        "status" => connects || matches!(key, "max_lag_bytes" | "log_format"),
        "verify" => connects || key == "log_format",
        "probe" => key == "metrics_addr",
        _ => false,
    }
}

/// The widest help text line, in columns.
const HELP_WIDTH: usize = 100;

/// The heading an option's help stands under: options grouped as docs/configuration.md
/// explains them.
fn heading(key: &str) -> &'static str {
    match key {
        "database_url" | "primary_url" | "nats_url" => "Servers",
        key if key.starts_with("nats_") => "NATS authentication and TLS",
        "table"
        | "table_preset"
        | "header_columns"
        | "trace_context_column"
        | "subject_template"
        | "include_event_types"
        | "exclude_event_types" => "The outbox table",
        key if key.ends_with("_column") => "The outbox table",
        "slot" | "publication" | "stream" | "subject_prefix" | "partitions" | "shared_stream"
        | "failover_slot" => "Slot, publication and stream",
        key if key.starts_with("stream_") => "Slot, publication and stream",
        "max_in_flight"
        | "duplicate_window"
        | "ack_timeout"
        | "on_poison"
        | "atomic_transactions"
        | "fast_ingest"
        | "cloudevents"
        | "cloudevents_source" => "Publishing",
        "backfill" | "mark_published" => "Backfill, marking and retention",
        key if key.starts_with("retention_") => "Backfill, marking and retention",
        _ => "Process and observability",
    }
}

fn main() -> ExitCode {
    no_transparent_huge_pages();
    let matches = cli().get_matches();
    let (subcommand, sub_matches) = matches.subcommand().expect("a subcommand is required");
    if let Some(exit) = print_generated(subcommand, sub_matches) {
        return exit;
    }
    let raw = load_raw(&matches, sub_matches);
    if subcommand == "probe" {
        let path = sub_matches
            .get_one::<String>("path")
            .map_or("/readyz", String::as_str);
        return probe(raw.ok().as_ref(), path);
    }
    let loaded = raw.and_then(|raw| Config::from_sources(&raw).map(|config| (raw, config)));
    let (raw, mut config) = match loaded {
        Ok(loaded) => loaded,
        Err(error) => {
            eprintln!("outbox-relay: configuration error: {error}");
            return ExitCode::from(2);
        }
    };
    logging::register_secrets(config.secrets(), &config.user_names());
    if subcommand == "config" {
        print!("{}", logging::scrub(&config::effective(&raw, &config)));
        return ExitCode::SUCCESS;
    }
    if subcommand == "run" && sub_matches.get_flag("no-create") {
        config.create = false;
    }
    // `status` prints its report on stdout; its log (stderr) says only what went wrong.
    let default_filter = if matches!(subcommand, "status" | "verify" | "replay") {
        "warn"
    } else {
        "info"
    };
    logging::init(config.log_format, default_filter);
    for warning in &config.warnings {
        warn!("{warning}");
    }
    // One TLS crypto provider for the whole process (Postgres and NATS connections alike).
    let _ = rustls::crypto::ring::default_provider().install_default();
    let runtime = match runtime(config.worker_threads) {
        Ok(runtime) => runtime,
        Err(e) => {
            eprintln!("outbox-relay: cannot start the async runtime: {e}");
            return ExitCode::FAILURE;
        }
    };
    match subcommand {
        "status" => status(&runtime, &config, sub_matches),
        "verify" => verify(&runtime, &config, sub_matches),
        "replay" => replay(&runtime, &config, sub_matches),
        _ => process(&runtime, subcommand, sub_matches, config),
    }
}

/// `completions` and `man`: generated from the command line's definition, no configuration
/// needed. `None` for the other subcommands.
fn print_generated(subcommand: &str, sub_matches: &clap::ArgMatches) -> Option<ExitCode> {
    let mut generated = Vec::new();
    match subcommand {
        "completions" => {
            if let Some(&shell) = sub_matches.get_one::<clap_complete::Shell>("shell") {
                clap_complete::generate(shell, &mut cli(), "outbox-relay", &mut generated);
            }
        }
        "man" => {
            if let Err(e) =
                clap_mangen::Man::new(with_options(commands(), true)).render(&mut generated)
            {
                eprintln!("outbox-relay man: {e}");
                return Some(ExitCode::FAILURE);
            }
        }
        _ => {}
    }
    if generated.is_empty() {
        return None;
    }
    use std::io::Write as _;
    // A reader that stops early (`| head`) is no error.
    let _ = std::io::stdout().write_all(&generated);
    Some(ExitCode::SUCCESS)
}

/// The raw configuration: the flags (the subcommand's over the top level's), the
/// environment and the config file (`--config`, `OUTBOX_RELAY_CONFIG`).
fn load_raw(
    matches: &clap::ArgMatches,
    sub_matches: &clap::ArgMatches,
) -> Result<RawConfig, config::ConfigError> {
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
    RawConfig::load(
        &flags,
        &|key| std::env::var(key).ok(),
        &env_keys,
        file.as_deref(),
    )
}

/// The async runtime, `worker_threads` wide.
fn runtime(worker_threads: usize) -> std::io::Result<tokio::runtime::Runtime> {
    // One thread by default: the profile showed the relay's CPU per event dominated by
    // cross-thread hand-offs when Postgres and nats-server share the machine's cores.
    if worker_threads == 1 {
        tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
    } else {
        tokio::runtime::Builder::new_multi_thread()
            .worker_threads(worker_threads)
            .enable_all()
            .build()
    }
}

/// `outbox-relay status`: the report on stdout (text or `--json`), its exit status.
fn status(
    runtime: &tokio::runtime::Runtime,
    config: &Config,
    sub_matches: &clap::ArgMatches,
) -> ExitCode {
    let status = runtime.block_on(outbox_relay::commands::status::gather(config));
    let text = if sub_matches.get_flag("json") {
        match serde_json::to_string_pretty(&status) {
            Ok(json) => json + "\n",
            Err(e) => {
                eprintln!("outbox-relay: cannot write the status as JSON: {e}");
                return ExitCode::FAILURE;
            }
        }
    } else {
        outbox_relay::commands::status::render(&status)
    };
    print!("{}", logging::scrub(&text));
    ExitCode::from(status.exit_code)
}

/// `outbox-relay verify`: the report on stdout, its exit status (VER5).
fn verify(
    runtime: &tokio::runtime::Runtime,
    config: &Config,
    sub_matches: &clap::ArgMatches,
) -> ExitCode {
    let range = range_of(sub_matches);
    let max_listed = sub_matches
        .get_one::<usize>("max-listed")
        .copied()
        .unwrap_or(100);
    let result = runtime.block_on(outbox_relay::commands::verify::run(config, range));
    print_report("verify", result, |report| {
        (
            report.render(max_listed),
            ExitCode::from(report.exit_code()),
        )
    })
}

/// `outbox-relay replay`: the report on stdout.
fn replay(
    runtime: &tokio::runtime::Runtime,
    config: &Config,
    sub_matches: &clap::ArgMatches,
) -> ExitCode {
    let force = sub_matches.get_flag("force");
    let result = runtime.block_on(outbox_relay::commands::replay::run(
        config,
        range_of(sub_matches),
        force,
    ));
    print_report("replay", result, |report| {
        (report.render(), ExitCode::SUCCESS)
    })
}

/// A one-shot command's report on stdout with its exit status (`report` says both), or its
/// error, scrubbed, on stderr with the error's exit status.
fn print_report<R>(
    command: &str,
    result: outbox_relay::error::Result<R>,
    report: impl FnOnce(R) -> (String, ExitCode),
) -> ExitCode {
    match result {
        Ok(done) => {
            let (text, exit) = report(done);
            print!("{text}");
            exit
        }
        Err(e) => {
            eprintln!("outbox-relay {command}: {}", logging::scrub(&e.to_string()));
            ExitCode::from(e.exit_code())
        }
    }
}

/// `init`, `backfill` and `run` (the streaming process, until a signal): their error is
/// logged and printed, its exit status returned.
fn process(
    runtime: &tokio::runtime::Runtime,
    subcommand: &str,
    sub_matches: &clap::ArgMatches,
    config: Config,
) -> ExitCode {
    let log_format = config.log_format;
    let result = runtime.block_on(async move {
        match subcommand {
            "init" => outbox_relay::commands::init::run(&config).await.map(|slot| {
                info!(confirmed_flush_lsn = %slot.confirmed_flush_lsn, "publication, slot and stream are ready");
            }),
            "backfill" => backfill(&config, sub_matches).await,
            _ => {
                let shutdown = CancellationToken::new();
                let trigger = shutdown.clone();
                tokio::spawn(async move {
                    outbox_relay::process::pipeline::shutdown_signal().await;
                    trigger.cancel();
                });
                outbox_relay::run(config, shutdown).await
            }
        }
    });
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            // One line, once: the plain line a terminal or journal reads, or the JSON record a
            // log pipeline parses.
            match log_format {
                config::LogFormat::Json => error!(error = %e, "outbox-relay stopped"),
                config::LogFormat::Text => {
                    eprintln!("outbox-relay: {}", logging::scrub(&e.to_string()))
                }
            }
            ExitCode::from(e.exit_code())
        }
    }
}

/// `outbox-relay backfill`: the range given, its figures logged and printed.
async fn backfill(
    config: &Config,
    sub_matches: &clap::ArgMatches,
) -> outbox_relay::error::Result<()> {
    let filter = outbox_relay::commands::backfill::Filter {
        pending_only: false,
        from_id: sub_matches.get_one::<String>("from-id").cloned(),
        to_id: sub_matches.get_one::<String>("to-id").cloned(),
        since: sub_matches.get_one::<String>("since").cloned(),
        until: sub_matches.get_one::<String>("until").cloned(),
    };
    let force = sub_matches.get_flag("force");
    outbox_relay::commands::backfill::range(config, &filter, force).await.map(|report| {
        info!(read = report.read, published = report.published, duplicates = report.duplicates, "backfill done");
        println!(
            "backfill: {} rows read, {} published, {} dropped by JetStream as duplicates (already in the stream within its duplicate window)",
            report.read, report.published, report.duplicates
        );
    })
}

/// `outbox-relay probe PATH`: GET `PATH` from the relay's metrics address; exit 0 on 200 OK,
/// 1 on anything else (Docker reads no other status).
fn probe(raw: Option<&RawConfig>, path: &str) -> ExitCode {
    let addr = match raw.map(MetricsConfig::from_raw) {
        Some(Ok(MetricsConfig {
            addr: Some(addr), ..
        })) => addr,
        Some(Ok(_)) => {
            eprintln!("outbox-relay probe: no metrics address to ask: set OUTBOX_RELAY_METRICS_ADDR, --metrics-addr or the file key metrics_addr as for the relay itself");
            return ExitCode::FAILURE;
        }
        Some(Err(error)) => {
            eprintln!("outbox-relay probe: configuration error: {error}");
            return ExitCode::FAILURE;
        }
        None => {
            eprintln!("outbox-relay probe: the configuration cannot be read (run `outbox-relay config` to see why)");
            return ExitCode::FAILURE;
        }
    };
    let answer = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .map_err(|e| format!("cannot start the async runtime: {e}"))
        .and_then(|runtime| {
            runtime.block_on(outbox_relay::observe::http::get(
                addr,
                path,
                std::time::Duration::from_secs(5),
            ))
        });
    match answer {
        Ok((200, body)) => {
            print!("{body}");
            ExitCode::SUCCESS
        }
        Ok((status, body)) => {
            print!("{body}");
            eprintln!("outbox-relay probe: {path} answered {status}");
            ExitCode::FAILURE
        }
        Err(error) => {
            eprintln!("outbox-relay probe: {error}");
            ExitCode::FAILURE
        }
    }
}

/// docs/configuration.md, rendered from [`cli`] (flags, commands) and `config::opt` (the
/// environment variable, file key, default and meaning of each flag).
#[cfg(test)]
fn configuration_doc(command: &Command) -> String {
    use outbox_relay::config::OptionSpec;
    let cell = |text: &str| text.replace('|', "\\|");
    let mut doc = String::from(
        "# Configuration\n\n\
         <!-- Generated from the command line's definition (`cli()` in crates/relay/src/main.rs and\n\
         \x20    `config::opt`) by a test that fails when this file differs; do not edit it by hand.\n\
         \x20    Regenerate: UPDATE_DOCS=1 cargo test -p outbox-relay --bin outbox-relay configuration_doc -->\n\n\
         Every option is a command-line flag, an environment variable and a key of the TOML file\n\
         given with `--config` (or `OUTBOX_RELAY_CONFIG`). Precedence: flag > environment > file >\n\
         default; the `nats` CLI's own variables (`NATS_USER`, `NATS_PASSWORD`, `NATS_CREDS`,\n\
         `NATS_NKEY`, `NATS_CA`, `NATS_CERT`, `NATS_KEY`) count too, below the file. Durations\n\
         read as `90s`, `2min`, `1h30m` or `7d` (a bare number is seconds). An example file with\n\
         every key: [deploy/outbox-relay.example.toml](../deploy/outbox-relay.example.toml). An unknown `OUTBOX_RELAY_*` variable or file key and an invalid value stop the\n\
         relay at start with a message naming them (exit 2). Secrets are never printed. A yes/no\n\
         option given as a bare flag means `true` (`--mark-published`; `--mark-published false`\n\
         works too).\n\n\
         ## Commands\n\n| command | flags of its own | does |\n|---|---|---|\n",
    );
    for sub in command.get_subcommands() {
        let flags: Vec<String> = sub
            .get_arguments()
            .filter(|arg| !arg.is_global_set() && !opt::ALL.iter().any(|s| s.key == arg.get_id()))
            .filter_map(|arg| {
                arg.get_long().map(|long| {
                    format!(
                        "`--{long}`: {}",
                        arg.get_help().map(|h| h.to_string()).unwrap_or_default()
                    )
                })
            })
            .collect();
        doc.push_str(&format!(
            "| `outbox-relay {}` | {} | {} |\n",
            sub.get_name(),
            cell(&flags.join("; ")),
            cell(&sub.get_about().map(|a| a.to_string()).unwrap_or_default())
        ));
    }
    doc.push_str(
        "\n## Options\n\n| flag | environment variable | file key | default | meaning |\n|---|---|---|---|---|\n",
    );
    let mut documented: Vec<&OptionSpec> = Vec::new();
    for arg in command.get_arguments() {
        let Some(long) = arg.get_long() else { continue };
        if arg.get_id() == "config" {
            doc.push_str(&format!(
                "| `--config` | `OUTBOX_RELAY_CONFIG` | | | {} |\n",
                cell("The TOML file with any of the options below, by file key")
            ));
            continue;
        }
        let spec = opt::ALL
            .iter()
            .find(|spec| spec.key == arg.get_id().as_str())
            .unwrap_or_else(|| panic!("--{long} is not an option of config::opt: document it"));
        documented.push(spec);
        let mut meaning = spec.help.to_owned();
        if spec.is_secret() {
            meaning.push_str(if spec.key.ends_with("_url") {
                " (credentials in it are never printed)"
            } else {
                " (a secret: never printed)"
            });
        }
        doc.push_str(&format!(
            "| `--{long}` | `{}` | `{}` | {} | {} |\n",
            spec.env,
            spec.key,
            spec.default.map(|d| format!("`{d}`")).unwrap_or_else(|| {
                if spec.key == opt::DATABASE_URL.key {
                    "required".into()
                } else {
                    String::new()
                }
            }),
            cell(&meaning)
        ));
    }
    for spec in opt::ALL {
        assert!(
            documented.iter().any(|d| d.key == spec.key),
            "option {} has no flag on the command line",
            spec.key
        );
    }
    doc
}

/// deploy/outbox-relay.example.toml, rendered from `config::opt`: every key, commented out,
/// with its meaning, environment variable and default.
#[cfg(test)]
fn example_toml() -> String {
    let mut out = String::from(
        "# outbox-relay's configuration file: outbox-relay run --config FILE (or OUTBOX_RELAY_CONFIG).\n\
         # Generated from the command line's definition (`config::opt`) by a test that fails when\n\
         # this file differs; do not edit it by hand. Regenerate:\n\
         #   UPDATE_DOCS=1 cargo test -p outbox-relay --bin outbox-relay example_toml\n\
         #\n\
         # Every key is commented out with its default; database_url is the one key without one.\n\
         # Precedence: flag > environment variable > this file > the nats CLI's NATS_* variables >\n\
         # default. Keep the file readable only by the relay's user if it holds a secret.\n",
    );
    for spec in opt::ALL {
        out.push('\n');
        let mut line = String::from("#");
        for word in spec.help.split_whitespace() {
            if line.len() + word.len() + 1 > 96 {
                out.push_str(&line);
                out.push('\n');
                line = String::from("#");
            }
            line.push(' ');
            line.push_str(word);
        }
        out.push_str(&line);
        out.push('\n');
        out.push_str(&format!(
            "# (flag --{}, environment {})\n",
            spec.long(),
            spec.env
        ));
        let value = spec.default.unwrap_or("");
        out.push_str(&format!(
            "# {} = {}\n",
            spec.key,
            toml::Value::String(value.to_owned())
        ));
    }
    out
}

/// Every `outbox-relay <command> --option` written in `text`: (command, option) pairs, for
/// the test that keeps the docs' commands runnable.
#[cfg(test)]
fn commands_in(text: &str) -> Vec<(String, String)> {
    let mut found = Vec::new();
    for line in text.lines() {
        for (at, _) in line.match_indices("outbox-relay ") {
            let rest = &line[at + "outbox-relay ".len()..];
            let end = rest
                .find(['`', '#', '|', ';', '&', ')', '\'', '"'])
                .unwrap_or(rest.len());
            let mut words = rest[..end].split_whitespace();
            let Some(command) = words.next() else {
                continue;
            };
            for word in words {
                if let Some(option) = word.strip_prefix("--") {
                    let option = option.split('=').next().unwrap_or(option);
                    found.push((
                        command.to_owned(),
                        option.trim_end_matches([',', '.']).to_owned(),
                    ));
                }
            }
        }
    }
    found
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]

    use super::*;

    /// `--help` of the command and of every subcommand fits in [`HELP_WIDTH`] columns, its
    /// options under their headings (issue 40).
    #[test]
    fn every_help_fits_in_100_columns() {
        let mut command = cli();
        command.build();
        let mut helps = vec![("outbox-relay".to_owned(), command.render_long_help())];
        for sub in command.get_subcommands_mut() {
            helps.push((sub.get_name().to_owned(), sub.render_long_help()));
        }
        assert!(helps.len() > 10, "every subcommand");
        for (name, help) in helps {
            let help = help.to_string();
            for line in help.lines() {
                assert!(
                    line.chars().count() <= HELP_WIDTH,
                    "{name} --help has a line of {} columns: {line}",
                    line.chars().count()
                );
            }
            if matches!(name.as_str(), "run" | "init" | "config") {
                for heading in [
                    "Servers:",
                    "NATS authentication and TLS:",
                    "The outbox table:",
                    "Publishing:",
                    "Process and observability:",
                ] {
                    assert!(help.contains(heading), "{name} --help: {heading}\n{help}");
                }
            }
        }
    }

    /// Each command's help lists the options it reads and no other (issue 40), the top
    /// level's none but says where they are; every command still accepts every option, where
    /// it always did.
    #[test]
    fn a_command_shows_only_its_own_options_and_accepts_the_rest() {
        let mut command = cli();
        command.build();
        let help = |name: &str| {
            let mut command = cli();
            command.build();
            let sub = command.find_subcommand_mut(name).unwrap();
            sub.render_long_help().to_string()
        };
        let root = command.render_long_help().to_string();
        assert!(!root.contains("--database-url"), "{root}");
        assert!(root.contains("outbox-relay <COMMAND> --help"), "{root}");
        // (command, options its help lists, options it leaves out)
        let expected: [(&str, &[&str], &[&str]); 6] = [
            ("probe", &["--metrics-addr"], &["--database-url"]),
            (
                "status",
                &["--max-lag-bytes", "--stream"],
                &["--retention-batch", "--fast-ingest"],
            ),
            ("verify", &["--table"], &["--metrics-addr"]),
            ("run", &["--retention-batch", "--cloudevents"], &[]),
            ("completions", &[], &["--database-url"]),
            ("man", &[], &["--database-url"]),
        ];
        for (name, shown, left_out) in expected {
            let text = help(name);
            for option in shown {
                assert!(
                    text.contains(option),
                    "{name} --help lacks {option}:\n{text}"
                );
            }
            for option in left_out {
                assert!(
                    !text.contains(option),
                    "{name} --help lists {option}:\n{text}"
                );
            }
        }
        // Hidden from a help, never refused: before the command and after it.
        for tokens in [
            &["outbox-relay", "status", "--retention-batch", "5"][..],
            &["outbox-relay", "--stream", "S", "probe"][..],
            &[
                "outbox-relay",
                "verify",
                "--metrics-addr",
                ":9464",
                "--from-id",
                "1",
            ][..],
        ] {
            command.clone().try_get_matches_from(tokens).unwrap();
        }
        let man = with_options(commands(), true)
            .render_long_help()
            .to_string();
        assert!(
            man.contains("--database-url"),
            "the man page documents every option"
        );
    }

    /// deploy/outbox-relay.example.toml is what `config::opt` defines: it cannot drift, and
    /// its defaults, uncommented, are a valid configuration.
    #[test]
    fn example_toml_matches_the_options() {
        let expected = example_toml();
        let path = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
            .join("../../deploy/outbox-relay.example.toml");
        let actual = std::fs::read_to_string(&path).unwrap_or_default();
        if actual != expected {
            if std::env::var_os("UPDATE_DOCS").is_some() {
                std::fs::write(&path, &expected).unwrap();
            } else {
                panic!(
                    "deploy/outbox-relay.example.toml differs from the options: regenerate it with\n  \
                     UPDATE_DOCS=1 cargo test -p outbox-relay --bin outbox-relay example_toml"
                );
            }
        }
        let uncommented: String = expected
            .lines()
            .filter_map(|line| line.strip_prefix("# "))
            .filter(|line| {
                opt::ALL
                    .iter()
                    .any(|spec| line.starts_with(&format!("{} = ", spec.key)))
            })
            .filter(|line| !line.ends_with("= \"\""))
            .map(|line| format!("{line}\n"))
            .collect();
        let dir = std::env::temp_dir().join(format!("outbox-relay-example-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let file = dir.join("relay.toml");
        std::fs::write(
            &file,
            format!("{uncommented}database_url = \"postgres://u@h/db\"\n"),
        )
        .unwrap();
        let raw = RawConfig::load(&BTreeMap::new(), &|_| None, &[], Some(&file)).unwrap();
        Config::from_sources(&raw).unwrap();
        std::fs::remove_dir_all(&dir).unwrap();
    }

    fn deploy_file(name: &str) -> String {
        let path = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
            .join("../../deploy")
            .join(name);
        std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()))
    }

    /// deploy/kubernetes/relay.yaml keeps what docs/operations.md relies on: two replicas
    /// replaced one at a time, probes on /healthz (a standby's /readyz is 503 by design),
    /// the metrics port the relay serves, non-root with a read-only root filesystem, the
    /// database URL from a Secret, only variables the relay knows, a disruption budget.
    #[test]
    fn the_kubernetes_manifests_keep_what_the_docs_rely_on() {
        use yaml_rust2::{Yaml, YamlLoader};
        let docs = YamlLoader::load_from_str(&deploy_file("kubernetes/relay.yaml")).unwrap();
        let of_kind = |kind: &str| {
            docs.iter()
                .find(|d| d["kind"].as_str() == Some(kind))
                .unwrap_or_else(|| panic!("no {kind}"))
                .clone()
        };
        let (config_map, deployment, budget) = (
            of_kind("ConfigMap"),
            of_kind("Deployment"),
            of_kind("PodDisruptionBudget"),
        );
        let spec = &deployment["spec"];
        assert_eq!(spec["replicas"].as_i64(), Some(2));
        let rolling = &spec["strategy"]["rollingUpdate"];
        assert_eq!(
            (
                rolling["maxSurge"].as_i64(),
                rolling["maxUnavailable"].as_i64()
            ),
            (Some(0), Some(1))
        );
        let pod = &spec["template"]["spec"];
        let container = &pod["containers"][0];
        let command = container["args"][0].as_str().unwrap();
        assert!(cli().find_subcommand(command).is_some(), "args: {command}");
        for probe in ["livenessProbe", "readinessProbe"] {
            assert_eq!(
                container[probe]["httpGet"]["path"].as_str(),
                Some("/healthz"),
                "{probe}"
            );
            assert_eq!(
                container[probe]["httpGet"]["port"].as_str(),
                Some("metrics")
            );
        }
        let data = config_map["data"].as_hash().unwrap();
        let addr = data[&Yaml::from_str("OUTBOX_RELAY_METRICS_ADDR")]
            .as_str()
            .unwrap();
        let port: i64 = addr.rsplit(':').next().unwrap().parse().unwrap();
        assert_eq!(container["ports"][0]["containerPort"].as_i64(), Some(port));
        assert_eq!(container["ports"][0]["name"].as_str(), Some("metrics"));
        assert_eq!(
            spec["template"]["metadata"]["annotations"]["prometheus.io/port"].as_str(),
            Some(port.to_string().as_str())
        );
        for (name, _) in data {
            let name = name.as_str().unwrap();
            assert!(
                opt::ALL.iter().any(|spec| spec.env == name),
                "the ConfigMap sets {name}, which the relay does not read"
            );
        }
        assert_eq!(pod["securityContext"]["runAsNonRoot"].as_bool(), Some(true));
        let security = &container["securityContext"];
        assert_eq!(security["readOnlyRootFilesystem"].as_bool(), Some(true));
        assert_eq!(security["allowPrivilegeEscalation"].as_bool(), Some(false));
        assert_eq!(security["capabilities"]["drop"][0].as_str(), Some("ALL"));
        let env = container["env"].as_vec().unwrap();
        let database = env
            .iter()
            .find(|e| e["name"].as_str() == Some("DATABASE_URL"))
            .expect("DATABASE_URL");
        assert!(
            !database["valueFrom"]["secretKeyRef"].is_badvalue(),
            "DATABASE_URL from a Secret"
        );
        let shutdown = config::parse_duration(opt::SHUTDOWN_TIMEOUT.default.unwrap()).unwrap();
        assert!(pod["terminationGracePeriodSeconds"].as_i64().unwrap() as u64 > shutdown.as_secs());
        assert_eq!(budget["spec"]["maxUnavailable"].as_i64(), Some(1));
        assert_eq!(budget["spec"]["selector"], spec["selector"]);
    }

    /// deploy/systemd/outbox-relay.service runs a command that exists, stops within its
    /// drain, does not restart a configuration error, and keeps its hardening.
    #[test]
    fn the_systemd_unit_runs_the_relay_hardened() {
        let unit = deploy_file("systemd/outbox-relay.service");
        let value = |key: &str| {
            unit.lines()
                .find_map(|line| line.strip_prefix(&format!("{key}=")))
                .unwrap_or_else(|| panic!("no {key}="))
        };
        let exec: Vec<&str> = value("ExecStart").split_whitespace().collect();
        assert!(exec[0].ends_with("/outbox-relay"));
        let tokens: Vec<&str> = std::iter::once("outbox-relay")
            .chain(exec[1..].iter().copied())
            .collect();
        cli().try_get_matches_from(tokens).unwrap();
        let stop: u64 = value("TimeoutStopSec").parse().unwrap();
        let shutdown = config::parse_duration(opt::SHUTDOWN_TIMEOUT.default.unwrap()).unwrap();
        assert!(stop > shutdown.as_secs());
        assert_eq!(value("RestartPreventExitStatus"), "2");
        for (key, expected) in [
            ("NoNewPrivileges", "yes"),
            ("ProtectSystem", "strict"),
            ("ProtectHome", "yes"),
            ("PrivateTmp", "yes"),
            ("DynamicUser", "yes"),
            ("CapabilityBoundingSet", ""),
            ("RestrictAddressFamilies", "AF_INET AF_INET6 AF_UNIX"),
        ] {
            assert_eq!(value(key), expected, "{key}");
        }
    }

    /// Every `outbox-relay <command> --option` the README and the operator's docs show names a
    /// command and an option that exist, so a newcomer's copy-paste parses.
    #[test]
    fn the_docs_commands_use_commands_and_options_that_exist() {
        let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../..");
        let cli = cli();
        let global: Vec<String> = cli
            .get_arguments()
            .filter_map(|a| a.get_long().map(str::to_owned))
            .collect();
        let mut wrong = Vec::new();
        let mut checked = 0;
        for doc in [
            "README.md",
            "docs/operations.md",
            "docs/migration.md",
            "docs/upgrading.md",
            "docs/guarantees.md",
        ] {
            let text = std::fs::read_to_string(root.join(doc)).unwrap();
            // Every OUTBOX_RELAY_* variable named exists too.
            for (at, _) in text.match_indices("OUTBOX_RELAY_") {
                let name: String = text[at..]
                    .chars()
                    .take_while(|c| c.is_ascii_uppercase() || c.is_ascii_digit() || *c == '_')
                    .collect();
                checked += 1;
                if name != "OUTBOX_RELAY_CONFIG"
                    && !name.ends_with('_')
                    && !opt::ALL.iter().any(|spec| spec.env == name)
                {
                    wrong.push(format!("{doc}: {name}"));
                }
            }
            for (command, option) in commands_in(&text) {
                let Some(sub) = cli.find_subcommand(&command) else {
                    continue;
                };
                checked += 1;
                let exists = option == "help"
                    || global.contains(&option)
                    || sub
                        .get_arguments()
                        .any(|a| a.get_long() == Some(option.as_str()));
                if !exists {
                    wrong.push(format!("{doc}: outbox-relay {command} --{option}"));
                }
            }
        }
        assert!(
            checked > 30,
            "only {checked} options found: is the extraction right?"
        );
        assert!(
            wrong.is_empty(),
            "options that do not exist:\n{}",
            wrong.join("\n")
        );
    }

    /// A yes/no option given bare means true, and still takes a value; other options
    /// still need theirs.
    #[test]
    fn a_bare_switch_means_true() {
        let matches = cli()
            .try_get_matches_from([
                "outbox-relay",
                "run",
                "--mark-published",
                "--shared-stream",
                "false",
                "--tlsfirst",
                "--slot",
                "s",
            ])
            .unwrap();
        let run = matches.subcommand_matches("run").unwrap();
        let value = |key: &str| run.get_one::<String>(key).map(String::as_str);
        assert_eq!(value("mark_published"), Some("true"));
        assert_eq!(value("shared_stream"), Some("false"));
        assert_eq!(value("nats_tlsfirst"), Some("true"));
        assert_eq!(value("slot"), Some("s"));
        assert!(cli()
            .try_get_matches_from(["outbox-relay", "run", "--slot"])
            .is_err());
    }

    /// docs/configuration.md is what the command line defines: it cannot drift.
    #[test]
    fn configuration_doc_matches_the_cli() {
        let expected = configuration_doc(&cli());
        let path =
            std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../../docs/configuration.md");
        let actual = std::fs::read_to_string(&path).unwrap_or_default();
        if actual == expected {
            return;
        }
        if std::env::var_os("UPDATE_DOCS").is_some() {
            std::fs::write(&path, &expected).unwrap();
            return;
        }
        panic!(
            "docs/configuration.md differs from the command line's definition: regenerate it with\n  \
             UPDATE_DOCS=1 cargo test -p outbox-relay --bin outbox-relay configuration_doc\n\
             The expected text:\n{expected}"
        );
    }
}
