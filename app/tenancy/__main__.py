"""``python -m app.tenancy``: make a key, hash one for a keys file, or check a keys file.

python -m app.tenancy new                # a fresh random key, and the line for the file
printf %s "$KEY" | python -m app.tenancy hash
python -m app.tenancy check keys.yaml    # what it grants, or what is wrong (exit 2)
"""

from __future__ import annotations

import argparse
import secrets
import sys
from pathlib import Path

from app.errors import SettingsError
from app.tenancy.keys import Keyring, Scope, key_hash


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m app.tenancy", description=__doc__.split("\n")[0]
    )
    commands = parser.add_subparsers(dest="command", required=True)
    commands.add_parser("new", help="print a new random key and its sha256 line")
    commands.add_parser("hash", help="print the sha256 of the key read from stdin")
    check = commands.add_parser("check", help="read a keys file and say what it grants")
    check.add_argument("file", type=Path)
    args = parser.parse_args(argv)
    if args.command == "new":
        key = secrets.token_urlsafe(32)
        print(f"key:    {key}\nsha256: {key_hash(key)}")
    elif args.command == "hash":
        key = sys.stdin.read().strip()
        if not key:
            print("error: no key on stdin", file=sys.stderr)
            return 2
        print(key_hash(key))
    else:
        try:
            ring = Keyring.read(args.file)
        except SettingsError as exc:
            print(f"error: {exc}", file=sys.stderr)
            return 2
        for name in ring.tenants:
            share = ring.tenant(name)
            quota = f"{share.rate:g} images/s, burst {share.burst:g}" if share.rate else "no quota"
            print(f"tenant {name}: {quota}, weight {share.weight:g}")
        anonymous = ring.anonymous
        scopes = ", ".join(s.value for s in Scope if anonymous and anonymous.allows(s))
        print(f"without a key: {scopes or 'nothing'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
