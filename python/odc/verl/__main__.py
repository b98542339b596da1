"""python -m odc.verl check: whether verl sees the odc backend, and why not."""

import sys

from . import check


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv != ["check"]:
        print("usage: python -m odc.verl check", file=sys.stderr)
        return 2
    ok, lines = check()
    for line in lines:
        print(line)
    print("odc backend: available" if ok else "odc backend: NOT available")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
