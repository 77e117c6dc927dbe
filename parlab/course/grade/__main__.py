"""``python -m parlab.course.grade``: the ``parlab grade`` command (see ``parlab.course.grade.command``)."""

import sys

from parlab.course.grade.command import main

# The guard matters: torch.multiprocessing.spawn re-imports the main module in each child.
if __name__ == "__main__":
    sys.exit(main())
