"""Base models (built or shipped in builtin/), loading in the run's precision, and the losses."""
