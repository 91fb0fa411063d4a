"""`python -m master.cli`: the `dlrover` command."""

from master.cli.main.main import main

if __name__ == "__main__":
    main()
