"""``python -m benchmarks.emulated``: see the package's description."""

from .cli import main

if __name__ == "__main__":
    main()
