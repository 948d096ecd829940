"""`python -m specheads ...` (also what `accelerate launch -m specheads train ...` runs)."""

from specheads.cli import main

if __name__ == "__main__":
    raise SystemExit(main())
