"""The ``rlmerge`` command installed by pip: the same command line as the Rust binary, run
in-process, with the same output and exit codes — Ctrl-C, SIGTERM and SIGHUP stop a merge with
its scratch folders removed and exit 130, as the binary does (unless the process started with
them ignored, as under `nohup`)."""

import signal
import sys


def _interrupt(signum, frame):
    raise KeyboardInterrupt(signal.Signals(signum).name)


def main() -> None:
    # (XDG_RUNTIME_DIR is set where unset by the package's import, as the binary sets it.)
    from ._rlmerge import call

    # Python's default for SIGTERM and SIGHUP ends the process at once, leaving the running
    # merge's scratch folder behind: turn them into the interrupt the call handles. A signal the
    # process started with ignored stays ignored, as Python keeps an ignored SIGINT (and the
    # binary all three): `nohup` ignores SIGHUP so a merge outlives its terminal.
    for name in ("SIGTERM", "SIGHUP"):
        sig = getattr(signal, name, None)
        if sig is not None and signal.getsignal(sig) is not signal.SIG_IGN:
            signal.signal(sig, _interrupt)
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
