"""``kforge`` as a script for forked ranks (tests/distributed/forked_ranks.py): ``main`` reads ``sys.argv``."""

from kempnerforge.cli import main

if __name__ == "__main__":
    main()
