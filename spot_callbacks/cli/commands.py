"""`spot-callbacks`: list, verify, pull and delete the committed checkpoints of a run; report
what its checkpoints and interruptions cost; plan whether spot is worth it for a job; list and
clean this machine's scratch folders.

    spot-callbacks ls s3://bucket/runs/exp1
    spot-callbacks verify s3://bucket/runs/exp1 --step 12000
    spot-callbacks pull s3://bucket/runs/exp1 ./resume
    spot-callbacks rm s3://bucket/runs/exp1 --step 11000 --yes
    spot-callbacks report s3://bucket/runs/exp1 --spot-price 1.2 --on-demand-price 3.9
    spot-callbacks scratch --clean --older-than 7d
    spot-callbacks plan --work-hours 200 --spot-price 1.2 --on-demand-price 3.9 \\
        --interruptions-per-hour 0.1 --checkpoint-seconds 30 --resume-seconds 300 --plot plan.png
    spot-callbacks plan --from s3://bucket/runs/exp1 --work-hours 200 --spot-price 1.2 --on-demand-price 3.9

Credentials come from the environment, as fsspec reads them (``AWS_*``,
``GOOGLE_APPLICATION_CREDENTIALS``, ``AZURE_STORAGE_*``), or from ``--storage-options JSON``
(``@FILE`` reads it from a file; ``${NAME}`` in a value is the environment variable ``NAME``).
`pull` replaces only an empty DEST or an earlier pull of the same run unless ``--force``.
Nothing this command prints contains a storage option's value: any of them may be a credential.
"""

from __future__ import annotations

import argparse
import difflib
import json
import logging
import math
import os
import posixpath
import sys
import time
import traceback
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import fsspec

import spot_callbacks.store.checkpoint_store as checkpoint_store
from spot_callbacks import __version__, settings
from spot_callbacks._format import count_of, human_size, printable
from spot_callbacks.accounting.attempts import attempt_outcomes, attempts_of_lineage, read_attempts
from spot_callbacks.accounting.costs import plan_job
from spot_callbacks.accounting.plan_inputs import plan_inputs, shown_rate, shown_seconds
from spot_callbacks.accounting.report import (
    ATTEMPT_HEADERS,
    RESUME_HEADERS,
    RunHistory,
    attempt_json,
    attempt_table_rows,
    format_rows,
    history_rows,
    plan_rows,
    resume_rows,
    write_plan_plot,
)
from spot_callbacks.cli.redaction import Redactor, install_log_handler, shown_options
from spot_callbacks.cli.tables import busy, plain_table, print_rich_table, rich_console
from spot_callbacks.config import load_storage_options, parse_duration
from spot_callbacks.errors import (
    CheckpointError,
    CheckpointNotFoundError,
    ConfigError,
    ManifestError,
    SpotError,
    StoreUnavailableError,
)
from spot_callbacks.persist.scratch import scratch_base
from spot_callbacks.persist.scratch_folders import delete_scratch_folder, list_scratch
from spot_callbacks.progress import is_terminal, showing_progress
from spot_callbacks.store import CheckpointInfo, CheckpointStore
from spot_callbacks.store.backends import BARE_PATH_PROTOCOL, URL_PREFIXES
from spot_callbacks.store.commit import Verdict, commit_order, lineage_of
from spot_callbacks.store.diagnosis import diagnose
from spot_callbacks.store.layout import list_folder
from spot_callbacks.store.meter import TransferMeter
from spot_callbacks.store.preflight import probe_readable
from spot_callbacks.store.pull_dest import check_pull_dest
from spot_callbacks.store.retry import call_with_timeout

log = logging.getLogger("spot_callbacks")

PROG = "spot-callbacks"
EXIT_OK, EXIT_ERROR, EXIT_USAGE, EXIT_INTERRUPTED = 0, 1, 2, 130
_SIZE_CHECK_THREADS = 8
_HINT_TIMEOUT_S = 10.0  # the listing of the folder above a URL with nothing under it, for "did you mean"
_HINT_NAMES = 8


class CliError(SpotError):
    """A problem to report as one line and exit status 1 (the message says what to do)."""


# ------------------------------------------------------------------------------------ entry point
def main(argv: list[str] | None = None) -> int:
    """Run ``spot-callbacks`` with ``argv`` (default: the process arguments); return the exit status.

    0 on success, 1 on an error (one line on stderr: ``spot-callbacks: error: ...``, with the cause and
    the fix; ``-v`` adds the traceback), 2 on a usage error. A store that cannot be read fails within
    the bounds of training's preflight (``$SPOT_PREFLIGHT_TIMEOUT_S``, 60 s; a refused connection half).

    Example:
        >>> main(["ls", "memory://doc-cli/empty-run"])
        1
    """
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
        if hasattr(args, "check_usage"):  # what argparse cannot say alone (`plan`: flags or --from)
            args.check_usage(args)
    except SystemExit as stop:  # --help, --version and usage errors: argparse has printed them
        return stop.code if isinstance(stop.code, int) else (EXIT_OK if stop.code is None else EXIT_USAGE)

    verbosity: int = args.verbose or 0
    restore_environment = _apply_timeout(getattr(args, "timeout", None))
    redact = Redactor()
    restore_logging = install_log_handler(verbosity, redact)
    try:
        redact.add_url(getattr(args, "url", ""))  # `plan` has no URL
        storage_options = parse_storage_options(args.storage_options)
        redact.add_options(storage_options)
        if storage_options:
            log.info(
                "%s: storage options given: %s (other values not shown)", PROG, shown_options(storage_options)
            )
        return args.run(args, storage_options)
    except KeyboardInterrupt:
        _print_error("interrupted", redact)
        return EXIT_INTERRUPTED
    except BrokenPipeError:  # `spot-callbacks ls URL | head`: the reader left; nothing to report
        return EXIT_ERROR
    except Exception as err:
        if verbosity:
            sys.stderr.write(printable(redact("".join(traceback.format_exception(err))), keep_newlines=True))
        _print_error(describe_error(err, verbose=bool(verbosity), url=getattr(args, "url", "")), redact)
        return EXIT_ERROR
    finally:
        restore_logging()
        restore_environment()


