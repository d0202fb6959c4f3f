"""``python -m runner``: see runner.app."""

from runner.startup import stamp

stamp("python start and imports")

from runner.app import cli  # noqa: E402

if __name__ == "__main__":
    cli()
