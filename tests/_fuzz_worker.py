"""Entry point of the fuzz worker process (``tests/_fuzz_core.py`` documents the protocol)."""

import sys

from _fuzz_core import main

if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