class _ArgumentParser(argparse.ArgumentParser):
    def error(self, message: str) -> Any:
        # A misplaced --storage-options value would be echoed as an unrecognized argument.
        if "{" in message:
            message = message[: message.index("{")] + "<a JSON value, not shown>"
        super().error(message)


def build_parser() -> argparse.ArgumentParser:
    """The argument parser of ``spot-callbacks`` (global options work before or after the command).

    Example:
        >>> build_parser().parse_args(["verify", "s3://bucket/run", "--step", "12"]).step
        12
    """
    parser = _ArgumentParser(
        prog=PROG,
        description="Inspect and manage the committed checkpoints of a spot_callbacks run (any fsspec URL), "
        "report what they cost, and plan whether spot is worth it.",
        epilog="Credentials come from the environment as fsspec reads them, or from --storage-options.",
    )
    parser.add_argument("--version", action="version", version=f"{PROG} {__version__}")
    _add_global_options(parser, suppress_defaults=False)
    commands = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)

    def command(name: str, help_text: str, run: Callable[[argparse.Namespace, dict[str, Any]], int]) -> Any:
        sub = commands.add_parser(name, help=help_text, description=help_text)
        sub.add_argument("url", metavar="URL", help=f"the run folder: {', '.join(URL_PREFIXES)} or a path")
        _add_global_options(sub, suppress_defaults=True)
        sub.set_defaults(run=run)
        return sub

    ls = command(
        "ls", "list the committed checkpoints, their sizes and whether their files are intact", _cmd_ls
    )
    ls.add_argument(
        "--json", action="store_true",
        help="print one JSON object for scripts: {url, newest_valid_step, checkpoints: [{step, created, "
        "reason, size_bytes, framework, url, valid, problem, newest_valid}]} (docs/cli.md)",
    )  # fmt: skip

    verify = command(
        "verify", "check a checkpoint's files against its manifest (default: the newest)", _cmd_verify
    )
    verify.add_argument("--step", type=_step, help="the step to verify (default: the newest committed)")
    verify.add_argument("--shallow", action="store_true", help="check file sizes only, do not read checksums")

    pull = command("pull", "download a checkpoint into a local folder and print its path", _cmd_pull)
    _add_pull_arguments(pull)

    rm = command("rm", "delete one checkpoint (its manifest first, then its files)", _cmd_rm)
    rm.add_argument("--step", type=_step, required=True, help="the step to delete")
    rm.add_argument("-y", "--yes", action="store_true", help="do not ask for confirmation")
    rm.add_argument("--force", action="store_true", help="allow deleting the newest valid checkpoint")

    report = command(
        "report",
        "the run's checkpoint and interruption costs, from its manifests: stall, lost work, resumes, goodput",
        _cmd_report,
    )
    report.add_argument(
        "--spot-price", type=_price, metavar="P", help="spot price per hour: adds the dollars"
    )
    report.add_argument(
        "--on-demand-price", type=_price, metavar="Q", help="on-demand price per hour: adds what spot saved"
    )
    report.add_argument(
        "--all", action="store_true",
        help=f"list every recent resume the ledger keeps (default: the newest {REPORT_RESUME_ROWS})",
    )  # fmt: skip
    report.add_argument(
        "--json", action="store_true",
        help="print one JSON object for scripts: {url, framework, newest_step, summary, notes, ledger, "
        "goodput, billed_s, interruptions, recent_resumes} (docs/cli.md)",
    )  # fmt: skip

    _add_plan_command(commands)
    _add_scratch_command(commands)
    return parser


