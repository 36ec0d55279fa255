"""Example third-party Weir backends (see README.md)."""
