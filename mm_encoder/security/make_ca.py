"""`mm-encoder make-ca DIR`: a CA for an operator's deployments, `DIR/ca.pem` and `DIR/ca.key` (0600 in a
0700 directory), what `serve --tls-dir DIR` takes. Sites that share one (an encoder site and its model
clusters, docs/sites.md) chain every certificate to one trust root; each site still issues its own
components' certificates from it, naming its own graph. An existing CA is never overwritten."""

from __future__ import annotations

import argparse
import sys
from datetime import timedelta
from pathlib import Path

from ..core.errors import PkiError
from .pki import CA_LIFETIME, Authority


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="mm-encoder make-ca", description=__doc__)
    p.add_argument("dir", type=Path, help="where ca.pem and ca.key are written (made 0700)")
    p.add_argument("--name", default="mm-encoder operator CA", help="the CA's common name")
    p.add_argument("--days", type=int, default=CA_LIFETIME.days, help="how long it is valid (default: %(default)s)")
    args = p.parse_args(argv)
    if args.days < 1:
        p.error("--days: at least 1")
    if (args.dir / "ca.pem").exists() or (args.dir / "ca.key").exists():
        print(f"error: {args.dir} already holds a CA; it is never overwritten (give it as --tls-dir, or "
              "name another directory)", file=sys.stderr)
        return 2
    try:
        ca = Authority.create(args.dir, name=args.name, lifetime=timedelta(days=args.days))
    except PkiError as e:
        print(f"error: {e.message}", file=sys.stderr)
        return 2
    print(f"{args.dir}/ca.pem: valid until {ca.not_after.isoformat()}; give every site --tls-dir {args.dir}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
