"""``python -m parlab.grade``: the ``parlab grade`` command (see ``parlab.grade.command``)."""

import sys

from parlab.grade.command import main

# The guard matters: torch.multiprocessing.spawn re-imports the main module in each child.
if __name__ == "__main__":
    sys.exit(main())