def _add_plan_command(commands: Any) -> None:
    """``plan``: reads no store unless ``--from DIRPATH`` takes its inputs from a run, so it takes no URL."""
    plan_help = (
        "expected cost and time of a job on spot and on demand, the optimal checkpoint interval "
        "and the break-even interruption rate (Daly's model; see spot_callbacks.accounting.costs)"
    )
    plan = commands.add_parser("plan", help=plan_help, description=plan_help)
    plan.add_argument(
        "--work-hours", type=_hours, required=True, metavar="W",
        help="training time: hours as a number, or a duration ('100h', '90min', '3d')",
    )  # fmt: skip
    plan.add_argument("--spot-price", type=_price, required=True, metavar="P", help="spot price per hour")
    plan.add_argument(
        "--on-demand-price", type=_price, required=True, metavar="Q", help="on-demand price per hour"
    )
    plan.add_argument(
        "--from", dest="url", default="", metavar="DIRPATH",
        help="take the checkpoint cost, the resume cost and the interruption rate from this run's ledger "
        "(what `report DIRPATH` measures); the three flags below override it",
    )  # fmt: skip
    plan.add_argument(
        "--interruptions-per-hour", type=_non_negative, metavar="RATE",
        help="expected interruptions per hour of spot time (0.05 = one a day); required without --from",
    )  # fmt: skip
    plan.add_argument(
        "--checkpoint-seconds", type=_positive_duration, metavar="DELTA",
        help="seconds training is blocked per checkpoint (stall plus slowdown; `report` measures it); "
        "required without --from",
    )  # fmt: skip
    plan.add_argument(
        "--resume-seconds", type=_duration, metavar="R",
        help="seconds from an interruption to training again: new machine, pull, load; required without --from",
    )  # fmt: skip
    plan.add_argument("--plot", metavar="PNG", help="also write a plot of expected cost against the interval")
    _add_global_options(plan, suppress_defaults=True)

    def check_usage(args: argparse.Namespace) -> None:
        missing = [flag for flag, dest, _, _ in _PLAN_INPUTS if getattr(args, dest) is None]
        if missing and not args.url:
            plan.error(
                f"the following arguments are required: {', '.join(missing)} "
                "(or --from DIRPATH, to take them from a run's ledger)"
            )

    plan.set_defaults(run=_cmd_plan, check_usage=check_usage)


# The inputs `plan --from` measures: flag, argument name, PlanInputs field, what it is in the output.
_PLAN_INPUTS = (
    ("--checkpoint-seconds", "checkpoint_seconds", "checkpoint_s", "checkpoint cost"),
    ("--resume-seconds", "resume_seconds", "resume_s", "resume cost"),
    ("--interruptions-per-hour", "interruptions_per_hour", "interruptions_per_hour", "interruption rate"),
)


def _add_scratch_command(commands: Any) -> None:
    """``scratch``: the local scratch folders of this machine, so it takes no URL either."""
    scratch_help = (
        "list the local scratch folders (one per dirpath: its size and last use) and, with --clean, "
        "delete those no live run holds"
    )
    scratch = commands.add_parser("scratch", help=scratch_help, description=scratch_help)
    scratch.add_argument(
        "--root",
        metavar="DIR",
        help="the folder that holds them (default: $SPOT_SCRATCH, else $TMPDIR/spot-callbacks-<uid>)",
    )
    scratch.add_argument(
        "--clean", action="store_true", help="delete the folders no live run on this host holds"
    )
    scratch.add_argument(
        "--dry-run", action="store_true",
        help="with --clean: list the folders it would delete (and whose run last used each), delete nothing",
    )  # fmt: skip
    scratch.add_argument(
        "--older-than", type=_duration, metavar="DURATION",
        help="only the folders not used for this long ('7d', '12h', seconds)",
    )  # fmt: skip
    _add_global_options(scratch, suppress_defaults=True)
    scratch.set_defaults(run=_cmd_scratch)


def _add_pull_arguments(pull: argparse.ArgumentParser) -> None:
    pull.add_argument(
        "dest", metavar="DEST", help="local folder to create (an earlier pull of this run is replaced)"
    )
    pull.add_argument("--step", type=_step, help="the step to pull (default: the newest valid)")
    pull.add_argument(
        "--force",
        action="store_true",
        help="replace a non-empty DEST that is not an earlier pull of this run (never a link, a file or the "
        "current directory)",
    )


def _add_global_options(parser: argparse.ArgumentParser, *, suppress_defaults: bool) -> None:
    # On a subcommand the defaults are suppressed, so a value given before the command survives.
    parser.add_argument(
        "--storage-options",
        metavar="JSON",
        default=argparse.SUPPRESS if suppress_defaults else None,
        help="fsspec storage options as a JSON object, or @FILE to read it from a file "
        '(e.g. \'{"endpoint_url": "http://localhost:9000"}\'); values are never printed',
    )
    parser.add_argument(
        "-v",
        "--verbose",
        action="count",
        default=argparse.SUPPRESS if suppress_defaults else 0,
        help="log what happens (-vv: also fsspec) and show tracebacks",
    )
    parser.add_argument(
        "--timeout",
        metavar="DURATION",
        type=_timeout,
        default=argparse.SUPPRESS if suppress_defaults else None,
        help="how long the command may wait for the store before it fails with the cause "
        "(e.g. 10, 30s, 2min; default: SPOT_PREFLIGHT_TIMEOUT_S for the first contact, SPOT_STORE_TIMEOUT_S per call)",
    )


def _timeout(text: str) -> float:
    try:
        seconds = parse_duration(text, key="--timeout")
    except ConfigError:
        seconds = None
    if seconds is None or not seconds > 0:
        raise argparse.ArgumentTypeError(f"{text!r} is not a duration; use e.g. 10, 30s or 2min")
    return seconds


def _apply_timeout(seconds: float | None) -> Callable[[], None]:
    """``--timeout``: this command's bounds on the store, through the knobs training reads too;
    returns what puts the environment back (``main`` may run many times in one process)."""
    if seconds is None:
        return lambda: None
    connect_s = min(settings.CONNECT_TIMEOUT_S.value(), seconds / 2)
    return settings.override(
        {
            settings.PREFLIGHT_TIMEOUT_S: seconds,
            settings.STORE_TIMEOUT_S: seconds,
            settings.CONNECT_TIMEOUT_S: connect_s,
        }
    )


