"""``python -m subspec.kernels [--build] [--check]``: which kernel tiers this CPU runs, building each one (once per
machine).

Prints one line per tier (built and loaded, or why not) and which one subspec uses; with ``--build`` the tiers are
built in parallel processes first (what CI does before the tests). Exits 1 if a tier this CPU supports failed to build.
With ``--check``, every tier is also compiled (syntax only: :func:`subspec.kernels.compile_check`), those this CPU
cannot run included, and a tier that does not compile exits 1 too.
"""
from __future__ import annotations

import argparse
import subprocess
import sys

from . import TIERS, active, compile_check, load, missing_flags, status, supported


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m subspec.kernels", description=__doc__.splitlines()[0])
    ap.add_argument("--build", action="store_true", help="build every supported tier, in parallel processes")
    ap.add_argument("--check", action="store_true",
                    help="also compile every tier, those this CPU cannot run included (syntax only, about 10 s each)")
    a = ap.parse_args(argv)
    tiers = supported()
    if a.build:
        code = "from subspec import kernels; kernels.load({!r}, quiet=True)"
        procs = [subprocess.Popen([sys.executable, "-c", code.format(t)]) for t in tiers]
        for p in procs:
            p.wait()
    failed = False
    for t in TIERS:
        missing = missing_flags(t)
        if missing:
            note = ""
            if a.check:
                error = compile_check(t)
                failed |= error is not None
                note = "; compiles" if error is None else f"; does not compile:\n{error}"
            print(f"{t:9s} not for this CPU (lacks {', '.join(missing)}){note}")
            continue
        reason = load(t, quiet=True)
        failed |= reason is not None
        print(f"{t:9s} {'ready' if reason is None else reason}")
    print(f"in use: {status()}" + ("" if active() else " (torch's kernels)"))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
