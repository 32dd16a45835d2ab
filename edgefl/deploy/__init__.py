"""Deploy edgefl on real devices: TLS and node keys, SuperLink and SuperNode processes, the CLI."""
