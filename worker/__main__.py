"""Run one worker:

    python -m worker --device N --run_dir RUN [config flags, the same as the PS's]
    python -m worker --join --device N --run_dir RUN [...]   # on a host other than the PS's
    python -m worker --help       # every flag

launch.sh starts one per GPU (or CPU slot) and restarts it if it dies. Exit status: 0
stopped (SIGTERM, Ctrl-C), 2 bad arguments, a worker already running on that device, or a
model that cannot take the PS's weights (another base model under a LoRA adapter, ...) or
that cannot be built (a library refusing a flag, ...: a restart would fail the same way),
3 its GPU failed (worker.loop.EXIT_DEVICE_BROKEN), 4 a job ran past --job_timeout_s
(worker.deadline.EXIT_JOB_DEADLINE: that attempt failed, its other jobs given back), 1 anything else, a full
disk among it (launch.sh restarts the worker: the disk may have room again).

``--join`` (what ``launch.sh --join`` passes): the worker's id carries this host's id,
``dev{N}.{host id}`` (asyncgrpo/run/hosts.py), so that worker N of every host has names
of its own; RUN must already be a run directory.
"""

import argparse
import logging
import sys

from asyncgrpo.config import ConfigError
from asyncgrpo.config_parser import parse_config
from asyncgrpo.messages import quiet_library_deprecations
from asyncgrpo.run import RunDir, RunDirError, WorkerAlreadyRunning
from asyncgrpo.run.fileops import DISK_FULL, set_file_modes
from asyncgrpo.run.hosts import HOST_ID
from asyncgrpo.run.rundir import parse_worker_id, worker_id
from asyncgrpo.weights.layout import WeightsMismatch, WeightsOutOfReach
from worker.loop import WorkerSetupError, run_worker

DESCRIPTION = ("An asyncgrpo worker: claims generation jobs from RUN/queue, generates and scores them with TRL's "
               "code and the PS's newest weights. --device N (required): this worker's device number (devN in file "
               "names). Every other flag below, the same as the parameter server's.")


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if "-h" in argv or "--help" in argv:
        parse_config(["--help"], prog="python -m worker --device N", description=DESCRIPTION)  # prints, exits 0
    own = argparse.ArgumentParser(prog="python -m worker", add_help=False)
    own.add_argument("--device", type=int, required=True, help="this worker's device number (dev N in file names)")
    own.add_argument("--join", action="store_true", help="a worker on another host than the PS's")
    own.error = _bad_input
    args, rest = own.parse_known_args(argv)
    device = worker_id(args.device, HOST_ID if args.join else None)
    if parse_worker_id(str(device)) is None:  # its files would be outside the grammar, and archived as junk
        _bad_input(f"--device {args.device}: must be a number from 0 to 999 (it names the worker's files: devN)")
    logging.basicConfig(level=logging.INFO, format=f"%(asctime)s worker{device} %(levelname)s %(message)s")
    quiet_library_deprecations()
    try:
        cfg = parse_config(rest)
        if cfg.run_dir is None:
            raise ConfigError("--run_dir is required for a worker")
        # create, not open: a worker may start before its PS has made the layout (both are
        # idempotent); it then waits for the PS's ps.json and first weights. One that joins
        # from another host joins a run that exists.
        if args.join:
            run = RunDir.open(cfg.run_dir)
            set_file_modes(cfg.share_with_group)
        else:
            run = RunDir.create(cfg.run_dir, cfg.share_with_group)
        return run_worker(cfg, run, device)
    except (ConfigError, OSError, RunDirError, WorkerAlreadyRunning, WeightsMismatch, WeightsOutOfReach,
            WorkerSetupError) as err:
        if isinstance(err, OSError) and err.errno in DISK_FULL:  # (not bad input: a restart may do)
            print(f"worker: error: no space left on the disk: {err}", file=sys.stderr)
            return 1
        print(f"worker: error: {err}", file=sys.stderr)
        return 2


def _bad_input(message: str):
    print(f"worker: error: {message}", file=sys.stderr)
    sys.exit(2)


if __name__ == "__main__":
    sys.exit(main())
