"""queue_tools: look inside a run's job queue and recover stale jobs.

    queue_tools ls      [RUN_DIR] [--json] [--watch] [--lease S]
    queue_tools cleanup [RUN_DIR] [--stale-after S] [--max-attempts K] [--keep-files K] [--keep-mb M] [--force]
                        [--dry-run] [--json]
    queue_tools report  [RUN_DIR] [--json]

cleanup also frees the /dev/shm weight buffers of the run's dead PS runs (a SIGKILLed PS
leaves them; each folder records its owner's pid and host, and only folders whose owner
is certainly dead on this host are freed).

With no RUN_DIR, the most recent run under $ASYNCGRPO_RUNS (default ~/asyncgrpo-runs).
A missing or non-run directory, or a bad flag: one line on stderr, exit status 2.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import signal
import sys
import time

from asyncgrpo.jobqueue import DEFAULT_MAX_ATTEMPTS, JobQueue, JobState, describe_error
from asyncgrpo.jobqueue.names import ArchiveReason, depth_line, done_reason, shown_name
from asyncgrpo.jobqueue.retention import compact_archive
from asyncgrpo.run import DEFAULT_LEASE_S, RunDir, RunDirError, fileops, latest_run, list_workers, metrics
from asyncgrpo.run.checkpoints import newest_complete_checkpoint
from asyncgrpo.run.liveness import HEARTBEAT_INTERVAL_S, fs_now, pid_alive
from asyncgrpo.weights.buffer_folders import SHM_ROOT, DeadFolder, remove_dead_folders

WATCH_INTERVAL_S = 1.0
TOOL_FAILURES_WARN = 0.5  # the share of a step's tool calls that failed from which health warns
SILENT_AFTER_S = 5.0  # a live worker whose heartbeat (every second) is this old while it holds jobs: said in health
# No step trained for this long while a worker has held a job as long: said in health (the PS's own log says so from
# 30 s on; a slow step of a large model is not a stall, so health waits longer).
TRAINER_WAIT_WARN_S = 120.0
DEADLINE_GRACE_S = 10.0  # a worker acts on a job's deadline within a second or two: past this, it could not


class _Parser(argparse.ArgumentParser):
    def error(self, message: str):  # one line, exit 2 (argparse would print the usage too)
        self.exit(2, f"queue_tools: error: {message}\n")


def _nonnegative(text: str) -> float:
    value = float(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {text}")
    return value


def _nonnegative_int(text: str) -> int:
    value = int(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {text}")
    return value


def _positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {text}")
    return value


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="queue_tools", description="Inspect and repair an asyncgrpo run's job queue.")
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)
    ls = sub.add_parser("ls", help="queue depth per state, workers, stale jobs, archive counts, health")
    ls.add_argument("run_dir", nargs="?", help="run directory (default: the most recent run)")
    ls.add_argument("--json", action="store_true", help="print one JSON object instead of text")
    ls.add_argument("--watch", action="store_true", help="refresh in place every second until Ctrl-C")
    ls.add_argument("--lease", type=_nonnegative, default=None,
                    help="seconds of silence after which a worker's job counts as stale (default: the run's "
                         f"--lease_s, {DEFAULT_LEASE_S:g} where its PS did not record one)")
    cleanup = sub.add_parser("cleanup", help="recover stale jobs, reap old temp files, archive junk, "
                                             "free a dead PS's weight buffers")
    cleanup.add_argument("run_dir", nargs="?", help="run directory (default: the most recent run)")
    cleanup.add_argument("--stale-after", type=_nonnegative, default=None, metavar="SECONDS",
                         help="lease: silence after which a job is recovered (default: the run's --lease_s, "
                              f"{DEFAULT_LEASE_S:g} where its PS did not record one)")
    cleanup.add_argument("--max-attempts", type=_positive_int, default=None, metavar="K",
                         help="archive a job as orphaned after K attempts (default: the run's --max_attempts, "
                              f"{DEFAULT_MAX_ATTEMPTS} where its PS did not record one)")
    cleanup.add_argument("--force", action="store_true",
                         help="with --stale-after under the workers' heartbeat interval: recover the jobs of live "
                              "workers too")
    cleanup.add_argument("--keep-files", type=_nonnegative_int, default=0, metavar="K",
                         help="archive retention: empty done/ files beyond the newest K, names kept (default 0: all)")
    cleanup.add_argument("--keep-mb", type=_nonnegative, default=0.0, metavar="M",
                         help="archive retention: empty done/ files beyond the newest M MB (default 0: all)")
    cleanup.add_argument("--dry-run", action="store_true", help="say what would be done, touch nothing")
    cleanup.add_argument("--json", action="store_true", help="print one JSON object instead of text")
    report = sub.add_parser("report", help="timings, throughput, utilisation, bottleneck; trace.json and plots")
    report.add_argument("run_dir", nargs="?", help="run directory (default: the most recent run)")
    report.add_argument("--json", action="store_true", help="print one JSON object instead of text")
    return parser


def inspect_run(run: RunDir, lease_s: float = DEFAULT_LEASE_S) -> dict:
    """Everything `ls` shows, as plain data. Scans queue/ and done/ names only (no payloads)."""
    queue = JobQueue(run)
    now = fs_now(run)
    names, junk = queue.scan()
    counts = {s.value: 0 for s in JobState}
    oldest_pending = None
    held: dict[str, list] = {}  # worker id -> [job id, seconds since the worker claimed it (or fenced it)]
    for name in names:
        counts[name.state.value] += 1
        if name.state not in (JobState.PENDING, JobState.PROCESSING, JobState.COMMITTING):
            continue
        try:
            age = now - os.lstat(queue.path(name)).st_mtime  # pending: since thrown; held: since claimed
        except FileNotFoundError:
            continue
        if name.state is JobState.PENDING:
            oldest_pending = age if oldest_pending is None else max(oldest_pending, age)
        else:
            held.setdefault(str(name.device), []).append([name.job_id, round(age, 3)])
    done = {r.value: 0 for r in ArchiveReason}
    done_other = 0
    newest_failed = (0.0, None)  # (ctime, path) of the newest job archived failed
    ps = run.read_ps_status()
    failed_since_ps_start = 0  # (those before: a relaunch's history, a reward function fixed since, say)
    unreadable_since_ps_start = 0  # files archived failed_load: corrupt, hostile, or emptied by compaction
    for entry in fileops.scan(run.done):
        reason = done_reason(entry.name)
        if reason is None:
            done_other += 1
        else:
            done[reason.value] += 1
        if reason in (ArchiveReason.FAILED, ArchiveReason.FAILED_LOAD):
            try:
                archived_at = entry.stat(follow_symlinks=False).st_ctime  # (the archiving rename's)
            except FileNotFoundError:
                continue
            since_ps_start = ps is None or archived_at >= ps.started_at
            if reason is ArchiveReason.FAILED_LOAD:
                unreadable_since_ps_start += since_ps_start
                continue
            newest_failed = max(newest_failed, (archived_at, entry.path))
            failed_since_ps_start += since_ps_start
    job_timeout_s = ps and ps.job_timeout_s
    stale = [a for a in queue.recover(lease_s=lease_s, dry_run=True, job_timeout_s=job_timeout_s)
             if a.job_id is not None]
    workers = [{**w.as_dict(), "held": sorted(held.get(str(w.device), []))} for w in list_workers(run, now, lease_s)]
    global_step = run.read_global_step()
    try:
        ps_beat_age = now - os.stat(run.ps_heartbeat_file).st_mtime
    except OSError:
        ps_beat_age = None
    report = {
        "run_dir": str(run.root),
        "lease_s": lease_s,
        **counts,
        "oldest_pending_age_s": None if oldest_pending is None else round(oldest_pending, 3),
        "workers": workers,
        "stale": [a.job_id for a in stale],
        "stale_details": [a.line() for a in stale],
        "junk": [e.name for e in junk],
        "done": done,
        "done_other": done_other,
        "last_failure": newest_failed[1] and failure_of(newest_failed[1]),
        "failed_since_ps_start": failed_since_ps_start,
        "unreadable_since_ps_start": unreadable_since_ps_start,
        "global_step": global_step,
        "checkpoint": (folder := newest_complete_checkpoint(run.checkpoints)) and folder.name,
        "ps": None if ps is None else {"pid": ps.pid, "host": ps.host, "state": ps.state, "mps": ps.mps,
                                       "job_timeout_s": ps.job_timeout_s, "started_at": ps.started_at,
                                       "alive": pid_alive(ps.pid, ps.host),
                                       "heartbeat_age_s": None if ps_beat_age is None else round(ps_beat_age, 3)},
        "last_step": last_logged_step(run),
    }
    since_start = None if ps is None else time.time() - ps.started_at
    try:  # written after every step (metrics.jsonl only every logging_steps); not before this PS's start
        since_last_step = now - os.stat(run.global_step_file).st_mtime
        since_last_step = since_last_step if since_start is None else min(since_last_step, since_start)
    except OSError:  # no step yet: since this PS started
        since_last_step = since_start
    report["since_last_step_s"] = None if since_last_step is None else round(max(0.0, since_last_step), 3)
    report["health"] = _health(report)
    return report


def failure_of(path) -> str | None:
    """The last error of a job archived ``failed`` (describe_error), or None when its payload is gone (emptied by
    archive retention) or holds none."""
    try:
        errors = fileops.load_payload(path)["data"]["errors"]
        return describe_error(errors[-1])
    except (fileops.PayloadLoadError, OSError, KeyError, TypeError, IndexError, AttributeError):
        return None


def last_logged_step(run: RunDir) -> dict | None:
    """The newest line of RUN/metrics.jsonl, read from its tail: every field a step logs (asyncgrpo/run/metrics.py
    StepMetrics), so a new metric reaches ``ls --json`` with nothing to add here."""
    return metrics.last_line(run.metrics_file)


def _health(report: dict) -> str:
    problems = []
    dead = [w for w in report["workers"] if not w["alive"] and w["state"] != "stopped"]
    alive = [w for w in report["workers"] if w["alive"]]
    ps = report["ps"]
    if ps is not None and ps["state"] == "training":
        if not ps["alive"]:
            problems.append(f"the parameter server (pid {ps['pid']}) is not running: relaunch on this run directory "
                            + (f"to resume from {report['checkpoint']}" if report["checkpoint"] else
                               "(no checkpoint saved yet: it starts from the beginning)"))
        elif (ps["heartbeat_age_s"] or 0) > SILENT_AFTER_S:
            problems.append(f"the parameter server (pid {ps['pid']} on {ps['host']}) silent for "
                            f"{ps['heartbeat_age_s']:.0f}s (stopped or swapped out?): the workers wait for it")
    problems += _stuck(report)
    if report["stale"]:
        problems.append(f"{len(report['stale'])} stale job(s)")
    for w in alive:
        if w.get("bad_delta"):
            problems.append(f"dev{w['device']} found v{w['bad_delta'][1]}'s weights delta bad on disk: it keeps older "
                            "weights until the next anchor (the parameter server publishes one while it waits)")
        if w["held"] and (w["heartbeat_age_s"] or 0) > SILENT_AFTER_S:
            problems.append(f"dev{w['device']} silent for {w['heartbeat_age_s']:.0f}s holding {len(w['held'])} "
                            f"job(s) (stopped or swapped out? its jobs come back after the lease)")
        elif w.get("remote") and (w["heartbeat_age_s"] or 0) > SILENT_AFTER_S:
            # (another host's: no lock or pid to go by, only its heartbeat's age)
            problems.append(f"dev{w['device']} on host {w['host']} silent for {w['heartbeat_age_s']:.0f}s (killed, "
                            f"or cut off?): counted dead once its heartbeat is {report['lease_s']:g}s old (the lease)")
        elif (w["heartbeat_age_s"] or 0) > report["lease_s"]:  # (alive by its lock, and nothing heard for a lease)
            problems.append(f"dev{w['device']} silent for {w['heartbeat_age_s']:.0f}s, past the lease (stopped or "
                            f"swapped out? kill -CONT {w['pid']} resumes a stopped process)")
    if dead:
        problems.append(f"{len(dead)} dead worker(s)")
    if report["junk"]:
        problems.append(f"{len(report['junk'])} file(s) outside the queue grammar")
    last = report["last_step"]
    if note := metrics.learning_note(last):
        problems.append(note)
    if last is not None and (last.get("tool_failure_rate") or 0) >= TOOL_FAILURES_WARN:
        problems.append(f"{last['tool_failure_rate']:.0%} of the tool calls failed at step {last['step']} (the "
                        "workers' logs name the errors: their [tools] lines)")
    if report["pending"] and not alive:
        problems.append("jobs are pending but no worker is alive")
    if report["failed_since_ps_start"]:
        problems.append(f"{report['failed_since_ps_start']} job(s) failed on every attempt and were not trained on "
                        f"(last error: {report['last_failure'] or 'not kept'})")
    if report["unreadable_since_ps_start"]:
        problems.append(f"{report['unreadable_since_ps_start']} file(s) could not be read and were archived "
                        "failed_load (corrupt, hostile, or a result emptied by compaction: the PS's log names each)")
    if report["done"]["orphaned"]:
        problems.append(f"{report['done']['orphaned']} job(s) orphaned (their workers died on every attempt) and "
                        "not trained on")
    if problems:
        ps = report["ps"]
        recovering = ps is not None and ps["state"] == "training" and ps["alive"]
        hint = "" if not (report["stale"] or report["junk"]) else (
            "; the running parameter server recovers them itself" if recovering else "; run `queue_tools cleanup`")
        return "WARN: " + ", ".join(problems) + hint
    return f"OK: {len(alive)} worker(s) alive, no stale jobs"


def _stuck(report: dict) -> list[str]:
    """What health says of jobs that do not end and of workers nobody will stop."""
    problems = []
    ps, alive = report["ps"], [w for w in report["workers"] if w["alive"]]
    held = sorted(((age, job, w) for w in alive for job, age in w["held"]), key=lambda item: -item[0])
    timeout_s = ps and ps.get("job_timeout_s")
    overdue = [(age, job, w) for age, job, w in held if timeout_s and age > timeout_s + DEADLINE_GRACE_S]
    for age, job, w in overdue:
        problems.append(f"job {job} held by dev{w['device']} for {age:.0f}s, past its deadline (--job_timeout_s "
                        f"{timeout_s:g}): stuck where the worker cannot act on it; recovery takes it back after the "
                        f"lease (`kill -USR1 {w['pid']}` logs where each thread is)")
    waited = report["since_last_step_s"]
    if (ps is not None and ps["state"] == "training" and ps["alive"] and held and not overdue
            and waited is not None and waited > TRAINER_WAIT_WARN_S and held[0][0] > TRAINER_WAIT_WARN_S):
        age, job, w = held[0]
        problems.append(f"no step trained for {waited:.0f}s while workers hold jobs: the oldest, {job}, held by "
                        f"dev{w['device']} for {age:.0f}s (a reward function or tool that does not return? "
                        f"`kill -USR1 {w['pid']}` logs where each thread is; --job_timeout_s ends it)")
    if ps is not None and (ps["state"] == "finished" or not ps["alive"]):
        unsupervised = [w for w in alive if w["state"] != "stopped"
                        and not (w.get("supervisor_pid") and pid_alive(w["supervisor_pid"], w["host"]))]
        if unsupervised:
            ended = "finished" if ps["state"] == "finished" else "stopped"
            problems.append(f"{len(unsupervised)} worker(s) alive beside a parameter server that has {ended}, with no "
                            "launch.sh to stop them: stop them (kill " +
                            " ".join(str(w["pid"]) for w in unsupervised) + ")")
    return problems


def _age(seconds) -> str:
    # (a heartbeat written since the fs clock was read is a few ms in the future: "-0.0s" read oddly)
    return "-" if seconds is None else f"{max(seconds, 0.0):.1f}s"


def format_report(r: dict) -> str:
    lines = [f"run: {r['run_dir']}" + (f"  (global step {r['global_step']})" if r["global_step"] is not None else "")]
    lines.append(f"queue: {depth_line(r, every_state=True)} (oldest pending {_age(r['oldest_pending_age_s'])})")
    last = r["last_step"]
    if last is not None:
        lines.append(f"training: {metrics.step_words(last)}")
    ps = r["ps"]
    if ps is None:
        lines.append("parameter server: none yet (no ps.json)")
    else:
        lines.append(f"parameter server: pid {ps['pid']} on {ps['host']}, {ps['state']}, "
                     + (f"alive (heartbeat {_age(ps['heartbeat_age_s'])} ago)" if ps["alive"] else "not running"))
    if ps is not None and ps.get("mps"):
        lines.append(f"NVIDIA MPS: {ps['mps']}")
    lines.append(f"workers: {len(r['workers'])}")
    for w in r["workers"]:
        lines.append(f"  dev{w['device']:<3} pid {w['pid'] or '-':<8} {'alive' if w['alive'] else 'dead ':<5} "
                     f"{(w['state'] or '-'):<8} heartbeat {_age(w['heartbeat_age_s'])} ago"
                     + (f" (on host {w['host']}: counted dead once {r['lease_s']:g}s old)" if w.get("remote") else "")
                     + (f"  holds {', '.join(f'{job} (for {_age(age)})' for job, age in w['held'])}" if w["held"]
                        else "  holds nothing")
                     + (f"  weights v{w['weights_version']}" if w["weights_version"] is not None else "")
                     + (f"  recompiles {w['recompiles']}" if w.get("recompiles") else ""))
    lines.append(f"stale: {len(r['stale'])}")
    lines += [f"  {detail}" for detail in r["stale_details"]]
    if r["junk"]:
        lines.append(f"outside the grammar: {', '.join(shown_name(name) for name in r['junk'][:10])}")
    archived = [f"{reason} {n}" for reason, n in r["done"].items() if n]
    if r["done_other"]:
        archived.append(f"other {r['done_other']}")
    lines.append("done (files, by reason): " + (" | ".join(archived) if archived else "empty"))
    if earlier := r["done"]["failed"] - r["failed_since_ps_start"]:
        lines.append(f"history: {earlier} job(s) failed on every attempt before this parameter server started (their "
                     "errors are in done/; a relaunch after a fix no longer meets them)")
    lines.append(f"health: {r['health']}")
    return "\n".join(lines)


def run_settings(run: RunDir, lease_s: float | None, max_attempts: int | None = None) -> tuple[float, int]:
    """The lease and attempts ls and cleanup go by: those given, else the run's (its PS's --lease_s and
    --max_attempts, in ps.json), else the defaults."""
    ps = run.read_ps_status()
    lease = lease_s if lease_s is not None else (ps and ps.lease_s) or DEFAULT_LEASE_S
    attempts = max_attempts if max_attempts is not None else (ps and ps.max_attempts) or DEFAULT_MAX_ATTEMPTS
    return lease, attempts


def cmd_ls(run: RunDir, args) -> int:
    args.lease = run_settings(run, args.lease)[0]
    if not args.watch:
        report = inspect_run(run, args.lease)
        print(json.dumps(report, indent=2) if args.json else format_report(report))
        return 0
    signal.signal(signal.SIGINT, signal.default_int_handler)  # Ctrl-C, even if started with SIGINT ignored
    try:
        while True:
            report = inspect_run(run, args.lease)
            text = json.dumps(report) if args.json else format_report(report)
            sys.stdout.write("\033[H\033[J" + text + f"\n\n(refreshing every {WATCH_INTERVAL_S:g}s; Ctrl-C to stop)\n")
            sys.stdout.flush()
            time.sleep(WATCH_INTERVAL_S)
    except KeyboardInterrupt:
        return 0


def training_is_over(run: RunDir) -> bool:
    """The run's PS finished training (RUN/ps.json) and is gone: nothing in queue/ will be trained on."""
    ps = run.read_ps_status()
    return ps is not None and ps.state == "finished" and not pid_alive(ps.pid, ps.host)


