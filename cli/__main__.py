"""`python -m cli`: the `llmfleet` command, as the child processes of `llmfleet up` run it."""

from cli.main import app

app()
