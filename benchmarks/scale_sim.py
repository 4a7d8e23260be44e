"""Scale simulation: 1,024 ranks. Three parts (``--parts``, default all):

* ``summarize``: a synthetic 1,024-rank run with one injected hang, written as the SDK writes it
  (grouped step trace ids, a root ``train`` span open from the first record, ``step`` with data_fetch,
  forward, backward, optimizer and a loss scalar, and each rank's digest: taken after its last record,
  as a hung rank's watchdog keeps rewriting it, or ``--digest-age`` seconds of run time before); at the last step one rank stops inside ``data_fetch`` and every
  other rank waits in ``backward``'s all-reduce. ``summarize --fast`` against a full summarize at two
  file sizes ``--factor`` apart: time and peak RSS of the CLI as users run it, the culprit both name,
  and the digest phases' p50/p95 against the exact ones. Runs are cached under ``--cache``.
* ``otlp``: 1,024 ranks, one after another in this process, each ``init`` with default settings but
  ``traces_exporter="otlp"`` to a gRPC receiver on loopback, two steps of 8 spans, ``shutdown``; spans
  and encoded bytes per step trace, with default ``trace_group_size`` and with one trace per step.
* ``sketch``: the digest's sketch (``otel_train.sketch``) against PyPI ``ddsketch`` and ``datasketches``
  (KLL, REQ): cost per added duration, p50/p95 error, serialised size, merging 1,024 of them.

    .venv/bin/python benchmarks/scale_sim.py [--parts summarize,otlp,sketch] [--ranks 1024] [--kib 128]
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import shutil
import subprocess
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path

import psutil

from otel_train import schema, sketch

CLI = Path(sys.executable).with_name("otel-train")
RUN_ID = "scale-sim"
PHASES = (("data_fetch", 4.0), ("forward", 30.0), ("backward", 55.0), ("optimizer", 8.0))
RECORD_BYTES = 520  # about what one generated line takes
GROUP = 64  # the default trace_group_size


def generate(root: Path, ranks: int, kib_per_rank: int, hang_rank: int, digest_age_s: float) -> Path:
    """Write (or reuse) a run of ``ranks`` files of about ``kib_per_rank`` KiB each; returns the run dir."""
    run = root / f"scale2-{ranks}x{kib_per_rank}k-hang{hang_rank}-age{digest_age_s:g}"
    if (run / ".complete").exists():
        return run
    shutil.rmtree(run, ignore_errors=True)
    logs = run / schema.STRUCTURED_LOGS_DIR
    logs.mkdir(parents=True)
    steps = max(2, kib_per_rank * 1024 // (RECORD_BYTES * 11))
    for rank in range(ranks):
        _RankWriter(logs, rank, ranks, hang=rank == hang_rank).write(steps, digest_age_s)
    (run / ".complete").write_text("ok")
    return run


class _RankWriter:
    """One simulated rank: its records (as the sink writes them) and the digest its watchdog would keep."""

    def __init__(self, logs: Path, rank: int, world: int, *, hang: bool) -> None:
        self.logs, self.rank, self.hang = logs, rank, hang
        self.rng = random.Random(rank)
        pid = 10_000 + rank
        self.base = (f'"rank":{rank},"local_rank":{rank % 8},"world_size":{world},"host":"node{rank // 8:04d}",'
                     f'"pid":{pid},"attempt":0,"run_id":"{RUN_ID}","source":"training","tid":{pid}')
        self.tid = pid
        self.ts, self.seq, self.size = 1_700_000_000.0, 0, 0
        self.lines: list[str] = []
        self.open: dict[str, dict] = {}
        self.buckets: dict[str, dict[int, int]] = defaultdict(dict)
        self.totals: dict[str, list[float]] = defaultdict(lambda: [0, 0.0, 0.0])
        self.digest: dict | None = None

    def line(self, kind: str, name: str, sid: str, parent: str | None, step: int | None, extra: str = "") -> None:
        self.seq += 1
        event = name + {"span_start": "_start", "span_end": "_end"}.get(kind, "")
        par = f',"parent_span_id":"{parent}"' if parent else ""
        trace = f"{schema.step_trace_id(RUN_ID, step or 0, self.rank // GROUP):032x}"
        at_step = f',"step":{step},"relative_step":{step}' if step is not None else ""
        text = (f'{{"v":1,"ts":{self.ts:.6f},"kind":"{kind}","event":"{event}","name":"{name}",'
                f'"trace_id":"{trace}","span_id":"{sid}"{par}{at_step},{self.base},"seq":{self.seq},'
                f'"caller":"train.py:88:train_loop"{extra}}}')
        self.lines.append(text)
        self.size += len(text) + 1
        if kind == "span_start":
            self.open[sid] = {"span_id": sid, "name": name, "parent_span_id": parent, "trace_id": trace,
                              "step": step, "start_ts": float(f"{self.ts:.6f}"), "tid": self.tid}

    def end(self, name: str, sid: str, parent: str | None, step: int | None, dur_s: float) -> None:
        self.line("span_end", name, sid, parent, step, f',"dur_ms":{dur_s * 1000:.3f},"status":"ok"')
        del self.open[sid]
        ns = int(dur_s * 1e9)
        counts, index = self.buckets[name], sketch.bucket(ns)
        counts[index] = counts.get(index, 0) + 1
        total = self.totals[name]
        total[0] += 1
        total[1] += dur_s * 1000
        total[2] = max(total[2], dur_s * 1000)

    def take_digest(self) -> None:
        self.digest = {
            "v": 1, "ts": self.ts, "seq": self.seq, "file": {"ino": 0, "size": self.size},
            "open": list(self.open.values()), "gamma": sketch.GAMMA,
            "phases": {name: {"count": int(t[0]), "sum_ms": t[1], "max_ms": t[2],
                              "buckets": {str(i): c for i, c in self.buckets[name].items()}}
                       for name, t in self.totals.items()},
        }

    def write(self, steps: int, digest_age_s: float) -> None:
        step_s = sum(ms for _, ms in PHASES) / 1000
        digest_step = max(0, steps - round(digest_age_s / step_s))
        self.line("instant", "process_start", "0" * 16, None, None, ',"attrs":{}')
        root = f"{self.rng.getrandbits(64):016x}"
        self.line("span_start", "train", root, None, None)
        for step in range(steps + 1):
            self.one_step(step, root, last=step == steps, digest=digest_age_s > 0 and step == digest_step)
        if self.digest is None:
            self.take_digest()
        path = self.logs / schema.trace_file_name("training", self.rank, "20240101-000000", f"s{self.rank:05d}")
        path.write_text("\n".join(self.lines) + "\n")
        assert self.digest is not None
        self.digest["file"]["ino"] = path.stat().st_ino
        digest = Path(schema.digest_file_name(str(path)))
        digest.parent.mkdir(exist_ok=True)
        digest.write_text(json.dumps(self.digest))

    def one_step(self, step: int, root: str, *, last: bool, digest: bool) -> None:
        step_id, step_start = f"{self.rng.getrandbits(64):016x}", self.ts
        self.line("span_start", "step", step_id, root, step)
        for name, ms in PHASES:
            sid = f"{self.rng.getrandbits(64):016x}"
            self.ts += 0.0002
            self.line("span_start", name, sid, step_id, step)
            if digest and name == "forward":
                self.take_digest()  # the watchdog's last look: inside forward of this step
            if last and (name == "data_fetch" if self.hang else name == "backward"):
                return  # the last step: the culprit never gets its batch, the others wait in all-reduce
            dur = ms * (0.8 + 0.4 * self.rng.random()) / 1000.0
            self.ts += dur
            self.end(name, sid, step_id, step, dur)
        self.ts += 0.0003
        self.line("scalar", "scalar", step_id, None, step, f',"values":{{"loss":{self.rng.random():.6f}}}')
        self.end("step", step_id, root, step, self.ts - step_start)


def run_cli(run: Path, *extra: str) -> tuple[float, float, dict]:
    """Wall seconds, peak RSS (MB, whole process tree) and the JSON of ``otel-train summarize``."""
    with tempfile.TemporaryFile() as out:  # a file, not a pipe: a big JSON answer never blocks the child
        t0 = time.perf_counter()
        proc = subprocess.Popen([str(CLI), "summarize", str(run), "--json", *extra], stdout=out)
        ps = psutil.Process(proc.pid)
        peak = 0
        while proc.poll() is None:
            try:
                peak = max(peak, sum(p.memory_info().rss for p in [ps, *ps.children(recursive=True)]))
            except psutil.Error:
                pass
            time.sleep(0.02)
        wall = time.perf_counter() - t0
        if proc.returncode != 0:
            raise SystemExit(f"otel-train summarize {' '.join(extra)} exited {proc.returncode}")
        out.seek(0)
        return wall, peak / 2**20, json.load(out)


def phase_error(full: dict, quick: dict) -> float:
    """The largest relative error of ``--fast``'s p50/p95 against the full summarize's, over phases."""
    exact = {row["name"]: row for row in full["phases"]}
    return max(abs(row[k] / exact[row["name"]][k] - 1) for row in quick["phases"] for k in ("p50_ms", "p95_ms"))


def part_summarize(args: argparse.Namespace) -> None:
    hang_rank = min(args.hang_rank, args.ranks - 1)
    print(f"\n{args.ranks} ranks, digest {args.digest_age:g} s of run time before the end\n")
    print("| run | full summarize (time, peak RSS) | `--fast` (time, peak RSS) | hang culprit | same | "
          "unclosed same | phases p50/p95 error |")
    print("|---|---:|---:|---|---|---|---:|")
    fast_times = []
    for kib in (args.kib, args.kib * args.factor):
        run = generate(args.cache, args.ranks, kib, hang_rank, args.digest_age)
        size = sum(p.stat().st_size for p in (run / schema.STRUCTURED_LOGS_DIR).iterdir()) / 2**20
        full_s, full_rss, full = run_cli(run)
        fast_s, fast_rss, quick = run_cli(run, "--fast")
        culprits = sorted((f["kind"], f["rank"]) for f in full["findings"] if f["kind"] == "hang")
        same = culprits == sorted((f["kind"], f["rank"]) for f in quick["findings"] if f["kind"] == "hang")
        fast_times.append(fast_s)
        print(f"| {args.ranks} × {kib} KiB ({size:.0f} MB) | {full_s:.2f} s, {full_rss:.0f} MB | "
              f"{fast_s:.2f} s, {fast_rss:.0f} MB | {culprits} | {'yes' if same else 'NO'} | "
              f"{'yes' if quick['unclosed'] == full['unclosed'] else 'NO'} | {phase_error(full, quick):.2%} |",
              flush=True)
    print(f"\n`--fast` time grows {fast_times[1] / fast_times[0]:.2f}× for {args.factor}× bigger files")


def send_ranks(endpoint: str, ranks: int, group: int) -> None:
    """Each rank in turn: init (defaults, OTLP only), two steps of 8 spans, shutdown."""
    import otel_train as ot

    os.environ["OTEL_EXPORTER_OTLP_ENDPOINT"] = endpoint
    save = tempfile.mkdtemp(prefix="scale-otlp-")
    for rank in range(ranks):
        ot.init(save_path=save, enabled=True, rank=rank, world_size=ranks, run_id=RUN_ID,
                traces_exporter="otlp", trace_group_size=group)
        for step in (1, 2):
            with ot.training_step(step):
                for name in ("data_fetch", "h2d", "forward"):
                    with ot.log_trace_span(name):
                        pass
                with ot.log_trace_span("backward"):
                    with ot.log_trace_span("allreduce"):
                        pass
                for name in ("optimizer", "zero_grad"):
                    with ot.log_trace_span(name):
                        pass
        ot.shutdown(timeout_s=30)
    shutil.rmtree(save, ignore_errors=True)


def part_otlp(args: argparse.Namespace) -> None:
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
    from otlp_receivers import GrpcOtlpReceiver  # the tests' real OTLP receiver on loopback

    print(f"\n{args.ranks} ranks over OTLP/gRPC, 2 steps × 8 spans each\n")
    print("| trace_group_size | step traces per step | spans per step trace (max) | bytes per step trace (max) "
          "| ranks per trace (max) | send time |")
    print("|---|---:|---:|---:|---:|---:|")
    for group in (GROUP, args.ranks):
        with GrpcOtlpReceiver() as rx:
            t0 = time.perf_counter()
            send_ranks(rx.endpoint, args.ranks, group)
            spans = rx.wait_for(args.ranks * 16, timeout=60)
            wall = time.perf_counter() - t0
            sizes = rx.trace_bytes()
        per_trace, ranks_in = defaultdict(int), defaultdict(set)
        for span in spans:
            per_trace[span["trace_id"]] += 1
            ranks_in[span["trace_id"]].add(span["resource"]["training.rank"])
        label = f"{group}" + (" (default)" if group == GROUP else " (one trace per step)")
        print(f"| {label} | {len(per_trace) // 2} | {max(per_trace.values())} | "
              f"{max(sizes.values()) / 1024:.0f} KiB | {max(map(len, ranks_in.values()))} | {wall:.1f} s |", flush=True)


def part_sketch(args: argparse.Namespace) -> None:
    from datasketches import kll_floats_sketch, req_floats_sketch
    from ddsketch import DDSketch
    from ddsketch.pb.proto import DDSketchProto

    rng = random.Random(3)
    values = [rng.lognormvariate(math.log(30e6), 0.4) for _ in range(20_000)]  # ns, a 30 ms phase
    exact = sorted(values)
    truth = {q: exact[int(q * (len(exact) - 1))] for q in (0.5, 0.95)}

    def ours() -> object:
        counts: dict[int, int] = {}
        for v in values:
            b = sketch.bucket(int(v))
            counts[b] = counts.get(b, 0) + 1
        return counts

    def ours_q(counts: dict, q: float) -> float:
        return sketch.mid_ns(sketch.quantile_index(sorted(counts.items()), q)[1])  # type: ignore[arg-type]

    def kll() -> object:
        s = kll_floats_sketch(200)
        for v in values:
            s.update(v)
        return s

    def req() -> object:
        s = req_floats_sketch(12)
        for v in values:
            s.update(v)
        return s

    def dd() -> object:
        s = DDSketch(relative_accuracy=0.01)
        for v in values:
            s.add(v)
        return s

    rows = [
        ("otel_train.sketch (γ 1.02)", ours, ours_q, lambda c: len(json.dumps({str(k): n for k, n in c.items()})),  # as in a digest
         lambda cs: sketch.merge(cs)),
        ("ddsketch DDSketch(0.01)", dd, lambda s, q: s.get_quantile_value(q),
         lambda s: len(DDSketchProto.to_proto(s).SerializeToString()), _dd_merge),
        ("datasketches KLL k=200", kll, lambda s, q: s.get_quantile(q), lambda s: len(s.serialize()), _ds_merge),
        ("datasketches REQ k=12", req, lambda s, q: s.get_quantile(q), lambda s: len(s.serialize()), _ds_merge),
    ]
    print(f"\nsketches: {len(values)} durations (lognormal around 30 ms), merge of {args.ranks}\n")
    print("| sketch | µs per add | p50 error | p95 error | serialised bytes | merge of ranks |")
    print("|---|---:|---:|---:|---:|---:|")
    for label, build, quantile, size, merge in rows:
        t0 = time.perf_counter()
        s = build()
        add_us = (time.perf_counter() - t0) / len(values) * 1e6
        errs = [abs(quantile(s, q) / truth[q] - 1) for q in (0.5, 0.95)]
        t0 = time.perf_counter()
        merge([s] * args.ranks)
        merge_ms = (time.perf_counter() - t0) * 1000
        print(f"| {label} | {add_us:.2f} | {errs[0]:.2%} | {errs[1]:.2%} | {size(s)} | {merge_ms:.0f} ms |", flush=True)


def _dd_merge(sketches: list) -> object:
    from ddsketch import DDSketch

    out = DDSketch(relative_accuracy=0.01)
    for s in sketches:
        out.merge(s)
    return out


def _ds_merge(sketches: list) -> object:
    out = type(sketches[0])(sketches[0].k)
    for s in sketches:
        out.merge(s)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--parts", default="summarize,otlp,sketch")
    parser.add_argument("--ranks", type=int, default=1024)
    parser.add_argument("--kib", type=int, default=128, help="KiB per rank of the smaller run")
    parser.add_argument("--factor", type=int, default=8, help="the bigger run's files are this many times bigger")
    parser.add_argument("--hang-rank", type=int, default=517)
    parser.add_argument("--digest-age", type=float, default=0.0,
                        help="run seconds between the last digest and the end (0: a hung rank's watchdog "
                             "keeps rewriting it, as its heartbeats are records)")
    parser.add_argument("--cache", type=Path, default=Path(tempfile.gettempdir()) / "otel-train-scale")
    args = parser.parse_args()
    parts = {"summarize": part_summarize, "otlp": part_otlp, "sketch": part_sketch}
    for name in args.parts.split(","):
        parts[name](args)


if __name__ == "__main__":
    main()
