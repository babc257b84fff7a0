"""`python -m devstack run -- CMD…` runs CMD with the local stack up; `up` keeps it up until Ctrl-C;
`serve [--workers N]` runs the deployed topology on it (devstack/topology.py) until Ctrl-C."""

from __future__ import annotations

import signal
import subprocess
import sys
import time

import psutil

from devstack import serve_env
from devstack.stack import local_stack


# How long Ctrl-C waits for the command (`dagster dev`: 2–8 s here), then SIGTERM as long, before it kills it.
STOP_GRACE_SECONDS = 30.0


def interrupt(proc: subprocess.Popen[bytes], grace: float) -> int:
    """Ctrl-C the command and wait for it; past ``grace``, SIGTERM it; past another, SIGKILL it. Once it took more
    than Ctrl-C, every process it started that is still there is killed too: Ctrl-C always ends `make dev` and the
    stack then stops what it started (a fresh clone's suite once saw `dagster dev` outlive 180 s after SIGTERM)."""
    tree = _descendants(proc.pid)  # now: a child that exits first leaves its own children to init
    proc.send_signal(signal.SIGINT)
    try:
        return proc.wait(grace)
    except subprocess.TimeoutExpired:
        proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(grace)
    except subprocess.TimeoutExpired:
        pass
    killed = []
    for p in [p for p in {*tree, *_descendants(proc.pid)} if p.is_running()]:
        try:
            killed.append(p.name())
            p.kill()
        except psutil.NoSuchProcess:
            pass
    print(f"devstack: {proc.args[0]} did not stop within {grace:g}s of Ctrl-C; "
          f"{'SIGTERM stopped it' if proc.poll() is not None else 'killed it'}, and killed what it left: "
          f"{sorted(killed)}", file=sys.stderr)
    if proc.poll() is None:
        proc.kill()
    return proc.wait()


def _descendants(pid: int) -> list[psutil.Process]:
    try:
        return psutil.Process(pid).children(recursive=True)
    except psutil.NoSuchProcess:
        return []


def main(argv: list[str]) -> int:
    if not argv or argv[0] not in {"run", "up", "serve"}:
        print("usage: python -m devstack run [--purpose P] -- CMD… | up | serve [--workers N]", file=sys.stderr)
        return 2
    if argv[0] == "serve":
        return serve(int(argv[argv.index("--workers") + 1]) if "--workers" in argv else 1)
    purpose = "dev"
    if "--purpose" in argv:
        purpose = argv[argv.index("--purpose") + 1]
    # SIGTERM behaves like Ctrl-C so the stack's finally-block stops what it started. SIGINT gets its handler back
    # too: started in the background, a process begins with SIGINT ignored, and its children would inherit that,
    # so the Ctrl-C passed on to the command would do nothing.
    signal.signal(signal.SIGTERM, lambda *_: (_ for _ in ()).throw(KeyboardInterrupt()))
    signal.signal(signal.SIGINT, signal.default_int_handler)
    with local_stack(purpose) as stack:
        for key in ("DATABASE_URL", "AWS_ENDPOINT_URL", "SANDBOX_URL", "DAGSTER_HOME"):
            if key in stack.env:
                print(f"devstack: {key}={stack.env[key]}", file=sys.stderr)
        if argv[0] == "up":
            try:
                while True:
                    time.sleep(3600)
            except KeyboardInterrupt:
                return 0
        cmd = argv[argv.index("--") + 1 :] if "--" in argv else []
        if not cmd:
            print("devstack: nothing to run", file=sys.stderr)
            return 2
        proc = subprocess.Popen(cmd)
        try:
            return proc.wait()
        except KeyboardInterrupt:
            return interrupt(proc, STOP_GRACE_SECONDS)


def endpoint_lines(endpoints: dict[str, str], env_file, log_dir) -> str:
    """Pure: what `make serve` prints: every endpoint by the name the env file gives it, then how to use them."""
    width = max(len(k) for k, _ in serve_env.ENDPOINTS)
    lines = [f"  {key:<{width}}  {endpoints[key]}    {what}" for key, what in serve_env.ENDPOINTS if key in endpoints]
    lines += ["", f"  every value above (and DAGSTER_HOME, DAGSTER_PG_URL, …) is in {env_file}; in another shell:",
              f"      set -a; . {env_file}; set +a",
              "  then `redrive …` and the runbooks of docs/operating.md act on this stack "
              "(`redrive rehearse list` arms a failure to practise on)",
              f"  logs  {log_dir}/<service>.log", "  Ctrl-C stops everything."]
    return "\n".join(lines)


def serve(workers: int) -> int:
    """`make serve`: every process of a deployment, each on its own, until Ctrl-C (or SIGTERM) stops them all."""
    from devstack.stack import dagster_home
    from devstack.topology import Topology

    signal.signal(signal.SIGINT, signal.default_int_handler)  # also when started in the background
    signal.signal(signal.SIGTERM, lambda *_: (_ for _ in ()).throw(KeyboardInterrupt()))
    status = 0
    try:
        with local_stack("serve") as stack:
            print("serve: starting the code server, webserver, daemon, conversion API and "
                  f"{workers} conversion worker(s) …", flush=True)
            with Topology(home=dagster_home("serve"), env=stack.env, workers=workers) as topology:
                env_file = serve_env.default_path()
                endpoints = topology.endpoints()
                serve_env.write(env_file, endpoints)
                try:
                    print(endpoint_lines(endpoints, env_file, topology.log_dir), flush=True)
                    while not (exited := topology.exited()):
                        time.sleep(1)
                finally:
                    serve_env.remove(env_file)
                print(f"serve: {', '.join(f'{n} exited with {c}' for n, c in exited.items())}; stopping the rest",
                      file=sys.stderr)
                status = 1
    except KeyboardInterrupt:
        pass
    print("serve: stopped everything it started.", flush=True)
    return status


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
