"""The ``ngrav`` command line: :mod:`.main` builds the app, one module per command group."""
