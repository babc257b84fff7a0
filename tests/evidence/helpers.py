"""Building file jobs and driving the evidence pipeline's sensors the way the daemon does."""

from __future__ import annotations

import csv
import io
import uuid
import zipfile
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import dagster as dg


def pdf(label: str) -> bytes:
    """A small file that passes the .pdf magic check; distinct bytes per label."""
    return b"%PDF-1.4\n% " + label.encode() + b"\n%%EOF\n"


def case_uuid(seed: str, n: int) -> str:
    return str(uuid.uuid5(uuid.NAMESPACE_OID, f"{seed}:case:{n}"))


def make_zip(rows: Sequence[Sequence[str]], files: Mapping[str, bytes], *, header: Sequence[str] = ("case_id", "evidence_files"),
             manifest: bytes | None = None, corrupt: Iterable[str] = ()) -> bytes:
    """A file job ZIP: manifest.csv (header + rows) and the files; `corrupt` members get a broken CRC."""
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w", zipfile.ZIP_DEFLATED) as zf:
        if manifest is None:
            text = io.StringIO()
            writer = csv.writer(text, lineterminator="\n")
            writer.writerow(header)
            writer.writerows(rows)
            manifest = text.getvalue().encode()
        zf.writestr("manifest.csv", manifest)
        for name, body in files.items():
            zf.writestr(name, body)
    data = buf.getvalue()
    for name in corrupt:  # flip a byte inside the member's compressed data: its CRC check fails on read
        with zipfile.ZipFile(io.BytesIO(data)) as zf:
            info = zf.getinfo(name)
        start = info.header_offset + 30 + len(info.filename.encode()) + len(info.extra)
        data = data[:start + 2] + bytes([data[start + 2] ^ 0xFF]) + data[start + 3:]
    return data


def standard_job(seed: str, rows: int, per_row: int) -> tuple[bytes, list[str]]:
    """`rows` valid rows of `per_row` PDFs each; returns the ZIP and the case ids."""
    cases = [case_uuid(seed, i) for i in range(rows)]
    files: dict[str, bytes] = {}
    manifest = []
    for i, case in enumerate(cases):
        names = [f"c{i}/evidence-{k}.pdf" for k in range(per_row)]
        for name in names:
            files[name] = pdf(f"{seed}/{name}")
        manifest.append([case, ";".join(names)])
    return make_zip(manifest, files), cases


def put_zip(s3: Any, bucket: str, key: str, data: bytes, notify_to: str = "merchant@example.com") -> str:
    s3.put_object(Bucket=bucket, Key=key, Body=data, Metadata={"notify-to": notify_to})
    return str(s3.head_object(Bucket=bucket, Key=key)["ETag"]).strip('"')


@dataclass
class Driver:
    """Ticks sensors with an instance ref (so partitioned requests resolve), adds the partitions they
    ask for, and launches their runs in process, skipping run keys already launched (as the daemon)."""

    defs: dg.Definitions
    instance: dg.DagsterInstance
    resources: Mapping[str, Any] = field(default_factory=dict)
    launched: list[dg.ExecuteInProcessResult] = field(default_factory=list)
    cursors: dict[str, str | None] = field(default_factory=dict)

    def tick(self, sensor_name: str) -> list[dg.RunRequest]:
        from orchestration.demo import evaluate_sensor_tick

        tick = evaluate_sensor_tick(self.defs, self.instance, sensor_name, self.cursors.get(sensor_name))
        self.cursors[sensor_name] = tick.cursor
        return tick.run_requests

    def launch(self, request: dg.RunRequest, job_name: str | None = None,
               op_selection: list[str] | None = None) -> dg.ExecuteInProcessResult | None:
        if request.run_key and self.instance.get_runs(filters=dg.RunsFilter(tags={"dagster/run_key": request.run_key})):
            return None
        job = self.defs.resolve_job_def(request.job_name or job_name)
        tags = {**(request.tags or {}), **({"dagster/run_key": request.run_key} if request.run_key else {})}
        quiet = {"loggers": {"console": {"config": {"log_level": "ERROR"}}}}
        result = job.execute_in_process(run_config={**quiet, **(request.run_config or {})}, instance=self.instance,
                                        tags=tags, partition_key=request.partition_key, raise_on_error=False,
                                        resources=dict(self.resources) or None, op_selection=op_selection)
        self.launched.append(result)
        return result

    def tick_and_launch(self, sensor_name: str, job_name: str | None = None) -> list[dg.ExecuteInProcessResult]:
        out = []
        for request in self.tick(sensor_name):
            result = self.launch(request, job_name)
            if result is not None:
                out.append(result)
        return out
