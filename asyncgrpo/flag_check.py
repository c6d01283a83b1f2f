"""A flag that is not one is refused in a fraction of a second, before torch, transformers and TRL are imported
(10-20 s on a small machine): launch.sh runs ``python -m asyncgrpo.flag_check FLAGS...`` first.

The flags are TRL's and transformers' dataclasses' fields and asyncgrpo's (asyncgrpo/config.py): knowing them means
importing those libraries. So the full parse (asyncgrpo.config_parser.parse_config) records the flags it knows in this
environment (``sys.prefix``), keyed by the versions of TRL and transformers and by asyncgrpo's config source; a
later check whose key matches refuses an unknown flag with the full parse's own line. Without a record that matches
(the first launch, an upgrade) it says nothing, and the full parse decides, as before.
"""

from __future__ import annotations

import difflib
import hashlib
import json
import os
import sys
from importlib import metadata
from pathlib import Path

RECORD = Path(sys.prefix) / "asyncgrpo-flags.json"
SOURCES = ("config.py", "peft_args.py", "config_parser.py")  # asyncgrpo's own flags, and how they are parsed


def key() -> str:
    """What the known flags depend on: TRL's and transformers' versions and asyncgrpo's config source."""
    digest = hashlib.sha256()
    for package in ("trl", "transformers"):
        try:
            digest.update(f"{package}={metadata.version(package)};".encode())
        except metadata.PackageNotFoundError:
            digest.update(f"{package}=?;".encode())
    for name in SOURCES:
        digest.update((Path(__file__).with_name(name)).read_bytes())
    return digest.hexdigest()


def record(known: set[str]) -> None:
    """Writes the flags the full parse knows (best effort: an environment it cannot write to keeps no record)."""
    try:
        text = json.dumps({"key": key(), "known": sorted(known)})
        if not RECORD.is_file() or RECORD.read_text() != text:
            tmp = RECORD.with_name(f"{RECORD.name}.{os.getpid()}.tmp")  # (workers start together)
            tmp.write_text(text)
            tmp.replace(RECORD)
    except OSError:
        pass


# Flags of earlier TRL releases that users still type, and what this one does instead.
REMOVED = {
    "max_prompt_length": "this TRL has no such flag and does not cut prompts; a prompt that with "
                         "--max_completion_length would not fit the model's positions is refused before the run "
                         "starts (docs/options.md)",
    "warmup_ratio": "transformers 5 has no such flag: --warmup_steps takes a fraction of the run's steps as well (a "
                    "value below 1, e.g. --warmup_steps 0.1)",
}


# launch.sh's own flags (it passes the others on): a typo of one reaches the parse as a flag of its own.
LAUNCH_SH_FLAGS = ("--workers", "--ps-procs", "--run-dir", "--max-steps", "--device", "--mps")


def unknown_flag(argv: list[str], known: set[str]) -> str | None:
    """The full parse's line for the first flag of ``argv`` not among ``known``; None when all are."""
    spelled = sorted({"--" + o[2:].replace("-", "_") for o in known})  # (each flag also has a --dashed-form)
    for arg in argv:
        flag = arg.split("=", 1)[0]
        if flag.startswith("--") and flag not in known:
            return f"{flag}: not a flag" + could_mean("--" + flag[2:].replace("-", "_"), spelled, LAUNCH_SH_FLAGS)
    return None


def could_mean(typed: str, among: list[str], launch_sh: tuple[str, ...] = ()) -> str:
    """What ``typed`` could be a typo or an abbreviation of, as the end of a refusal's line (for a flag TRL
    removed, what it does instead); ``launch_sh``: launch.sh's own flags, named as its."""
    if (instead := REMOVED.get(typed.removeprefix("--"))) is not None:
        return f": {instead}"

    def close_to(names: list[str]) -> list[str]:  # (an abbreviation, or the end of a longer name: --decoding)
        suffix = "_" + typed.removeprefix("--")
        return ([o for o in names if o.startswith(typed) or o.endswith(suffix)]
                or difflib.get_close_matches(typed, names, n=3, cutoff=0.75))

    candidates = close_to(among)[:5]
    launcher = {f"--{flag[2:].replace('-', '_')}": flag for flag in launch_sh}
    candidates += [f"launch.sh's {launcher[o]}" for o in close_to(sorted(launcher)) if o not in candidates]
    return f"; did you mean {' or '.join(candidates)}?" if candidates else " (--help lists them)"


def check(argv: list[str]) -> str | None:
    """The line refusing a flag of ``argv``, where the record of this environment says it is not one; None
    otherwise (all are flags, or there is no record to go by)."""
    try:
        recorded = json.loads(RECORD.read_text())
        if recorded.get("key") != key():
            return None
        known = set(recorded["known"])
    except (OSError, ValueError, KeyError, TypeError):
        return None
    return unknown_flag(argv, known)


if __name__ == "__main__":
    if (line := check(sys.argv[1:])) is not None:
        print(f"ps: error: {line}", file=sys.stderr)
        sys.exit(2)