def _step(text: str) -> int:
    try:
        step = int(text)
    except ValueError:
        step = -1
    if step < 0:
        raise argparse.ArgumentTypeError(f"{text!r} is not a step; use an integer >= 0")
    return step


def _number(text: str, what: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not math.isfinite(value) or value < 0:
        raise argparse.ArgumentTypeError(f"{text!r} is not {what}; use a number >= 0")
    return value


def _price(text: str) -> float:
    return _number(text, "a price per hour")


def _non_negative(text: str) -> float:
    return _number(text, "a rate")


def _positive(text: str) -> float:
    value = _number(text, "a number of hours")
    if value == 0:
        raise argparse.ArgumentTypeError(f"{text!r} must be > 0")
    return value


def _hours(text: str) -> float:
    """Hours: a bare number is hours, a duration ('100h', '90min') is converted."""
    try:
        return _positive(text)
    except argparse.ArgumentTypeError:
        try:
            seconds = parse_duration(text, key="work-hours") or 0.0
        except ConfigError:
            raise argparse.ArgumentTypeError(
                f"{text!r} is not a duration; use hours (e.g. 100) or e.g. '100h', '90min', '3d'"
            ) from None
    if seconds <= 0:
        raise argparse.ArgumentTypeError(f"{text!r} must be > 0")
    return seconds / 3600.0


def _duration(text: str) -> float:
    try:
        return _number(text, "a number of seconds")
    except argparse.ArgumentTypeError:
        try:
            return parse_duration(text, key="seconds") or 0.0
        except ConfigError:
            raise argparse.ArgumentTypeError(
                f"{text!r} is not a duration; use seconds (e.g. 45) or e.g. '90s', '5min', '1h'"
            ) from None


def _positive_duration(text: str) -> float:
    value = _duration(text)
    if value == 0:
        raise argparse.ArgumentTypeError(
            f"{text!r} must be > 0 (a checkpoint that costs nothing needs no plan)"
        )
    return value


# ------------------------------------------------------------------------------------ commands
REPORT_RESUME_ROWS = 20  # report's resume table by default; --all lists every one the ledger keeps


def _cmd_ls(args: argparse.Namespace, storage_options: dict[str, Any]) -> int:
    store = _open_store(args.url, storage_options)
    infos = store.committed()
    verdicts = [Verdict(info.step, info.url, info, None) for info in infos]
    if infos or store.step_folders():  # a manifest that cannot be trusted is listed as damaged
        verdicts = checkpoint_store.manifest_verdicts(store)
    if not verdicts:  # the folder holds something (an upload that never committed, a lock), not a checkpoint
        if getattr(args, "json", False):
            _print_json({"url": store.url, "newest_valid_step": None, "checkpoints": []})
        else:
            print(f"no committed checkpoints in {store.url}")
        return EXIT_OK
    infos = [verdict.info for verdict in verdicts if verdict.info is not None]
    problems = size_problems(store, infos)
    problems.update({verdict.step: verdict.problem for verdict in verdicts if verdict.info is None})
    # What latest() picks: the lineage of the manifest the store wrote last, first (lineage_ordered).
    ordered, _ = checkpoint_store.lineage_ordered(store, infos)
    newest_valid = next((info.step for info in reversed(ordered) if problems[info.step] is None), None)
    if getattr(args, "json", False):
        _print_json({
            "url": store.url,
            "newest_valid_step": newest_valid,
            "checkpoints": [_ls_record(verdict, newest_valid, problems[verdict.step]) for verdict in verdicts],
        })  # fmt: skip
        return EXIT_OK
    rows = [_ls_row(verdict, newest_valid, problems[verdict.step]) for verdict in verdicts]
    if newest_valid is None:
        footer = f"no valid checkpoint: all {len(rows)} committed checkpoints are damaged"
    else:
        footer = f"* newest valid checkpoint (what a resume uses): step {newest_valid}"
    console = rich_console(sys.stdout)
    if console is None:
        for line in plain_table(rows):
            print(line)
        print(footer)
    else:
        print_rich_table(console, rows, footer)
    return EXIT_OK


def _print_json(doc: dict[str, Any]) -> None:
    """One JSON object on stdout; strings from the store are data here (JSON escapes control bytes)."""
    print(json.dumps(doc, indent=2, sort_keys=False, allow_nan=False, default=str))


def _ls_record(verdict: Verdict, newest_valid: int | None, problem: str | None) -> dict[str, Any]:
    info = verdict.info
    if info is None:
        return {"step": verdict.step, "url": verdict.url, "created": None, "reason": None, "size_bytes": None,
                "framework": None, "valid": False, "problem": problem or "damaged", "newest_valid": False}  # fmt: skip
    return {
        "step": info.step,
        "url": info.url,
        "created": info.created.astimezone(timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
        "reason": info.reason,
        "size_bytes": info.size_bytes,
        "framework": info.framework,
        "valid": problem is None,
        "problem": problem,
        "newest_valid": info.step == newest_valid,
    }


def _ls_row(verdict: Verdict, newest_valid: int | None, problem: str | None) -> tuple[str, ...]:
    info = verdict.info
    if info is None:  # a manifest that cannot be trusted: only its step is known
        return ("", str(verdict.step), "?", "?", "?", "?", problem or "damaged")
    return (
        "*" if info.step == newest_valid else "",
        str(info.step),
        info.created.astimezone(timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
        info.reason,
        human_size(info.size_bytes),
        info.framework,
        problem or "ok",
    )


def newest_valid_lineage(
    store: CheckpointStore, infos: list[CheckpointInfo]
) -> tuple[list[CheckpointInfo], list[str]]:
    """The checkpoints up to the newest valid one (what ``ls`` marks and a resume uses), and one note
    per checkpoint committed after it, which speaks for another history (``report`` follows that one).

    Example:
        >>> newest_valid_lineage(CheckpointStore("memory://doc-cli/lineage"), [])
        ([], [])
    """
    ordered, stored_at = checkpoint_store.lineage_ordered(store, infos)  # latest()'s order
    newest = checkpoint_store.newest_valid(store, ordered, on_damaged=lambda info, problem: None)
    if newest is None:
        return infos, []
    # Committed before it by the store's clock, and not dated after it (the history speaks with its newest).
    committed_before = commit_order(stored_at)
    lineage = [
        info
        for info in infos
        if committed_before(info) <= committed_before(newest) and info.created <= newest.created
    ]
    notes = []
    for info in infos:
        if info in lineage:
            continue
        created = info.created.astimezone(timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")
        if lineage_of(info) != lineage_of(newest):
            what = "another lineage's (another run's); `latest` follows the lineage the store wrote last"
        else:
            what = "damaged" if info.step > newest.step else "a run that started again below it"
        notes.append(
            f"not in this report: step {info.step} ({info.reason}, committed {created}) is not in the history "
            f"of the newest valid checkpoint, step {newest.step}, which this report follows: {what}"
        )
    return lineage, notes


def _cmd_verify(args: argparse.Namespace, storage_options: dict[str, Any]) -> int:
    store = _open_store(args.url, storage_options, warm=not args.shallow)
    if args.step is None:
        committed_checkpoints = store.committed()
        if not committed_checkpoints:
            raise CheckpointNotFoundError(f"no committed checkpoints in {store.url}")
        info = committed_checkpoints[-1]
    else:
        info = store.read_manifest(args.step)
    what = "sizes checked" if args.shallow else "verified"
    if args.shallow:
        with busy(f"checking the sizes of {info.url} ({human_size(info.size_bytes)})"):
            store.verify(info.step, deep=False)
    else:  # every byte is read: on a terminal, the bars of a pull; piped, a line every ~10 s on stderr
        meter = TransferMeter("verify")
        with showing_progress(meter, f"verify {info.url}", verb="verified"):
            store.verify(info.step, deep=True, meter=meter)
    file_count = len(info.files)
    print(
        f"OK step {info.step}: {file_count} file{'' if file_count == 1 else 's'}, "
        f"{human_size(info.size_bytes)} {what}" + (" (--shallow: checksums not read)" if args.shallow else "")
    )
    return EXIT_OK


def _cmd_pull(args: argparse.Namespace, storage_options: dict[str, Any]) -> int:
    store = _open_store(args.url, storage_options, warm=True)
    info = store.latest() if args.step is None else store.read_manifest(args.step)
    if info is None:
        raise CheckpointNotFoundError(
            f"no valid committed checkpoint in {store.url}; `{PROG} ls` shows what is there"
        )
    step = info.step
    dest = Path(os.path.abspath(Path(args.dest).expanduser()))
    check_pull_dest(
        store.url, lambda step: checkpoint_store.committed_at(store, step), None, dest, force=args.force
    )  # stricter than the library: DEST is the user's
    meter = TransferMeter("pull")
    with showing_progress(meter, f"pull {info.url}", verb="pulled"):
        pulled = store.pull(step, dest, force=True, meter=meter)  # links, files and the cwd stay refused
    log.info("%s: pulled step %d from %s", PROG, step, store.url)
    print(pulled.resolve())
    return EXIT_OK


def _cmd_rm(args: argparse.Namespace, storage_options: dict[str, Any]) -> int:
    store = _open_store(args.url, storage_options)
    step: int = args.step
    checkpoint_store.refuse_foreign(store, step)
    if step not in store.step_folders():
        raise CheckpointNotFoundError(f"no checkpoint at step {step} in {store.url}; `{PROG} ls` lists them")
    try:
        info: CheckpointInfo | None = store.read_manifest(step)
    except (CheckpointNotFoundError, ManifestError):
        info = None  # an upload that never committed, or an unreadable manifest: safe to delete
    newest_valid = store.latest()
    if newest_valid is not None and newest_valid.step == step and not args.force:
        raise CliError(
            f"step {step} is the newest valid checkpoint in {store.url} (the one a resume uses); "
            "pass --force to delete it anyway"
        )
    if info is None:
        what = f"uncommitted folder {store.step_url(step)}"
    else:
        created = info.created.astimezone(timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")
        what = f"checkpoint {info.url} ({human_size(info.size_bytes)}, {info.reason}, created {created})"
    if not args.yes and not _confirm(f"delete {printable(what)}?"):
        print(f"{PROG}: not deleted", file=sys.stderr)
        return EXIT_ERROR
    store.delete(step)
    print(f"deleted {printable(what)}")
    return EXIT_OK


def _cmd_report(args: argparse.Namespace, storage_options: dict[str, Any]) -> int:
    if args.on_demand_price is not None and args.spot_price is None:
        raise CliError("--on-demand-price needs --spot-price too: the saving compares the two")
    store = _open_store(args.url, storage_options)
    committed_checkpoints = store.committed()
    if not committed_checkpoints:
        if args.json:
            _print_json({"url": store.url, "newest_step": None, "summary": {}, "recent_resumes": []})
        else:
            print(f"no committed checkpoints in {store.url}")
        return EXIT_OK
    lineage, notes = newest_valid_lineage(store, committed_checkpoints)
    history = RunHistory.from_checkpoints(store.url, lineage)
    newest = history.newest
    # A process killed before its lineage's first commit is billed to the lineage that came next.
    committed = {lineage_of(info) for info in committed_checkpoints}
    records = attempts_of_lineage(read_attempts(store), {lineage_of(info) for info in lineage}, committed)
    # None without records (runs written before them): the ledger's figures. One outcome per record.
    attempts = attempt_outcomes(records, resume_point=newest.step) if records else None
    rows = history_rows(history, args.spot_price, args.on_demand_price, attempts=attempts)
    resumes = resume_rows(history)
    kept = len(resumes)
    processes = attempt_table_rows(attempts) if attempts is not None else []
    processes_kept = len(processes)
    if not args.all:
        resumes = resumes[-REPORT_RESUME_ROWS:]
        processes = processes[-REPORT_RESUME_ROWS:]
    created = newest.created.astimezone(timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")
    if args.json:
        resume_records = list(history.ledger.recent_resumes)
        ledger = history.ledger
        attempt_docs = attempt_json(attempts) if attempts is not None else []
        _print_json({
            "url": store.url,
            "framework": newest.framework,
            "newest_step": newest.step,
            "newest_created": created,
            "summary": dict(rows),
            "notes": notes,
            "goodput": attempts.goodput if attempts is not None else ledger.goodput,
            "goodput_basis": "attempts" if attempts is not None else "ledger",
            "billed_s": attempts.billed_s if attempts is not None else ledger.billed_s,
            "lost_work_s": attempts.lost_s if attempts is not None else ledger.lost_work_s,
            "interruptions": history.interruptions,
            "ledger": ledger.to_json(),
            "recent_resumes": [
                r.to_json() for r in (resume_records if args.all else resume_records[-REPORT_RESUME_ROWS:])
            ],
            "attempts": attempt_docs if args.all else attempt_docs[-REPORT_RESUME_ROWS:],
        })  # fmt: skip
        return EXIT_OK
    process_title = f"processes ({len(processes)} of {processes_kept})"
    if len(processes) < processes_kept:
        process_title += "; --all lists every one"
    title = printable(f"{store.url} ({newest.framework}), newest checkpoint committed {created}")
    # The ledger's count covers resumes older than the records it keeps; never fewer than those.
    resume_title = f"recent resumes ({len(resumes)} of {max(history.ledger.resumes, kept)})"
    if len(resumes) < kept:
        resume_title += "; --all lists every one kept"
    # (title, headers, right-aligned columns, rows) of each table below the summary, shown when it has rows.
    tables = [
        (resume_title, RESUME_HEADERS, {1, 3, 4, 5, 6}, resumes),
        (process_title, ATTEMPT_HEADERS, {2, 4, 5, 6, 7}, processes),
    ]
    console = rich_console(sys.stdout)
    if console is None:
        print(title)
        for note in notes:
            print(printable(note))
        print(format_rows(rows))
        for table_title, headers, right_aligned, table_rows in tables:
            if table_rows:
                print(f"\n{table_title}")
                for line in plain_table(table_rows, headers, right_aligned=right_aligned):
                    print(f"  {line}")
        return EXIT_OK
    from rich import box
    from rich.table import Table
    from rich.text import Text

    for note in notes:
        console.print(printable(note), markup=False)
    summary = Table(title=Text(title), title_justify="left", show_header=False, box=box.SIMPLE)
    summary.add_column(style="bold", no_wrap=True)
    summary.add_column(overflow="fold")
    for label, value in rows:
        summary.add_row(Text(printable(label)), Text(printable(value)))
    console.print(summary)
    for table_title, headers, right_aligned, table_rows in tables:
        if not table_rows:
            continue
        table = Table(title=table_title, title_justify="left", header_style="bold", box=box.SIMPLE_HEAD)
        for col, header in enumerate(headers):
            table.add_column(header.lower(), justify="right" if col in right_aligned else "left")
        for row in table_rows:
            table.add_row(*(Text(printable(cell)) for cell in row))
        console.print(table)
    return EXIT_OK


def _cmd_plan(args: argparse.Namespace, storage_options: dict[str, Any]) -> int:
    inputs, rows = _plan_inputs(args, storage_options)
    plan = plan_job(
        work_hours=args.work_hours, spot_price=args.spot_price, on_demand_price=args.on_demand_price,
        interruptions_per_hour=inputs["interruptions_per_hour"], checkpoint_s=inputs["checkpoint_seconds"],
        resume_s=inputs["resume_seconds"],
    )  # fmt: skip
    rows.extend(plan_rows(plan))
    if args.plot:
        path = Path(args.plot).expanduser()
        try:
            write_plan_plot(plan, path)
        except ImportError:
            raise CliError("--plot needs matplotlib: pip install matplotlib") from None
        except OSError as err:
            raise CliError(f"cannot write the plot to {path}: {err.strerror or err}") from None
        rows.append(("plot", str(path)))
    console = rich_console(sys.stdout)
    if console is None:
        print(format_rows(rows, indent=""))
        return EXIT_OK
    from rich import box
    from rich.table import Table
    from rich.text import Text

    table = Table(show_header=False, box=box.SIMPLE)
    table.add_column(style="bold", no_wrap=True)
    table.add_column(overflow="fold")
    for label, value in rows:
        table.add_row(Text(printable(label)), Text(printable(value)))
    console.print(table)
    return EXIT_OK


def _plan_inputs(
    args: argparse.Namespace, storage_options: dict[str, Any]
) -> tuple[dict[str, float], list[tuple[str, str]]]:
    """The planner's three inputs (by argument name) and, with ``--from``, one row each saying where it came
    from: given on the command line, or measured by the run (read as ``report`` reads it)."""
    given = {dest: getattr(args, dest) for _, dest, _, _ in _PLAN_INPUTS if getattr(args, dest) is not None}
    if not args.url:
        return given, []
    store = _open_store(args.url, storage_options)
    committed_checkpoints = store.committed()
    if not committed_checkpoints:
        raise CliError(
            f"no committed checkpoints in {store.url}, so no ledger to plan from: --from needs a run that "
            f"committed a checkpoint (`{PROG} ls` shows what is there), or pass --checkpoint-seconds, "
            "--resume-seconds and --interruptions-per-hour without --from"
        )
    lineage, notes = newest_valid_lineage(store, committed_checkpoints)
    for note in notes:
        print(printable(note.replace("this report follows", "this plan follows")))
    measured = plan_inputs(RunHistory.from_checkpoints(store.url, lineage))
    values = dict(given)
    rows: list[tuple[str, str]] = []
    lacking: list[str] = []
    for flag, dest, field_name, label in _PLAN_INPUTS:
        shown = shown_rate if dest == "interruptions_per_hour" else shown_seconds
        found = getattr(measured, field_name)
        if dest in given:
            what = f"{shown(given[dest])}, given ({flag})"
            if found is not None:
                what += f"; the run measured {shown(found.value)}"
        elif found is not None:
            values[dest] = found.value
            what = f"{shown(found.value)}, from the run: {found.how}"
        else:
            lacking.append(f"the {label} ({measured.lacking[flag]}): pass {flag}")
            continue
        rows.append((label, what))
    if lacking:
        raise CliError(f"the ledger of {store.url} lacks " + "; ".join(lacking))
    return values, rows


SCRATCH_HEADERS = ("FOLDER", "DIRPATH", "SIZE", "LAST USE (UTC)", "HELD BY")


def _cmd_scratch(args: argparse.Namespace, storage_options: dict[str, Any]) -> int:
    base = Path(args.root).expanduser() if args.root else scratch_base()
    if not base.is_dir() or base.is_symlink():
        print(f"no scratch folders: {base} is not a folder")
        return EXIT_OK
    now = time.time()
    folders = [
        folder for folder in list_scratch(base)
        if args.older_than is None or now - folder.last_used >= args.older_than
    ]  # fmt: skip
    rows = [
        (
            folder.name, printable(folder.dirpath or "(unknown: made before scratch records)"), human_size(folder.size_bytes),
            datetime.fromtimestamp(folder.last_used, timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
            folder.held_by or "-",
        )
        for folder in folders
    ]  # fmt: skip
    total = human_size(sum(folder.size_bytes for folder in folders))
    print(f"{base}: {len(folders)} scratch folder{'' if len(folders) == 1 else 's'}, {total}")
    for line in plain_table(rows, SCRATCH_HEADERS, right_aligned={2}) if rows else ():
        print(line)
    if not args.clean:
        if args.dry_run:
            raise CliError(
                "--dry-run goes with --clean: `scratch --clean --dry-run` lists what --clean deletes"
            )
        return EXIT_OK
    if args.dry_run:
        doomed = [folder for folder in folders if not folder.held]
        print(
            f"would delete {count_of(len(doomed), 'folder')} "
            f"({human_size(sum(folder.size_bytes for folder in doomed))}); "
            f"would keep {len(folders) - len(doomed)} a live run holds; nothing deleted (--dry-run)"
        )
        for folder in doomed:
            print(
                f"  {folder.name}  {printable(folder.dirpath or '(unknown)')}  {human_size(folder.size_bytes)}"
            )
        return EXIT_OK
    deleted = [folder for folder in folders if not folder.held and delete_scratch_folder(folder, base)]
    held = [folder for folder in folders if folder not in deleted]
    print(
        f"deleted {len(deleted)} folder{'' if len(deleted) == 1 else 's'} "
        f"({human_size(sum(folder.size_bytes for folder in deleted))} freed); "
        f"kept {len(held)} a live run holds"
    )
    return EXIT_OK


# ------------------------------------------------------------------------------------ helpers
def parse_storage_options(text: str | None) -> dict[str, Any]:
    """The ``--storage-options`` value as a dict: a JSON object, or ``@FILE`` holding one (JSON or YAML).

    ``${NAME}`` in a value is the environment variable ``NAME``. Error messages never quote the
    value (it may hold credentials).

    Example:
        >>> parse_storage_options('{"endpoint_url": "http://localhost:9000"}')
        {'endpoint_url': 'http://localhost:9000'}
        >>> parse_storage_options("{endpoint_url: x}")
        Traceback (most recent call last):
        ...
        spot_callbacks.cli.commands.CliError: --storage-options is not valid JSON (Expecting property name enclosed in double quotes: line 1 column 2); pass a JSON object such as '{"endpoint_url": "http://localhost:9000"}'
    """
    if text is None:
        return {}
    try:
        return load_storage_options(text, source="--storage-options") or {}
    except ConfigError as err:
        raise CliError(str(err)) from None


def describe_error(err: BaseException, verbose: bool = False, url: str = "") -> str:
    """One line saying what went wrong: our own errors as they are; a store's with the cause and the fix
    that training's diagnosis gives (:mod:`spot_callbacks.store.diagnosis`), others with their type.

    Example:
        >>> describe_error(ValueError("bad"))
        'ValueError: bad (-v shows the traceback)'
        >>> describe_error(ConnectionRefusedError(111, "Connection refused"), url="s3://b/run")  # doctest: +ELLIPSIS
        "nothing accepts connections at the store's endpoint (...). Fix: check endpoint_url ..."
    """
    if isinstance(err, StoreUnavailableError):
        message = _store_unavailable(url or err.dirpath, err)
    elif isinstance(err, (CliError, CheckpointError, ConfigError)):
        message = str(err)
    else:
        protocol = fsspec.core.split_protocol(url)[0] or BARE_PATH_PROTOCOL
        bucket = url.split("://", 1)[-1].lstrip("/").split("/")[0]
        found = diagnose(err, protocol, bucket, reading=True)
        if found.specific:
            message = f"{found.cause}. Fix: {found.fix}"
        else:
            message = f"{type(err).__name__}: {err}" if str(err) else type(err).__name__
            if not verbose:
                message += " (-v shows the traceback)"
    return " ".join(message.split())


def _store_unavailable(url: str, err: StoreUnavailableError) -> str:
    # Training's wording ("could not list dirpath: ...") said for a read of a URL.
    cause = err.cause.partition(": ")[2] if err.cause.startswith("could not ") else err.cause
    return f"cannot read {url}: {cause}. Fix: {err.fix}".replace("in dirpath", "in the URL")


def size_problems(store: CheckpointStore, infos: list[CheckpointInfo]) -> dict[int, str | None]:
    """For each checkpoint, ``None`` when its files have the manifest's sizes, else the short reason.

    One listing per checkpoint, several at a time. Errors other than damage (network, permission)
    propagate.

    Example:
        >>> size_problems(CheckpointStore("memory://doc-cli/no-run"), [])
        {}
    """

    def check(info: CheckpointInfo) -> str | None:
        problem = store.damage(info)
        # The message names the file by its full URL; inside a table the file name says it.
        return None if problem is None else problem.removeprefix(f"{info.url}/")

    if not infos:
        return {}
    with ThreadPoolExecutor(max_workers=min(_SIZE_CHECK_THREADS, len(infos))) as pool:
        return dict(zip((info.step for info in infos), pool.map(check, infos), strict=True))


def _open_store(url: str, storage_options: dict[str, Any], warm: bool = False) -> CheckpointStore:
    """The store of ``url``, proven readable within training's preflight bounds, with something in it.
    ``warm``: build the payload clients meanwhile (a command that moves payload bytes).

    A store that cannot be read raises one line with the cause and the fix (no backend retries or
    tracebacks); a missing bucket, a missing folder and an empty prefix (a typo: an object store
    has no folders to miss) are errors that name it, and the closest name beside it.
    """
    try:
        store = CheckpointStore(url, storage_options=storage_options)
    except (SpotError, ImportError):
        raise
    except Exception as err:  # a backend that refuses its options as it is built
        raise CliError(f"cannot open {url}: {describe_error(err, verbose=True, url=url)}") from err
    if warm:
        store.warm_data_plane()
    if not probe_readable(store):
        raise CliError(f"nothing is stored under {store.url}{_nearby_names(store)}")
    return store


def _nearby_names(store: CheckpointStore) -> str:
    """``(...); did you mean ...?`` from the folder above (a prefix typo such as ``runs/dem0``), else what
    is there."""
    root = store.root.rstrip("/")
    parent, name = posixpath.dirname(root), posixpath.basename(root)
    if not parent or parent == root or "/" not in root.lstrip("/"):
        return " (no such folder or prefix; check the URL)"
    try:
        entries = call_with_timeout(
            lambda: list_folder(store.fs, parent), _HINT_TIMEOUT_S, "list the folder above"
        )
    except Exception:  # noqa: BLE001 - only a hint: the error already names the URL
        entries = []
    siblings = sorted({posixpath.basename(entry.rstrip("/")) for entry in entries} - {name, ""})
    close = difflib.get_close_matches(name, siblings, n=3, cutoff=0.6)
    if close:
        names = " or ".join(repr(store.url_of(posixpath.join(parent, sibling))) for sibling in close)
        return f" (no such folder or prefix); did you mean {names}?"
    if siblings:
        shown = ", ".join(siblings[:_HINT_NAMES]) + (", ..." if len(siblings) > _HINT_NAMES else "")
        return f" (no such folder or prefix; {store.url_of(parent)} holds: {shown})"
    return f" (no such folder or prefix, and nothing under {store.url_of(parent)} either; check the URL)"


def _confirm(question: str) -> bool:
    if not is_terminal(sys.stdin):
        raise CliError("refusing to delete without confirmation: stdin is not a terminal; pass --yes")
    sys.stderr.write(f"{question} [y/N] ")
    sys.stderr.flush()
    return sys.stdin.readline().strip().lower() in ("y", "yes")


def _print_error(message: str, redact: Redactor) -> None:
    print(f"{PROG}: error: {printable(redact(message), keep_newlines=True)}", file=sys.stderr)
