import sys

from comap_async.cli import main

sys.exit(main(["actor", *sys.argv[1:]]))
