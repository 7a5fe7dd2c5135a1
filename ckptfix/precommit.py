"""`ckptfix-precommit FILE...`: the pre-commit hook. Inspects each staged weight file and
prints one line per problem; exits 1 when any file has a finding at or above --fail-on."""

from __future__ import annotations

import argparse
import sys

from ckptfix.core.errors import CkptfixError
from ckptfix.core.findings import Severity
from ckptfix.ops.inspect import inspect
from ckptfix.ops.report import FAIL_ON_LEVELS


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="ckptfix-precommit", description=__doc__)
    parser.add_argument("files", nargs="*")
    parser.add_argument("--fail-on", choices=FAIL_ON_LEVELS, default="error")
    args = parser.parse_args(argv)
    failed = False
    for path in args.files:
        try:
            report = inspect(path)
        except CkptfixError as exc:
            print(exc.line(), file=sys.stderr)
            failed = True
            continue
        if report.exit_code(args.fail_on) == 0:
            continue
        failed = True
        threshold = Severity(args.fail_on).rank
        for item in report.findings:
            if item.severity.rank >= threshold:
                where = item.file or path
                print(
                    f"{item.severity.value}: {where}: {item.code}: {item.message}", file=sys.stderr
                )
    return 1 if failed else 0


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
