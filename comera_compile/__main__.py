"""`python -m comera_compile ...` (and `torchrun -m comera_compile demo ...`): the `comera-compile` command."""

import sys

from comera_compile.cli import main

sys.exit(main())
