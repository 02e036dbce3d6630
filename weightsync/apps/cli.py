"""``weightsync coordinator | agent | demo | bench | status`` — the command line."""

from __future__ import annotations

import argparse
import asyncio
import json
import signal
import sys

from weightsync.engine import ENGINES
from weightsync.errors import WeightSyncError
from weightsync.lifecycle import Terminated, exit_without_finalizing, interrupt_on_sigterm
from weightsync.logs import configure_logging
from weightsync.options import AGENT_DEFAULTS, COORDINATOR_DEFAULTS
from weightsync.security import TOKEN_ENV, Security
from weightsync.sizes import parse_size
from weightsync.validate import check_engine_id

STATUS_TIMEOUT_S = 10.0
JSON_HELP = "print the output as JSON instead of a table, or write it to PATH"


def _size(text: str) -> int:
    """``32MiB``, ``1GiB`` or bytes (argparse type)."""
    try:
        return parse_size(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _size_text(text: str) -> str:
    """A size, checked here and passed on as written (argparse type)."""
    _size(text)
    return text


def _add_security(p, *, server: bool) -> None:
    g = p.add_argument_group("security")
    g.add_argument("--tls-cert", default="", help="PEM certificate (server and client identity)")
    g.add_argument("--tls-key", default="", help="PEM private key of --tls-cert")
    g.add_argument("--tls-ca", default="", help="PEM CA: verify peers with it (servers then require client certs)")
    g.add_argument("--token-file", default="", help=f"shared token file (else ${TOKEN_ENV}, if set)")
    if server:
        g.add_argument("--insecure", action="store_true", help="serve plaintext (explicit; logs a warning)")


def _security(args) -> Security:
    security = Security.from_files(cert=args.tls_cert, key=args.tls_key, ca=args.tls_ca,
                                   token_file=args.token_file, insecure=getattr(args, "insecure", False))
    if hasattr(args, "insecure"):  # a server: TLS or explicit plaintext, checked before starting
        security.require_server_mode()
    if args.command == "coordinator":  # under mutual TLS, the certificate must carry our role
        security.require_role("coordinator")
    elif args.command == "agent":
        if args.advertise:
            from weightsync.server.common.serving import check_advertise
            check_advertise(args.advertise)
        if args.engine_id:
            check_engine_id(args.engine_id)
            security.require_role("agent", args.engine_id)
    return security


def _add_coordinator(sub) -> None:
    C = COORDINATOR_DEFAULTS  # noqa: N806
    p = _command(sub, "coordinator", help="run the coordinator service")
    p.add_argument("--listen", default=C.listen, help="HOST:PORT to serve on (port 0 = ephemeral)")
    p.add_argument("--state-db", default=C.state_db, help="SQLite state file (survives restarts)")
    p.add_argument("--port-file", default="", help="write the bound HOST:PORT here once serving")
    p.add_argument("--heartbeat-interval-s", "--heartbeat-interval", type=float, default=C.heartbeat_interval_s, help="seconds between agent heartbeats")
    p.add_argument("--heartbeat-timeout-s", "--heartbeat-timeout", type=float, default=C.heartbeat_timeout_s,
                   help="an engine silent this long is unavailable")
    p.add_argument("--shutdown-grace-s", "--shutdown-grace", type=float, default=C.shutdown_grace_s, help="seconds in-flight RPCs get at shutdown")
    p.add_argument("--idempotency-retention-s", "--idempotency-retention", type=float, default=C.idempotency_retention_s,
                   help="seconds idempotency records are kept")
    p.add_argument("--idempotency-max-records", type=int, default=C.idempotency_max_records,
                   help="most idempotency records kept")
    p.add_argument("--metrics-port", type=int, default=0, help="serve Prometheus metrics on this port (0 = off)")
    p.add_argument("--no-catch-up", dest="catch_up", action="store_false",
                   help="leave fenced engines for the next Broadcast instead of catching them up from a ready peer")
    p.add_argument("--catch-up-bucket-bytes", type=_size, default=C.catch_up_bucket_bytes,
                   help="bucket size of a catch-up from a peer")
    p.add_argument("--catch-up-transport", choices=("auto", "shm", "gloo"), default=C.catch_up_transport,
                   help="auto: shm between agents on one host address, gloo otherwise (gloo where agents share "
                        "an address but not /dev/shm, as containers may)")
    p.add_argument("--enable-fault-injection", action="store_true", help=argparse.SUPPRESS)
    _add_security(p, server=True)


def _add_agent(sub) -> None:
    A = AGENT_DEFAULTS  # noqa: N806
    p = _command(sub, "agent", help="run an engine agent (sidecar)")
    p.add_argument("--coordinator", required=True, help="coordinator HOST:PORT")
    p.add_argument("--engine", default=A.engine, choices=ENGINES, help="engine kind")
    p.add_argument("--engine-url", default="", help="vllm, sglang: the server's base URL, e.g. http://127.0.0.1:8000")
    p.add_argument("--checkpoint-dir", default="",
                   help="sglang: the served model's local safetensors folder, when /model_info's model_path is "
                        "not one (plans are checked against it)")
    p.add_argument("--sglang-flattened-bucket", action="store_true",
                   help="sglang: this SGLang takes load_format='flattened_bucket' in its distributed weight "
                        "updates (releases from late 2025 on), so rounds with the group layout 'flattened' "
                        "are accepted (refused otherwise)")
    p.add_argument("--model", default=A.model, help="reference model preset (tiny|small|medium) or JSON config")
    p.add_argument("--listen", default=A.listen, help="HOST:PORT to serve on (port 0 = ephemeral)")
    p.add_argument("--advertise", default=A.advertise,
                   help="host the coordinator and peers reach this agent at (default: the --listen host; for "
                        "0.0.0.0 or ::, this host's address on the route to the coordinator)")
    p.add_argument("--engine-id", default="", help="engine id (default: random)")
    p.add_argument("--port-file", default="", help="write the bound HOST:PORT here once registered")
    p.add_argument("--register-timeout-s", "--register-timeout", type=float, default=A.register_timeout_s, help="seconds to keep trying to register")
    p.add_argument("--shutdown-grace-s", "--shutdown-grace", type=float, default=A.shutdown_grace_s,
                   help="seconds a running transfer gets to finish at shutdown")
    p.add_argument("--step-delay-s", "--step-delay", type=float, default=A.step_delay_s, help="reference engine: sleep between steps (s)")
    p.add_argument("--health-url", default="", help="launched engine's health URL (e.g. http://127.0.0.1:8000/health)")
    p.add_argument("--launch-timeout-s", "--launch-timeout", type=float, default=A.launch_timeout_s, help="seconds the launched engine gets to be healthy")
    p.add_argument("--restart", choices=("no", "on-failure"), default=A.restart,
                   help="relaunch a launched engine that exits or stops answering its health URL (it is fenced "
                        "until it holds the fleet's weights)")
    p.add_argument("--max-restarts", type=int, default=A.max_restarts,
                   help="relaunches allowed with --restart on-failure (back-off 1 s, doubling, at most 30 s)")
    p.add_argument("--metrics-port", type=int, default=0, help="serve Prometheus metrics on this port (0 = off)")
    p.add_argument("--ready-port", type=int, default=0,
                   help="serve HTTP GET /ready on this port: 200 while the engine serves the fleet's weights, else 503 (0 = off)")
    # Tests only: honour WEIGHTSYNC_FAULTS. Hidden so nobody turns it on from --help.
    p.add_argument("--enable-fault-injection", action="store_true", help=argparse.SUPPRESS)
    _add_security(p, server=True)
    p.add_argument("--launch", action="store_true",
                   help="-- CMD [ARGS...]: start this engine command, own it and its whole process tree "
                        "(must come last; everything after it is the command)")


def _add_demo(sub) -> None:
    p = _command(sub, "demo", help="coordinator + 2 reference engines + a short training run, synced every step")
    p.add_argument("--steps", type=int, default=8, help="training steps (one sync each)")
    p.add_argument("--engines", type=int, default=2, help="number of agents")
    p.add_argument("--transport", default="auto", choices=["auto", "gloo", "shm", "group"],
                   help="data plane (auto: shm for engines on this host, gloo to other hosts)")


def _tensor_counts(text: str) -> list[int]:
    """``300`` or ``89,512,2048`` -> tensor counts (argparse type)."""
    try:
        counts = [int(part) for part in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a tensor count or a comma-separated list of them: {text!r}") from None
    if any(n < 1 for n in counts):
        raise argparse.ArgumentTypeError(f"tensor counts must be >= 1: {text!r}")
    return counts


def _add_bench(sub) -> None:
    p = _command(sub, "bench", help="measure transfer time against the alternatives, in one run")
    p.add_argument("--size", type=_size_text, default="256MiB", help="payload size, e.g. 1GiB, 256MiB")
    p.add_argument("--tensors", type=_tensor_counts, default=[300],
                   help="about how many tensors the payload is split into (default: about a dense 8B model's count; "
                        "mixture-of-experts models have tens of thousands); a comma-separated list "
                        "(89,512,2048,20000) runs every method at each count in one run (with --hosts or --trainer-ranks: a "
                        "fleet booted per count, and the time per byte at each count against the first)")
    p.add_argument("--shape-profile", default="dense", choices=["dense", "moe"],
                   help="dense layers, or moe: most tensors are small expert matrices (128 experts per layer "
                        "where the count allows)")
    p.add_argument("--engines", type=int, default=2, help="receiving engines (agent processes)")
    p.add_argument("--trainer-memory", default="plain", choices=["plain", "huge-pages"],
                   help="where the trainer's weights lie: plain (an allocation each, as torch makes them: 4 KiB "
                        "pages unless the machine says otherwise) or huge-pages (end to end on transparent huge "
                        "pages, weightsync.client.place_on_huge_pages; the baselines' buffers too)")
    p.add_argument("--transport", action="append",
                   choices=["auto", "gloo", "shm", "shm-ring", "group", "group-flat", "group-tensors", "nccl",
                            "cuda-ipc"],
                   help="weightsync transport to measure (repeatable; default gloo and shm; with --hosts, "
                        "auto and gloo); shm-ring is shm with the direct reads off (every byte through the "
                        "shared-memory ring); group takes the layout a trainer gets by default (auto: "
                        "flattened where the tensors average under 1 MiB and every engine takes it, as the "
                        "bench's do); group-flat asks for the "
                        "flattened layout (SGLang's flattened_bucket: a broadcast per run of tensors), "
                        "group-tensors for a broadcast per tensor (SGLang's classic protocol)")
    p.add_argument("--hosts", type=int, default=0,
                   help="run on N simulated hosts (network namespaces; needs root): host a has the coordinator, "
                        "the trainer and one engine, the others --engines-per-host each")
    p.add_argument("--engines-per-host", type=int, default=2, help="with --hosts: engines on every other host")
    p.add_argument("--trainer-ranks", type=int, default=0,
                   help="a sharded trainer of N FSDP2 ranks: every rank sends its shards, against all-gather to "
                        "rank 0 then send (transport: the first --transport, default auto); with --hosts: the "
                        "ranks on host a, each transport measured sharded and gathered into rank 0")
    p.add_argument("--trainer-parallel", choices=("fsdp", "hsdp", "tp", "fsdp-tp"), default="fsdp",
                   help="with --trainer-ranks: how the trainer shards its model: FSDP2 (rows), HSDP (FSDP2 over two "
                        "replica groups: an even number of ranks), tensor parallel (row-wise layers' weights by "
                        "columns) or FSDP2 over tensor parallel (blocks of rows and columns: 4 or more ranks, even)")
    p.add_argument("--steps", type=int, default=3, help="timed rounds per method")
    p.add_argument("--passes", type=int, default=1,
                   help="run every method --steps times, this many times over, on fresh processes each pass, the "
                        "weightsync transports and the baselines taking turns to go first; each figure is the "
                        "median of all the passes' steps (ratios then compare the same minutes more nearly)")
    p.add_argument("--settle-s", type=float, default=None,
                   help="before each pass's weightsync transports and its baselines, wait until the machine has "
                        "gone this many seconds (default 4) without handing a batch of freed memory back to its "
                        "host (where the kernel counts it: /sys/module/page_reporting; at most 60 s; 0: do not "
                        "wait)")
    p.add_argument("--bucket-bytes", type=_size, default="32MiB", help="bucket size of the plan")
    p.add_argument("--baselines", action=argparse.BooleanOptionalAction, default=True,
                   help="also run per-tensor-gloo, flat-gloo, disk, grpc-stream, memcpy (with --trainer-ranks: "
                        "the all-gather to rank 0)")
    p.add_argument("--attest", action="store_true",
                   help="also run every weightsync round with the attestation probe (method weightsync+attest)")
    p.add_argument("--json", nargs="?", const="-", default="", metavar="PATH", help=JSON_HELP)
    p.add_argument("--plot", default="", help="write a PNG of throughput per method here")


def _add_status(sub) -> None:
    p = _command(sub, "status", help="show engines and the current round")
    p.add_argument("--coordinator", required=True, help="coordinator HOST:PORT")
    p.add_argument("--json", nargs="?", const="-", default="", metavar="PATH", help=JSON_HELP)
    p.add_argument("--watch", action="store_true", help="then follow the coordinator's event stream")
    _add_security(p, server=False)


def _add_pki(sub) -> None:
    p = _command(sub, "pki", help="make a CA and mint role certificates (coordinator, agent, trainer)")
    actions = p.add_subparsers(dest="pki_command", required=True)
    init = actions.add_parser("init", help="create a CA in DIR (ca.pem, ca-key.pem)")
    init.add_argument("directory")
    issue = actions.add_parser("issue", help="mint a certificate for one role, signed by DIR's CA")
    issue.add_argument("directory")
    issue.add_argument("--role", required=True, choices=["coordinator", "agent", "trainer"])
    issue.add_argument("--engine-id", default="", help="the engine an agent's certificate speaks for")
    issue.add_argument("--host", action="append", default=[],
                       help="a name or IP the holder serves on (repeatable; default 127.0.0.1 and localhost)")
    issue.add_argument("--name", default="", help="file name stem (default: the role, or agent-<engine-id>)")


def _pki(args) -> int:
    from weightsync.pki import DEFAULT_HOSTS, CertificateAuthority
    if args.pki_command == "init":
        authority = CertificateAuthority.init(args.directory)
        print(f"CA: {authority.ca} (give to every process); key: {authority.ca_key} (keep private)")
        return 0
    issued = CertificateAuthority(args.directory).issue(args.role, engine_id=args.engine_id,
                                                        hosts=tuple(args.host) or DEFAULT_HOSTS, name=args.name)
    print(f"--tls-cert {issued.cert} --tls-key {issued.key} --tls-ca {CertificateAuthority(args.directory).ca}")
    return 0


class _Help(argparse.ArgumentDefaultsHelpFormatter):
    """Every option's default in --help, except where there is none to show."""

    def _get_help_string(self, action):
        if action.default in (None, "", False, argparse.SUPPRESS) or "default" in (action.help or ""):
            return action.help
        return super()._get_help_string(action)


def _logging_options(parser: argparse.ArgumentParser, *, defaults: bool) -> None:
    """--log-level and --log-format, before the command or after it (a command's own
    copy has no default, so it only overrides what was given before)."""
    parser.add_argument("--log-level", default="INFO" if defaults else argparse.SUPPRESS,
                        choices=["DEBUG", "INFO", "WARNING", "ERROR"], type=str.upper, help="log threshold")
    parser.add_argument("--log-format", default="text" if defaults else argparse.SUPPRESS, choices=["text", "json"],
                        help="json: one JSON object per line")


def _command(sub, name: str, *, help: str) -> argparse.ArgumentParser:  # noqa: A002 (argparse's name)
    """A command's parser: its defaults shown, the logging options accepted after it too."""
    common = argparse.ArgumentParser(add_help=False)
    _logging_options(common, defaults=False)
    return sub.add_parser(name, help=help, parents=[common], formatter_class=_Help)


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version
    try:
        return version("weightsync")
    except PackageNotFoundError:
        return "unknown (not installed)"


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="weightsync", description=__doc__, formatter_class=_Help)
    parser.add_argument("--version", action="version", version=f"weightsync {_version()}")
    _logging_options(parser, defaults=True)
    sub = parser.add_subparsers(dest="command", required=True)
    _add_coordinator(sub)
    _add_agent(sub)
    _add_demo(sub)
    _add_bench(sub)
    _add_status(sub)
    _add_pki(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Entry point of the ``weightsync`` console script; returns the exit code."""
    argv = list(sys.argv[1:] if argv is None else argv)
    launch: list[str] = []
    if "--launch" in argv:  # everything after it is the engine command, never our options
        index = argv.index("--launch")
        argv, launch = argv[:index + 1], argv[index + 1:]
        if launch[:1] == ["--"]:
            launch = launch[1:]
        if not launch:
            print("weightsync: --launch needs a command: --launch -- CMD [ARGS...]", file=sys.stderr)
            return 2
    args = build_parser().parse_args(argv)
    configure_logging(args.log_level, args.log_format)
    if args.command in ("bench", "demo"):
        # These run a local cluster in this process (or in a child of it): a SIGTERM
        # unwinds them as Ctrl-C does, so they stop what they started and remove
        # their files (the server commands handle their signals themselves).
        interrupt_on_sigterm()
    try:
        if args.command == "coordinator":
            from weightsync.options import CoordinatorOptions
            from weightsync.server.coordinator.main import run_coordinator
            return asyncio.run(run_coordinator(CoordinatorOptions(
                listen=args.listen, state_db=args.state_db, port_file=args.port_file,
                heartbeat_interval_s=args.heartbeat_interval_s, heartbeat_timeout_s=args.heartbeat_timeout_s,
                shutdown_grace_s=args.shutdown_grace_s, idempotency_retention_s=args.idempotency_retention_s,
                idempotency_max_records=args.idempotency_max_records,
                enable_fault_injection=args.enable_fault_injection, security=_security(args),
                metrics_port=args.metrics_port, catch_up=args.catch_up,
                catch_up_bucket_bytes=args.catch_up_bucket_bytes, catch_up_transport=args.catch_up_transport)))
        if args.command == "agent":
            from weightsync.options import AgentOptions
            from weightsync.server.agent.main import run_agent
            return exit_without_finalizing(asyncio.run(run_agent(AgentOptions(
                coordinator=args.coordinator, engine=args.engine, model=args.model, listen=args.listen,
                advertise=args.advertise,
                engine_id=args.engine_id, port_file=args.port_file, register_timeout_s=args.register_timeout_s,
                shutdown_grace_s=args.shutdown_grace_s, step_delay_s=args.step_delay_s,
                enable_fault_injection=args.enable_fault_injection,
                launch=tuple(launch),
                health_url=args.health_url, launch_timeout_s=args.launch_timeout_s, security=_security(args),
                engine_url=args.engine_url, checkpoint_dir=args.checkpoint_dir, metrics_port=args.metrics_port,
                sglang_flattened=args.sglang_flattened_bucket,
                ready_port=args.ready_port, restart=args.restart, max_restarts=args.max_restarts))))
        if args.command == "demo":
            from weightsync.apps.demo import run_demo
            return run_demo(steps=args.steps, engines=args.engines, transport=args.transport)
        if args.command == "bench":
            return _bench(args)
        if args.command == "pki":
            return _pki(args)
        if args.command == "status":
            return asyncio.run(_status(args.coordinator, json_to=args.json, watch=args.watch,
                                       security=_security(args)))
    except WeightSyncError as exc:
        print(f"weightsync {args.command}: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt as exc:
        return 128 + (exc.signum if isinstance(exc, Terminated) else signal.SIGINT)
    return 2


def _bench_hosts(args) -> int:
    from weightsync.apps.bench.hosts import hosts_table, run_hosts_bench

    def run_one(tensors: int, json_path: str = "") -> dict:
        return run_hosts_bench(hosts=args.hosts, engines_per_host=args.engines_per_host, size=args.size,
                               tensors=tensors, rounds=args.steps, transports=args.transport or ["auto", "gloo"],
                               json_path=json_path, trainer_ranks=args.trainer_ranks,
                               trainer_parallel=args.trainer_parallel, shape_profile=args.shape_profile)

    return _bench_counts(args, run_one, hosts_table, row_key="transport")


def _bench_trainer_ranks(args) -> int:
    from weightsync.apps.bench.sharded import run_sharded_bench, sharded_table

    def run_one(tensors: int, json_path: str = "") -> dict:
        return run_sharded_bench(ranks=args.trainer_ranks, engines=args.engines, size=args.size, tensors=tensors,
                                 rounds=args.steps, transport=(args.transport or ["auto"])[0],
                                 bucket_bytes=args.bucket_bytes, json_path=json_path,
                                 baselines=args.baselines, parallel=args.trainer_parallel,
                                 shape_profile=args.shape_profile)

    return _bench_counts(args, run_one, sharded_table, row_key="mode")


def _bench_counts(args, run_one, table, *, row_key: str) -> int:
    """One run (one count: its report as before), or a run per tensor count and the time
    per byte at each against the first (``count_sweep``)."""
    from weightsync.apps.bench.count_sweep import sweep_counts, sweep_lines

    try:
        to_file = "" if args.json == "-" else args.json
        if len(args.tensors) == 1:
            one = run_one(args.tensors[0], to_file)
            if args.json == "-":
                _emit_json(one, "-")
            else:
                print(table(one))
            return 0

        def show(count: int, one: dict) -> None:
            print(f"-- about {count} tensors, {one['results'][0]['payload_bytes']} bytes", flush=True)
            print(table(one), flush=True)

        report = sweep_counts(run_one, args.tensors, row_key=row_key, json_path=to_file,
                              on_report=None if args.json == "-" else show)
    except ValueError as exc:
        print(f"weightsync bench: {exc}", file=sys.stderr)
        return 2
    if args.json == "-":
        _emit_json(report, "-")
        return 0
    for line in sweep_lines(report):
        print(line)
    return 0


def _bench(args) -> int:
    from weightsync import transport as transports
    from weightsync.apps.bench.returned_memory import QUIET_S
    from weightsync.apps.bench.runner import against_baselines, ratios, run_bench, table

    if (args.hosts or args.trainer_ranks) and args.passes != 1:
        print("weightsync bench: --passes is for the single-trainer benchmark", file=sys.stderr)
        return 2
    if (args.hosts or args.trainer_ranks) and args.settle_s is not None:
        print("weightsync bench: --settle-s is for the single-trainer benchmark", file=sys.stderr)
        return 2
    if (args.hosts or args.trainer_ranks) and args.trainer_memory != "plain":
        print("weightsync bench: --trainer-memory is for the single-trainer benchmark", file=sys.stderr)
        return 2
    if (args.hosts or args.trainer_ranks) and {"shm-ring", "group-flat", "group-tensors"} & set(args.transport or []):
        print("weightsync bench: shm-ring, group-flat and group-tensors are for the single-trainer benchmark",
              file=sys.stderr)
        return 2
    if args.hosts:
        return _bench_hosts(args)
    if args.trainer_ranks:
        return _bench_trainer_ranks(args)
    chosen = args.transport or ["gloo", "shm"]
    for name in chosen:
        base = name.removesuffix("-ring").removesuffix("-flat").removesuffix("-tensors")
        reason = transports.unavailable_reason(transports.kind_from_name(base))
        if reason is not None:
            print(f"weightsync bench: transport {name} unavailable here: {reason}", file=sys.stderr)
            return 2
    try:
        report = run_bench(size=args.size, tensors=args.tensors, engines=args.engines, transports=chosen,
                           steps=args.steps, baselines=args.baselines, plot_path=args.plot,
                           json_path="" if args.json == "-" else args.json,
                           bucket_bytes=args.bucket_bytes, attest=args.attest,
                           shape_profile=args.shape_profile, trainer_memory=args.trainer_memory,
                           passes=args.passes, settle_s=QUIET_S if args.settle_s is None else args.settle_s)
    except ValueError as exc:
        print(f"weightsync bench: {exc}", file=sys.stderr)
        return 2
    if args.json == "-":
        _emit_json(report, "-")
        return 0
    print(table(report))
    for line in ratios(report) + against_baselines(report):
        print(line)
    return 0


def engine_status(e) -> str:
    """One word for an engine's state, worst first."""
    if not e.available:
        return "unavailable"
    if e.faulted:
        return "faulted"
    if e.receiving:
        return "receiving"
    if e.torn:
        return "torn"
    if e.fenced:
        return "fenced"
    return "paused" if e.paused else "serving"


def _emit_json(data, where: str) -> None:
    """``--json``: to stdout (``-``) or to the file ``where``."""
    text = json.dumps(data, indent=2)
    if where == "-":
        print(text, flush=True)
    else:
        with open(where, "w") as f:
            f.write(text + "\n")


async def _status(coordinator: str, *, json_to: str, watch: bool, security: Security) -> int:
    """The coordinator's view, over a plain stub: no torch, no trainer client (fast)."""
    import grpc
    from google.protobuf.json_format import MessageToDict

    from weightsync.errors import coordinator_error
    from weightsync.v1 import coordinator_pb2, coordinator_pb2_grpc

    async with security.channel(coordinator) as channel:
        stub = coordinator_pb2_grpc.CoordinatorServiceStub(channel)
        try:
            state = await stub.GetState(coordinator_pb2.GetStateRequest(), timeout=STATUS_TIMEOUT_S)
        except grpc.aio.AioRpcError as exc:
            raise coordinator_error(exc, coordinator=coordinator, operation="status") from None
        if json_to:
            _emit_json(MessageToDict(state, preserving_proto_field_name=True), json_to)
        else:
            print(f"weight version {state.weight_version}; round {state.round.round_id} ({state.round.phase}"
                  f"{', target v' + str(state.round.target_version) if state.round.target_version else ''})")
            print(f"{'engine':<16} {'address':<22} {'model':<14} {'state':<12} {'ready':<6} {'version':>8} "
                  f"{'behind':>7} {'torn':<12} {'heartbeat':<10}")
            for e in state.engines:
                age = f"{e.heartbeat_age_s:.1f}s ago" if e.heartbeat_age_s >= 0 else "never"
                torn = f"yes (v{e.torn_version})" if e.torn else "no"
                model = e.model if len(e.model) <= 14 else e.model[:13] + "~"  # a vLLM's URL
                print(f"{e.engine_id:<16} {e.address:<22} {model:<14} {engine_status(e):<12} "
                      f"{'yes' if e.ready else 'no':<6} {e.weight_version:>8} {e.versions_behind:>7} {torn:<12} "
                      f"{age:<10}", flush=True)
        if watch:
            async for response in stub.WatchEvents(coordinator_pb2.WatchEventsRequest()):
                event = response.event
                if json_to:
                    print(json.dumps(MessageToDict(event, preserving_proto_field_name=True)), flush=True)
                else:
                    fields = " ".join(f"{k}={v}" for k, v in sorted(event.fields.items()) if v)
                    print(f"{event.seq:>6} {event.kind:<20} {event.engine_id:<12} {fields}", flush=True)
    return 0


__all__ = ["main", "build_parser"]
