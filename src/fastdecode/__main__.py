"""``python -m fastdecode``: the ``fastdecode`` command."""

import sys

from fastdecode.cli import main

if __name__ == "__main__":
    sys.exit(main())
