"""``comap data alfworld --archive PATH... --to DIR``: extract the offline ALFWorld games once."""

from __future__ import annotations

import argparse
import sys
import time


def add_arguments(p: argparse.ArgumentParser) -> None:
    sub = p.add_subparsers(dest="dataset", required=True, metavar="DATASET")
    alf = sub.add_parser("alfworld", help="extract ALFWorld game archives (alfworld-download layout)")
    alf.add_argument(
        "--archive",
        nargs="+",
        default=None,
        metavar="PATH",
        help="json_2.1.1-*.tar.xz archives (default: all in <repo>/../shared/data/alfworld)",
    )
    alf.add_argument(
        "--to",
        default="~/.cache/comap-async/alfworld",
        metavar="DIR",
        help="data root to extract into; use it as --data DIR or ALFWORLD_DATA (default: %(default)s)",
    )


def run(args: argparse.Namespace) -> int:
    from comap_async.envs.alfworld_games import AlfworldDataError, default_archive_dir, extract_archives

    archives = args.archive or sorted(str(p) for p in default_archive_dir().glob("json_2.1.1-*.tar.xz"))
    if not archives:
        print(f"comap data: error: no --archive given and none in {default_archive_dir()}", file=sys.stderr)
        return 2
    t0 = time.time()
    try:
        extracted = extract_archives(archives, args.to)
    except AlfworldDataError as exc:
        print(f"comap data: error: {exc}", file=sys.stderr)
        return 2
    skipped = len(archives) - len(extracted)
    print(
        f"extracted {len(extracted)} archive(s), {skipped} already present, in {time.time() - t0:.1f}s", file=sys.stderr
    )
    print(args.to)
    return 0
