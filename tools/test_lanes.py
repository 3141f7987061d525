"""Runs the test suite's pytest groups side by side: ``make test`` and ``.ci/run`` call it.

Each group is its own pytest process (why the suite is split: the Makefile's comment on
``TEST_GROUPS``). One pytest process keeps one core busy (it compiles and runs small programs, one at a
time), so on CI's two cores two groups at once take about half the time of one after the other.

``python tools/test_lanes.py [--lanes N] GROUP ...``, where each GROUP is one argument::

    "strict A-L: tests/test_a.py tests/test_b.py"
    "fused OpInfo: TORCH_TPU_EAGER_MODE=fused tests/test_opinfo.py"
    "newest torch: @.venv-torch2.15.0/bin/python tests/test_device.py"

a name, a colon, then ``VAR=value`` settings for that group's environment, an optional
``@interpreter`` (default: this one), and pytest's arguments. Groups start in the order given (give
the longest first), at most N at a time; a group's output is printed whole when it ends, so two
groups never interleave. Every group runs even when one fails; the exit status is 1 if any failed.
The last lines are a table of each group's exit status, seconds and pytest's closing line.
"""

from __future__ import annotations

import argparse
import os
import re
import shlex
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

_SETTING = re.compile(r"[A-Z_][A-Z0-9_]*=")
_CLOSING = re.compile(r"^(?:\d+ \w+|no tests ran).* in [\d.]+s")  # pytest's last line, with or without -q


@dataclass
class Group:
    """One pytest process: its name, extra environment, interpreter and pytest arguments."""

    name: str
    env: dict[str, str]
    python: str
    args: list[str]
    proc: subprocess.Popen | None = None
    log: Path | None = None
    started: float = 0.0
    seconds: float = 0.0
    rc: int | None = None
    closing: str = field(default="")


def parse_group(spec: str) -> Group:
    """``"name: VAR=v @python args..."`` -> a Group; a spec without a name is refused, so that a
    Makefile variable that expands to nothing cannot start a pytest of the whole tests folder."""
    name, sep, rest = spec.partition(":")
    if not sep or not name.strip():
        raise SystemExit(f"test_lanes: {spec!r}: expected 'name: [VAR=value ...] [@python] pytest-args'")
    words = shlex.split(rest)
    env: dict[str, str] = {}
    python = sys.executable
    while words and _SETTING.match(words[0]):
        key, _, value = words.pop(0).partition("=")
        env[key] = value
    if words and words[0].startswith("@"):
        python = words.pop(0)[1:]
    if not words:
        raise SystemExit(f"test_lanes: group {name.strip()!r} names no tests")
    return Group(name.strip(), env, python, words)


def default_lanes(n_groups: int) -> int:
    """One lane per core this process may use, at most one per 6 GiB of memory (a group's pytest
    reaches about 3 GiB, more while a distributed test's ranks run), and no more than the groups."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    try:
        memory_gib = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
    except (ValueError, OSError, AttributeError):
        memory_gib = 6.0
    return max(1, min(cores, int(memory_gib // 6), n_groups))


def _start(group: Group, workdir: Path) -> None:
    group.log = workdir / f"{len(list(workdir.iterdir())):02d}.log"
    out = group.log.open("w")
    group.started = time.monotonic()
    group.proc = subprocess.Popen(
        [group.python, "-m", "pytest", *group.args], env={**os.environ, **group.env},
        stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True)
    out.close()
    print(f"test_lanes: started {group.name}", flush=True)


def _finish(group: Group) -> None:
    assert group.proc is not None and group.log is not None
    group.rc = group.proc.returncode
    group.seconds = time.monotonic() - group.started
    text = group.log.read_text(errors="replace")
    for line in reversed(text.splitlines()):
        line = line.strip(" =")
        if _CLOSING.match(line):
            group.closing = line
            break
    bar = "#" * 20
    print(f"\n{bar} {group.name}: exit {group.rc} in {group.seconds:.0f} s {bar}", flush=True)
    sys.stdout.write(text)
    print(f"{bar} end of {group.name} {bar}\n", flush=True)


def _stop_all(groups: list[Group]) -> None:
    for g in groups:
        if g.proc is not None and g.proc.poll() is None:
            try:
                os.killpg(g.proc.pid, signal.SIGTERM)
            except ProcessLookupError:
                pass


def run(groups: list[Group], lanes: int) -> int:
    """Runs the groups, at most ``lanes`` at once; returns 0 if every group passed, else 1."""
    waiting = list(groups)
    running: list[Group] = []
    began = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="test-lanes-") as tmp:
        workdir = Path(tmp)
        try:
            while waiting or running:
                while waiting and len(running) < lanes:
                    g = waiting.pop(0)
                    _start(g, workdir)
                    running.append(g)
                time.sleep(0.5)
                for g in [g for g in running if g.proc is not None and g.proc.poll() is not None]:
                    running.remove(g)
                    _finish(g)
        except KeyboardInterrupt:
            _stop_all(running)
            raise
    width = max(len(g.name) for g in groups)
    print(f"test_lanes: {len(groups)} groups, {lanes} at a time, in {time.monotonic() - began:.0f} s", flush=True)
    for g in groups:
        print(f"  {g.name:<{width}}  exit {g.rc}  {g.seconds:6.0f} s  {g.closing}")
    return 0 if all(g.rc == 0 for g in groups) else 1


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lanes", type=int, default=0, help="groups at once (default: one per core, memory allowing)")
    parser.add_argument("groups", nargs="+", help="'name: [VAR=value ...] [@python] pytest-args'")
    ns = parser.parse_args(argv)
    groups = [parse_group(s) for s in ns.groups]
    lanes = ns.lanes if ns.lanes > 0 else default_lanes(len(groups))
    sys.stdout.reconfigure(line_buffering=True)
    return run(groups, lanes)


if __name__ == "__main__":
    sys.exit(main())
