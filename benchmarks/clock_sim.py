"""Clock estimate at scale (docs/clock.md): a synthetic run of 1,024 ranks on 128 hosts, every host's
clock ``offset + drift x elapsed`` (offsets up to +-2 s, drifts up to +-200 ppm, host 0 the reference),
data-parallel steps with scheduling noise on the arrivals (an exponential of 5 ms per rank and step),
a world all_reduce per step, 10 s between steps (so the drifts matter: up to 2 ms per step).

Written as the SDK writes it (tests/analysis_fixtures.py's ``Proc``), then read back in this process:
the time of a whole ``summarize`` (read, span model, comm graph, findings, clock) against the time of
the estimate alone on the same graphs, and each host's offset and drift error against the truth.

    .venv/bin/python benchmarks/clock_sim.py [--ranks 1024] [--hosts 128] [--steps 40] [--repeat 3]
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

from analysis_fixtures import Proc, write_run  # noqa: E402
from comm_sim import base, declare, dp_steps  # noqa: E402

from otel_train import schema  # noqa: E402
from otel_train.analysis.clock import estimate  # noqa: E402
from otel_train.analysis.comm import build_graphs  # noqa: E402
from otel_train.analysis.spans import load_run  # noqa: E402
from otel_train.analysis.summary import summarize_run  # noqa: E402

T0 = 1_700_000_000.0


class DriftProc(Proc):
    """A ``Proc`` whose records carry its host's clock: true time + offset + drift x (true - T0)."""

    offset: float = 0.0
    drift: float = 0.0

    def _base(self, kind: str, event: str, name: str) -> dict:
        rec = super()._base(kind, event, name)
        true = T0 + self.now_ms / 1000.0
        rec[schema.TS] = round(true + self.offset + self.drift * (true - T0), 6)
        return rec


def generate(root: Path, ranks: int, hosts: int, steps: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    offsets = np.r_[0.0, rng.uniform(-2.0, 2.0, hosts - 1)]
    drifts = np.r_[0.0, rng.uniform(-200e-6, 200e-6, hosts - 1)]
    per = ranks // hosts
    procs = []
    for r in range(ranks):
        p = DriftProc(rank=r, world_size=ranks, host=f"h{r // per:03d}")
        p.offset, p.drift = float(offsets[r // per]), float(drifts[r // per])
        p.lines.clear()
        p._seq = 0
        p.instant(schema.INSTANT_PROCESS_START)
        procs.append(p)
    declare(procs)
    noise = rng.exponential(5.0, (steps, ranks))

    def times(r: int, s: int) -> dict[str, float]:
        t = base(r, s)
        t["data_fetch"] += float(noise[s, r])
        return t

    seq = 0
    for s in range(steps):
        seq = dp_steps(procs, range(s, s + 1), times, seq0=seq)
        for p in procs:
            p.advance(10_000.0)
    for p in procs:
        p.shutdown()
    write_run(root, procs)
    return offsets, drifts


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--ranks", type=int, default=1024)
    ap.add_argument("--hosts", type=int, default=128)
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--seed", type=int, default=11)
    args = ap.parse_args()
    root = Path(tempfile.mkdtemp(prefix="clock-sim-"))
    try:
        began = time.perf_counter()
        offsets, drifts = generate(root, args.ranks, args.hosts, args.steps, args.seed)
        size = sum(f.stat().st_size for f in (root / schema.STRUCTURED_LOGS_DIR).iterdir())
        print(f"wrote {args.ranks} ranks on {args.hosts} hosts, {args.steps} steps, {size / 2**20:.0f} MiB "
              f"in {time.perf_counter() - began:.1f} s; load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs")
        whole, alone, graph_s = [], [], []
        for _ in range(args.repeat):
            t = time.perf_counter()
            run = load_run(root)
            summary = summarize_run(run)
            whole.append(time.perf_counter() - t)
            t = time.perf_counter()
            graphs = build_graphs(run)
            graph_s.append(time.perf_counter() - t)
            first = min(d.first_ts for d in run.processes if d.host == "h000" and d.first_ts)
            t = time.perf_counter()
            clock = estimate(graphs.values(), first)
            alone.append(time.perf_counter() - t)
        rows = {r["host"]: r for r in summary["clock"]}
        err = np.array([rows[f"h{i:03d}"]["offset_ms"] - offsets[i] * 1e3 for i in range(args.hosts)])
        derr = np.array([rows[f"h{i:03d}"]["drift_ppm"] - drifts[i] * 1e6 for i in range(args.hosts)])
        print(f"summarize (read + model + graph + findings + clock): median {np.median(whole):.2f} s of {args.repeat}")
        print(f"  comm graph alone: {np.median(graph_s):.3f} s; the estimate alone: {np.median(alone) * 1e3:.1f} ms "
              f"= {np.median(alone) / np.median(whole) * 100:.2f} % of summarize")
        print(f"offset error: max |{np.abs(err).max() * 1e3:.2f}| us, p50 {np.median(np.abs(err)) * 1e3:.2f} us; "
              f"drift error: max |{np.abs(derr).max():.3f}| ppm; samples per host "
              f"{min(r['samples'] for r in rows.values())}-{max(r['samples'] for r in rows.values())}; "
              f"clock_skew findings {sum(f['kind'] == 'clock_skew' for f in summary['findings'])}")
        assert clock.rows() == summary["clock"] or len(clock.rows()) == len(summary["clock"])
    finally:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
