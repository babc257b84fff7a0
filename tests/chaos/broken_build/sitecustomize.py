"""A deliberately broken build for the chaos harness's self-test (tests/chaos/test_chaos_run.py).

On PYTHONPATH, Python imports this in every process it starts (the code server, the daemon, run
workers): the core's dead-letter write (with its alert) is made and rolled back, so a final failure
leaves its work row dead with no dead letter. The chaos run must then fail.
"""

try:
    from redrive.reliability import Reliability

    _real = Reliability._record_final

    def _skipped(self, conn, final, link):  # type: ignore[no-untyped-def]
        nested = conn.begin_nested()
        recorded = _real(self, conn, final, link)
        nested.rollback()
        return recorded

    Reliability._record_final = _skipped  # type: ignore[method-assign]
except ImportError:  # a process outside the project (pip, a tool): nothing to break
    pass
