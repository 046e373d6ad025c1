"""`python -m comera_compile.cli ...`, as `python -m comera_compile ...`: the `comera-compile` command."""

import sys

from comera_compile.cli import main

sys.exit(main())
