"""torchrun for `--nproc`: torch's launcher, except that a failed process ends it with that process's own
error (already printed) and exit code, not torchrun's traceback of the launcher itself."""

from __future__ import annotations

import sys

from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
from torch.distributed.run import parse_args, run


def main(argv: list[str]) -> int:
    """Run torchrun with `argv` (its own options, then `-m module args...`); 0, or the first failure's code."""
    try:
        run(parse_args(argv))
    except ChildFailedError as e:
        rank, failure = e.get_first_failure()
        code = failure.exitcode
        if code < 0:  # killed by a signal: nothing of ours was printed
            print(f"comera-compile: process {rank} was killed by signal {-code}", file=sys.stderr, flush=True)
        return code if code > 0 else 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
