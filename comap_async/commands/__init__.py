"""Subcommands of ``comap`` that belong to the core (tools, not processes)."""
