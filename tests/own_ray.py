"""A Ray head started with `ray start` that stops only its own processes, so it can run beside the embedded test
clusters of the other xdist worker (`ray stop` would stop every Ray process of the user, theirs too).

Every process of the head is marked: `ray start` runs with HETSPOT_TEST_RAY=<token> in its environment, which the
daemons it leaves behind (GCS, raylets, dashboard, autoscaler) inherit, and so do the nodes the autoscaler starts
from the monitor. Ray renames some of its processes (setproctitle) over the memory /proc reads their environment
from, so a stop takes the marked processes and every descendant of one: the agents and workers a raylet starts,
the dashboard's modules. All of them are found before any is killed (a killed parent's children would be
re-parented and lose the link).
"""

from __future__ import annotations

import os
import secrets
import signal
import time

MARK = "HETSPOT_TEST_RAY"


def new_mark() -> dict[str, str]:
    """The environment entry that marks one head's processes."""
    return {MARK: secrets.token_hex(8)}


def new_temp_dir() -> str:
    """A Ray temp dir for one head (`ray start --head --temp-dir=...`; its nodes take the head's). Short, since Ray's
    socket paths must stay under 107 bytes. Of its own, since Ray Jobs give a job's driver RAY_ADDRESS from
    `ray_current_cluster` in the head's temp dir, the address of the newest head started there: in the shared
    /tmp/ray, an embedded test cluster that the other xdist worker starts after this head would take this head's
    jobs (their drivers connect to it, and their py_modules are not in its GCS)."""
    import tempfile

    return tempfile.mkdtemp(prefix="hs-", dir="/tmp")


def _processes() -> dict[int, tuple[int, str]]:
    """This user's live processes (zombies left out): pid -> (parent pid, environment)."""
    out = {}
    me = os.getuid()
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            if os.stat(f"/proc/{name}").st_uid != me:
                continue
            with open(f"/proc/{name}/stat") as f:
                state, ppid = f.read().rsplit(")", 1)[1].split()[:2]
            if state == "Z":
                continue
            with open(f"/proc/{name}/environ", "rb") as f:
                env = f.read().decode(errors="replace")
        except (OSError, ValueError, IndexError):
            continue
        out[int(name)] = (int(ppid), env)
    return out


def marked_processes(mark: dict[str, str]) -> set[int]:
    """The processes carrying `mark` in their environment, and all their descendants."""
    (key, token), = mark.items()
    needle = f"{key}={token}"
    procs = _processes()
    found = {pid for pid, (_, env) in procs.items() if needle in env.split("\0")} - {os.getpid()}
    children: dict[int, list[int]] = {}
    for pid, (ppid, _) in procs.items():
        children.setdefault(ppid, []).append(pid)
    todo = list(found)
    while todo:
        for child in children.get(todo.pop(), []):
            if child not in found and child != os.getpid():
                found.add(child)
                todo.append(child)
    return found


def stop_marked(mark: dict[str, str], timeout_s: float = 30.0) -> int:
    """SIGKILL every process of the head marked `mark` (as `ray stop --force` does, but only these), until none is
    left: one started while the first were found (a worker, a node the autoscaler was bringing up) is taken by the
    next round. The number of processes killed."""
    deadline, killed = time.monotonic() + timeout_s, set[int]()
    while pids := marked_processes(mark):
        killed |= pids
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        if time.monotonic() > deadline:
            raise RuntimeError(f"Ray processes of a test head still alive after {timeout_s:.0f} s: {sorted(pids)}")
        time.sleep(0.2)
    return len(killed)
