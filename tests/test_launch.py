"""`--nproc`'s launcher: a process that fails ends the run with its own message and exit code, and the
user does not get torchrun's traceback of the launcher on top."""

import subprocess
import sys


def test_a_failed_process_gives_its_own_error_and_exit_code_without_the_launchers_traceback(tmp_path):
    child = tmp_path / "child.py"
    child.write_text("import os, sys\nsys.exit(f'rank {os.environ[\"RANK\"]}: bad input, do this instead')\n")
    done = subprocess.run([sys.executable, "-m", "comera_compile.cli.torchrun", "--standalone",
                           "--nproc-per-node=1", str(child)], capture_output=True, text=True, timeout=300)
    assert done.returncode == 1
    assert "rank 0: bad input, do this instead" in done.stderr
    assert "Traceback" not in done.stderr and "ChildFailedError" not in done.stderr


def test_a_process_that_succeeds_exits_zero(tmp_path):
    child = tmp_path / "child.py"
    # one write each: under PYTHONUNBUFFERED print's pieces interleave in the shared pipe ("worldworld 2 2")
    child.write_text("import os\nos.write(1, f\"world {os.environ['WORLD_SIZE']}\\n\".encode())\n")
    done = subprocess.run([sys.executable, "-m", "comera_compile.cli.torchrun", "--standalone",
                           "--nproc-per-node=2", str(child)], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert done.stdout.count("world 2") == 2
