"""``python -m runner``: see runner.cli."""

from runner.cli import main

if __name__ == "__main__":
    main()
