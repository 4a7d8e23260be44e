"""``export --profiles``: a run's export with its torch.profiler windows merged (docs/profiling.md).

Chrome: the export, then ``export.profiles.merge`` adds the windows' events to it. Perfetto: the export,
then the same merge on a Chrome export of the same run and options (a temporary file beside the
output, removed after), whose placed events ``export.perfetto_profiles`` appends to the Perfetto file
as packets: both formats put every event at the same time on the same rank.
"""

from __future__ import annotations

import json
import os
import secrets
from pathlib import Path
from typing import Any

from otel_train.analysis.export import ExportResult, export
from otel_train.analysis.export.perfetto_profiles import packets
from otel_train.analysis.export.profiles import Merged, merge

FORMATS = ("chrome", "perfetto")


def export_with_profiles(path: str | Path, fmt: str, output: str | Path | None, **options: Any
                         ) -> tuple[ExportResult, Merged]:
    """Export the run at ``path`` as ``fmt`` (chrome or perfetto) to the file ``output`` (None: the
    default) with its profiler windows merged; ``options`` as :func:`~otel_train.analysis.export.export`."""
    if fmt not in FORMATS:
        raise ValueError(f"--profiles: merged into a {' or '.join(FORMATS)} export only, not {fmt!r}")
    done = export(path, fmt, output, **options)
    if fmt == "chrome":
        return done, merge(done.output, path)
    chrome = done.output.with_name(f".{done.output.name}.{secrets.token_hex(4)}.profiles.json")
    try:
        export(path, "chrome", chrome, **{**options, "cache": False})
        merged = merge(chrome, path)
        added = packets(json.loads(chrome.read_bytes()))
    finally:
        if chrome.exists():
            os.unlink(chrome)
    with open(done.output, "ab") as out:
        out.write(added)
    return done, merged
