"""compare.py: run every pattern in torch and JAX, check parity, print one table.

    python compare.py --model mlp --patterns dp     # one model, one pattern
    python compare.py --help                         # the options; bench, plan, checkpoint, doctor

The command line lives in the package parallel_twins (parallel_twins/cli.py; installed, also as the
``parallel-twins`` command); this file is its entry point from the repository root. Torch ranks,
spawned fresh, re-import this file as ``__mp_main__``: its top level imports no JAX.
"""

import sys

from parallel_twins.cli import main

if __name__ == "__main__":
    sys.exit(main())
