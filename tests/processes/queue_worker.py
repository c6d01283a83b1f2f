"""A queue worker process for the tests: the real claim/complete protocol with an echo "model".

    python tests/processes/queue_worker.py RUN --device N [--until-empty] [--max-jobs K]
        [--crash-at after_claim|mid_result_write|after_fence|before_archive]
        [--stop-at after_claim|after_fence] [--claim-only] [--wait-for-go] [--no-fsync]

--crash-at SIGKILLs this process at that protocol step; --stop-at SIGSTOPs it there (the
test resumes it with SIGCONT). --claim-only claims until the queue is empty and prints the
claimed job ids (the race test). Prints one JSON line per job.
"""

import argparse
import json
import os
import signal
import sys
import threading

from asyncgrpo.jobqueue import ArchiveReason, JobQueue, JobState, QueueWatcher
from asyncgrpo.run import RunDir, WorkerPresence, fileops


def signal_self(sig):
    sys.stdout.flush()
    os.kill(os.getpid(), sig)


def arm(point: str | None, sig) -> None:
    """Wraps the library call at ``point`` so that this process gets ``sig`` there."""
    if point == "mid_result_write":
        write_all = fileops._write_all

        def half_then_signal(fd, data):
            if "/queue/.tmp/" in os.readlink(f"/proc/self/fd/{fd}"):  # the result, not a heartbeat
                write_all(fd, data[: len(data) // 2])
                os.fsync(fd)
                signal_self(sig)
            write_all(fd, data)

        fileops._write_all = half_then_signal
    elif point == "after_fence":
        publish = fileops.publish

        def signal_then_publish(*args, **kwargs):
            signal_self(sig)
            return publish(*args, **kwargs)

        fileops.publish = signal_then_publish
    elif point == "before_archive":
        archive = JobQueue.archive_if_present

        def signal_before_processed(self, path, job_id, reason, attempt=1):
            if reason is ArchiveReason.PROCESSED:
                signal_self(sig)
            return archive(self, path, job_id, reason, attempt)

        JobQueue.archive_if_present = signal_before_processed


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("run_dir")
    parser.add_argument("--device", type=int, required=True)
    parser.add_argument("--until-empty", action="store_true")
    parser.add_argument("--max-jobs", type=int)
    parser.add_argument("--crash-at")
    parser.add_argument("--stop-at")
    parser.add_argument("--claim-only", action="store_true")
    parser.add_argument("--wait-for-go", action="store_true")
    parser.add_argument("--no-fsync", action="store_true")
    args = parser.parse_args()

    run = RunDir.open(args.run_dir)
    queue = JobQueue(run, fsync=not args.no_fsync)
    presence = WorkerPresence(run, args.device).start()
    queue.recover(own_device=args.device)
    arm(args.crash_at, signal.SIGKILL)
    arm(args.stop_at, signal.SIGSTOP)
    if args.wait_for_go:
        print("ready", flush=True)
        sys.stdin.readline()

    if args.claim_only:
        claimed = []
        while (job := queue.claim(args.device)) is not None:
            claimed.append(job.job_id)
        print(json.dumps(claimed), flush=True)
        presence.stop()
        return 0

    watcher = QueueWatcher(run.queue, {JobState.PENDING})
    done = 0
    while args.max_jobs is None or done < args.max_jobs:
        job = queue.claim(args.device)
        if job is None:
            if args.until_empty:
                break
            watcher.wait()
            continue
        presence.update(job_id=job.job_id, state="busy")
        if args.crash_at == "after_claim":
            signal_self(signal.SIGKILL)
        if args.stop_at == "after_claim":
            signal_self(signal.SIGSTOP)
        published = queue.complete(job, {"echo": job.data, "device": args.device}, weights_version=0)
        print(json.dumps({"job_id": job.job_id, "attempt": job.attempt, "published": published}), flush=True)
        presence.update(job_id=None, state="idle")
        done += 1
    watcher.close()
    presence.stop()
    return 0


if __name__ == "__main__":
    assert threading.current_thread() is threading.main_thread()
    sys.exit(main())
