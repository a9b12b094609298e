"""``python -m parallel_twins …``: the same command as ``python compare.py …`` and ``parallel-twins …``
(parallel_twins/cli.py); messages and provenance name it as it was started (args.prog)."""

import sys

from parallel_twins.cli import main

if __name__ == "__main__":
    sys.exit(main())
