"""One package per pipeline; what every asset shares is here."""

# Who the UI names as every asset's owner (Dagster: an email or `team:<name>`); the on-call team redrive pages.
OWNERS = ["team:redrive-oncall"]
