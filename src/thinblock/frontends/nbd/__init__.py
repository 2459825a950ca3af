"""NBD frontend: a sans-IO protocol core (`protocol`) and an asyncio shell (`server`)."""
