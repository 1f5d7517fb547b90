"""``python -m app.batch``: the old name of ``python -m app.bulk`` (embed or tag a folder of
images), kept so scripts that run it go on working; it says the new name."""

from __future__ import annotations

import sys

from app.bulk import main

if __name__ == "__main__":
    print("note: python -m app.batch is now python -m app.bulk", file=sys.stderr)
    sys.exit(main())
