"""`python -m devstack run -- CMD…` runs CMD with the local stack up; `up` keeps it up until Ctrl-C."""

from __future__ import annotations

import signal
import subprocess
import sys
import time

from devstack.stack import local_stack


def main(argv: list[str]) -> int:
    if not argv or argv[0] not in {"run", "up"}:
        print("usage: python -m devstack run [--purpose P] -- CMD… | up", file=sys.stderr)
        return 2
    purpose = "dev"
    if "--purpose" in argv:
        purpose = argv[argv.index("--purpose") + 1]
    # SIGTERM behaves like Ctrl-C so the stack's finally-block stops what it started.
    signal.signal(signal.SIGTERM, lambda *_: (_ for _ in ()).throw(KeyboardInterrupt()))
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
            proc.send_signal(signal.SIGINT)
            return proc.wait()


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
