"""Measured data as an input: the profile database, its import formats (Sailor, CSV) and
the ``profile import`` / ``profile show`` commands (docs/measured.md). Torch-free."""
