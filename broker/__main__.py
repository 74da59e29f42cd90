import sys

from broker.cli import main

if __name__ == "__main__":  # a spawned gate worker imports this module too
    sys.exit(main())
