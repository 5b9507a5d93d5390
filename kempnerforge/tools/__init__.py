"""Command-line tools on the ``kforge`` entry point besides training: generate, convert, eval, check-env."""
