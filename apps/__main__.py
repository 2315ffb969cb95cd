"""python -m apps NAME [flags]: run benchmark app NAME, the same as python -m apps.NAME [flags]."""
import importlib
import sys

from apps.cli import APPS, fail


def main(argv=None) -> dict:
    argv = sys.argv[1:] if argv is None else list(argv)
    usage = f"usage: python -m apps NAME [flags]   (NAME: {', '.join(APPS)}; python -m apps.NAME --help for flags)"
    if argv and argv[0] in ("-h", "--help"):
        print(usage)
        sys.exit(0)
    if not argv:
        fail(f"no app named; {usage}")
    name = argv[0]
    if name not in APPS:
        fail(f"unknown app {name!r}; the apps are {', '.join(APPS)}")
    return importlib.import_module(f"apps.{name}").main(argv[1:])


if __name__ == "__main__":
    main()
