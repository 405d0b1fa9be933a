"""``python -m staleflow <subcommand>``: see staleflow.cli."""

from staleflow.cli import main

if __name__ == "__main__":
    main()
