import sys

from lightning_async_pp.cli import main

if __name__ == "__main__":
    sys.exit(main())
