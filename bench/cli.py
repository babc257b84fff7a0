"""`python -m bench cli`: how long the operator's command takes to answer, each call a fresh process.

Issue 16 §6 asks for `redrive --help` and the read-only commands under half a second. Each
round starts every contender once, in rotated order, so shared load hits them alike; the
figures are medians. Baselines in the same run: a bare interpreter (the floor) and
`import dagster` (what every call paid while the command imported the code location).
With BENCH_CLI_BEFORE=<a checkout of an older commit>, that checkout's command runs in the
same rounds (on this virtualenv, its code first on the path) for a before/after pair. Each row also
gives the median CPU time (user + system) of the process: on a shared machine the wall time is mostly
the wait for a core, the CPU time what the command costs.
"""

from __future__ import annotations

import os
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROUNDS = int(os.environ.get("BENCH_CLI_ROUNDS", "9"))
BIN = Path(sys.executable).parent


Contender = tuple[list[str], dict[str, str]]


def contenders() -> dict[str, Contender]:
    redrive = str(BIN / "redrive")
    env = dict(os.environ)
    runs = {
        "python -c pass (floor)": ([sys.executable, "-c", "pass"], env),
        "redrive --help": ([redrive, "--help"], env),
        "redrive dlq list": ([redrive, "dlq", "list"], env),
        "redrive dlq show 0 (missing)": ([redrive, "dlq", "show", "0"], env),
        "python -c 'import dagster' (baseline)": ([sys.executable, "-c", "import dagster"], env),
    }
    before = os.environ.get("BENCH_CLI_BEFORE")
    if before:
        old = {**env, "PYTHONPATH": before}
        runs["redrive --help (before)"] = ([redrive, "--help"], old)
        runs["redrive dlq list (before)"] = ([redrive, "dlq", "list"], old)
    return runs


def _children_cpu() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def wall(run: Contender) -> tuple[float, float]:
    """Wall time and CPU time (user + system) of one fresh process. On a shared, loaded machine the wall time
    is mostly waiting for a core; the CPU time is what the command itself costs."""
    argv, env = run
    cpu = _children_cpu()
    started = time.perf_counter()
    done = subprocess.run(argv, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, timeout=120, env=env)
    elapsed = time.perf_counter() - started
    if done.returncode not in (0, 2):  # 2: the missing dead letter answers one line and exits 2
        raise RuntimeError(f"{argv[1:]} exited {done.returncode}: {done.stderr.strip()[-300:]}")
    return elapsed, _children_cpu() - cpu


def main() -> int:
    if not os.environ.get("DATABASE_URL"):
        print("bench cli: run it as `python -m bench cli` (the local stack provides DATABASE_URL)")
        return 1
    runs = contenders()
    times: dict[str, list[float]] = {name: [] for name in runs}
    cpus: dict[str, list[float]] = {name: [] for name in runs}
    names = list(runs)
    wall(runs["redrive dlq list"])  # one warm-up: the first connection may create the database's caches
    for round_ in range(ROUNDS):
        for name in names[round_ % len(names):] + names[: round_ % len(names)]:
            elapsed, cpu = wall(runs[name])
            times[name].append(elapsed)
            cpus[name].append(cpu)
    medians = {name: statistics.median(values) for name, values in times.items()}
    cpu_medians = {name: statistics.median(values) for name, values in cpus.items()}
    floor = medians["python -c pass (floor)"]
    dagster = medians["python -c 'import dagster' (baseline)"]
    print(f"  {ROUNDS} rounds, each contender once per round in rotated order; wall time of a fresh process")
    print(f"  {'command':<40}{'median':>9}{'min':>9}{'max':>9}{'vs import dagster':>20}{'CPU median':>12}")
    for name, values in times.items():
        print(f"  {name:<40}{medians[name]:>8.3f}s{min(values):>8.3f}s{max(values):>8.3f}s"
              f"{medians[name] / dagster:>19.2f}×{cpu_medians[name]:>11.3f}s")
    print(f"  above the interpreter floor: --help {medians['redrive --help'] - floor:.3f}s, "
          f"dlq list {medians['redrive dlq list'] - floor:.3f}s")
    for name in ("redrive --help", "redrive dlq list"):
        if f"{name} (before)" in medians:
            print(f"  {name}: before/after = {medians[f'{name} (before)'] / medians[name]:.1f}× wall, "
                  f"{cpu_medians[f'{name} (before)'] / cpu_medians[name]:.1f}× CPU")
    return 0


if __name__ == "__main__":
    sys.exit(main())
