"""Command-line frontend: thin wrappers around the Python API."""
