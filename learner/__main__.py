import sys

from comap_async.cli import main

sys.exit(main(["learner", *sys.argv[1:]]))
