"""``python -m parlab``: the ``parlab`` command (see ``parlab.cli``)."""

import sys

from parlab.cli import main

# The guard matters: torch.multiprocessing.spawn re-imports the main module in each child.
if __name__ == "__main__":
    sys.exit(main())
