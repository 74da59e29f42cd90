import sys

from comap_async.cli import main

sys.exit(main(["evaluator", *sys.argv[1:]]))
