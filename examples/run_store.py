"""Each model's run of a comparison (demo, pretrain) saved as soon as it finishes, so that a stopped run goes on
with ``--resume``: the runs saved in ``<out>/runs/`` that were trained the same way are kept, and only the
others train."""

from __future__ import annotations

import contextlib
import json
import os
from dataclasses import asdict
from pathlib import Path
from typing import Any, Callable, Iterator

from comera_compile.examples.code_data import DemoError

__all__ = ["fingerprint", "run_path", "RunStore"]


def _same_path(value: Any) -> Any:
    """A path field as the file system names it, so that ``./data``, ``data`` and ``~/x/data`` agree."""
    if isinstance(value, (str, Path)) and str(value) and Path(value).expanduser().exists():
        return os.path.realpath(Path(value).expanduser())
    return str(value) if isinstance(value, Path) else value


def fingerprint(cfg: Any, skip: tuple[str, ...], env: dict[str, Any], *, paths: tuple[str, ...] = (),
                **data: Any) -> dict[str, Any]:
    """What a saved run must share with this one for --resume to keep it: the config's fields but `skip`
    (where it is written, what else trains, how it is shown), those in `paths` as the file system names them,
    the `data` given, and from `env` (demo_report.environment) the device, the process count, the CPU threads
    and torch's version."""
    fields = {k: (_same_path(v) if k in paths else str(v) if isinstance(v, Path) else v)
              for k, v in asdict(cfg).items() if k not in skip}
    where = {k: env[k] for k in ("device", "processes", "threads", "torch")}
    return json.loads(json.dumps({**fields, **data, **where}))   # as a saved one reads back: tuples as lists


def run_path(out: Path, name: str) -> Path:
    """Where a finished run is kept: ``<out>/runs/<name>.json``."""
    return Path(out) / "runs" / f"{name}.json"


class RunStore:
    """The finished runs of `names` in `out` for `command` (demo, pretrain): ``runs`` holds those --resume kept
    (every saved one trained by the same command with the same fingerprint; DemoError naming what differs for
    one that was not), ``kept`` their names, ``save`` keeps a new one on the main process, and ``training()``
    says, when the runs stop early, what was kept and how to go on."""

    def __init__(self, out: Path, names: list[str], fingerprint: dict[str, Any], *, command: str, resume: bool,
                 main: bool, log: Callable[[str], None]) -> None:
        self.out, self.names, self.main, self.log, self.command = Path(out), list(names), main, log, command
        self.fingerprint = {"command": command, **fingerprint}
        self.runs: dict[str, dict[str, Any]] = {}
        self.kept: list[str] = []
        if main:   # found now, not after the first model trained
            try:
                (self.out / "runs").mkdir(parents=True, exist_ok=True)
            except OSError as e:
                raise DemoError(f"--out {str(self.out)!r}: cannot make that folder ({e.strerror or e}); give a "
                                f"folder you can write") from e
            if not os.access(self.out / "runs", os.W_OK):
                raise DemoError(f"--out {str(self.out)!r}: that folder is not writable; give one you can write")
        if resume:
            for name in self.names:
                saved = self._load(name)
                if saved is not None:
                    self.runs[name] = saved
            self.kept = list(self.runs)
            rest = [n for n in self.names if n not in self.runs]
            log(f"resume: {', '.join(self.runs) or 'no finished run'} kept from {self.out}"
                + (f"; training {', '.join(rest)}" if rest else ""))
        else:
            saved = [n for n in self.names if run_path(self.out, n).is_file()]
            if saved:
                log(f"note: {self.out / 'runs'} holds finished runs of {', '.join(saved)}; this run replaces them "
                    f"(--resume would keep them)")
                if main:   # gone now: a --resume after a stop keeps only this run's; the report of those runs
                    for n in saved:   # goes with them, the folder never showing runs it no longer holds
                        run_path(self.out, n).unlink()
                    for report in ("table.md", "results.json", "curves.png"):
                        (self.out / report).unlink(missing_ok=True)

    def _load(self, name: str) -> dict[str, Any] | None:
        path = run_path(self.out, name)
        if not path.is_file():
            return None
        try:
            saved = json.loads(path.read_text())
            run, theirs = saved["run"], saved["fingerprint"]
        except (ValueError, KeyError, TypeError) as e:
            raise DemoError(f"--resume: {path} is not a run this command saved ({e}); move it away to train "
                            f"{name} again") from e
        if theirs.get("command", self.command) != self.command:   # runs saved before the command was kept: any
            raise DemoError(f"--resume: {path} was saved by `comera-compile {theirs['command']}`, not "
                            f"`comera-compile {self.command}`; give this command a new --out")
        ours = {k: v for k, v in self.fingerprint.items() if k != "command" or "command" in theirs}
        differ = [k for k in sorted(set(ours) | set(theirs)) if ours.get(k) != theirs.get(k)]
        if differ:
            said = ", ".join(f"{k} {theirs.get(k)!r} there, {ours.get(k)!r} here" for k in differ)
            raise DemoError(f"--resume: {name}'s run in {path} was trained differently ({said}); give the options "
                            f"it ran with, or a new --out")
        return run

    def save(self, name: str, run: dict[str, Any]) -> None:
        """Keep `name`'s finished run (main process only); a write cut short leaves no half file behind."""
        self.runs[name] = run
        if not self.main:
            return
        path = run_path(self.out, name)
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(".json.tmp")
        tmp.write_text(json.dumps({"fingerprint": self.fingerprint, "run": run}, indent=1) + "\n")
        tmp.replace(path)

    @contextlib.contextmanager
    def training(self) -> Iterator[None]:
        """Around the training: if it stops before every run finished, name the kept ones and the command
        that goes on."""
        try:
            yield
        except BaseException as e:
            if self.runs and len(self.runs) < len(self.names):
                self.log(f"\nstopped: {', '.join(self.runs)} finished and kept in {self.out / 'runs'}; the same "
                         f"`comera-compile {self.command}` with --resume --out {self.out} trains only the rest")
            if isinstance(e, KeyboardInterrupt):   # the hint is the message: no traceback
                raise SystemExit(130) from None
            raise
