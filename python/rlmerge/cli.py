"""The ``rlmerge`` command installed by pip: the same command line as the Rust binary, run
in-process, with the same output and exit codes."""

import sys


def main() -> None:
    from ._rlmerge import call

    sys.stdout.flush()
    try:
        code, _, error = call(sys.argv[1:], False)
    except KeyboardInterrupt:
        print("error: interrupted; nothing was written at the output path", file=sys.stderr)
        sys.exit(130)
    if error:
        print(error, file=sys.stderr)
    sys.exit(code)


if __name__ == "__main__":
    main()
