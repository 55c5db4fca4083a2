"""``python -m sglang_replayssm``: the same as the ``sglang-replayssm`` command."""
import sys

from .cli import main

if __name__ == "__main__":
    sys.exit(main())
