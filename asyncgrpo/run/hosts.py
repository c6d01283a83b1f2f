"""Which host a process runs on, and whether the run directory can be watched with inotify.

``HOST_ID`` names the place a process's pids and flocks mean something: the hostname, the
kernel's boot id and the PID namespace, hashed to 8 hex digits. Two processes with the same
HOST_ID see each other's pids and share one kernel's locks, so "pid not found" or "lock
free" really means dead. A hostname alone does not say that: two containers (or two
machines) may share one, and a container has its own PID namespace. Anything with another
HOST_ID is judged by its heartbeat's age alone (liveness.py). ``ASYNCGRPO_HOST_ID`` overrides
it: letters and digits (at most 16) are used as they are, anything else is hashed. Workers
that join a run from another host carry it in their names (``dev1.{HOST_ID}``).

``network_filesystem(path)``: inotify sees only the changes made through this kernel, so on
NFS, CIFS, cluster and most FUSE filesystems a watcher misses what other hosts do; the queue
watcher polls there instead (watcher.py).
"""

from __future__ import annotations

import hashlib
import os
import re
import socket

HOST_ID_ENV = "ASYNCGRPO_HOST_ID"
_PLAIN_ID_RE = re.compile(r"^[A-Za-z0-9]{1,16}$")  # safe in file names, no "_", "-" or "." (grammar separators)

# Filesystems on which other hosts' changes reach this one without inotify events.
NETWORK_FILESYSTEMS = frozenset({
    "nfs", "nfs4", "cifs", "smb3", "smbfs", "ncpfs", "afs", "9p", "ceph", "glusterfs", "lustre", "gpfs",
    "beegfs", "orangefs", "pvfs2", "ocfs2", "gfs2", "virtiofs", "vboxsf"})


def _read(path: str) -> str:
    try:
        with open(path) as f:
            return f.read().strip()
    except OSError:
        return ""


def host_id(environ: dict | None = None) -> str:
    """This process's host identity (see the module docstring)."""
    override = (os.environ if environ is None else environ).get(HOST_ID_ENV, "")
    if override and _PLAIN_ID_RE.fullmatch(override):
        return override
    if override:
        seed = override
    else:
        try:
            pid_namespace = os.readlink("/proc/self/ns/pid")
        except OSError:
            pid_namespace = ""
        seed = "\n".join((socket.gethostname(), _read("/proc/sys/kernel/random/boot_id"), pid_namespace))
    return hashlib.sha1(seed.encode()).hexdigest()[:8]


HOST_ID = host_id()


def same_host(record: dict) -> bool:
    """Whether the process that wrote ``record`` (a heartbeat, a version file, ...) runs on
    this host: by its ``host_id``, or by its ``host`` name for records written before host
    ids existed."""
    if "host_id" in record:
        return record["host_id"] == HOST_ID
    return record.get("host") == socket.gethostname()


def filesystem_type(path: str | os.PathLike, mounts: str | None = None) -> str | None:
    """The type of the filesystem ``path`` is on (``/proc/self/mounts``'s third field), or None."""
    if mounts is None:
        mounts = _read("/proc/self/mounts")
    target = os.path.realpath(path)
    best, best_type = "", None
    for line in mounts.splitlines():
        fields = line.split()
        if len(fields) < 3:
            continue
        point = re.sub(r"\\([0-7]{3})", lambda m: chr(int(m[1], 8)), fields[1])  # "\040" is a space
        inside = target == point or target.startswith(point.rstrip("/") + "/")
        if inside and len(point) >= len(best):  # the last of equal mounts is the one on top
            best, best_type = point, fields[2]
    return best_type


def network_filesystem(path: str | os.PathLike, mounts: str | None = None) -> str | None:
    """The filesystem type of ``path`` if other hosts may change it unseen by inotify, else None."""
    kind = filesystem_type(path, mounts)
    if kind is None:
        return None
    if kind in NETWORK_FILESYSTEMS or kind.split(".")[0] in NETWORK_FILESYSTEMS:
        return kind
    if kind.startswith("fuse") and "overlay" not in kind:  # sshfs, gcsfuse, s3fs, juicefs, ...
        return kind
    return None
