"""NBD frontend: a sans-IO protocol core (`protocol`) and its threaded socket shell (`server`)."""