def cmd_cleanup(run: RunDir, args) -> int:
    if args.stale_after is not None and args.stale_after < HEARTBEAT_INTERVAL_S and not args.force:
        print(f"queue_tools: error: --stale-after {args.stale_after:g} is under the workers' heartbeat interval "
              f"({HEARTBEAT_INTERVAL_S:g} s): every job a worker on another host holds would count as stale, a live "
              "worker's too; pass --force to recover them anyway", file=sys.stderr)
        return 2
    lease_s, max_attempts = run_settings(run, args.stale_after, args.max_attempts)
    # A finished run's leftovers (a worker stopped or killed with a job in hand, a job given back) are archived
    # unused: re-queued, they would wait for a worker and a PS that will not come.
    over = training_is_over(run)
    queue = JobQueue(run)
    ps = run.read_ps_status()
    actions = queue.recover(lease_s=lease_s, max_attempts=max_attempts, dry_run=args.dry_run,
                            requeue=not over, job_timeout_s=ps and ps.job_timeout_s)
    if over:
        actions += queue.archive_leftovers(dry_run=args.dry_run)
    retention = None
    if args.keep_files or args.keep_mb:
        retention = compact_archive(run, args.keep_files, args.keep_mb, dry_run=args.dry_run)
    freed = remove_dead_folders(run, (SHM_ROOT, run.weights), dry_run=args.dry_run)
    if args.json:
        print(json.dumps({"run_dir": str(run.root), "dry_run": args.dry_run,
                          "actions": [a.__dict__ for a in actions],
                          "retention": retention and retention.as_dict(),
                          "weight_buffers": [{"path": str(f.path), "pid": f.pid, "buffers": f.buffers,
                                              "bytes": f.nbytes} for f in freed]}, indent=2))
        return 0
    for action in actions:
        print(("would " if args.dry_run else "") + action.line())
    if retention is not None:
        print(retention.line())
    for line in _freed_lines(freed, "would free" if args.dry_run else "freed"):
        print(line)
    done = len(actions) + len(freed) + (len(retention.compacted) if retention is not None else 0)
    summary = f"cleanup: {done} action(s)" if done else "cleanup: nothing to do"
    print(summary + (" (dry run: nothing changed)" if args.dry_run and done else ""))
    return 0


