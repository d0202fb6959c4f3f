"""``python -m runner``: see runner.app."""

from runner.app import cli

if __name__ == "__main__":
    cli()
