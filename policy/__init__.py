"""The platform's Pulumi policy pack (see rules.py; the CLI runs __main__.py)."""
