"""``python -m runner``: see runner.cli."""

from runner.startup import stamp

stamp("python start and imports")

from runner.cli import main  # noqa: E402

if __name__ == "__main__":
    main()
