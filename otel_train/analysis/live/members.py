"""Which processes ``watch`` follows: those of one run of the directory (docs/analysis.md, "Several runs
in one directory"), each one's attempt numbered over all of them."""

from __future__ import annotations

from pathlib import Path

from otel_train.analysis.records import Head, ProcessFiles, TraceReadError, Warn, head
from otel_train.analysis.spans import assign_attempts, choose_run, in_run

ProcessKey = tuple[str, int, str]
"""A process file set's key (:attr:`ProcessFiles.key`)."""
GroupKey = tuple[str, int]
"""(source, attempt): the processes that ran together."""


class RunMembers:
    """The run watched: the one ``--run-id`` names, else the run started last among those present at the
    first look; the others' files are ignored, and a directory seen holding several runs is said once
    (through ``warn``)."""

    def __init__(self, path: Path, warn: Warn) -> None:
        self._path, self._warn = path, warn
        self._pfs: dict[ProcessKey, ProcessFiles] = {}  # the processes followed
        self._heads: dict[ProcessKey, Head | None] = {}
        self._run: str | None = None  # the run watched, once known
        self._other_runs: set[ProcessKey] = set()  # processes of other runs: not followed
        self._said_runs = False

    def known(self, key: ProcessKey) -> bool:
        """Whether the process was seen already (followed, or of another run)."""
        return key in self._pfs or key in self._other_runs

    def head(self, key: ProcessKey) -> Head | None:
        """The first records of a process seen."""
        return self._heads[key]

    def admit(self, pfs: list[ProcessFiles]) -> tuple[list[ProcessFiles], dict[ProcessKey, int]]:
        """Of processes that appeared (in one go: attempts are numbered over all of them), those of the
        run watched, and the attempt of every process followed (unnumbered restarts are renumbered by
        start time); nothing when none is of the run."""
        for pf in pfs:
            self._heads[pf.key] = head(pf)
        pfs = self._of_run(pfs)
        if not pfs:
            return [], {}
        for pf in pfs:
            self._pfs[pf.key] = pf
        attempts = assign_attempts(self._pfs.values(), {p: self._heads[k] for k, p in self._pfs.items()})
        return pfs, {key: attempts[pf] for key, pf in self._pfs.items()}

    def _of_run(self, pfs: list[ProcessFiles]) -> list[ProcessFiles]:
        heads = {pf: self._heads[pf.key] for pf in pfs}
        heads.update({pf: self._heads[key] for key, pf in self._pfs.items()})
        try:
            chosen, note, members = choose_run(heads, self._path, self._run)
        except TraceReadError:  # --run-id names a run that has not written here yet: wait for it
            self._other_runs.update(pf.key for pf in pfs)
            return []
        self._run = chosen
        if note is not None and not self._said_runs:
            self._said_runs = True
            self._warn(note)
        mine = [pf for pf in pfs if in_run(self._heads[pf.key], members, note)]
        self._other_runs.update(pf.key for pf in pfs if pf not in mine)
        return mine