def _freed_lines(freed: list[DeadFolder], verb: str) -> list[str]:
    """One line per dead PS: "freed N weight buffers of dead PS pid P: X MB"."""
    by_pid: dict = {}
    for f in freed:
        buffers, nbytes = by_pid.get(f.pid, (0, 0))
        by_pid[f.pid] = (buffers + f.buffers, nbytes + f.nbytes)
    return [f"{verb} {n} weight buffers of dead PS {'pid ' + str(pid) if pid is not None else '(no owner record)'}: "
            f"{nbytes / 1e6:.1f} MB" for pid, (n, nbytes) in by_pid.items()]


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    # The commands print what they do themselves; the library's own log lines would repeat it.
    queue_log = logging.getLogger("asyncgrpo.queue")
    level = queue_log.level
    queue_log.setLevel(logging.ERROR)
    try:
        return _run_command(args)
    finally:
        queue_log.setLevel(level)  # main() is also called in-process (tests, other tools)


def _run_command(args) -> int:
    try:
        run = RunDir.open(args.run_dir) if args.run_dir else latest_run()
    except RunDirError as err:
        print(f"queue_tools: error: {err}", file=sys.stderr)
        return 2
    # What it writes (the report, a re-thrown job's new file) follows the run's modes, as the PS set them.
    umask = fileops.set_file_modes(run.shared_with_group)
    try:
        if args.command == "report":
            from queue_tools.report import cmd_report
            return cmd_report(run, args)
        return cmd_ls(run, args) if args.command == "ls" else cmd_cleanup(run, args)
    except BrokenPipeError:  # `queue_tools ls | head`: the reader has what it wanted
        # (and Python's own flush of stdout at exit would fail again: stdout now goes nowhere)
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0
    except OSError as err:
        print(f"queue_tools: error: {err}", file=sys.stderr)
        return 1
    finally:
        os.umask(umask)  # main() is also called in-process
