"""Everything that decides the privacy guarantee; see README.md beside this file."""
